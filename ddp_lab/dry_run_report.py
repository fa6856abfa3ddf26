"""What `python -m ddp_lab.dry_run` counted, beside the performance model's figures: dry_run.json's
dict (`summarize`), each rank's figures (`rank_sends`) and the console table (`report`). The run
itself is ddp_lab/dry_run.py."""

from __future__ import annotations

from ddp_lab import comm
from ddp_lab.comm import ring
from ddp_lab.perf.collectives import tree_children, tree_rank_sent
from ddp_lab.perf.memory import GB
from ddp_lab.perf.step import bytes_per_step
from ddp_lab.sync.config import wire_dtype
from ddp_lab.tables import format_table

VALUES = ("tensor values mean nothing on the fake backend (a receive moves nothing): only bytes, "
          "messages and buffers are counted and checked")


def summarize(cfg, plan, rows: list[dict], wall_s: float, device: str, g: int) -> dict:
    """dry_run.json: the counts, the model's figures beside them, and the per-rank rows (each
    with the model's bytes and messages, `rank_sends`). `plan`: the dry run's `Plan`; `device`:
    the tensors' (meta or cpu); `g`: ranks per node."""
    n, s = cfg.world_size, cfg.sync
    costs = [comm.cost(s.name, k * elem, n, op=op, node_size=g) for op, k, elem in plan.calls]
    rows = [{**r, **_predicted_sends(plan.calls, s.name, n, r["rank"], g)} for r in rows]
    busiest = max(rows, key=lambda r: r["bytes_sent"])
    grad_bytes = sum(plan.bucket_numels) * plan.comm_elem
    out = {"world_size": n, "sync": s.name, "zero": s.zero, "node_size": g,
           "device": device,
           "model": cfg.model.name, "comm_dtype": wire_dtype(s), "overlap": s.overlap,
           "bucket_numels": plan.bucket_numels, "collectives": [op for op, _, _ in plan.calls],
           "ranks_run": len(rows), "values": VALUES,
           "total_bytes": sum(r["bytes_sent"] for r in rows),
           "predicted_total_bytes": int(sum(c.total_bytes for c in costs)),
           # plain data parallelism's: one all-reduce of the same gradients (ZeRO's against it)
           "allreduce_total_bytes": int(comm.cost(s.name, grad_bytes, n, node_size=g).total_bytes),
           "max_rank_bytes": busiest["bytes_sent"], "max_rank": busiest["rank"],
           "predicted_max_rank_bytes": sum(c.bytes_per_rank for c in costs),
           "simulated_max_rank_bytes": bytes_per_step(s.name, grad_bytes, n, s.zero,
                                                      sum(plan.bucket_numels) * 4,
                                                      s.reshard_after_forward, node_size=g),
           # chunk rounding against N | numel: under 2 elements a collective for each level of
           # rings it runs (ddp_lab/comm/ring.py; hring: two), on every rank; the tree's and
           # naive's all-reduce send whole tensors: none
           "rounding_bound_bytes": 2 * (1 + (s.name == "hring" and g not in (1, n)))
           * sum(elem for _, _, elem in plan.calls),
           "max_bytes_off_model": max(abs(r["bytes_sent"] - r["predicted_bytes_sent"])
                                      for r in rows),
           "messages_as_predicted": all(r["messages"] == r["predicted_messages"] for r in rows),
           # why scratch_bytes is null: p2p keeps (so counts) receive buffers on the CPU only
           "scratch_not_counted": "meta" if device == "meta" else None,
           "scratch_as_predicted": None if device == "meta" else all(
               r["scratch_bytes"] == r["predicted_scratch_bytes"] for r in rows),
           "max_predicted_memory_bytes": max(r["predicted_memory_bytes"] for r in rows),
           "device_gb": cfg.dry_run.device_gb, "wall_s": round(wall_s, 3)}
    if s.zero:
        out["zero_shards_cover"] = shards_cover(rows, plan.bucket_numels, n)
    out["per_rank"] = rows
    return out


