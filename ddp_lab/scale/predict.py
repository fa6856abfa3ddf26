"""The model's prediction of every sweep point, phase by phase, next to what the point measured.

A step at world size N, from the N=1 point of the same sync (its measured phases, subscript 1)
and what was measured on its own at N: the interference probe (ddp_lab/scale/interfere.py:
contention k, the slowdowns, the gradients' readiness, a store round trip) and the all-reduce
fit (ddp_lab/cost/network.py):

    data         data_1 k_fwd + one c10d store round trip (the loop's heartbeat, N > 1)
    forward      forward_1 k_fwd
    backward     backward_1 k_bwd                 (without communication: the loop's calibration)
    sync         sync_1                           (the sync's own local work, measured at N=1)
    exposed      schedule(buckets, backward, all-reduce (+ ours: pack, unpack), interference)
                 .exposed (ddp_lab.cost.network.schedule) + DDP: sync_1 k_bwd (its bucket copies
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
"""

from __future__ import annotations

import json
import os
import statistics

from ddp_lab.buckets import DEFAULT_BUCKET_MB
from ddp_lab.cost import network as net
from ddp_lab.dtypes import element_size

PHASES = ("data", "forward", "backward", "sync", "exposed_comm", "guard", "optim", "other")
NAN = float("nan")


class Probe:
    """An interference probe's result (interfere.py's OUT.json), or several pooled: their rounds
    together, derived again (sweeps with repeats run one probe per repeat)."""

    def __init__(self, result: dict, path: str = ""):
        self.path, self.raw = path, result
        d = result["derived"]
        self.world_size = int(result["world_size"])
        self.rounds = int(result.get("rounds", 0))
        self.contention = {k: v for k, v in d["contention"].items() if v == v}
        self.algos = {k: v for k, v in d.items() if isinstance(v, dict) and "comm_ms" in v}
        self.store_ms = float(d.get("store_ms", 0.0))
        self.skew = {k: max(0.0, v) for k, v in d.get("skew", {}).items() if v == v}
        self.other_cores = float(result.get("other_cores", NAN))
        self.numels = result.get("param_numels", [])
        self.ready = d.get("grad_ready", [])

    @classmethod
    def load(cls, *paths: str) -> "Probe":
        results = []
        for path in paths:
            with open(path) as f:
                results.append(json.load(f))
        if len(results) == 1:
            return cls(results[0], paths[0])
        from ddp_lab.scale.interfere import derive

        every = [[r for res in results for r in res["samples"][rank]]  # per rank, pooled
                 for rank in range(len(results[0]["samples"]))]
        sizes = {a: v["bucket_bytes"] for a, v in results[0]["derived"].items()
                 if isinstance(v, dict) and "bucket_bytes" in v}
        pooled = {**results[0], "rounds": len(every[0]), "samples": every,
                  "derived": derive(every, sizes, len(results[0]["param_numels"]))}
        return cls(pooled, ", ".join(paths))

    def k(self, phase: str) -> float:
        return self.contention.get(phase, 1.0)

    def interference(self, algo: str) -> net.Interference:
        a = self.algos.get(algo)
        if a is None:
            return net.NO_INTERFERENCE
        # A slowdown below 1 is noise (nothing runs faster for sharing): floor it.
        return net.Interference(max(1.0, a["compute_slowdown"]), max(1.0, a["comm_slowdown"]))

    def grads(self) -> list[tuple[int, float]] | None:
        """(numel, ready fraction) in backward order, where readiness was measured (CPU)."""
        if not self.ready or len(self.ready) != len(self.numels) or any(
                f != f for f in self.ready):
            return None
        return list(zip(self.numels, self.ready))[::-1]


def load_probes(paths: dict[str, list[str]]) -> dict:
    """{key: Probe} pooled over each key's paths that exist (a failed probe leaves none)."""
    out = {}
    for key, ps in paths.items():
        ps = [p for p in ps if p and os.path.exists(p)]
        if ps:
            out[key] = Probe.load(*ps)
    return out


def _algo(sync: str) -> str:
    return "native" if sync == "ddp" else sync


def _zero(point) -> int:
    return int(point.config.get("sync", {}).get("zero", 0) or 0)


def _buckets(row: dict, point, probe: Probe | None) -> list[net.Bucket]:
    """The point's buckets by its sync's rule, ready as the probe measured (else by FLOPs)."""
    scfg, mcfg = point.config.get("sync", {}), point.config.get("model", {})
    elem = element_size(scfg.get("comm_dtype", "fp32"))
    grads = probe.grads() if probe is not None else None
    if grads is None:
        profile = net.profile_model(mcfg.get("name", row["model"]), mcfg.get("image_size"),
                                    point.config.get("data", {}).get("num_classes"),
                                    mcfg.get("fc_width", 4096))
        grads = profile.gradients_in_backward_order()
    ddp = point.sync == "ddp"
    return net.buckets_of(grads, elem, float(scfg.get("bucket_mb", DEFAULT_BUCKET_MB)),
                          "ddp" if ddp else "ours", 1.0 if ddp else None)


