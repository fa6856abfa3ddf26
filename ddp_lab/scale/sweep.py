"""The sweep's points: plan them (world sizes x syncs x swept settings, each with its training
overrides), their passes, and points collected from existing run directories. A point is one
(world size, sync, swept setting) triple, run as

    python -m torch.distributed.run --standalone --nproc_per_node=N -m ddp_lab.train \
        <profile defaults> <args> <training overrides> <swept setting> sync=<sync> \
        train.resume=never hydra.run.dir=<sweep dir>/points/<name>

(launch.py runs it, results.py turns its summary into a row).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from dataclasses import dataclass, field

from ddp_lab.cli import CONF_DIR
from ddp_lab.config import ConfigError

# Point defaults by device. Everything here can be overridden on the command line.
PROFILES = {
    "cpu": {"model": "alexnet_cifar", "data": "synthetic", "precision": "fp32",
            "data.num_samples": "512", "data.val_samples": "64",
            "train.batch_size": "8", "train.max_steps": "12", "train.timing_warmup": "3"},
    "gpu": {"model": "alexnet", "data": "synthetic", "precision": "bf16",
            "train.channels_last": "true", "train.batch_size": "256", "train.max_steps": "60",
            "train.timing_warmup": "10"},
}
# Always: no mid-run evaluation, one checkpoint at the end, no progress bar, never resume.
FIXED = {"train.eval_every_epochs": "0", "train.progress": "false", "train.resume": "never"}
# Training overrides recognised on the scale command line and passed to every point.
PASS_THROUGH = re.compile(r"^[+~]*((model|data|precision|optim)(=|\.)|(sync|train|dist)\.|seed=)")


@dataclass
class Point:
    name: str
    world_size: int
    sync: str
    extra: str  # the swept setting ("" for none)
    mode: str
    per_rank_batch: int
    args: list[str]
    run_dir: str
    status: str = "planned"  # planned | ok | failed | timeout | missing | skipped
    error: str = ""
    returncode: int | None = None
    wall_s: float = float("nan")
    summary: dict = field(default_factory=dict)
    config: dict = field(default_factory=dict)  # the point's resolved training config
    load_avg: float = float("nan")  # the machine's 1-minute load average as the point ended
    other_cores: float = float("nan")  # cores busy with anything but the point while it ran

    @property
    def series(self) -> str:
        return self.sync + (f" {self.extra}" if self.extra else "")


def parse_overrides(items) -> dict[str, str]:
    out = {}
    for item in items:
        for tok in str(item).split():
            if "=" not in tok:
                raise ConfigError(f"override {tok!r} is not key=value")
            k, v = tok.split("=", 1)
            out[k] = v
    return out


def slug(text: str) -> str:
    """A swept setting as part of a point name (no '=', which Hydra's override grammar would
    trip over in hydra.run.dir=...)."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text.replace(" ", ",")).strip("_")


def local_gpus() -> int:
    import torch
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_profile(cfg) -> str:
    if cfg.profile == "auto":
        return "gpu" if local_gpus() else "cpu"
    if cfg.profile not in PROFILES:
        raise ConfigError(f"profile={cfg.profile!r} is not one of auto, cpu, gpu")
    return cfg.profile


def world_sizes(cfg, profile: str) -> list[int]:
    if cfg.nproc:
        sizes = sorted(set(int(n) for n in cfg.nproc))
        if sizes[0] < 1:
            raise ConfigError(f"nproc={list(cfg.nproc)}: world sizes must be >= 1")
        return sizes
    top = local_gpus() if profile == "gpu" else cfg.cpu_procs
    top = max(1, top)
    sizes = [2 ** i for i in range(int(math.log2(top)) + 1)]
    return sizes + ([top] if top not in sizes else [])


