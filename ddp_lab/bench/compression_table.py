"""The compression study's table (ddp_lab/bench/compression.py runs the study): per nproc, link
speed and arm, from every run's row (runs.jsonl): accuracy over the seeds, bytes and elements per
step, the step time median (min-max) over the runs, steps and seconds to the target; beside it the
model's figures (ddp_lab/perf/compression.py): the step on a link from the arm's own runs without
one, and from fp32's runs and the arm's compressor timed alone; the change against fp32; the link
speed below which the arm pays. Also its two plots."""

from __future__ import annotations

import math
import os
import statistics
from typing import NamedTuple

from ddp_lab.bench.common import plot_lines
from ddp_lab.config import ConfigError
from ddp_lab.perf.compression import Thread, breakeven_gbps, predict_step_ms, split
from ddp_lab.perf.step import Bucket


class NoLink(NamedTuple):
    """An arm as its runs without a link measured it: its communication thread, and the bytes
    each of its buckets puts on the busiest link."""
    thread: Thread
    link_bytes: list[float]


def arm_rows(runs: list[dict], cfg, buckets: dict[str, list[Bucket]],
             alone_ms: dict | None = None) -> list[dict]:
    """The table: one row per nproc, link speed and arm that has runs (see the module);
    `buckets`: each arm's buckets (bytes, when ready; cut in the dtype they travel in),
    `alone_ms`: calibrate's, for the predictions from fp32."""
    ok = [r for r in runs if r["status"] == "ok"]
    pick = lambda **k: [r for r in ok if all(r[a] == v for a, v in k.items())]
    rows, no_link = [], {}  # (nproc, arm) -> NoLink
    for n in cfg.nproc:
        for gbps in cfg.gbps:
            for arm in cfg.arms:
                here, alone = pick(nproc=n, gbps=gbps, arm=arm), pick(nproc=n, gbps=0.0, arm=arm)
                if here and alone:
                    if (n, arm) not in no_link:
                        no_link[n, arm] = _measured_thread(arm, alone, buckets[arm])
                    rows.append(_arm_row(n, gbps, arm, here, alone, no_link[n, arm]))
    for row in rows:  # against fp32 at the same nproc and link
        base = next((b for b in rows if (b["nproc"], b["gbps"], b["arm"]) ==
                     (row["nproc"], row["gbps"], "fp32")), None)
        fp32, arm = no_link.get((row["nproc"], "fp32")), no_link[row["nproc"], row["arm"]]
        if base is not None:
            _against(row, base, arm, fp32)
        if fp32 is not None and (row["nproc"], row["arm"]) in (alone_ms or {}):
            _from_fp32(row, fp32, arm.link_bytes, alone_ms[row["nproc"], row["arm"]],
                       buckets[row["arm"]])
    return rows


def _measured_thread(arm: str, alone: list[dict], buckets: list[Bucket]) -> NoLink:
    """The arm's NoLink from its runs without a link: the medians of its step, backward, host
    time in the collectives (split over the buckets as the bytes each sends) and each bucket's
    compressor time."""
    sent = alone[0].get("bucket_bytes_sent") or [b.nbytes for b in buckets]
    timed = {len(r["bucket_compress_ms"]) for r in alone}
    if {len(r.get("bucket_bytes_sent") or sent) for r in alone} | (timed - {0}) != {len(buckets)}:
        raise ConfigError(
            f"{arm}: its runs were cut in other buckets than the {len(buckets)} this command's "
            f"model and sync.bucket_mb make: give the study's training overrides again "
            f"(compression_info.json's training_overrides, e.g. sync.bucket_mb)")
    compress = ([statistics.median(ms) for ms in zip(*(r["bucket_compress_ms"] for r in alone))]
                or [0.0] * len(sent))  # (no compressor: none)
    busy = statistics.median(r["comm_busy_ms"] for r in alone)
    # sync=ddp: torch's reducer times nothing per bucket, so nothing is taken to hide (each
    # bucket ready at backward's end): the link adds its whole wire time, an upper bound
    ready = [1.0] * len(buckets) if math.isnan(busy) else [b.ready for b in buckets]
    host = split(0.0 if math.isnan(busy) else busy, sent)
    thread = Thread(_spread([r["step_ms"] for r in alone])[0],
                    statistics.median(r["backward_ms"] for r in alone), tuple(ready),
                    tuple(h + c for h, c in zip(host, compress)))
    return NoLink(thread, split(alone[0]["link_bytes_per_step"], sent))


def _from_fp32(row: dict, fp32: NoLink, link_bytes: list[float], alone_ms: float,
               buckets: list[Bucket]) -> None:
    """The compression-compute term's prediction of the row from fp32's runs without a link,
    put on the arm's `buckets` (bf16 and fp16 cut fewer): fp32's host time and the arm's
    compressor timed alone split over them as their gradient bytes, and the arm's link bytes
    per bucket (ddp_lab/perf/compression.py)."""
    row["compress_alone_ms"] = alone_ms
    weights = [b.nbytes for b in buckets]
    # fp32's buckets all at backward's end (one bucket, or sync=ddp's untimed): so are the arm's
    at_end = all(r == 1.0 for r in fp32.thread.ready)
    ready = (1.0,) * len(buckets) if at_end else tuple(b.ready for b in buckets)
    base = fp32.thread
    arm = NoLink(Thread(base.step_ms, base.backward_ms, ready,
                        tuple(split(sum(base.busy_ms), weights))), link_bytes)
    compute_ms = split(alone_ms, weights)
    row["predicted_from_fp32_ms"] = predict_step_ms(*arm, row["gbps"], compute_ms)
    row["from_fp32_err_pct"] = 100 * (row["predicted_from_fp32_ms"] / row["step_ms"] - 1)
    if not row["gbps"]:
        row["predicted_breakeven_gbps"] = _breakeven(arm, fp32, compute_ms)


