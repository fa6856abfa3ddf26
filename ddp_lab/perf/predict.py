"""The model's prediction of every sweep point, phase by phase, next to what the point measured.

A step at world size N, from the N=1 point of the same sync (its measured phases, subscript 1)
and what was measured on its own at N: the interference probe (ddp_lab/perf/probe.py:
contention k, the slowdowns, the gradients' readiness, a store round trip) and the all-reduce
fit (ddp_lab/perf/fit.py):

    data         data_1 k_fwd + one c10d store round trip (the loop's heartbeat, N > 1)
    forward      forward_1 k_fwd
    backward     backward_1 k_bwd                 (without communication: the loop's calibration)
    sync         sync_1                           (the sync's own local work, measured at N=1)
    exposed      schedule(buckets, backward, all-reduce (+ ours: pack, unpack), interference)
                 .exposed (ddp_lab/perf/step.py) + DDP: sync_1 k_bwd (its bucket copies
                 inside backward), less sync_1 (paid at N=1 too), >= 0
                 + skew_bwd (optim + forward + backward)        (waiting for the slowest rank)
    guard        guard_1 k_guard (1 + skew_guard) + all-reduce of the 2 x N flags (fit, native);
                 ZeRO (sync.zero >= 1): guard_1 / N (the check reads one shard's gradients)
    optim        optim_1 k_optim; ZeRO: optim_1 k_optim / N (the update of one shard) + the
                 all-gather of the parameters after it (the fit, op all_gather)
    other        other_1 k_step                   (what the phase medians leave of the step)

k_phase = that phase with every rank computing / with one rank computing (probe: all / solo), 1
at N=1; skew = the slowest rank's time / rank 0's - 1 with every rank computing (probe: all).
The all-reduce of a bucket = the probe's own timing of that bucket at N, alone, where it timed
one of that size (the same buckets as the training's, in its process layout: these, not the
fit, are what training achieved in the sweeps of docs/results/cpu16-scaling); else the fit at
its size and N (a reduce-scatter at sync.zero=2: the all-reduce's alpha and beta over the
reduce-scatter's rounds and bytes). Plus, for our syncs, packing and unpacking it at the
probe's measured bytes per second. DDP's buckets play one after the other like ours: they
become ready at different times in backward, so rarely run side by side. The bucket layout is the
sync's own rule; readiness is the probe's (measured on CPU), else the FLOP share. Strong scaling
scales the batch-sized phases (data, forward, backward, other) by the per-rank batch ratio.

Efficiency = r x step_1 / step_N, with step_1 the N=1 point's measured step: nothing in the
prediction is fitted to the points it is compared with.

Extrapolated (predict.from_nproc, e.g. [1, 2, 4] in a sweep to N=8): every point is predicted
from the measurements at those world sizes only. The fit is made from their calibration rows,
pooled over them (a fit per world size cannot exist at an N never calibrated), and N enters
through the formulas' rounds and bytes (perf/collectives.py's cost). A point at an N not listed
takes the probe of its sync and setting at the largest listed N (`probe_for`), without that
probe's all-reduce timings (its N's, not the point's: the fit prices every bucket at the point's
N), and ASSUMES that probe's contention, skew, slowdowns, readiness, store round trip and
packing rate hold at its own N too (on one host, more ranks share the same cores and memory
bandwidth: the first thing to suspect where it misses). The row's pred_note says which N's
measurements predicted it.

A point is the sweep's (ddp_lab/scale/sweep.py's `Point`): what is read of it here is its
name, status, sync, world_size, per_rank_batch, resolved training config and summary.
"""

from __future__ import annotations

from ddp_lab.buckets import sync_rule
from ddp_lab.dtypes import element_size
from ddp_lab.perf.compute import profile_model
from ddp_lab.perf.fit import Fit
from ddp_lab.perf.params import NO_INTERFERENCE
from ddp_lab.perf.probe import Probe
from ddp_lab.perf.step import (ZERO_OPS, Bucket, Schedule, buckets_of, bytes_per_step, gathers,
                               schedule)

PHASES = ("data", "forward", "backward", "sync", "exposed_comm", "guard", "optim", "other")
NAN = float("nan")


def _algo(sync: str) -> str:
    return "native" if sync == "ddp" else sync