def plan(cfg, passthrough: list[str], sweep_dir: str) -> tuple[list[Point], str]:
    """The points of the sweep (world sizes x syncs x swept settings), and the profile used."""
    if cfg.mode not in ("weak", "strong"):
        raise ConfigError(f"mode={cfg.mode!r} is not one of weak, strong")
    profile = resolve_profile(cfg)
    base = {**PROFILES[profile], **parse_overrides(cfg.args), **parse_overrides(passthrough),
            **FIXED}
    if "sync" in base:
        raise ConfigError("choose syncs with syncs=[...] (sync= is what the sweep varies)")
    steps = int(base["train.max_steps"])
    if steps <= int(base["train.timing_warmup"]):
        raise ConfigError(f"train.max_steps={steps} leaves no timed step after "
                          f"train.timing_warmup={base['train.timing_warmup']}")
    base.setdefault("train.checkpoint_every", str(steps))  # one checkpoint, at the end
    sizes = world_sizes(cfg, profile)
    batch = int(base["train.batch_size"])
    global_batch = cfg.global_batch or batch * sizes[-1]
    if cfg.mode == "strong":
        bad = [n for n in sizes if global_batch % n]
        if bad:
            raise ConfigError(f"mode=strong: global_batch={global_batch} is not divisible by "
                              f"world size(s) {bad}")
    extras = list(cfg.sweep) or [""]
    gpus = local_gpus()
    points = []
    for extra in extras:
        extra_args = parse_overrides([extra])
        if "sync" in extra_args:
            raise ConfigError(f"sweep entry {extra!r}: choose syncs with syncs=[...]")
        if cfg.mode == "strong" and "train.batch_size" in extra_args:
            raise ConfigError(f"sweep entry {extra!r}: mode=strong sets train.batch_size from "
                              "global_batch; sweep global batches as separate sweeps")
        for sync in cfg.syncs:
            for n in sizes:
                if sync == "none" and n > 1:
                    continue  # nothing to synchronise only makes sense alone
                per_rank = (global_batch // n if cfg.mode == "strong"
                            else int(extra_args.get("train.batch_size", batch)))
                args = {**base, **extra_args, "train.batch_size": str(per_rank)}
                name = f"n{n}-{sync}" + (f"-{slug(extra)}" if extra else "")
                run_dir = os.path.join(sweep_dir, "points", name)
                p = Point(name, n, sync, extra, cfg.mode, per_rank,
                          [f"{k}={v}" for k, v in args.items()] + [f"sync={sync}"], run_dir)
                if not os.path.exists(os.path.join(CONF_DIR, "sync", f"{sync}.yaml")):
                    p.status, p.error = "missing", (f"conf/sync/{sync}.yaml does not exist: "
                                                    f"sync={sync} is not on this branch yet")
                elif profile == "gpu" and n > gpus:
                    p.status, p.error = "skipped", f"world size {n} > {gpus} local GPUs"
                points.append(p)
    return points, profile


def check_point_config(point: Point) -> None:
    """Compose the first point's training config here, so a misspelt training override fails
    the sweep once, with Hydra's or validate()'s message, instead of failing every point."""
    from omegaconf import OmegaConf

    from ddp_lab.cli import compose
    from ddp_lab.config import validate

    try:
        cfg = compose([a for a in point.args if not a.startswith("hydra.")])
        validate(cfg)
    except ConfigError:
        raise
    except Exception as e:  # Hydra's composition errors carry the useful message
        raise ConfigError(f"training overrides {point.args}: {e}") from None
    point.config = OmegaConf.to_container(cfg, resolve=True)


def repeat_suffix(repeat: int) -> str:
    return f".r{repeat + 1}" if repeat else ""


def for_repeat(p: Point, repeat: int) -> Point:
    """The point's run for pass `repeat` (0: the point itself, in points/<name>/; then
    points/<name>.r2/, ...)."""
    if repeat == 0 or p.status in ("missing", "skipped"):
        return p
    return dataclasses.replace(p, run_dir=p.run_dir + repeat_suffix(repeat), summary={},
                               config=dict(p.config), status="planned", error="",
                               returncode=None, wall_s=float("nan"))


def probe_path(run_dir: str) -> str:
    """The interference probe's file of the point run in `run_dir`, where a sweep keeps it:
    <sweep>/points/<name>[.rK] -> <sweep>/interference/<name>[.rK].json."""
    points, name = os.path.split(os.path.abspath(run_dir).rstrip("/"))
    return os.path.join(os.path.dirname(points), "interference", name + ".json")


def collect_point(run_dir: str) -> Point:
    """A point from an existing run directory (a multi-node run, say): its summary and config."""
    run_dir = os.path.abspath(run_dir)
    with open(os.path.join(run_dir, "summary.json")) as f:
        s = json.load(f)
    config = {}
    if os.path.exists(os.path.join(run_dir, "run_info.json")):
        with open(os.path.join(run_dir, "run_info.json")) as f:
            config = json.load(f).get("config", {})
    p = Point(os.path.basename(run_dir.rstrip("/")), s["world_size"], s["sync"], "",
              "weak", s["per_rank_batch"], [], run_dir, status="ok", summary=s, config=config)
    return p
