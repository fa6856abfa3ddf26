"""ZeRO end to end: `torchrun -m ddp_lab.train sync=ring|naive sync.zero=1|2` (and sync=ddp
sync.zero=1, torch's ZeroRedundancyOptimizer) on 2 gloo ranks, against named references: DDP on the
same ranks and one process on the whole batch (helpers.SMALL, shared with test_train.py), the same
sync at zero=0, and an uninterrupted run for stop-and-resume. Also: summary.json's memory block,
counted against predicted, and the bytes a step sends.

Tolerances as in tests/test_zero.py (whose module docstring says why): SGD within 1e-6 of every
reference; AdamW within 2 lr a step of DDP, all but a few elements within 1e-6; resumed runs
bitwise equal to uninterrupted ones. A launch is the slow part: all of them are background
launches (tests/README.md)."""

import pytest
import torch

from background import background
from helpers import SMALL, SMALL_BUCKETS, check, final_params, max_abs_diff, summary
from launchers import ranks
from reliab_helpers import RESUME, assert_same_training_state, train_log

TOLERANCE = 1e-6
FP16 = ["precision=fp16", "train.batch_size=4"]  # fp16 convolutions are slow on CPU: small steps
RUNS = {  # id: overrides (2 ranks x 16, helpers.SMALL)
    "ring-zero1": ["sync=ring", "sync.zero=1"],
    "ring-zero2": ["sync=ring", "sync.zero=2"],
    "naive-zero2-no-overlap-accum": ["sync=naive", "sync.zero=2", "sync.overlap=false",
                                     "train.accum_steps=2", "train.batch_size=8"],
    "ddp-zero1": ["sync=ddp", "sync.zero=1"],
    "ring-zero2-adamw": ["sync=ring", "sync.zero=2", "optim=adamw"],
    "ddp-adamw": ["sync=ddp", "optim=adamw"],
    "ring-zero2-fp16": ["sync=ring", "sync.zero=2", *FP16],
    "ring-fp16": ["sync=ring", *FP16],
}
STOP = ["train.stop_at_step=4", "train.checkpoint_every=2"]


@background(cost=lambda run: 20 if "fp16" in run else 10, keys=RUNS)
def launched(run, run_dir):
    """Run id of RUNS -> its run dir."""
    overrides = RUNS[run]
    batch = [] if any(o.startswith("train.batch_size=") for o in overrides) else [
        "train.batch_size=16"]
    check(ranks(SMALL + SMALL_BUCKETS + batch + overrides + [f"hydra.run.dir={run_dir}"],
                timeout=240))
    return run_dir


@background(cost=15, keys=(1, 2))
def resumed(zero, directory):
    """sync.zero -> (an uninterrupted run's dir, the dir of the same run stopped at step 4 and
    then run again with the same command)."""
    args = RESUME + ["sync=ring", f"sync.zero={zero}"]
    ref, run = directory / "reference", directory / "resumed"
    check(ranks(args + ["train.checkpoint_every=6", f"hydra.run.dir={ref}"]))
    check(ranks(args + STOP + [f"hydra.run.dir={run}"]))
    check(ranks(args + STOP[1:] + [f"hydra.run.dir={run}"]))
    return ref, run


@pytest.mark.timeout(600)
@pytest.mark.parametrize("run", ["ring-zero1", "ring-zero2", "naive-zero2-no-overlap-accum",
                                 "ddp-zero1"])
def test_zero_with_sgd_trains_like_ddp_and_one_process(run, launched, small_references):
    got = final_params(launched[run])
    s = summary(launched[run])
    assert len(set(s["rank_param_digests"])) == 1, "replicas differ"
    for ref in ("ddp", "single"):
        diff = max_abs_diff(final_params(small_references[ref]), got)
        assert diff < TOLERANCE, f"{run}: max |ours - {ref}| = {diff}"