def _setting(point, key: str):
    """`key` ("sync.comm_dtype") of the point's resolved training config: every point the model
    predicts has one (predict_rows says so where it does not), so nothing is assumed."""
    group, name = key.split(".")
    return point.config[group][name]


def _zero(point) -> int:
    return int(_setting(point, "sync.zero"))


def _reshards(point) -> bool:
    """sync.reshard_after_forward (runs from before the key had it: true, as they did)."""
    return bool(point.config["sync"].get("reshard_after_forward", True))


def fit_for(fits: dict, sync: str, backend: str) -> tuple[Fit | None, str]:
    """The alpha-beta fit that prices `sync`'s collectives on `backend`: its own, else the
    backend's native all-reduce's, said in the note that comes with it."""
    own = fits.get((_algo(sync), backend))
    if own is not None or _algo(sync) == "native":
        return own, ""
    native = fits.get(("native", backend))
    return native, (f"priced with native's fit (none of {sync} on {backend})"
                    if native is not None else "")


def _buckets(row: dict, point, probe: Probe | None) -> list[Bucket]:
    """The point's buckets by its sync's rule, ready as the probe measured (else by FLOPs)."""
    elem = element_size(_setting(point, "sync.comm_dtype"))
    grads = probe.grads() if probe is not None else None
    if grads is None:
        profile = profile_model(_setting(point, "model.name"), _setting(point, "model.image_size"),
                                _setting(point, "data.num_classes"),
                                _setting(point, "model.fc_width"))
        grads = profile.gradients_in_backward_order()
    return buckets_of(grads, elem, float(_setting(point, "sync.bucket_mb")),
                      *sync_rule(point.sync == "ddp"))


def comm_schedule(row: dict, point, fit: Fit | None, probe: Probe | None,
                  backward_ms: float) -> Schedule:
    """The point's backward and bucket all-reduces as the model plays them at its N: each bucket
    priced by bucket_time_s, and (our syncs) packed and unpacked on the sync's thread at the
    probe's bytes per second (DDP's copies run inside backward: booked in sync)."""
    n, algo = point.world_size, _algo(point.sync)
    if fit is None or n < 2:
        return schedule([], backward_ms * 1e-3, None)
    measured = probe.algos.get(algo, {}) if probe is not None else {}
    local = measured.get("local_s_per_byte", 0.0) if algo != "native" else 0.0
    overlap = bool(_setting(point, "sync.overlap")) or point.sync == "ddp"
    inter = probe.interference(algo) if probe is not None else NO_INTERFERENCE
    return schedule(_buckets(row, point, probe), backward_ms * 1e-3,
                        lambda nb: bucket_time_s(nb, point, fit, measured) + nb * local,
                        overlap, inter)


def bucket_time_s(nbytes: int, point, fit: Fit, measured: dict) -> float:
    """One bucket's collective at the point's N: the probe's median time of a bucket of that
    size alone (all-reduces only: ZeRO-2's reduce-scatter was not probed), else the fit's."""
    op = ZERO_OPS[_zero(point)][0]
    by_size = dict(zip(measured.get("bucket_bytes", []),
                       (ms[1] * 1e-3 for ms in measured.get("bucket_ms", []))))
    if op == "all_reduce" and nbytes in by_size:
        return by_size[nbytes]
    return fit.time_s(nbytes, point.world_size, op)


def gather_ms(row: dict, point, fit: Fit | None, probe: Probe | None) -> float:
    """ZeRO: the all-gathers of every bucket's parameters (fp32; `gathers` of them a step), as
    the fit prices them, exposed; 0 without ZeRO or at N=1. (Stage 3 gathers per unit, one per
    module: priced over the buckets here, the same bytes, its count of latencies not modelled.)"""
    n = point.world_size
    if not _zero(point) or n < 2 or fit is None:
        return 0.0
    elem = element_size(_setting(point, "sync.comm_dtype"))
    times = gathers(_zero(point), _reshards(point))
    return times * sum(fit.time_s(b.nbytes * 4 / elem, n, "all_gather")
                       for b in _buckets(row, point, probe)) * 1e3


