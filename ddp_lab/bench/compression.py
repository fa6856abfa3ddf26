"""The compression study: what each `sync.compress` arm costs in accuracy, saves in bytes, and does
to the step time on slower links, measured, beside the performance model's prediction.

    python -m ddp_lab.bench.compression                                   # every arm, 3 seeds
    python -m ddp_lab.bench.compression nproc=[2,4,8] gbps=[0,10,1]       # a 16-core host
    python -m ddp_lab.bench.compression arms=[fp32,powersgd-r2] seeds=[0] gbps=[0] steps=3 \
        target_accuracy=0 train.eval_every_epochs=0                       # count elements only
    python -m ddp_lab.bench.compression data=cifar10                      # CIFAR-10, when present
    python -m ddp_lab.bench.compression <the same> tabulate_only=true     # a study cut short

Training overrides on the command line (model=..., data=..., optim.*, train.*, sync.*, seed=...)
go to every run, as with `python -m ddp_lab.scale`, and `sync=ddp` runs the arms through torch's
comm hooks (the reference; bf16, fp16 and powersgd only). Every run is a real torchrun job of
ddp_lab.train (sync=ring, AdamW, `RECIPE`), one at a time:
- accuracy runs: each arm x seed x nproc, `steps` steps, no emulated link, evaluated each epoch;
- link runs: each of `link_arms` x link speed (`gbps` > 0) x nproc, `repeats` times,
  `timing_steps` steps, every rank its own node behind a link of that speed (dist.node_size=1,
  dist.link.gbps; ddp_lab/dist.py), so every byte it sends waits on it; `dist.*` on the command
  line changes the layout (sync=hring dist.node_size=2 dist.link.shared=true: nodes of 2 ranks
  sharing a link).
Per run (runs.jsonl): final accuracy, accuracy per evaluation, the step time (the run's median
over its timed steps), bytes and elements sent per step (counted: the Recorder's bytes; the
elements handed to the collectives, summary.json's `comm.compression`, else every gradient
element), the compressor's own host time per step.
Per arm, nproc and link (arms.jsonl, the table: ddp_lab/bench/compression_table.py): accuracy
over the seeds, bytes and elements, the step time, and the model's figures beside it. On a link,
the step predicted from the arm's own runs without a link plus what the bytes its busiest link
carries (counted: summary.json's `link_bytes_per_step`) add over the link on its communication
thread, bucket by bucket (`sync_buckets`: when each is ready), beyond backward; fitted on no
linked point. The compression-compute term (ddp_lab/perf/compression.py): before any run each
compressor is timed alone in this process on the run's bucket shapes, with the runs' threads
(`compress_alone.json`, `calibrate`), and every arm, linked or not, is predicted from fp32's
runs without a link with that time and its link bytes on fp32's thread
(`predicted_from_fp32_ms`), and its break-even link speed from the same
(`predicted_breakeven_gbps`): no run of the arm is an input but its counted bytes.
"""

from __future__ import annotations

import glob
import json
import math
import os
import sys
from dataclasses import dataclass, field

import torch
from hydra.core.config_store import ConfigStore

from ddp_lab.bench.common import entry, report, write_info
from ddp_lab.bench.compression_table import COLUMNS, arm_rows, plot
from ddp_lab.buckets import sync_rule
from ddp_lab.config import ConfigError
from ddp_lab.dtypes import element_size
from ddp_lab.perf.compression import bucket_shapes, compress_alone_ms
from ddp_lab.perf.compute import profile_model
from ddp_lab.perf.step import Bucket, make_buckets
from ddp_lab.sync.config import wire_dtype

