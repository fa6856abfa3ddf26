"""Injected faults (`fault.*`) on real 2-rank gloo jobs, each against what must survive it:
a killed rank under torchrun --max-restarts=1 (the restarted group resumes and ends bitwise equal
to an uninterrupted run), a hung rank (the job fails within dist.timeout_s, naming the collective
and the rank), non-finite losses (fp16: the scaler skips on every rank; fp32: skip together or
stop, never a NaN in a checkpoint), a diverged replica (stopped, ranks named)."""

import json

import pytest
import torch
import torch.distributed as dist

from ddp_lab import guard
from background import background
from helpers import check, summary
from launchers import ranks, torchrun
from reliab_helpers import (NO_DROPOUT, RESUME, SYNC_NAMES, SYNCS, assert_same_training_state,
                            ckpt, train_log)


# Each fault below needs one launch, and nothing from the others but the uninterrupted reference
# (conftest.py's `uninterrupted`): they are background launches (tests/README.md); a hung run
# waits mostly idle for its timeout.
KILLED = RESUME + ["sync=ddp", "train.checkpoint_every=2", "fault.kill_rank=1", "fault.at_step=5"]
HANG_TIMEOUT_S = 10
# Each sync hangs sharded, so ZeRO's stages run under torchrun itself too: DDP with torch's
# ZeroRedundancyOptimizer (stage 1), ours reduce-scattering (stage 2).
ZERO_STAGE = {"ddp": 1, "ring": 2}
HUNG = {sync: NO_DROPOUT + [f"sync={sync}", f"sync.zero={ZERO_STAGE[sync]}", "train.max_steps=4",
                            f"dist.timeout_s={HANG_TIMEOUT_S}", "fault.hang_rank=1",
                            "fault.at_step=3", "fault.hang_s=150"]
        for sync in SYNC_NAMES}
NAN_SKIPPED = NO_DROPOUT + ["sync=ddp", "train.max_steps=2", "train.checkpoint_every=1",
                            "train.keep_every=1", "fault.nan_at_step=2", "fault.nan_rank=1"]
NAN_STOP = NO_DROPOUT + ["sync=ddp", "train.max_steps=4", "train.checkpoint_every=1",
                         "train.nonfinite=stop", "fault.nan_at_step=3", "fault.nan_rank=1"]
# Batch 2 per rank, not TINY's 8: fp16 autocast on the CPU takes seconds per sample (no fast fp16
# kernels), and what is checked (the scaler's skip and halving on every rank) does not depend on it.
FP16_INF = [a for a in NO_DROPOUT if not a.startswith("train.batch_size=")] + [
    "train.batch_size=2", "sync=ddp", "precision=fp16", "train.max_steps=3",
    "precision.init_scale=1024", "fault.nan_at_step=2", "fault.nan_rank=1", "fault.nan_value=inf"]
DIVERGED = NO_DROPOUT + ["sync=ddp", "train.max_steps=4", "train.consistency_every=1",
                         "train.checkpoint_every=1", "fault.perturb_rank=1", "fault.at_step=2"]


def restartable(args, timeout):
    """torchrun, restarting a failed group once."""
    return torchrun(args, timeout=timeout,
                    launcher_args=["--standalone", "--nproc_per_node=2", "--max-restarts=1"])


# name: (overrides, launch timeout, launcher, about how many seconds it takes alone). A fault that
# ends or restarts the job runs under torchrun itself (not forked ranks): how its agent ends,
# restarts and reports the job is part of what these tests check. The non-finite steps that
# training skips end normally: they run as every other test of what a run computes.
FAULTS = {"killed": (KILLED, 240, restartable, 60),
          **{f"hung_{sync}": (HUNG[sync], 150, torchrun, 30) for sync in SYNC_NAMES},
          "nan_skipped": (NAN_SKIPPED, 180, ranks, 20), "nan_stop": (NAN_STOP, 180, torchrun, 20),
          "fp16_inf": (FP16_INF, 180, ranks, 40), "diverged": (DIVERGED, 180, torchrun, 20)}


@background(cost=lambda name: FAULTS[name][3], keys=FAULTS)
def fault(name, run_dir):
    """(the finished launch, run_dir) of FAULTS[name]."""
    args, timeout, launcher, _ = FAULTS[name]
    return launcher(args + [f"hydra.run.dir={run_dir}"], timeout=timeout), run_dir


@pytest.mark.timeout(300)
def test_killed_rank_is_restarted_and_resumes_to_the_uninterrupted_result(fault, uninterrupted):
    proc, run = fault["killed"]
    check(proc)
    assert "fault: killing rank 1 (SIGKILL) at step 5" in proc.stderr
    assert proc.stderr.count("fault: killing") == 1  # the restarted attempt runs clean
    assert f"resumed from {run}/checkpoint.pt at step 4" in train_log(run)
    assert_same_training_state(run, uninterrupted["ddp"])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("sync", SYNCS)