def predict_phases(row: dict, point, base: dict, fits: dict, probe: Probe | None) -> dict:
    """pred_<phase>_ms for one point from its baseline's booked phases `base` (see the module)."""
    n = point.world_size
    r = point.per_rank_batch / max(1, base.get("per_rank_batch") or point.per_rank_batch)
    k = probe.k if probe is not None else (lambda phase: 1.0)
    skew = probe.skew if probe is not None else {}
    fit, _ = fit_for(fits, point.sync, row["backend"])
    native = fits.get(("native", row["backend"]))
    backward = base["backward_ms"] * r * k("backward")
    sched = comm_schedule(row, point, fit, probe, backward)
    sync = base["sync_ms"]
    gather = gather_ms(row, point, fit, probe)
    shards = n if _zero(point) else 1  # ZeRO: the check and the update read one shard
    pred = {
        "data": base["data_ms"] * r * k("forward") + (probe.store_ms if probe and n > 1 else 0.0),
        "forward": base["forward_ms"] * r * k("forward"),
        "backward": backward,
        "sync": sync,
        "guard": base["guard_ms"] * k("guard") / shards,
        "optim": base["optim_ms"] * k("optim") / shards + gather,
        "other": base["other_ms"] * r * k("step"),
    }
    # Collectives wait for the slowest rank: the gradient all-reduces for the rank slowest
    # through optim, forward and backward, the guard's for the slowest non-finite check.
    straggler = skew.get("backward", 0.0) * (pred["optim"] + pred["forward"] + backward)
    # What the sync costs beyond backward at N (the loop's exposed_comm): the schedule's, and
    # DDP's bucket copies inside backward as slowed there; less what N=1 paid (booked in sync).
    lost = sched.exposed_s * 1e3 + (sync * k("backward") if point.sync == "ddp" else 0.0)
    pred["exposed_comm"] = max(0.0, lost - sync) + straggler
    pred["guard"] *= 1 + skew.get("guard", 0.0)
    pred["guard"] += native.time_s(8 * n, n) * 1e3 if native and n > 1 else 0.0
    out = {f"pred_{ph}_ms": pred[ph] for ph in PHASES}
    out.update(pred_step_ms=sum(pred.values()), pred_compute_ms=pred["forward"] + backward,
               pred_slowdown_ms=sched.slowdown_s * 1e3, pred_wait_ms=sched.wait_s * 1e3,
               pred_straggler_ms=straggler, pred_comm_busy_ms=sched.busy_s * 1e3 + gather,
               pred_gather_ms=gather)
    return out


def bandwidths(row: dict, point, fit: Fit | None, probe: Probe | None) -> dict:
    """Bus bandwidth (GB/s) of the point's gradient bytes: as the fit prices its buckets, as the
    probe measured its all-reduces alone and beside compute; the loop's own is busbw_GBps."""
    n, algo = point.world_size, _algo(point.sync)
    bus = row["grad_bytes"] * 2 * (n - 1) / n if n > 1 else 0.0
    out = {"calib_busbw_GBps": NAN, "probe_busbw_GBps": NAN, "probe_loaded_busbw_GBps": NAN}
    if n < 2 or bus != bus:
        return out
    if fit is not None:
        sizes = [b.nbytes for b in _buckets(row, point, probe)]
        out["calib_busbw_GBps"] = bus / sum(fit.time_s(s, n) for s in sizes) / 1e9
    a = probe.algos.get(algo) if probe is not None else None
    if a and "bucket_ms" in a:  # (a lent probe has none: Probe.lent)
        alone = sum(ar for _, ar, _ in a["bucket_ms"]) * 1e-3
        out["probe_busbw_GBps"] = bus / alone / 1e9
        out["probe_loaded_busbw_GBps"] = bus / (alone * max(1.0, a["comm_slowdown"])) / 1e9
    return out


def probe_columns(point, probe: Probe | None) -> dict:
    algo = _algo(point.sync)
    inter = probe.interference(algo) if probe is not None else NO_INTERFERENCE
    return {"contention": probe.k("backward") if probe is not None else 1.0,
            "compute_slowdown": inter.compute, "comm_slowdown": inter.comm,
            "probe_other_cores": probe.other_cores if probe is not None else NAN}


def worst_phase(row: dict) -> tuple[str, float]:
    """The phase the prediction misses most (ms, predicted - measured)."""
    misses = {ph: row.get(f"pred_{ph}_ms", NAN) - row.get(f"{ph}_ms", NAN) for ph in PHASES}
    misses = {k: v for k, v in misses.items() if v == v}
    if not misses:
        return "", NAN
    ph = max(misses, key=lambda k: abs(misses[k]))
    return ph, misses[ph]


