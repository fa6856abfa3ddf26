"""Launching a point: a real torchrun job in a process group of its own, with a timeout (which
stops torchrun and all its ranks); its result read back from the point's summary.json. A point
that fails is a row with its status and the last lines of its output; the sweep goes on. Also
how busy the machine was with anything else while it ran (Linux)."""

from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import time

from ddp_lab.scale.sweep import Point


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
    if not keep_checkpoints:  # checkpoint*.pt, and sharded ones' directories (ZeRO, FSDP)
        for path in glob.glob(os.path.join(point.run_dir, "checkpoint*")):
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)


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