@pytest.mark.timeout(600)
def test_zero2_with_adamw_is_close_to_ddp(launched):
    got, ref = (final_params(launched[r]) for r in ("ring-zero2-adamw", "ddp-adamw"))
    diffs = torch.cat([(got[k].double() - ref[k].double()).abs().view(-1) for k in ref])
    lr, steps = 1e-3, 3
    assert diffs.max() <= 2 * lr * steps and int((diffs > TOLERANCE).sum()) <= 4, \
        (diffs.max().item(), int((diffs > TOLERANCE).sum()))


@pytest.mark.timeout(600)
def test_zero2_with_fp16_loss_scaling_trains_like_zero0(launched):
    runs = [launched[r] for r in ("ring-zero2-fp16", "ring-fp16")]
    s = [summary(r) for r in runs]
    assert s[0]["nonfinite_skipped_steps"] == s[1]["nonfinite_skipped_steps"]
    assert s[0]["rank_nonfinite_skipped_steps"][0] == s[0]["rank_nonfinite_skipped_steps"][1]
    assert max_abs_diff(*(final_params(r) for r in runs)) < TOLERANCE


@pytest.mark.timeout(600)
@pytest.mark.parametrize("run", ["ring-zero1", "ring-zero2", "ddp-zero1"])
def test_memory_counted_against_predicted(run, launched, small_references):
    """Per rank, counted from storages: parameters whole; optimizer state 1/N at zero>=1 (ours
    within one element per bucket; torch's assigns whole parameters: the two ranks' shares add
    up to the whole); gradients 1/N at zero>=1 (ours); buckets whole at zero=1, the largest
    bucket at zero=2. zero=0 (DDP) for scale."""
    m, zero = summary(launched[run])["memory"], int(run[-1])
    base = summary(small_references["ddp"])["memory"]
    p, n = m["predicted"], 2
    assert m["params_bytes"] == [p["params_bytes"]] * n == base["params_bytes"]
    whole = base["optimizer_state_bytes"][0]  # SGD momentum: one fp32 tensor per parameter
    assert whole == p["params_bytes"] and base["predicted"]["optimizer_state_bytes"] == whole
    if run.startswith("ddp"):
        assert sum(m["optimizer_state_bytes"]) == whole
        assert m["grads_bytes"] == [p["params_bytes"]] * n and m["comm_buffer_bytes"] == [None] * n
        return
    buckets = len(summary(launched[run])["comm"]["shard_numel"])
    for rank in range(n):
        assert abs(m["optimizer_state_bytes"][rank] - whole / n) <= 4 * buckets
        assert abs(m["grads_bytes"][rank] - p["grads_bytes"]) <= 4 * buckets
        assert m["comm_buffer_bytes"][rank] == p["comm_buffer_bytes"]
    assert p["comm_buffer_bytes"] == (p["params_bytes"] if zero == 1 else 4 * 256 * 384 * 3 * 3)


@pytest.mark.timeout(600)
def test_zero2_sends_the_all_reduce_s_bytes_at_two_ranks(launched, small_references):
    """At N = 2 a reduce-scatter and an all-gather send half the gradient each: one
    all-reduce's bytes; zero=1 sends an all-reduce and an all-gather: 1.5 times that."""
    ddp = summary(small_references["ddp"])["comm_bytes_per_step"]
    assert summary(launched["ring-zero2"])["comm_bytes_per_step"] == ddp
    assert summary(launched["ring-zero1"])["comm_bytes_per_step"] * 2 == 3 * ddp


@pytest.mark.timeout(600)
@pytest.mark.parametrize("zero", [1, 2])
def test_stop_and_resume_is_bitwise_the_uninterrupted_run(zero, resumed):
    """train.stop_at_step=4, then the same command again: parameters and the (gathered,
    unsharded) optimizer state equal the uninterrupted run's bitwise."""
    ref, run = resumed[zero]
    assert f"resumed from {run}/checkpoint.pt at step 4" in train_log(run)
    assert_same_training_state(run, ref)
