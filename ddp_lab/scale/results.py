"""The sweep's results: one row per point, its throughput against its N=1 point, its step booked by
phase, its bytes and bandwidth; and, over several passes, the pass each row keeps.

Efficiency (weak and strong alike): throughput_N / (N x throughput_1), where throughput_1 is the
N=1 point of the same sync and swept setting. Weak scaling keeps the per-GPU batch, so perfect
scaling is N times the images per second. Strong scaling keeps the global batch (per-rank batch
= global / N), so perfect scaling is a step N times shorter; the same formula is then
T_1 / (N x T_N) with T the time of one global batch. Speed-up = throughput_N / throughput_1 =
N x efficiency.
"""

from __future__ import annotations

import math

from ddp_lab.dtypes import element_size
from ddp_lab.scale.sweep import Point


def _nan(x) -> float:
    return float("nan") if x is None else float(x)


def phases(summary: dict) -> dict[str, float]:
    """The loop's phase medians (ms) from summary.json's time_ms. `backward` is backward without
    communication where the loop calibrated it (`backward_local`), and `lost` what the step
    spends on the gradient sync beyond it: backward + comm - backward_local (the loop's
    exposed_comm, unclipped; DDP waits inside backward, ours in `comm`). Without calibration
    backward is as timed, which under DDP counts its waiting as compute."""
    t = summary.get("time_ms", {})
    backward, comm = _nan(t.get("backward")), _nan(t.get("comm", 0.0))
    local = _nan(t["backward_local"]) if "backward_local" in t else backward
    return {"step_ms": _nan(t.get("step")), "data_ms": _nan(t.get("data")),
            "forward_ms": _nan(t.get("forward")), "backward_ms": local,
            "lost_ms": backward + comm - local, "guard_ms": _nan(t.get("guard", 0.0)),
            "optim_ms": _nan(t.get("optim")), "comm_busy_ms": _nan(t.get("comm_busy")),
            "comm_source": "exposed_comm" if "backward_local" in t else "comm"}


def grad_bytes(point: Point) -> float:
    dtype = point.config.get("sync", {}).get("comm_dtype", "fp32")
    return point.summary.get("parameters", 0) * element_size(dtype)


def baseline(p: Point, points: list[Point]) -> Point | None:
    """The N=1 point `p` is measured against: the same sync and setting, else another sync's."""
    ok = {(q.sync, q.extra, q.world_size): q for q in points if q.status == "ok"}
    for sync in (p.sync, "none", "ddp", *sorted({q.sync for q in points})):
        b = ok.get((sync, p.extra, 1))
        if b is not None:
            return b
    return None


def booked_phases(p: Point, b: Point | None) -> dict:
    """The point's step as the report books it (ms): data, forward, backward (without
    communication), sync, exposed_comm, guard, optim and other (what the medians leave of the
    median step). `sync` is the sync's own local work, what it costs at N=1 where nothing is
    sent (DDP copies every gradient into its buckets and back), taken from the N=1 point `b` of
    the same sync; exposed_comm is what the gradient sync costs beyond it (0 at N=1)."""
    s = p.summary
    ph = phases(s) if s else dict.fromkeys(phases({}), float("nan"))
    if s and ph["comm_source"] == "comm" and p.sync == "ddp" and b is not None \
            and p.mode == "weak" and p.world_size > 1:
        # No calibration: estimate DDP's waiting as the backward it added over N=1.
        extra = max(0.0, ph["backward_ms"] - phases(b.summary)["backward_ms"])
        ph.update(lost_ms=ph["lost_ms"] + extra, backward_ms=ph["backward_ms"] - extra,
                  comm_source="backward-backward(N=1)")
    base = phases(b.summary) if b is not None and b.sync == p.sync else None
    sync = max(0.0, base["lost_ms"]) if base is not None and base["lost_ms"] == base["lost_ms"] \
        else 0.0
    ph["sync_ms"] = sync
    ph["exposed_comm_ms"] = max(0.0, ph.pop("lost_ms") - sync)
    ph["other_ms"] = ph["step_ms"] - sum(ph[f"{k}_ms"] for k in (
        "data", "forward", "backward", "sync", "exposed_comm", "guard", "optim"))
    ph["compute_ms"] = ph["forward_ms"] + ph["backward_ms"]
    return ph


def bus_bandwidth(p: Point, ph: dict, gb: float) -> tuple[float, str]:
    """(busbw GB/s, where its time came from): the sync's busy time if it reports one, else the
    exposed time (an upper bound when communication overlaps backward); none for bare DDP."""
    n = p.world_size
    bus_bytes = gb * 2 * (n - 1) / n if n > 1 else 0.0
    overlap = bool(p.config.get("sync", {}).get("overlap", True)) or p.sync == "ddp"
    if not math.isnan(ph.get("comm_busy_ms", float("nan"))):
        comm_t, bw_source = ph["comm_busy_ms"], "busy"
    elif ph["comm_source"] == "comm" and p.sync == "ddp":
        comm_t, bw_source = float("nan"), "none (DDP: not measured)"
    else:
        comm_t = ph["exposed_comm_ms"]
        bw_source = "exposed (upper bound: overlapped)" if overlap else "exposed (no overlap)"
    busbw = (bus_bytes / (comm_t * 1e-3) / 1e9
             if n > 1 and comm_t == comm_t and comm_t > 0.1 else float("nan"))
    return busbw, bw_source


