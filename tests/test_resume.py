"""Checkpoint and resume, against an uninterrupted run: `train.stop_at_step=K` then the same
command again must end bitwise equal (torch.equal) to training straight through, for every sync;
damaged checkpoints are refused and the previous good one used; what goes into a checkpoint can
always be loaded with weights_only=True and never runs code."""

import os
import random
import shutil

import numpy as np
import pytest
import torch

from ddp_lab import checkpoint
from ddp_lab.config import ConfigError
from ddp_lab.optim import lr_factor
from background import background
from helpers import check, compose_config, summary
from launchers import ranks
from reliab_helpers import RESUME, SYNC_NAMES, SYNCS, assert_same_training_state, ckpt, train_log

STOP = ["train.stop_at_step=4", "train.checkpoint_every=2", "train.keep_every=2"]
AGAIN = [a for a in STOP if "stop_at_step" not in a]  # the same command without train.stop_at_step


def _stop(run, sync):
    """A run stopped at step 4 (mid-epoch 1), and what it left: its summary, its files, the
    position, learning rate and RNG states in its checkpoint."""
    check(ranks(RESUME + [f"sync={sync}", f"hydra.run.dir={run}"] + STOP))
    c = ckpt(os.path.join(run, "checkpoint.pt"))
    return {"summary": summary(run), "files": set(os.listdir(run)),
            "position": (c["step"], c["epoch"], c["epoch_batch"]),
            "lr": c["scheduler"]["_last_lr"][0], "rng": c["rng"]}


@background(cost=lambda sync: 12 if sync != "ddp" else 24, keys=SYNC_NAMES)
def stop_then_again(sync, run):
    """`_stop`, then the same command without train.stop_at_step in its run dir: (what the stop
    left, the second launch's result, the run dir). For ddp the stopped run is first copied for
    `_damage_then_resume` (test_damaged_...'s start: a stopped ddp run like this one)."""
    left = _stop(run, sync)
    if sync == "ddp":
        shutil.copytree(run, _damaged(run))
        _damage_then_resume(_damaged(run))
    return left, ranks(RESUME + [f"sync={sync}", f"hydra.run.dir={run}"] + AGAIN), run


def _damaged(run):
    """Where stop_then_again["ddp"] copies its stopped run to damage it."""
    return run.parent / f"{run.name}_damaged"