# Every arm's sync.* overrides.
ARMS = {
    "fp32": [], "bf16": ["sync.compress=bf16"], "fp16": ["sync.compress=fp16"],
    **{f"powersgd-r{r}{'' if ef else '-noef'}":
       ["sync.compress=powersgd", f"sync.compress_rank={r}",
        f"sync.error_feedback={str(ef).lower()}"]
       for ef in (True, False) for r in (1, 2, 4)},
    "topk-1pct": ["sync.compress=topk", "sync.topk_fraction=0.01"],
}
# Every run: our ring, AdamW (SGD's first epochs on digits barely move: the study's budget is a
# few epochs), a short warm-up, no checkpoint but the last (removed after reading), no resume.
RECIPE = ["sync=ring", "optim=adamw", "optim.warmup_steps=5", "train.batch_size=32",
          "train.calibrate_steps=0", "train.progress=false", "train.resume=never",
          "train.checkpoint_every=1000000"]
PASSED = []  # the command line's training overrides (main)
# Every run, linked or not: every rank its own node, so the runs without a link count the bytes
# the linked runs' links will carry (summary.json's link_bytes_per_step: 0 on one node).
NODES = ["dist.node_size=1"]


@dataclass
class CompressionConfig:
    arms: list[str] = field(default_factory=lambda: list(ARMS))
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    nproc: list[int] = field(default_factory=lambda: [2, 4])
    gbps: list[float] = field(default_factory=lambda: [0.0, 10.0, 1.0])  # 0: no emulated link
    link_arms: list[str] = field(default_factory=list)  # arms timed on the links; []: every arm
    steps: int = 66  # the accuracy runs' fixed budget (3 epochs of digits at 2 x 32)
    timing_steps: int = 12  # the link runs'
    timing_warmup: int = 4  # steps each run leaves out of its step time
    repeats: int = 3  # link runs per arm, speed and nproc
    target_accuracy: float = 0.7
    compress_start: int = 0  # PowerSGD and top-k arms: steps sent uncompressed first
    point_timeout_s: float = 600.0
    threads_per_rank: int = 0  # OMP threads per rank; 0: the cores over the largest nproc
    env: dict[str, str] = field(default_factory=dict)
    plot: bool = True
    # true: launch nothing; tabulate the runs already in the run directory (a study a time limit
    # cut short), each missing run listed as such
    tabulate_only: bool = False


ConfigStore.instance().store(name="bench_compression_schema", node=CompressionConfig)


def check(cfg) -> None:
    bad = [a for a in [*cfg.arms, *cfg.link_arms] if a not in ARMS]
    if bad:
        raise ConfigError(f"arms: {bad[0]!r} is not one of {', '.join(ARMS)}")
    if "fp32" not in cfg.arms or cfg.link_arms and "fp32" not in cfg.link_arms:
        raise ConfigError("arms and link_arms must hold fp32: every other arm is compared with it")
    if not cfg.seeds or not cfg.nproc or min(cfg.nproc) < 1 or 0 not in cfg.gbps:
        raise ConfigError("seeds, nproc (>= 1) and gbps (with 0: no link) must not be empty")
    if min(cfg.steps, cfg.timing_steps, cfg.repeats) < 1 or cfg.timing_warmup < 0:
        raise ConfigError("steps, timing_steps and repeats must be >= 1, timing_warmup >= 0")
    bad_speed = [g for g in cfg.gbps if not (math.isfinite(g) and g >= 0)]
    if bad_speed:
        raise ConfigError(f"gbps: {bad_speed[0]} is not a link speed (finite, >= 0; 0: no link)")
    for name, ok, rule in (("target_accuracy", 0 <= cfg.target_accuracy <= 1, "in [0, 1]"),
                           ("point_timeout_s", cfg.point_timeout_s > 0, "> 0"),
                           ("threads_per_rank", cfg.threads_per_rank >= 0, ">= 0 (0: auto)"),
                           ("compress_start", cfg.compress_start >= 0, ">= 0")):
        if not ok:
            raise ConfigError(f"{name}={getattr(cfg, name)} must be {rule}")