def point_row(p: Point, b: Point | None) -> dict:
    """One point's row: what ran, throughput against baseline `b`, the step breakdown, bytes."""
    s, n = p.summary, p.world_size
    row = {"point": p.name, "status": p.status, "mode": p.mode, "sync": p.sync,
           "setting": p.extra, "world_size": n,
           "backend": s.get("backend", ""), "device": s.get("device", ""),
           "model": s.get("model", p.config.get("model", {}).get("name", "")),
           "precision": s.get("precision", ""), "per_rank_batch": p.per_rank_batch,
           "global_batch": s.get("global_batch", p.per_rank_batch * n),
           "timed_steps": s.get("timed_steps", 0)}
    thr = _nan(s.get("train_img_per_s")) if s else float("nan")
    thr1 = _nan(b.summary.get("train_img_per_s")) if b else float("nan")
    ph = booked_phases(p, b)
    gb = grad_bytes(p) if s else float("nan")
    busbw, bw_source = bus_bandwidth(p, ph, gb)
    ranks = [x for x in s.get("rank_step_ms", []) if x == x]
    row.update({
        "img_per_s": thr, "img_per_s_per_gpu": thr / n,
        "speedup": thr / thr1, "efficiency": thr / (n * thr1),
        "baseline": b.name if b else "",
        **{k: v for k, v in ph.items()},
        "comm_bytes_per_step": s.get("comm_bytes_per_step", float("nan")) if s else float("nan"),
        "gather_ms": _nan(s.get("comm", {}).get("gather_ms")) if s else float("nan"),
        "grad_bytes": gb, "busbw_GBps": busbw, "busbw_source": bw_source if n > 1 else "",
        "rank_skew": (max(ranks) / min(ranks) - 1) if len(ranks) > 1 and min(ranks) > 0 else 0.0,
        "wall_s": p.wall_s, "load_avg": p.load_avg, "other_cores": p.other_cores,
        "baseline_other_cores": b.other_cores if b is not None else float("nan"),
        "error": p.error.replace("\n", " | ")[-600:],
    })
    if p.status != "ok":
        row.update(comm_source="", busbw_source="", rank_skew=float("nan"))
    return row


def rows_from_points(points: list[Point]) -> list[dict]:
    """One row per point; efficiency against the N=1 point of the same sync and setting."""
    return [point_row(p, baseline(p, points) if p.status == "ok" else None) for p in points]


def bases(points: list[Point]) -> dict[str, dict]:
    """point name -> the booked phases of its N=1 baseline (what the model starts from)."""
    out = {}
    for p in points:
        b = baseline(p, points) if p.status == "ok" else None
        if b is not None:
            out[p.name] = {**booked_phases(b, b), "per_rank_batch": b.per_rank_batch}
    return out


def merge_passes(per_pass: list[list[dict]]) -> list[dict]:
    """One row per point from its rows of every pass (`repeats`): the pass with the median
    efficiency, whole; an N=1 point, the pass its series' largest world size took (so the pair
    the report compares ran minutes apart), else its median step. Each pass's efficiency is a
    point against its N=1 point of the same pass, predicted with the probe run right after it:
    under about the same load, while a shared machine's load moves between passes. A row keeps
    its pass's phases, which add up, and its own prediction; `pass` says which it is and
    `efficiency_passes` / `pred_efficiency_passes` what every pass gave."""
    chosen, series_pass = [], {}
    for rows in zip(*per_pass):
        ok = [(i, r) for i, r in enumerate(rows) if r["status"] == "ok"]
        i = _median_pass(ok, "efficiency" if rows[0]["world_size"] > 1 else "step_ms")
        chosen.append(i)
        if ok and rows[0]["world_size"] > 1:
            key = (rows[0]["sync"], rows[0].get("setting", ""))
            if rows[0]["world_size"] >= series_pass.get(key, (0, 0))[0]:
                series_pass[key] = (rows[0]["world_size"], i)
    out = []
    for rows, i in zip(zip(*per_pass), chosen):
        ok = [(j, r) for j, r in enumerate(rows) if r["status"] == "ok"]
        if not ok:
            out.append({**rows[-1], "passes": 0})
            continue
        if rows[0]["world_size"] == 1:
            i = series_pass.get((rows[0]["sync"], rows[0].get("setting", "")), (0, i))[1]
            i = i if rows[i]["status"] == "ok" else ok[0][0]
        row = {**rows[i], "passes": len(ok), "pass": i + 1}
        for k in ("efficiency", "pred_efficiency"):
            row[f"{k}_passes"] = " ".join(f"{r[k]:.3g}" for _, r in ok)
        out.append(row)
    return out


def _median_pass(ok: list[tuple[int, dict]], key: str) -> int:
    """The index of the pass with the median `key` (the lower one of an even count)."""
    if not ok:
        return 0
    ranked = sorted(ok, key=lambda ir: (ir[1][key] != ir[1][key], ir[1][key]))
    return ranked[(len(ranked) - 1) // 2][0]
