"""Shared test helpers: compose configs without launching, and launch real torchrun jobs with a
timeout so a distributed bug fails the test instead of hanging CI."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import torch
from hydra import compose, initialize_config_dir

from ddp_lab.config import register_configs
from ddp_lab.train import CONF_DIR, _register_resolvers

REPO = os.path.dirname(CONF_DIR)
# Small, fast, deterministic runs: dropout off so ranks and world sizes are comparable.
FAST = ["train.progress=false", "model.dropout=0", "train.timing_warmup=0", "train.calibrate_steps=0"]


def compose_config(overrides: list[str] = (), config_name: str = "config"):
    register_configs()
    _register_resolvers()
    with initialize_config_dir(CONF_DIR, version_base=None):
        return compose(config_name, overrides=list(overrides))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env(**extra) -> dict:
    e = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)
    e.pop("RANK", None)
    return e


def torchrun(args: list[str], nproc: int = 2, timeout: float = 240, extra_env=None,
             launcher_args: list[str] | None = None, module: str = "ddp_lab.train"):
    """Run `torchrun ... -m module args` to completion (or kill it at `timeout`)."""
    launcher = launcher_args or ["--standalone", f"--nproc_per_node={nproc}"]
    cmd = [sys.executable, "-m", "torch.distributed.run", *launcher, "-m", module, *args]
    return subprocess.run(cmd, cwd=REPO, env=env(**(extra_env or {})), capture_output=True,
                          text=True, timeout=timeout)


def python_module(args: list[str], module: str = "ddp_lab.train", timeout: float = 240,
                  extra_env=None):
    cmd = [sys.executable, "-m", module, *args]
    return subprocess.run(cmd, cwd=REPO, env=env(**(extra_env or {})), capture_output=True,
                          text=True, timeout=timeout)


def check(proc) -> None:
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"


def summary(run_dir) -> dict:
    with open(os.path.join(run_dir, "summary.json")) as f:
        return json.load(f)


def final_params(run_dir) -> dict[str, torch.Tensor]:
    return torch.load(os.path.join(run_dir, "checkpoint.pt"), weights_only=True)["model"]


def max_abs_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)