def check_points(points: list) -> None:
    """Every run's training config, as torchrun will start it (its world size too), valid before
    any run starts: an arm the command line's sync cannot run (top-k with sync=ddp), a link
    sync=ddp would not wait for. One line naming the run. Each kind of run is checked once: a
    seed or a repeat changes nothing the checks read."""
    from ddp_lab.cli import compose
    from ddp_lab.config import validate
    from ddp_lab.dist import launched_as

    seen = set()
    for point, what in points:
        if (what["nproc"], what["arm"], what["gbps"]) in seen:
            continue
        seen.add((what["nproc"], what["arm"], what["gbps"]))
        with launched_as(what["nproc"]):
            try:
                validate(compose(point.args))
            except ConfigError as e:
                raise ConfigError(f"{point.name}: {e}") from None


def arm_config(cfg, arm: str):
    """The training config of the arm's runs (without a seed or a link: those change neither
    its validity nor its compressor)."""
    from ddp_lab.cli import compose

    return compose([*recipe(), *ARMS[arm], *_start(cfg, arm), *PASSED])


def check_fresh(run_dir: str) -> None:
    """A study's runs are never launched over: relaunching a point deletes its directory."""
    if glob.glob(os.path.join(run_dir, "runs", "*", "summary.json")):
        raise ConfigError(f"{run_dir} holds a study's runs already: tabulate them with "
                          "tabulate_only=true, or give another hydra.run.dir")


def recipe() -> list[str]:
    """RECIPE less what the command line's training overrides set themselves (optim=sgd, say)."""
    given = {a.split("=", 1)[0] for a in PASSED}
    return [a for a in RECIPE if a.split("=", 1)[0] not in given]


def _start(cfg, arm: str) -> list[str]:
    """PowerSGD's and top-k's sync.compress_start (the 16-bit arms have none)."""
    return ([f"sync.compress_start={cfg.compress_start}"]
            if arm.startswith(("powersgd", "topk")) else [])


def plan(cfg, run_dir: str) -> list:
    """Every run as a ddp_lab.scale Point, accuracy runs first."""
    from ddp_lab.scale.sweep import Point

    points = []

    def add(kind, n, arm, seed, gbps, repeat, args):
        where = f"s{seed}" if kind == "accuracy" else f"{gbps:g}gbps-r{repeat}"
        name = f"{kind}-n{n}-{arm}-{where}"
        point = Point(name, n, "ring", arm, "compression", 32,
                      [*recipe(), *ARMS[arm], *_start(cfg, arm), f"seed={seed}", *NODES, *args,
                       *PASSED],
                      os.path.join(run_dir, "runs", name))
        points.append((point, {"phase": kind, "nproc": n, "arm": arm, "seed": seed,
                               "gbps": gbps, "repeat": repeat}))

    # Arms take turns (each seed, each repeat runs every arm before the next), so a drift in
    # the machine's load over minutes falls on every arm alike, not on the arms run last.
    for n in cfg.nproc:
        for seed in cfg.seeds:
            for arm in cfg.arms:
                add("accuracy", n, arm, seed, 0.0, 0, [f"train.max_steps={cfg.steps}",
                                                       f"train.timing_warmup={cfg.timing_warmup}"])
        for gbps in (g for g in cfg.gbps if g > 0):
            for repeat in range(cfg.repeats):
                for arm in cfg.link_arms or cfg.arms:
                    add("link", n, arm, cfg.seeds[0], gbps, repeat, [
                        f"train.max_steps={cfg.timing_steps}", "train.eval_every_epochs=0",
                        f"train.timing_warmup={cfg.timing_warmup}", f"dist.link.gbps={gbps:g}"])
    return points


