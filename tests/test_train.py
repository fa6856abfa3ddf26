"""End-to-end training under torchrun on gloo (CPU), against named references."""

import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from ddp_lab.config import is_neutral
from background import background
from helpers import SMALL, SMALL_BUCKETS, check, final_params, max_abs_diff, summary
from launchers import free_port, run_cmd, torchrun

TOLERANCE = 1e-6


@pytest.fixture(scope="module")
def single_process_reference(small_references):
    """One process on the whole batch (sync=none, batch 32): the reference for 2 ranks x 16.
    Shared with test_sync_train.py (conftest.py)."""
    return small_references["single"]


def test_ddp_two_ranks_equal_single_process_on_the_whole_batch(single_process_reference,
                                                               small_references):
    """sync=ddp, 2 ranks x 16 (the run test_sync_train.py also compares its syncs against)."""
    run = small_references["ddp"]
    ref, got = final_params(single_process_reference), final_params(run)
    s = summary(run)
    assert s["world_size"] == 2 and s["global_batch"] == 32
    assert len(set(s["rank_param_digests"])) == 1  # identical parameters on every rank
    diff = max_abs_diff(ref, got)
    init = _initial_params()
    moved = max_abs_diff(ref, init)
    assert moved > 1e-3, "training did not move the parameters: the comparison would be empty"
    assert diff < TOLERANCE, f"max |2 ranks - 1 process| = {diff}"


def _initial_params():
    from ddp_lab.models import build_model
    torch.manual_seed(0)
    return build_model("alexnet_cifar", 10, 0.0, fc_width=512).state_dict()


def test_outputs_of_a_run(single_process_reference):
    run = single_process_reference
    names = set(os.listdir(run))
    assert {"summary.json", "metrics.jsonl", "checkpoint.pt", "run_info.json", "train.log"} <= names
    assert any(n.startswith("events.out.tfevents") for n in names)
    s = summary(run)
    for key in ("world_size", "sync", "precision", "global_batch", "steps", "train_img_per_s",
                "val_accuracy", "val_loss"):
        assert key in s
    assert s["steps"] == 3 and s["sync"] == "none" and s["train_img_per_s"] > 0
    rows = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]
    # log_every=2 of 3 steps: step 2, and the last step's partial window
    assert [r["step"] for r in rows if "train/loss" in r] == [2, 3]
    assert any("val/accuracy" in r for r in rows)
    ckpt = torch.load(os.path.join(run, "checkpoint.pt"), weights_only=True)
    assert set(ckpt["model"]) == set(_initial_params())
    info = json.load(open(os.path.join(run, "run_info.json")))
    assert info["provenance"]["torch"] == torch.__version__ and "git_commit" in info["provenance"]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(run))
    acc.Reload()
    assert {"train/loss", "throughput/img_per_s", "val/accuracy"} <= set(acc.Tags()["scalars"])
    phases = {f"time/{p}_ms" for p in ("data", "forward", "backward", "comm", "optim")}
    assert phases <= set(acc.Tags()["scalars"])  # the step-time breakdown, per log window
    assert all(phases <= set(r) for r in rows if "train/loss" in r)


def test_two_nodes_through_c10d_rendezvous_match_one_node(single_process_reference,
                                                          small_references, tmp_path):
    """Two torchrun agents (--nnodes=2, one process each) meeting at a c10d endpoint on localhost;
    the same command as the DDP reference, whose ranks forked from the test process
    (launchers.ranks, as for every test of what a run computes): torchrun's processes must end
    bitwise where those did."""
    port = free_port()
    run_dir = tmp_path / "two_nodes"
    args = SMALL + SMALL_BUCKETS + ["sync=ddp", "train.batch_size=16", f"hydra.run.dir={run_dir}"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=ddp_lab_test",
           "-m", "ddp_lab.train", *args]
    # Both at once, each in a session of its own (run_cmd: killed whole on timeout, its output
    # read as it comes, so neither blocks on a full pipe).
    with ThreadPoolExecutor(max_workers=2) as pool:
        agents = [pool.submit(run_cmd, cmd, 240) for _ in range(2)]
    for agent in agents:
        check(agent.result())
    assert summary(run_dir)["world_size"] == 2
    diff = max_abs_diff(final_params(single_process_reference), final_params(run_dir))
    assert diff < TOLERANCE, diff
    assert max_abs_diff(final_params(small_references["ddp"]), final_params(run_dir)) == 0


# Keys that change nothing the run computes (ddp_lab.config.NEUTRAL): no progress bar, no
# calibration passes, and one checkpoint, at the end, instead of a 186 MB one every epoch.
NEUTRAL_OVERRIDES = ["train.progress=false", "train.calibrate_steps=0",
                     "train.checkpoint_every=100000"]


@background(cost=140)
def default_command(run_dir):
    """The README's first command under torchrun itself: 2 CPU ranks, the default config."""
    return torchrun(NEUTRAL_OVERRIDES + [f"hydra.run.dir={run_dir}"], timeout=600), run_dir


def test_default_command_reaches_90_percent_on_digits(default_command):
    proc, run_dir = default_command
    check(proc)
    s = summary(run_dir)
    assert s["val_accuracy"] >= 0.90, s
    assert all(is_neutral(key.split("=")[0]) for key in NEUTRAL_OVERRIDES)