def comm_schedule(row: dict, point, fit: net.Fit | None, probe: Probe | None,
                  backward_ms: float) -> net.Schedule:
    """The point's backward and bucket all-reduces as the model plays them at its N: each bucket
    priced by bucket_time_s, and (our syncs) packed and unpacked on the sync's thread at the
    probe's bytes per second (DDP's copies run inside backward: booked in sync)."""
    n, algo = point.world_size, _algo(point.sync)
    if fit is None or n < 2:
        return net.schedule([], backward_ms * 1e-3, None)
    measured = probe.algos.get(algo, {}) if probe is not None else {}
    local = measured.get("local_s_per_byte", 0.0) if algo != "native" else 0.0
    overlap = bool(point.config.get("sync", {}).get("overlap", True)) or point.sync == "ddp"
    inter = probe.interference(algo) if probe is not None else net.NO_INTERFERENCE
    return net.schedule(_buckets(row, point, probe), backward_ms * 1e-3,
                        lambda nb: bucket_time_s(nb, point, fit, measured) + nb * local,
                        overlap, inter)


def bucket_time_s(nbytes: int, point, fit: net.Fit, measured: dict) -> float:
    """One bucket's collective at the point's N: the probe's median time of a bucket of that
    size alone (all-reduces only: ZeRO-2's reduce-scatter was not probed), else the fit's."""
    op = net.ZERO_OPS[_zero(point)][0]
    by_size = dict(zip(measured.get("bucket_bytes", []),
                       (ms[1] * 1e-3 for ms in measured.get("bucket_ms", []))))
    if op == "all_reduce" and nbytes in by_size:
        return by_size[nbytes]
    return fit.time_s(nbytes, point.world_size, op)


def gather_ms(row: dict, point, fit: net.Fit | None, probe: Probe | None) -> float:
    """ZeRO: the all-gather of every bucket's parameters (fp32) after the optimizer, as the fit
    prices it; 0 without ZeRO or at N=1."""
    n = point.world_size
    if not _zero(point) or n < 2 or fit is None:
        return 0.0
    elem = element_size(point.config.get("sync", {}).get("comm_dtype", "fp32"))
    return sum(fit.time_s(b.nbytes * 4 / elem, n, "all_gather")
               for b in _buckets(row, point, probe)) * 1e3


def predict_phases(row: dict, point, base: dict, fits: dict, probe: Probe | None) -> dict:
    """pred_<phase>_ms for one point from its baseline's booked phases `base` (see the module)."""
    n = point.world_size
    r = point.per_rank_batch / max(1, base.get("per_rank_batch") or point.per_rank_batch)
    k = probe.k if probe is not None else (lambda phase: 1.0)
    skew = probe.skew if probe is not None else {}
    fit = fits.get((_algo(point.sync), row["backend"])) or fits.get(("native", row["backend"]))
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


def bandwidths(row: dict, point, fit: net.Fit | None, probe: Probe | None) -> dict:
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
    if a:
        alone = sum(ar for _, ar, _ in a["bucket_ms"]) * 1e-3
        out["probe_busbw_GBps"] = bus / alone / 1e9
        out["probe_loaded_busbw_GBps"] = bus / (alone * max(1.0, a["comm_slowdown"])) / 1e9
    return out


def probe_columns(point, probe: Probe | None) -> dict:
    algo = _algo(point.sync)
    inter = probe.interference(algo) if probe is not None else net.NO_INTERFERENCE
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


def predict_rows(rows: list[dict], points: list, fits: dict, probes: dict,
                 bases: dict[str, dict]) -> None:
    """Add the model's per-phase prediction and efficiency to every ok row (columns pred_*).
    `probes`: {point name: its Probe}; `bases`: point name -> its N=1 baseline's
    booked phases (sweep.booked_phases), with its per_rank_batch."""
    by_name = {p.name: p for p in points}
    for row in rows:
        row.update(empty())
        p = by_name[row["point"]]
        if p.status != "ok":
            continue
        n = p.world_size
        row["pred_bytes_per_step"] = (net.bytes_per_step(
            _algo(p.sync), row["grad_bytes"], n, _zero(p),
            4 * p.summary.get("parameters", 0)) if p.sync != "none" else 0.0)
        base = bases.get(p.name)
        fit = fits.get((_algo(p.sync), row["backend"])) or fits.get(("native", row["backend"]))
        if base is None:
            row["pred_note"] = "no N=1 point"
            continue
        if n > 1 and fit is None:
            row["pred_note"] = f"no alpha-beta fit for {_algo(p.sync)} on {row['backend']}"
            continue
        probe = probes.get(p.name) if n > 1 else None
        if n > 1 and probe is None:
            row["pred_note"] = "no interference probe: none assumed"
        row.update(predict_phases(row, p, base, fits, probe))
        row.update(bandwidths(row, p, fit, probe), **probe_columns(p, probe))
        r = p.per_rank_batch / max(1, base.get("per_rank_batch") or p.per_rank_batch)
        row["pred_efficiency"] = r * base["step_ms"] / row["pred_step_ms"]
        row["pred_err_pct"] = 100 * (row["pred_efficiency"] - row["efficiency"]) / row["efficiency"]
        row["pred_step_err_pct"] = 100 * (row["pred_step_ms"] - row["step_ms"]) / row["step_ms"]
        if n > 1:  # (at N=1 the prediction is the measurement it starts from)
            row["worst_phase"], row["worst_phase_miss_ms"] = worst_phase(row)


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