def _breakeven(arm: NoLink, fp32: NoLink, compute_ms: list[float] | None = None) -> float:
    """The link speed below which the arm (with `compute_ms` more per bucket) beats fp32."""
    return breakeven_gbps(lambda g: predict_step_ms(*arm, g, compute_ms),
                          lambda g: predict_step_ms(*fp32, g),
                          sum(fp32.link_bytes) - sum(arm.link_bytes))


def _arm_row(n: int, gbps: float, arm: str, here: list[dict], alone: list[dict],
             no_link: NoLink) -> dict:
    accuracy = [r["val_accuracy"] for r in alone if r["phase"] == "accuracy"]
    step, lo, hi = _spread([r["step_ms"] for r in here])
    reached = [r["steps_to_target"] for r in alone if r.get("steps_to_target") is not None]
    steps_to = statistics.median(reached) if len(reached) > len(accuracy) / 2 else math.nan
    first = alone[0]
    row = {"nproc": n, "gbps": gbps, "arm": arm, "runs": len(here),
           "acc_mean": statistics.mean(accuracy) if accuracy else math.nan,
           "acc_sd": statistics.stdev(accuracy) if len(accuracy) > 1 else math.nan,
           "bytes_per_step": first["bytes_per_step"],
           "link_bytes_per_step": first["link_bytes_per_step"],
           "elements_per_step": first["elements_per_step"],
           "gradient_elements": first["gradient_elements"],
           "compress_ms": statistics.median(r["compress_ms"] for r in alone),
           "step_ms": step, "step_ms_min": lo, "step_ms_max": hi,
           "reached_target": f"{len(reached)}/{len(accuracy)}", "steps_to_target": steps_to,
           "time_to_target_s": steps_to * step / 1e3}
    if gbps:
        row["predicted_step_ms"] = predict_step_ms(*no_link, gbps)
        row["predicted_err_pct"] = 100 * (row["predicted_step_ms"] / step - 1)
    return row


def _against(row: dict, base: dict, arm: NoLink, fp32: NoLink) -> None:
    """The row's elements, accuracy and step time against fp32's row `base` at its nproc and
    link (`arm`, `fp32`: as their runs without a link measured them)."""
    row["x_fewer_elements"] = base["elements_per_step"] / row["elements_per_step"]
    row["acc_vs_fp32_pts"] = 100 * (row["acc_mean"] - base["acc_mean"])
    row["step_change_ms"] = row["step_ms"] - base["step_ms"]
    if "predicted_step_ms" in row:
        row["predicted_change_ms"] = row["predicted_step_ms"] - base["predicted_step_ms"]
        row["change_err_pct"] = (100 * (row["predicted_change_ms"] / row["step_change_ms"] - 1)
                                 if row["step_change_ms"] else math.nan)
    else:
        row["breakeven_gbps"] = _breakeven(arm, fp32)


def plot(rows: list[dict], run_dir: str) -> None:
    """accuracy against bytes per step (no link), and measured against predicted step time."""
    alone = [r for r in rows if r["gbps"] == 0]
    plot_lines({f"{r['arm']} n={r['nproc']}": ([r["bytes_per_step"] / 1e6], [r["acc_mean"]])
                for r in alone}, os.path.join(run_dir, "accuracy_vs_bytes.png"),
               xlabel="MB sent per step per rank (counted)",
               ylabel="final accuracy (mean of seeds)",
               title="accuracy against bytes", logx=True)
    series = {}
    for r in sorted(rows, key=lambda r: -r["gbps"]):
        if r["gbps"]:
            for kind, y in (("measured", r["step_ms"]), ("predicted", r["predicted_step_ms"])):
                xs, ys = series.setdefault(f"{r['arm']} n={r['nproc']} {kind}", ([], []))
                xs.append(r["gbps"])
                ys.append(y)
    if series:
        plot_lines(series, os.path.join(run_dir, "step_time_vs_link.png"), xlabel="link (Gb/s)",
                   ylabel="step time (ms)", title="measured and predicted step time", logx=True)


COLUMNS = ["nproc", "gbps", "arm", "acc_mean", "acc_sd", "bytes_per_step", "link_bytes_per_step",
           "elements_per_step",
           "x_fewer_elements", "compress_ms", "step_ms", "step_ms_min", "step_ms_max",
           "predicted_step_ms", "step_change_ms", "predicted_change_ms", "change_err_pct",
           "breakeven_gbps", "reached_target", "time_to_target_s", "compress_alone_ms",
           "predicted_from_fp32_ms", "from_fp32_err_pct", "predicted_breakeven_gbps"]


def _spread(xs: list[float]) -> tuple[float, float, float]:
    return (statistics.median(xs), min(xs), max(xs)) if xs else (math.nan,) * 3