def _damage_then_resume(run):
    """The stopped ddp run, damaged: checkpoint.pt with one flipped byte in tensor data
    (torch.load would accept it), checkpoint_step4.pt truncated, a temporary left by a save
    killed midway; then the same command again."""
    latest, kept4 = os.path.join(run, "checkpoint.pt"), os.path.join(run, "checkpoint_step4.pt")
    with open(latest, "r+b") as f:
        f.seek(os.path.getsize(latest) // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x40]))
    torch.load(latest, weights_only=True)  # torch itself does not notice
    with open(kept4, "r+b") as f:
        f.truncate(os.path.getsize(kept4) // 2)
    stale = os.path.join(run, "checkpoint.pt.tmp.12345")
    with open(stale, "wb") as f:
        f.write(b"half a checkpoint")
    check(ranks(RESUME + ["sync=ddp", f"hydra.run.dir={run}", "train.checkpoint_every=2"]))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("sync", SYNCS)
def test_stop_at_step_then_rerun_equals_uninterrupted_run(sync, uninterrupted, stop_then_again):
    ref = uninterrupted[sync]
    left, again, run = stop_then_again[sync]
    s = left["summary"]
    assert s["steps"] == 4 and s["total_steps"] == 6 and s["stopped_early"]
    # the position: step 4 of 3-step epochs is epoch 1, batch 1; the schedule is the full run's
    assert left["position"] == (4, 1, 1)
    assert left["lr"] == pytest.approx(
        compose_config(RESUME).optim.lr * lr_factor(4, 0, 6, "cosine", 0.0), rel=1e-12)
    assert len(left["rng"]) == 2 and {"torch", "python", "numpy"} <= set(left["rng"][1])
    assert "checkpoint_step6.pt" not in left["files"]
    assert {"checkpoint_step2.pt", "checkpoint_step4.pt"} <= left["files"]

    # the same command without train.stop_at_step
    check(again)
    assert f"resumed from {run}/checkpoint.pt at step 4" in train_log(run)
    assert summary(run)["steps"] == 6 and not summary(run)["stopped_early"]
    assert_same_training_state(run, ref)


@pytest.mark.timeout(300)
def test_damaged_checkpoints_are_refused_and_the_previous_good_one_used(uninterrupted,
                                                                        stop_then_again):
    """checkpoint.pt with one flipped byte in tensor data (torch.load would accept it),
    checkpoint_step4.pt truncated, a temporary left by a save killed midway: the run resumes from
    checkpoint_step2.pt (mid-epoch 0) and still ends equal to the uninterrupted run."""
    ref = uninterrupted["ddp"]
    run = _damaged(stop_then_again["ddp"][2])
    latest, kept4 = os.path.join(run, "checkpoint.pt"), os.path.join(run, "checkpoint_step4.pt")
    log = train_log(run)
    assert f"refusing checkpoint {latest} is corrupted" in log
    assert f"refusing checkpoint {kept4} is unreadable, truncated or corrupted" in log
    assert "removed stale temporary" in log
    assert not os.path.exists(os.path.join(run, "checkpoint.pt.tmp.12345"))
    assert f"resumed from {run}/checkpoint_step2.pt at step 2" in log
    assert_same_training_state(run, ref)


# ---- in-process: no launch ----------------------------------------------------------------------

def _tiny_state(step=3):
    return {"model": {"w": torch.arange(6.0)}, "optimizer": {"state": {}, "param_groups": []},
            "step": step, "config_digest": "d"}


def test_every_checkpoint_damaged_refuses_instead_of_starting_over(tmp_path):
    checkpoint.atomic_save(_tiny_state(), str(tmp_path / "checkpoint.pt"))
    with open(tmp_path / "checkpoint.pt", "r+b") as f:
        f.truncate(100)
    with pytest.raises(ConfigError, match="no usable checkpoint.*Starting over would overwrite"):
        checkpoint.find_resumable(str(tmp_path), "auto", "d", log=lambda m: None)
    assert os.path.getsize(tmp_path / "checkpoint.pt") == 100  # left for the user to decide


def test_incompatible_checkpoint_is_refused_with_the_differences(tmp_path):
    state = _tiny_state() | {"resume_config": {"optim.lr": 0.01, "world_size": 2}}
    checkpoint.atomic_save(state, str(tmp_path / "checkpoint.pt"))
    with pytest.raises(ConfigError) as e:
        checkpoint.find_resumable(str(tmp_path), "auto", "other", log=lambda m: None,
                                  current={"optim.lr": 0.02, "world_size": 2})
    assert "different config" in str(e.value) and "optim.lr: 0.01 -> 0.02" in str(e.value)
    assert "hydra.run.dir" in str(e.value) and "train.resume=never" in str(e.value)


def test_a_sharded_checkpoint_against_a_whole_one_names_only_real_differences():
    """A sharded checkpoint's resume_config holds the global batch where a whole one's holds the
    world size and batch: the diff names sync.zero, not those three as '<unset>'."""
    sharded = {"sync.zero": 2, "global_batch": 16}
    whole = {"sync.zero": 0, "world_size": 2, "train.batch_size": 8}
    said = checkpoint._config_diff(sharded, whole)
    assert said == " Differences (checkpoint -> now): sync.zero: 2 -> 0."
    # a global batch that really changed is still named (2 x 4 = 8 against 16)
    assert "global_batch: 16 -> 8" in checkpoint._config_diff(
        sharded, {**whole, "train.batch_size": 4})
    assert "global_batch: 16 -> 8" in checkpoint._config_diff({"global_batch": 16},
                                                              {"global_batch": 8})


class _Exploit:
    def __reduce__(self):
        return (os.system, ("touch /tmp/ddp_lab_pwned",))


def test_a_checkpoint_with_pickled_code_is_refused_and_runs_nothing(tmp_path):
    if os.path.exists("/tmp/ddp_lab_pwned"):
        os.remove("/tmp/ddp_lab_pwned")
    path = tmp_path / "checkpoint.pt"
    torch.save({"model": {}, "step": 1, "payload": _Exploit()}, path)
    with pytest.raises(ConfigError, match="unreadable"):
        checkpoint.load(str(path))
    assert not os.path.exists("/tmp/ddp_lab_pwned")


def test_a_save_that_fails_leaves_the_previous_checkpoint_and_no_temporary(tmp_path):
    path = str(tmp_path / "checkpoint.pt")
    checkpoint.atomic_save(_tiny_state(1), path)
    before = open(path, "rb").read()
    with pytest.raises(Exception):
        checkpoint.atomic_save(_tiny_state(2) | {"bad": lambda: 0}, path)  # cannot be pickled
    assert open(path, "rb").read() == before and os.listdir(tmp_path) == ["checkpoint.pt"]
    assert checkpoint.load(path)["step"] == 1


def test_rng_state_round_trips_through_a_weights_only_checkpoint(tmp_path):
    device = torch.device("cpu")
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    random.random(), np.random.rand(), torch.rand(1), np.random.randn()  # leave a cached gaussian
    checkpoint.atomic_save(_tiny_state() | {"rng": [checkpoint.rng_state(device)]},
                           str(tmp_path / "c.pt"))
    expected = (random.random(), np.random.randn(3).tolist(), torch.rand(3).tolist())
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    checkpoint.set_rng_state(checkpoint.load(str(tmp_path / "c.pt"))["rng"][0], device)
    assert (random.random(), np.random.randn(3).tolist(), torch.rand(3).tolist()) == expected


def test_config_digest_ignores_only_what_does_not_change_the_result():
    from omegaconf import OmegaConf

    def digest(overrides, world_size=2):
        return checkpoint.config_digest(
            OmegaConf.to_container(compose_config(overrides), resolve=True), world_size)
    base = digest([])
    for neutral in ["train.stop_at_step=3", "train.checkpoint_every=5", "fault.kill_rank=1",
                    "dist.timeout_s=9", "train.nonfinite=stop", "train.consistency_every=1"]:
        assert digest([neutral]) == base, neutral
    for meaningful in ["optim.lr=0.5", "seed=1", "train.batch_size=7", "model.dropout=0.1"]:
        assert digest([meaningful]) != base, meaningful
    assert digest([], world_size=4) != base


def test_keep_every_must_divide_into_the_checkpoint_interval():
    checkpoint.check_keep_every(6, 3, 10)
    checkpoint.check_keep_every(20, 0, 10)
    with pytest.raises(ConfigError, match="train.keep_every=5 must be a multiple of the 10 steps"):
        checkpoint.check_keep_every(5, 0, 10)
