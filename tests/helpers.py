"""Shared test helpers: compose configs without launching, and launch real jobs (torchrun, its
ranks forked from a process with torch imported, python -m) with a timeout so a distributed bug
fails the test instead of hanging CI."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from types import SimpleNamespace
from typing import Callable

import torch
from ddp_lab.cli import CONF_DIR, compose

REPO = os.path.dirname(CONF_DIR)
# Small, fast, deterministic runs: dropout off so ranks and world sizes are comparable.
FAST = ["train.progress=false", "model.dropout=0", "train.timing_warmup=0", "train.calibrate_steps=0"]
# The short end-to-end runs of test_train.py and test_sync_train.py, which share their two
# references (one process on the whole batch; DDP on 2 ranks): SMALL_REFERENCES below.
# Random images, not digits: digits' flat backgrounds put activations exactly on ReLU/max-pool
# ties, where a 1e-9 rounding difference flips a discrete choice and two correct float32 runs part
# by 1e-5 within a few steps. On random images the runs agree to ~1e-8. A classifier 512 wide
# (3.0 M parameters instead of 23.3 M): every launch checkpoints, checksums and sends 8x fewer
# bytes. Runs with a sync add SMALL_BUCKETS: 2 MB buckets, 9 of them, so backward still overlaps
# several (the largest, at ZeRO-2 the scratch: the 384x256x3x3 convolution's weight alone).
SMALL = FAST + ["model.fc_width=512", "data=synthetic", "data.num_samples=512",
                "data.val_samples=64", "model.default_classes=10", "train.max_steps=3",
                "optim.warmup_steps=0", "train.log_every=2", "train.resume=never"]
SMALL_BUCKETS = ["sync.bucket_mb=2"]
# `python -m ddp_lab.scale` at a tiny size: conftest.py's `scale_sweep` and test_scale.py's other
# sweeps.
SCALE_TINY = ["model.fc_width=512", "data.num_samples=512", "model.default_classes=10",
              "train.batch_size=8", "train.max_steps=6", "train.timing_warmup=2", "model.dropout=0",
              "repeats=1"]  # (the sweep's own: one pass, even on a busy machine)
# DDP and one of our syncs, end to end (each point is a torchrun job, ~25 s on a 2-core VM). The
# bytes naive and tree send are checked exactly below this level: tests/test_comm.py (per
# algorithm and rank), tests/test_sync.py (per step), tests/test_perf_network.py (the model).
SCALE_SWEPT = ["ddp", "ring"]


def compose_config(overrides: list[str] = (), config_name: str = "config"):
    return compose(overrides, config_name)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env(**extra) -> dict:
    e = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for k in ("RANK", "MASTER_ADDR", "MASTER_PORT"):  # never a rendezvous of this process's
        e.pop(k, None)
    e.update(extra)
    return e


def run_cmd(cmd: list[str], timeout: float, extra_env=None, cwd: str = REPO):
    """Run `cmd` to completion in a session of its own, from the repo root. On timeout the whole
    process group is killed (torchrun's workers, a script's children: nothing outlives the test,
    and nothing holds the output pipes open) and the test fails with the output's tails. Returns
    .returncode, .stdout, .stderr and .elapsed (seconds)."""
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env(**(extra_env or {})), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"timed out after {timeout} s: {cmd}\n{out[-3000:]}\n{err[-6000:]}")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # stragglers of a failed job
        except ProcessLookupError:
            pass
    return SimpleNamespace(returncode=proc.returncode, stdout=out, stderr=err,
                           elapsed=time.monotonic() - t0)


def torchrun(args: list[str], nproc: int = 2, timeout: float = 240, extra_env=None,
             launcher_args: list[str] | None = None, module: str = "ddp_lab.train"):
    """Run `torchrun ... -m module args` to completion (or kill it at `timeout`)."""
    launcher = launcher_args or ["--standalone", f"--nproc_per_node={nproc}"]
    return run_cmd([sys.executable, "-m", "torch.distributed.run", *launcher, "-m", module, *args],
                   timeout, extra_env)


def ranks(args: list[str], nproc: int = 2, timeout: float = 240, extra_env=None,
          module: str = "ddp_lab.train"):
    """What `torchrun(args, nproc, ...)` computes (nproc=0: `python_module(args, module, ...)`),
    with the ranks forked from a process that has torch imported already
    (spawn_helpers.run_module): for the tests of what a run computes."""
    from spawn_helpers import run_module

    return run_module(module, args, nproc, env(**(extra_env or {})), timeout, REPO)


def python_module(args: list[str], module: str = "ddp_lab.train", timeout: float = 240,
                  extra_env=None):
    return run_cmd([sys.executable, "-m", module, *args], timeout, extra_env)


def scale(args, timeout=420):
    return ranks(args, nproc=0, module="ddp_lab.scale", timeout=timeout)


def run_together(calls: dict, workers: int = 2) -> dict[object, Future]:
    """Run independent launches (name -> zero-argument callable) `workers` at a time and return
    name -> its finished Future: `.result()` is the launch's return value, or raises what it
    raised. Each keeps its own timeout."""
    with ThreadPoolExecutor(max_workers=workers) as pool:
        futures = {name: pool.submit(fn) for name, fn in calls.items()}
    return futures


# Every launch the suite's tests read (training runs, benchmarks, bad commands, injected faults),
# each declared with launch_together next to the tests that read it. conftest.py's `launches` starts
# all of them that a selected test reads, in the background before the first test, two at a time,
# while the tests that need no launch run: a launch leaves cores idle much of its time (its start-up,
# a rank waiting at a barrier or on a hung peer), and they fill them. Declared at import, so every
# one is known once collection ends. Name -> (the test modules that read it, cost, fn).
TOGETHER: dict[str, tuple[tuple[str, ...], float, Callable]] = {}


def launch_together(name: str, cost: float, used_by: tuple[str, ...] = ()):
    """Decorator: `fn(directory) -> result` joins TOGETHER as `name`, launched where one of
    `used_by` (test module names; by default the module that declares it) has selected tests.
    `cost`: about how many seconds it takes alone on a 2-core machine (within a module, the
    longest starts first)."""
    used_by = used_by or (sys._getframe(1).f_globals["__name__"],)

    def add(fn):
        assert name not in TOGETHER, f"two launches named {name}"
        TOGETHER[name] = (used_by, cost, fn)
        return fn
    return add


def _small_reference(overrides: list[str], nproc: int, run_dir):
    check(ranks(SMALL + overrides + [f"hydra.run.dir={run_dir}"], nproc=nproc, timeout=240))
    return run_dir


# The two named references of the end-to-end training tests, made once per session: one process on
# the whole batch (sync=none, batch 32) and torch DDP on 2 ranks x 16 (sync=ddp), both SMALL.
SMALL_REFERENCES = {"single": (["sync=none", "train.batch_size=32"], 1),
                    "ddp": (["sync=ddp", "train.batch_size=16", *SMALL_BUCKETS], 2)}
for _name, (_overrides, _nproc) in SMALL_REFERENCES.items():
    launch_together(f"small_{_name}", cost=10, used_by=(
        "test_train", "test_sync_train", "test_zero_train", "test_trace"))(
        partial(_small_reference, _overrides, _nproc))


def check(proc) -> None:
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"


def summary(run_dir) -> dict:
    with open(os.path.join(run_dir, "summary.json")) as f:
        return json.load(f)


def bench_rows(proc, run_dir, name: str, plot: bool = True) -> list[dict]:
    """A benchmark's `name` table, as every benchmark hands it over: printed (its header and one
    line a row), written as name.jsonl and name.csv with the same rows, and drawn as name.png when
    plot=true. Returns the JSON rows."""
    import csv

    check(proc)
    rows = [json.loads(line) for line in open(os.path.join(run_dir, f"{name}.jsonl"))]
    assert rows, f"{name}.jsonl has no rows"
    with open(os.path.join(run_dir, f"{name}.csv"), newline="") as f:
        table = list(csv.DictReader(f))
    assert len(table) == len(rows) and set(table[0]) == {k for r in rows for k in r}
    first = next(iter(rows[0]))
    assert all(c[first] == str(r[first]) for c, r in zip(table, rows))
    # The printed table: a header starting with a row key over a line of dashes, then a line a
    # row (a column no row has is printed blank, so only the first is sure to be a key).
    lines = proc.stdout.splitlines()

    def table_at(i: int) -> bool:
        header, rule, body = lines[i].split(), lines[i + 1], lines[i + 2:i + 2 + len(rows)]
        return (bool(header) and header[0] in table[0] and "-" in rule
                and set(rule) <= {"-", " "} and len(body) == len(rows)
                and all(line.strip() for line in body))

    assert any(map(table_at, range(len(lines) - 1))), f"no {name} table printed:\n{proc.stdout}"
    assert os.path.exists(os.path.join(run_dir, f"{name}.png")) == plot
    return rows


def final_params(run_dir) -> dict[str, torch.Tensor]:
    return torch.load(os.path.join(run_dir, "checkpoint.pt"), weights_only=True)["model"]


def max_abs_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)
