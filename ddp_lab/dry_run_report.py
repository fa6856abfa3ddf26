"""What `python -m ddp_lab.dry_run` counted, beside the performance model's figures: dry_run.json's
dict (`summarize`) and the console table (`report`). The run itself is ddp_lab/dry_run.py."""

from __future__ import annotations

from ddp_lab import comm
from ddp_lab.perf.memory import GB
from ddp_lab.perf.step import bytes_per_step
from ddp_lab.tables import format_table

VALUES = ("tensor values mean nothing on the fake backend (a receive moves nothing): only bytes, "
          "messages and buffers are counted and checked")


def summarize(cfg, plan, rows: list[dict], wall_s: float, device: str, g: int) -> dict:
    """dry_run.json: the counts, the model's figures beside them, and the per-rank rows. `plan`:
    the dry run's `Plan`; `device`: the tensors' (meta or cpu); `g`: ranks per node."""
    n, s = cfg.world_size, cfg.sync
    costs = [comm.cost(s.name, k * elem, n, op=op, node_size=g) for op, k, elem in plan.calls]
    busiest = max(rows, key=lambda r: r["bytes_sent"])
    grad_bytes = sum(plan.bucket_numels) * plan.comm_elem
    out = {"world_size": n, "sync": s.name, "zero": s.zero, "node_size": g,
           "device": device,
           "model": cfg.model.name, "comm_dtype": s.comm_dtype, "overlap": s.overlap,
           "bucket_numels": plan.bucket_numels, "collectives": [op for op, _, _ in plan.calls],
           "ranks_run": len(rows), "values": VALUES,
           "total_bytes": sum(r["bytes_sent"] for r in rows),
           "predicted_total_bytes": int(sum(c.total_bytes for c in costs)),
           "max_rank_bytes": busiest["bytes_sent"], "max_rank": busiest["rank"],
           "predicted_max_rank_bytes": sum(c.bytes_per_rank for c in costs),
           "simulated_max_rank_bytes": bytes_per_step(s.name, grad_bytes, n, s.zero,
                                                      sum(plan.bucket_numels) * 4,
                                                      node_size=g),
           # the ring's chunk rounding: under 2 elements per collective (ddp_lab/comm/ring.py)
           "rounding_bound_bytes": 2 * sum(elem for _, _, elem in plan.calls),
           "scratch_as_predicted": None if device == "meta" else all(
               r["scratch_bytes"] == r["predicted_scratch_bytes"] for r in rows),
           "max_predicted_memory_bytes": max(r["predicted_memory_bytes"] for r in rows),
           "device_gb": cfg.dry_run.device_gb, "wall_s": round(wall_s, 3)}
    if s.zero:
        out["zero_shards_cover"] = shards_cover(rows, plan.bucket_numels, n)
    out["per_rank"] = rows
    return out


def shards_cover(rows: list[dict], bucket_numels: list[int], world_size: int) -> bool | None:
    """Whether the ranks' ZeRO shards of each bucket cover every element exactly once (None
    when not every rank ran)."""
    if len(rows) != world_size:
        return None
    for b, numel in enumerate(bucket_numels):
        pieces = sorted(tuple(r["shards"][b]) for r in rows)
        ends = [0] + [stop for _, stop in pieces]
        if any(start != end for (start, _), end in zip(pieces, ends)) or ends[-1] != numel:
            return False
    return True


def report(out: dict) -> str:
    """The console table: a few ranks (all in dry_run.json) and the counts against the model."""
    rows = out["per_rank"]
    picks = {*(r["rank"] for r in rows[:3]), out["max_rank"], rows[-1]["rank"]}
    shown = rows if len(rows) <= 12 else [r for r in rows if r["rank"] in picks]
    table = format_table([{"rank": r["rank"], "bytes_sent": r["bytes_sent"],
                           "messages": r["messages"], "scratch_B": r["scratch_bytes"],
                           "model_scratch_B": r["predicted_scratch_bytes"],
                           "model_memory_GB": round(r["predicted_memory_bytes"] / GB, 3)}
                          for r in shown])
    lines = [f"dry run: sync={out['sync']} zero={out['zero']}, {len(rows)} of "
             f"{out['world_size']} ranks on torch's fake backend ({out['device']} tensors), one "
             f"step, buckets of {', '.join(map(str, out['bucket_numels']))} elements "
             f"({out['comm_dtype']})", VALUES, table]
    if len(shown) < len(rows):
        lines.append(f"({len(rows) - len(shown)} more ranks in dry_run.json)")
    scratch = {None: "not counted on meta (dry_run.device=cpu counts it)",
               True: "as comm.scratch_numel predicts, on every rank run",
               False: "NOT as comm.scratch_numel predicts on some ranks: see dry_run.json"}
    lines += [
        f"bytes, all ranks run: counted {out['total_bytes']}, comm.cost() "
        f"{out['predicted_total_bytes']} for all {out['world_size']}: "
        f"{_versus(out['total_bytes'], out['predicted_total_bytes'])}",
        f"bytes, busiest rank:  counted {out['max_rank_bytes']} (rank {out['max_rank']}), "
        f"comm.cost() {out['predicted_max_rank_bytes']:.0f}: "
        f"{_versus(out['max_rank_bytes'], out['predicted_max_rank_bytes'])} (the ring's "
        f"rounding: within {out['rounding_bound_bytes']} B); the simulation's "
        f"{out['simulated_max_rank_bytes']:.0f}",
        f"scratch: {scratch[out['scratch_as_predicted']]}",
        f"memory: at most {out['max_predicted_memory_bytes'] / GB:.3f} GB a rank, predicted "
        f"(dry_run.device_gb={out['device_gb']:g})"]
    if "zero_shards_cover" in out:
        lines.append(f"ZeRO shards cover every element exactly once: {out['zero_shards_cover']}")
    return "\n".join(lines + [f"{out['wall_s']:.1f} s"])


def _versus(counted: float, model: float) -> str:
    return "equal" if counted == model else f"{counted - model:+.0f} B"
