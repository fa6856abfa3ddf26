"""The sweep: plan the points, launch each as a real torchrun job, turn summaries into rows.

A point is one (world size, sync, swept setting) triple, run as

    python -m torch.distributed.run --standalone --nproc_per_node=N -m ddp_lab.train \
        <profile defaults> <args> <training overrides> <swept setting> sync=<sync> \
        train.resume=never hydra.run.dir=<sweep dir>/points/<name>

with a timeout; its result is read back from the point's summary.json. A point that fails is a
row with its status and the last lines of its output; the sweep goes on.

Efficiency (weak and strong alike): throughput_N / (N x throughput_1), where throughput_1 is the
N=1 point of the same sync and swept setting. Weak scaling keeps the per-GPU batch, so perfect
scaling is N times the images per second. Strong scaling keeps the global batch (per-rank batch
= global / N), so perfect scaling is a step N times shorter; the same formula is then
T_1 / (N x T_N) with T the time of one global batch. Speed-up = throughput_N / throughput_1 =
N x efficiency.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

from ddp_lab.config import ConfigError
from ddp_lab.dtypes import element_size
from ddp_lab.cli import CONF_DIR

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


def torchrun_cmd(point: Point) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={point.world_size}", "-m", "ddp_lab.train", *point.args,
            f"hydra.run.dir={point.run_dir}"]


def point_env(cfg, profile: str, largest: int) -> dict:
    env = dict(os.environ)
    for k, v in cfg.env.items():
        env.setdefault(k, str(v))
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
              "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        env.pop(k, None)  # a sweep started from inside a torchrun job must not inherit its ranks
    if profile == "cpu":
        # The same threads per rank at every world size: weak scaling compares equal workers.
        threads = cfg.threads_per_rank or max(1, (os.cpu_count() or 1) // largest)
        env["OMP_NUM_THREADS"] = str(threads)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def tail(path: str, lines: int = 10) -> str:
    """The useful end of a failed point's output: our one-line `error:` if there is one, then
    the last lines the ranks printed before torchrun's own report of the failure."""
    try:
        with open(path, errors="replace") as f:
            text = f.read().splitlines()[1:]  # the first line is the command
    except OSError:
        return ""
    cut = next((i for i, l in enumerate(text) if "failed (exitcode" in l
                or l.startswith("Traceback (most recent call last)") and "torch/distributed/run.py"
                in " ".join(text[i:i + 6])), len(text))
    errors = [l for l in text if l.startswith("error:")]
    last = [l for l in text[:cut] if l.strip()][-lines:] or [l for l in text if l.strip()][-lines:]
    return "\n".join(dict.fromkeys(errors[-1:] + last))


def launch(point: Point, env: dict, timeout_s: float, keep_checkpoints: bool) -> None:
    """Run the point to completion or its timeout; fill status, error, summary."""
    if os.path.isdir(point.run_dir):
        shutil.rmtree(point.run_dir)  # a stale summary.json must never be read as this run's
    os.makedirs(point.run_dir)
    log_path = os.path.join(point.run_dir, "launcher.log")
    t0, cpu0 = time.perf_counter(), cpu_seconds()
    point.returncode, timed_out = run_logged(torchrun_cmd(point), env, log_path, timeout_s)
    if timed_out:
        point.status = "timeout"
    point.wall_s = time.perf_counter() - t0
    point.other_cores = others_cores(cpu0, cpu_seconds(), point.wall_s)
    point.load_avg = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    summary_path = os.path.join(point.run_dir, "summary.json")
    if point.status == "timeout":
        point.error = f"killed after {timeout_s:.0f} s\n" + tail(log_path)
    elif point.returncode != 0:
        point.status, point.error = "failed", f"exit {point.returncode}\n" + tail(log_path)
    elif not os.path.exists(summary_path):
        point.status, point.error = "failed", "no summary.json\n" + tail(log_path)
    else:
        point.status = "ok"
        with open(summary_path) as f:
            point.summary = json.load(f)
        info_path = os.path.join(point.run_dir, "run_info.json")
        if os.path.exists(info_path):
            with open(info_path) as f:
                point.config = json.load(f).get("config", point.config)
    if not keep_checkpoints:
        for name in os.listdir(point.run_dir):
            if name.startswith("checkpoint") and name.endswith(".pt"):
                os.remove(os.path.join(point.run_dir, name))


def cpu_seconds() -> tuple[float, float]:
    """(CPU seconds the whole machine has been busy, CPU seconds of our finished children):
    their differences over a point say how busy the machine was with anything else (Linux)."""
    try:
        with open("/proc/stat") as f:
            fields = [float(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return float("nan"), float("nan")
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)  # idle + iowait
    t = os.times()
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK"), t.children_user + t.children_system


def others_cores(before: tuple, after: tuple, wall_s: float) -> float:
    """Cores busy with other work (other users, the sweep itself) on average over `wall_s`."""
    if wall_s <= 0 or any(x != x for x in (*before, *after)):
        return float("nan")
    return max(0.0, (after[0] - before[0]) - (after[1] - before[1])) / wall_s


def run_logged(cmd: list[str], env: dict, log_path: str, timeout_s: float) -> tuple[int, bool]:
    """Run `cmd` with its output (and the command line first) in `log_path`, in a session of its
    own: on timeout the whole group (torchrun and its ranks) is stopped, so none of them lives on
    or holds a pipe. Returns (exit code, timed out)."""
    with open(log_path, "w") as log:
        log.write(" ".join(cmd) + "\n")
        log.flush()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        try:
            return proc.wait(timeout=timeout_s), False
        except subprocess.TimeoutExpired:
            _stop_group(proc)
            return proc.returncode, True


def _stop_group(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 15)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


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


# ---- rows -------------------------------------------------------------------------------------

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
