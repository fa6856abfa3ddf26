"""Shared by the reliability tests (test_resume, test_faults, test_bad_input): a tiny run, the
syncs they cover, and how a run is compared with its uninterrupted reference (conftest.py's
`uninterrupted`)."""

from __future__ import annotations

import os

import pytest
import torch

from helpers import FAST, training_state
from launchers import REPO

# 2 ranks x 8 = 16 samples per step, 48 samples: 3 steps per epoch, 6 steps in 2 epochs, so a stop
# at step 4 (or 2) is mid-epoch. Random images (see test_train.py on why not digits). Dropout on:
# resuming must restore every rank's RNG to reproduce the masks.
TINY = [a for a in FAST if not a.startswith("model.dropout")] + [
    "model.fc_width=512", "data=synthetic", "data.num_samples=48", "data.val_samples=16",
    "model.default_classes=10", "train.epochs=2", "train.batch_size=8", "optim.warmup_steps=0", "train.log_every=1"]
RESUME = TINY + ["model.dropout=0.5"]
NO_DROPOUT = TINY + ["model.dropout=0"]

HAVE_RING = os.path.exists(os.path.join(REPO, "conf", "sync", "ring.yaml"))
SYNCS = [
    "ddp",
    pytest.param("ring", marks=pytest.mark.skipif(
        not HAVE_RING, reason="sync=ring is not available yet (no conf/sync/ring.yaml on this branch)")),
]
SYNC_NAMES = ["ddp"] + ["ring"] * HAVE_RING  # the SYNCS that run here (for fixtures)


def ckpt(path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def assert_bitwise_equal(a: dict, b: dict, what: str = "") -> None:
    assert a.keys() == b.keys()
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, f"{what}: tensors differ bitwise: {differ[:5]}"


def assert_same_training_state(run_dir, ref_dir) -> None:
    """Final parameters and optimizer state equal bitwise (torch.equal) to the reference's."""
    got, ref = training_state(run_dir), training_state(ref_dir)
    assert got["step"] == ref["step"]
    assert_bitwise_equal(got["tensors"], ref["tensors"], "parameters and optimizer state")
    assert got["scheduler"]["last_epoch"] == ref["scheduler"]["last_epoch"]


def train_log(run_dir) -> str:
    with open(os.path.join(run_dir, "train.log")) as f:
        return f.read()