def empty() -> dict:
    """The model's columns of a row, before (or without) a prediction."""
    cols = [f"pred_{ph}_ms" for ph in PHASES] + [
        "pred_bytes_per_step", "pred_step_ms", "pred_efficiency", "pred_err_pct",
        "pred_step_err_pct", "pred_compute_ms", "pred_slowdown_ms", "pred_wait_ms",
        "pred_straggler_ms", "pred_comm_busy_ms", "pred_gather_ms", "worst_phase_miss_ms",
        "contention", "compute_slowdown", "comm_slowdown", "calib_busbw_GBps", "probe_busbw_GBps",
        "probe_loaded_busbw_GBps", "probe_other_cores"]
    return {**dict.fromkeys(cols, NAN), "pred_note": "", "worst_phase": ""}


def probe_for(p, points: list, probes: dict, from_nproc: tuple[int, ...]) -> tuple:
    """(the Probe that predicts point `p`, what the row's note says of it): its own; with
    `from_nproc` (predict.from_nproc), and `p` at a world size outside it, the probe of the same
    sync and setting at the largest world size listed, lent (Probe.lent: its contention, skew
    and slowdowns assumed to hold at p's N, its buckets priced by the fit at p's N)."""
    if not from_nproc or p.world_size in from_nproc:
        return probes.get(p.name), ""
    m = max(from_nproc)
    donor = {(q.sync, q.extra, q.world_size): q for q in points}.get((p.sync, p.extra, m))
    probe = probes.get(donor.name) if donor is not None else None
    return (probe.lent() if probe is not None else None,
            f"; interference of the N={m} probe, its buckets priced by the fit at N={p.world_size}")


def predict_rows(rows: list[dict], points: list, fits: dict, probes: dict,
                 bases: dict[str, dict], from_nproc: tuple[int, ...] = ()) -> None:
    """Add the model's per-phase prediction and efficiency to every ok row (columns pred_*).
    `probes`: {point name: its Probe}; `bases`: point name -> its N=1 baseline's
    booked phases (ddp_lab/scale/results.py's booked_phases), with its per_rank_batch.
    `from_nproc` (predict.from_nproc): the world sizes the fits were made at (pooled over them:
    fit_alpha_beta's world_sizes) and whose probes predict every point (probe_for); () = each
    point from its own N's."""
    by_name = {p.name: p for p in points}
    for row in rows:
        row.update(empty())
        p = by_name[row["point"]]
        if p.status != "ok":
            continue
        n = p.world_size
        if not p.config:
            row["pred_note"] = "no resolved training config (run_info.json): nothing to price"
            continue
        row["pred_bytes_per_step"] = (bytes_per_step(
            _algo(p.sync), row["grad_bytes"], n, _zero(p), 4 * p.summary["parameters"],
            _reshards(p)) if p.sync != "none" else 0.0)
        base = bases.get(p.name)
        fit, fit_note = fit_for(fits, p.sync, row["backend"])
        if base is None:
            row["pred_note"] = "no N=1 point"
            continue
        if n > 1 and fit is None:
            row["pred_note"] = f"no alpha-beta fit for {_algo(p.sync)} on {row['backend']}"
            continue
        probe, lent = probe_for(p, points, probes, from_nproc) if n > 1 else (None, "")
        notes = [fit_note] if n > 1 and fit_note else []
        if n > 1 and from_nproc:
            notes.append(f"from N={sorted(from_nproc)} only: the fit pooled over them" + lent)
        if n > 1 and probe is None:
            notes.append("no interference probe: none assumed")
        row["pred_note"] = "; ".join(notes)
        row.update(predict_phases(row, p, base, fits, probe))
        row.update(bandwidths(row, p, fit, probe), **probe_columns(p, probe))
        r = p.per_rank_batch / max(1, base.get("per_rank_batch") or p.per_rank_batch)
        row["pred_efficiency"] = r * base["step_ms"] / row["pred_step_ms"]
        row["pred_err_pct"] = 100 * (row["pred_efficiency"] - row["efficiency"]) / row["efficiency"]
        row["pred_step_err_pct"] = 100 * (row["pred_step_ms"] - row["step_ms"]) / row["step_ms"]
        if n > 1:  # (at N=1 the prediction is the measurement it starts from)
            row["worst_phase"], row["worst_phase_miss_ms"] = worst_phase(row)