def run_row(point, what: dict, target: float) -> dict:
    """One run's row from its summary.json and metrics.jsonl."""
    row = {**what, "status": point.status, "wall_s": round(point.wall_s, 1)}
    if point.status != "ok":
        return row | {"error": point.error.splitlines()[0] if point.error else ""}
    s = point.summary
    compression = s["comm"].get("compression", {})
    curve = evaluations(point.run_dir)
    reached = [step for step, acc in curve if acc >= target]
    return row | {
        "val_accuracy": s["val_accuracy"], "step_ms": s["time_ms"].get("step", math.nan),
        "bytes_per_step": s["comm_bytes_per_step"],
        "link_bytes_per_step": _link_bytes(s),
        "elements_per_step": compression.get("elements_per_step", s["parameters"]),
        "gradient_elements": s["parameters"],
        "compress_ms": compression.get("compress_ms", 0.0),
        # the link term's inputs (sync=ddp: torch's reducer times no host time, counts no bucket)
        "backward_ms": s["time_ms"].get("backward", math.nan),
        "comm_busy_ms": s["time_ms"].get("comm_busy", math.nan),
        "bucket_bytes_sent": compression.get("bucket_bytes_sent", s["comm"].get("bucket_bytes")),
        "bucket_compress_ms": compression.get("bucket_compress_ms", []),
        "steps_to_target": reached[0] if reached else None, "curve": curve}


def _link_bytes(summary: dict) -> float:
    """What the busiest link carried per step; rank 0's bytes where it was not counted (sync=ddp:
    torch's all-reduce, or a study from before the count), the same on nodes of one rank."""
    counted = summary.get("link_bytes_per_step")
    return summary["comm_bytes_per_step"] if counted is None else counted


def read_back(point) -> None:
    """The point as its run directory left it: ok with its summary.json, else missing."""
    path = os.path.join(point.run_dir, "summary.json")
    if not os.path.exists(path):
        point.status, point.error = "missing", "not run (tabulate_only)"
        return
    with open(path) as f:
        point.summary = json.load(f)
    point.status = "ok"