def _predicted_sends(calls: list[tuple[str, int, int]], algo: str, n: int, rank: int,
                    g: int) -> dict:
    """The model's figures for `rank`'s row: `rank_sends` summed over one step's `calls`."""
    sends = [rank_sends(algo, op, numel, elem, n, rank, g) for op, numel, elem in calls]
    return {"predicted_bytes_sent": sum(b for b, _ in sends),
            "predicted_messages": sum(m for _, m in sends)}


def rank_sends(algo: str, op: str, numel: int, elem: int, n: int, rank: int,
               g: int) -> tuple[float, int]:
    """The model's (bytes, messages) that `rank` sends in one `op` of `numel` elements of `elem`
    bytes on `n` ranks (hring: nodes of `g`). Bytes as comm.cost() prices them, N | numel
    assumed: its bytes_per_rank where every rank sends alike (ring, hring), and where ranks
    differ its terms for this rank, whose maximum is bytes_per_rank and sum total_bytes (a test
    holds them to that). Messages: one a send of the schedule (ddp_lab/comm's modules), a ring's
    one a slice; the model does not know that a tensor smaller than the group has empty chunks,
    which are not sent."""
    s = numel * elem
    if n == 1 or numel == 0:
        return 0.0, 0
    if algo in ("ring", "hring"):
        return (comm.cost(algo, s, n, op, node_size=g).bytes_per_rank,
                _ring_messages(op, numel, elem, n, rank, g if algo == "hring" else n))
    if algo == "naive":  # rank 0 gathers from and sends to every rank, the others to it once
        if rank == 0:
            return (n - 1) * s / (n if op == "reduce_scatter" else 1), n - 1
        return s / (n if op == "all_gather" else 1), 1
    return (tree_rank_sent(s, n, rank, op),  # up to the parent once, down to each child
            (rank > 0) + len(tree_children(rank, n)))


def _ring_messages(op: str, numel: int, elem: int, n: int, rank: int, g: int) -> int:
    """A ring of k sends k-1 steps a half, a message a slice of its largest chunk
    (ring.slices_per_chunk). hring: a ring of g over the tensor, then one of n/g over this
    rank's piece of g (tensor_split's); with g 1 or n, the flat ring."""
    halves = 2 if op == "all_reduce" else 1
    rings = [(n, numel)] if g in (1, n) else [(g, numel),
                                              (n // g, numel // g + (rank % g < numel % g))]
    return sum(halves * (k - 1) * ring.slices_per_chunk(-(-m // k), elem) for k, m in rings)


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
                           "model_bytes": round(r["predicted_bytes_sent"]),
                           "messages": r["messages"], "model_messages": r["predicted_messages"],
                           "scratch_B": r["scratch_bytes"] if r["scratch_bytes"] is not None
                           else out["scratch_not_counted"],
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
        f"{_versus(out['max_rank_bytes'], out['predicted_max_rank_bytes'])} (the rings' "
        f"rounding: within {out['rounding_bound_bytes']} B); the simulation's "
        f"{out['simulated_max_rank_bytes']:.0f}",
        f"bytes, every rank run: at most {out['max_bytes_off_model']:.0f} B from the model's; "
        f"messages: {'as' if out['messages_as_predicted'] else 'NOT as'} the model counts "
        f"them on every rank run",
        f"scratch: {scratch[out['scratch_as_predicted']]}",
        f"memory: at most {out['max_predicted_memory_bytes'] / GB:.3f} GB a rank, predicted "
        f"(dry_run.device_gb={out['device_gb']:g})"]
    if out["zero"] and out["allreduce_total_bytes"]:
        lines.append(f"ZeRO-{out['zero']}: comm.cost() "
                     f"{out['predicted_total_bytes'] / out['allreduce_total_bytes']:.3f}x the "
                     f"bytes of plain data parallelism's all-reduce ({out['allreduce_total_bytes']}"
                     f" B; stage 3 on a ring: the ZeRO paper's 1.5x)")
    if "zero_shards_cover" in out:
        lines.append(f"ZeRO shards cover every element exactly once: {out['zero_shards_cover']}")
    return "\n".join(lines + [f"{out['wall_s']:.1f} s"])


def _versus(counted: float, model: float) -> str:
    off = round(counted - model)  # (bytes are whole: a model's float a hair off is equal)
    return "equal" if off == 0 else f"{off:+d} B"