def test_hung_rank_fails_the_job_within_the_timeout_naming_collective_and_rank(sync, fault):
    proc, _ = fault[f"hung_{sync}"]
    # rank 1 would sleep 150 s: ending well before proves rank 0 gave up and torchrun ended it
    assert proc.returncode != 0
    assert proc.elapsed < 90, proc.elapsed
    err = proc.stderr
    assert "fault: rank 1 hangs at step 3" in err
    line = next(l for l in err.splitlines() if l.startswith("error: rank 0: collective"))
    assert f"timed out after dist.timeout_s={HANG_TIMEOUT_S}" in line, line
    assert "at step 3" in line and "ranks behind: rank 1 (last began step 2)" in line, line
    if sync == "ddp":
        assert "gradient all-reduce inside backward (sync=ddp)" in line, line
    assert "Traceback" not in err.split("error: rank 0")[0]


@pytest.mark.timeout(300)
def test_fp32_nonfinite_step_is_skipped_on_every_rank(fault):
    """NaN logits on rank 1 only at step 2: both ranks skip step 2 (an all-reduced decision),
    and the skip is a true no-op: parameters and momentum after step 2 equal those after step 1
    (that training moves them at all is test_train's and test_resume's business)."""
    proc, run = fault["nan_skipped"]
    check(proc)
    s = summary(run)
    assert s["nonfinite_skipped_steps"] == 1 and s["rank_nonfinite_skipped_steps"] == [[2], [2]]
    assert len(set(s["rank_param_digests"])) == 1
    assert ("step 2: non-finite loss on rank(s) [1]; non-finite gradients on rank(s) [0, 1]; "
            "step skipped on every rank") in train_log(run)
    one, two = (ckpt(run / f"checkpoint_step{k}.pt") for k in (1, 2))
    for k in one["model"]:
        assert torch.equal(one["model"][k], two["model"][k]), k
    for i in one["optimizer"]["state"]:
        assert torch.equal(one["optimizer"]["state"][i]["momentum_buffer"],
                           two["optimizer"]["state"][i]["momentum_buffer"])
    rows = [json.loads(l) for l in open(run / "metrics.jsonl")]
    assert [r["step"] for r in rows if r.get("train/loss") != r.get("train/loss")] == [2]  # NaN


@pytest.mark.timeout(300)
def test_fp32_nonfinite_stop_policy_fails_clearly_and_keeps_a_finite_checkpoint(fault):
    proc, run = fault["nan_stop"]
    assert proc.returncode != 0
    assert ("error: step 3: non-finite loss on rank(s) [1]; non-finite gradients on rank(s) "
            "[0, 1]; stopping (train.nonfinite=stop)") in proc.stderr
    c = ckpt(run / "checkpoint.pt")
    assert c["step"] == 2
    assert all(torch.isfinite(v).all() for v in c["model"].values())
    assert not (run / "summary.json").exists()


@pytest.mark.timeout(300)
def test_fp16_inf_is_skipped_by_the_scaler_on_every_rank_and_the_scale_halved(fault):
    proc, run = fault["fp16_inf"]
    check(proc)
    s = summary(run)
    assert s["precision"] == "fp16" and s["rank_nonfinite_skipped_steps"] == [[2], [2]]
    assert len(set(s["rank_param_digests"])) == 1
    scale = {r["step"]: r["precision/loss_scale"] for r in map(json.loads, open(
        run / "metrics.jsonl")) if "precision/loss_scale" in r}
    assert scale == {1: 1024.0, 2: 512.0, 3: 512.0}
    assert "GradScaler found inf/NaN gradients, step skipped on every rank, loss scale 1024 -> 512" \
        in train_log(run)
    assert all(torch.isfinite(v).all() for v in ckpt(run / "checkpoint.pt")["model"].values())


@pytest.mark.timeout(300)
def test_diverged_replica_stops_training_naming_the_rank(fault):
    """Rank 1's first parameter moves by one ulp before step 2; the checksum after step 2 sees it."""
    proc, run = fault["diverged"]
    assert proc.returncode != 0
    assert "error: replicas diverged by step 2: rank(s) [1] differ from rank(s) [0]" in proc.stderr
    assert ckpt(run / "checkpoint.pt")["step"] == 1  # the diverged step was not saved


# ---- in-process ---------------------------------------------------------------------------------

@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_a_nan_never_reaches_a_checkpoint(one_rank_group):
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    guard.assert_finite(opt, 1)
    opt.state[model.weight]["momentum_buffer"][0, 0] = float("inf")
    with pytest.raises(guard.NonFiniteError, match="refusing to checkpoint step 2"):
        guard.assert_finite(opt, 2)
    opt.state[model.weight]["momentum_buffer"][0, 0] = 0.0
    with torch.no_grad():
        model.bias[1] = float("nan")  # a parameter the optimizer updates
    with pytest.raises(guard.NonFiniteError, match="refusing to checkpoint step 3"):
        guard.assert_finite(opt, 3)


def test_param_checksum_sees_one_ulp_and_only_real_changes():
    a = [torch.randn(5000), torch.randn(3, 7)]
    b = [t.clone() for t in a]
    assert torch.equal(guard.param_checksum(a), guard.param_checksum(b))
    b[0][4321] = torch.nextafter(b[0][4321], torch.tensor(float("inf")))
    assert not torch.equal(guard.param_checksum(a), guard.param_checksum(b))
    c = [a[0].flip(0), a[1]]  # same values, other positions
    assert not torch.equal(guard.param_checksum(a), guard.param_checksum(c))
