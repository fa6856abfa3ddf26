"""Shared test helpers: the runs' configurations, composing configs without launching, and
reading what a launch left (launchers.py starts them)."""

from __future__ import annotations

import json
import os

import torch
from ddp_lab import sharded_checkpoint
from ddp_lab.cli import compose
from launchers import ranks

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


def scale(args, timeout=420):
    """`python -m ddp_lab.scale args`, forked (its points still run under torchrun)."""
    return ranks(args, nproc=0, module="ddp_lab.scale", timeout=timeout)


# The two named references of the end-to-end training tests, made once per session (conftest.py's
# `small_references`): one process on the whole batch (sync=none, batch 32) and torch DDP on
# 2 ranks x 16 (sync=ddp), both SMALL. Name -> (overrides, ranks).
SMALL_REFERENCES = {"single": (["sync=none", "train.batch_size=32"], 1),
                    "ddp": (["sync=ddp", "train.batch_size=16", *SMALL_BUCKETS], 2)}


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


def training_state(run_dir) -> dict:
    """The run's last checkpoint: its step, schedule and every tensor by key. checkpoint.pt's
    model and optimizer state, or (sync.zero>=1, sync=fsdp) the newest sharded checkpoint's
    tensors, read whole in this process (ddp_lab.sharded_checkpoint.read_whole)."""
    path = os.path.join(run_dir, "checkpoint.pt")
    if not os.path.exists(path):
        c = sharded_checkpoint.read_whole(sharded_checkpoint.candidates(str(run_dir))[0])
        return {"step": c["step"], "scheduler": c["scheduler"], "tensors": c["tensors"]}
    c = torch.load(path, map_location="cpu", weights_only=True)
    optim = {f"optim.{i}.{k}": v for i, s in c["optimizer"]["state"].items() for k, v in s.items()}
    return {"step": c["step"], "scheduler": c["scheduler"],
            "tensors": {**{f"model.{k}": v for k, v in c["model"].items()}, **optim}}


def final_params(run_dir) -> dict[str, torch.Tensor]:
    """The model's parameters in the run's last checkpoint (checkpoint.pt, or sharded: whole)."""
    tensors = training_state(run_dir)["tensors"]
    return {k[len("model."):]: v for k, v in tensors.items() if k.startswith("model.")}


def max_abs_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)