def evaluations(run_dir: str) -> list[list]:
    """[step, validation accuracy] of every evaluation of a run (its metrics.jsonl)."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [[r["step"], r["val/accuracy"]] for r in rows if "val/accuracy" in r]


def calibrate(cfg, run_dir: str, threads: int) -> dict:
    """(nproc, arm) -> the arm's compressor timed alone (ms a step; 0 for arms without one), on
    `threads` threads, kept in compress_alone.json; a study tabulated again reads that file (the
    time is the machine's that ran it). With sync=ddp, PowerSGD is torch's hook, not ours: not
    timed, NaN."""
    path = os.path.join(run_dir, "compress_alone.json")
    if cfg.tabulate_only:
        if not os.path.exists(path):  # (a study from before the term)
            return {}
        with open(path) as f:
            return {(r["nproc"], r["arm"]): r["compress_alone_ms"] for r in json.load(f)}
    from ddp_lab.compress import COMPRESSORS
    from ddp_lab.models import build_model

    before, rows = torch.get_num_threads(), []
    torch.set_num_threads(threads)
    try:
        for arm in cfg.arms:
            c = arm_config(cfg, arm)
            timed = c.sync.compress in COMPRESSORS and c.sync.name != "ddp"
            if timed:
                model = build_model(c.model.name, c.data.num_classes, 0.0, c.model.stem,
                                    c.model.fc_width)
                shapes = bucket_shapes(model, c.sync.bucket_mb)
            for n in cfg.nproc:
                ms = (compress_alone_ms(COMPRESSORS[c.sync.compress].from_config(c.sync),
                                        shapes, n) if timed else
                      0.0 if c.sync.compress not in COMPRESSORS else math.nan)
                rows.append({"nproc": n, "arm": arm, "compress_alone_ms": ms})
    finally:
        torch.set_num_threads(before)
    with open(path, "w") as f:
        json.dump(rows, f, indent=1)
    return {(r["nproc"], r["arm"]): r["compress_alone_ms"] for r in rows}


def sync_buckets(cfg, arm: str) -> list[Bucket]:
    """The arm's buckets (bytes, and the fraction of backward done when each is ready) as the
    scaling model cuts the sync's (ddp_lab/perf/predict.py): the model's layers by their forward
    FLOPs, our syncs' rule (DDP's for sync=ddp) at sync.bucket_mb, in the dtype they travel in."""
    c = arm_config(cfg, arm)
    profile = profile_model(c.model.name, c.model.image_size, c.data.num_classes,
                            c.model.fc_width)
    rule, first_mb = sync_rule(c.sync.name == "ddp")
    return make_buckets(profile, c.sync.bucket_mb, element_size(wire_dtype(c.sync)), first_mb, rule)


def run(cfg, run_dir: str) -> list[dict]:
    from ddp_lab.scale.launch import launch, point_env

    check(cfg)
    points = plan(cfg, run_dir)
    if not cfg.tabulate_only:
        check_fresh(run_dir)
        check_points(points)
    env = point_env(cfg, "cpu", max(cfg.nproc))
    alone_ms = calibrate(cfg, run_dir, int(env["OMP_NUM_THREADS"]))
    runs = []
    for i, (point, what) in enumerate(points):
        if cfg.tabulate_only:
            read_back(point)
        else:
            launch(point, env, cfg.point_timeout_s, keep_checkpoints=False)
        runs.append(run_row(point, what, cfg.target_accuracy))
        print(f"[{i + 1}/{len(points)}] {point.name}: {point.status} ({point.wall_s:.0f} s)",
              flush=True)
    report(runs, run_dir, "runs", ["phase", "nproc", "arm", "seed", "gbps", "repeat", "status",
                                   "val_accuracy", "step_ms", "bytes_per_step",
                                   "elements_per_step", "steps_to_target"], title="every run")
    rows = arm_rows(runs, cfg, {arm: sync_buckets(cfg, arm) for arm in cfg.arms}, alone_ms)
    report(rows, run_dir, "arms", COLUMNS, title="per arm (against fp32 at its nproc and link)",
           notes=[f"accuracy: mean and sd over {len(cfg.seeds)} seeds after {cfg.steps} steps; "
                  "step_ms: median (min, max) over the runs",
                  "predicted = the arm's step without a link + what its busiest link's bytes "
                  "over it add on its communication thread, bucket by bucket, beyond backward "
                  "(ddp_lab/perf/compression.py); fitted on no linked point",
                  "breakeven_gbps: below this link speed the arm's step is shorter than fp32's",
                  "predicted_from_fp32 = fp32's step without a link + what the arm's compressor "
                  "timed alone (compress_alone_ms) and its link bytes over the link add on "
                  "fp32's communication thread; no run of the arm is an input but its bytes"])
    if cfg.plot and rows:
        plot(rows, run_dir)
    write_info(run_dir, "compression", cfg, torch.device("cpu"),
               training_overrides=[*recipe(), *PASSED])
    return rows


def is_training_override(arg: str) -> bool:
    """A training override (ddp_lab.scale's, and `sync=`: the study runs one sync, ours by
    default; `sync=ddp` runs the arms through torch's comm hooks, the reference)."""
    from ddp_lab.scale.sweep import PASS_THROUGH

    return bool(PASS_THROUGH.match(arg)) or arg.startswith("sync=")


def main(argv: list[str] | None = None) -> None:
    """Training overrides go to every run (PASSED), the rest to the study's own config."""
    from ddp_lab.scale.app import run_name

    argv = list(sys.argv[1:] if argv is None else argv)
    PASSED[:] = [a for a in argv if is_training_override(a)]
    own = [a for a in argv if not is_training_override(a)]
    if not any(a.startswith("hydra.run.dir=") for a in own):
        own.append(f"hydra.run.dir=outputs/bench/compression/{run_name(argv)}")
    sys.argv = [sys.argv[0], *own]
    entry(run, "bench/compression")()


if __name__ == "__main__":
    main()
