"""ZeRO end to end: `torchrun -m ddp_lab.train sync=ring|naive sync.zero=1|2|3` (and sync=ddp
sync.zero=1, torch's ZeroRedundancyOptimizer) on 2 gloo ranks, against named references: DDP on the
same ranks and one process on the whole batch (helpers.SMALL, shared with test_train.py), the same
sync at zero=0, and an uninterrupted run for stop-and-resume (zero=2|3; loading at 1-3 ranks is
tests/test_sharded_checkpoint.py's). Also: summary.json's
memory block, counted against predicted, and the bytes a step sends.

Tolerances as in tests/test_zero.py (whose module docstring says why): SGD within 1e-6 of every
reference; AdamW within 2 lr a step of DDP, all but a few elements within 1e-6; resumed runs
bitwise equal to uninterrupted ones. A launch is the slow part: all of them are background
launches (tests/README.md)."""

import pytest
import torch

from ddp_lab.models import build_model
from background import background
from helpers import SMALL, SMALL_BUCKETS, check, final_params, max_abs_diff, summary
from launchers import ranks
from reliab_helpers import RESUME, assert_same_training_state, train_log

TOLERANCE = 1e-6
# fp16 convolutions are slow on CPU: small steps. Rank 0's logits are made NaN at step 2, so a
# step is skipped and the comparison of skipped steps compares something.
FP16 = ["precision=fp16", "train.batch_size=4", "fault.nan_at_step=2"]
RUNS = {  # id: overrides (2 ranks x 16, helpers.SMALL)
    "ring-zero1": ["sync=ring", "sync.zero=1"],
    "ring-zero2": ["sync=ring", "sync.zero=2"],
    "ring-zero3": ["sync=ring", "sync.zero=3"],
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


@background(cost=15, keys=(2, 3))
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
@pytest.mark.parametrize("run", ["ring-zero1", "ring-zero2", "ring-zero3",
                                 "naive-zero2-no-overlap-accum", "ddp-zero1"])
def test_zero_with_sgd_trains_like_ddp_and_one_process(run, launched, small_references):
    got = final_params(launched[run])
    s = summary(launched[run])
    assert len(set(s["rank_param_digests"])) == 1, "replicas differ"
    for ref in ("ddp", "single"):
        diff = max_abs_diff(final_params(small_references[ref]), got)
        assert diff < TOLERANCE, f"{run}: max |ours - {ref}| = {diff}"


@pytest.mark.timeout(600)
def test_zero2_with_adamw_is_close_to_ddp(launched):
    """At N = 2 both sums are the same additions (DDP divides by 2 first, we after: exact
    either way), so the gradients are equal; what may differ is fused AdamW's rounding of an
    element in a flat shard against in its own parameter (a vector lane or the scalar tail: an
    FMA or not), at most a few ulp of the parameter a step. Tolerance: 4 ulp x 3 steps, per
    element, relative to the parameter (measured: 1 of 3.0 M elements apart, by 2.3e-10)."""
    got, ref = (final_params(launched[r]) for r in ("ring-zero2-adamw", "ddp-adamw"))
    ulp, steps = torch.finfo(torch.float32).eps, 3
    for k in ref:
        diff = (got[k].double() - ref[k].double()).abs()
        bound = 4 * steps * ulp * ref[k].double().abs()
        assert (diff <= bound).all(), (k, diff.max().item(), int((diff > bound).sum()))


@pytest.mark.timeout(600)
def test_zero2_with_fp16_loss_scaling_trains_like_zero0(launched):
    """Step 2's NaN is skipped on every rank at both stages (the loss scaler's verdict, all-
    reduced at zero=2 where each rank sees a shard), the other steps train alike: parameters
    within 1e-6 of zero=0's and moved from the initial weights."""
    runs = [launched[r] for r in ("ring-zero2-fp16", "ring-fp16")]
    s = [summary(r) for r in runs]
    assert s[0]["nonfinite_skipped_steps"] == s[1]["nonfinite_skipped_steps"] >= 1
    assert s[0]["rank_nonfinite_skipped_steps"][0] == s[0]["rank_nonfinite_skipped_steps"][1]
    assert 2 in s[0]["rank_nonfinite_skipped_steps"][0]
    zero2, zero0 = (final_params(r) for r in runs)
    assert max_abs_diff(zero2, zero0) < TOLERANCE
    torch.manual_seed(0)  # the runs' seed: ddp_lab.step.build_parts makes their initial weights
    initial = build_model("alexnet_cifar", 10, 0.0, fc_width=512).state_dict()
    assert max_abs_diff(zero2, initial) > 100 * TOLERANCE


@pytest.mark.timeout(600)
@pytest.mark.parametrize("run", ["ring-zero1", "ring-zero2", "ddp-zero1"])
def test_memory_counted_against_predicted(run, launched, small_references):
    """Per rank, counted from storages against the prediction. After the first optimizer step:
    parameters whole; optimizer state 1/N (ours within one element per bucket; torch's assigns
    whole parameters: the two ranks' shares add up to the whole); gradients 1/N (ours: the
    shards); buckets whole at zero=1, the two largest at zero=2; the ring's receive scratch
    exactly as it keeps it (the reduction's on the communication thread, the all-gather's on the
    training thread). Inside the next step ours hold, at most, the shards' gradients and one
    bucket's, made and not yet packed (each bucket's are released as it is packed): that is the
    peak, and it is the prediction but for one bias (below). zero=0 (DDP) for scale."""
    mem, zero, n = summary(launched[run])["memory"], int(run[-1]), 2
    base = summary(small_references["ddp"])["memory"]
    p = {k: v[0] for k, v in mem["predicted"].items()}  # the ring's: the same on both ranks
    assert all(v == [p[k]] * n for k, v in mem["predicted"].items())
    after = mem["points"]["after_optimizer"]
    whole = base["optimizer_state_bytes"][0]  # SGD momentum: one fp32 tensor per parameter
    assert after["params_bytes"] == [p["params_bytes"]] * n == base["params_bytes"]
    assert whole == p["params_bytes"] == base["predicted"]["optimizer_state_bytes"][0]
    if run.startswith("ddp"):
        assert sum(after["optimizer_state_bytes"]) == whole
        assert after["grads_bytes"] == [p["params_bytes"]] * n
        assert after["comm_buffer_bytes"] == after["comm_scratch_bytes"] == [None] * n
        return
    sizes = sorted(summary(launched[run])["comm"]["bucket_bytes"])
    slack = 4 * len(sizes)  # each bucket's shard: one fp32 element more or less than 1/N
    largest = 4 * 256 * 384 * 3 * 3  # the largest bucket: that convolution's weight alone
    assert sizes[-1] == largest
    for rank in range(n):
        assert abs(after["optimizer_state_bytes"][rank] - whole / n) <= slack
        assert abs(after["grads_bytes"][rank] - whole / n) <= slack
        assert after["comm_buffer_bytes"][rank] == p["comm_buffer_bytes"]
        assert after["comm_scratch_bytes"][rank] == p["comm_scratch_bytes"] > 0
    assert p["comm_buffer_bytes"] == (whole if zero == 1 else sizes[-1] + sizes[-2])
    assert abs(p["grads_bytes"] - (whole / n + largest)) <= slack
    peak = mem["points"]["in_step"]
    assert mem["peak_point"] == ["in_step"] * n
    # A convolution's weight gradient is made before its bias's (ConvolutionBackward), and at 2 MB
    # buckets that weight is a bucket of its own right after its bias's: it waits, whole, while
    # the bias's bucket is packed. So the peak holds one bias (256 fp32) more than predicted.
    bias = 4 * 256
    for rank in range(n):
        assert abs(peak["grads_bytes"][rank] - (p["grads_bytes"] + bias)) <= slack
        assert abs(mem["excess_bytes"][rank] - bias) <= slack
        assert mem["excess_bytes"][rank] < 0.1 * sum(p.values())  # ZeRO-2's excess: gone


@pytest.mark.timeout(600)
def test_zero2_sends_the_all_reduce_s_bytes_at_two_ranks(launched, small_references):
    """At N = 2 a reduce-scatter and an all-gather send half the gradient each: one
    all-reduce's bytes; zero=1 sends an all-reduce and an all-gather: 1.5 times that."""
    ddp = summary(small_references["ddp"])["comm_bytes_per_step"]
    assert summary(launched["ring-zero2"])["comm_bytes_per_step"] == ddp
    assert summary(launched["ring-zero1"])["comm_bytes_per_step"] * 2 == 3 * ddp


@pytest.mark.timeout(600)
@pytest.mark.parametrize("zero", [2, 3])
def test_stop_and_resume_is_bitwise_the_uninterrupted_run(zero, resumed):
    """train.stop_at_step=4, then the same command again: parameters and every rank's shards of
    the optimizer state (a sharded checkpoint; at zero=3 the parameters' shards too) equal the
    uninterrupted run's bitwise. (zero=1 checkpoints as zero=2 does: the same ShardedSync code.)"""
    ref, run = resumed[zero]
    assert f"resumed from {run}/checkpoint_step4 at step 4" in train_log(run)
    assert_same_training_state(run, ref)


@pytest.mark.timeout(600)
def test_ddp_bytes_are_counted_and_zero1_adds_its_broadcasts(launched, small_references):
    """sync=ddp's bytes are counted where DDP hands each bucket to the backend (a comm hook) and
    where ZeroRedundancyOptimizer broadcasts the parameters (the dispatcher): every gradient once
    a step, every parameter once a step (fp32: 4 bytes each). Bus bytes by nccl-tests'
    convention are the ring's per-rank bytes of that payload (comm.cost), plus the broadcasts'."""
    from ddp_lab.comm import cost

    plain, zero1 = summary(small_references["ddp"]), summary(launched["ddp-zero1"])
    payload = 4 * plain["parameters"]
    assert plain["comm"]["allreduce_payload_bytes"] == payload
    assert plain["comm"]["broadcast_payload_bytes"] == 0
    assert plain["comm_bytes_per_step"] == cost("ring", payload, 2).bytes_per_rank
    assert zero1["comm"]["allreduce_payload_bytes"] == payload
    assert zero1["comm"]["broadcast_payload_bytes"] == payload
    assert zero1["comm_bytes_per_step"] == plain["comm_bytes_per_step"] + payload


@pytest.mark.timeout(600)
def test_zero3_runs_its_collectives_sends_1_5x_and_holds_what_it_predicts(launched,
                                                                           small_references):
    """zero=3 end to end (it trains like DDP and one process: above). Per step, 8 units (5
    convolutions, 3 linear layers): 8 all-gathers in forward, 8 in backward, 8 reduce-scatters,
    so 1.5x DDP's bytes, which are the ring all-reduce's (at N=2 an all-reduce of m elements
    sends 4m bytes; the second all-gather one shard more: within a rounding element per unit).
    Replicas equal (checksums of the gathered parameters). Memory: the most a step holds is the
    prediction (two units gathered, one's gradient made) within one element per unit of each
    sharded kind, and at rest a rank holds half the parameters."""
    s3, ddp = summary(launched["ring-zero3"]), summary(small_references["ddp"])
    assert len(set(s3["rank_param_digests"])) == 1
    units = s3["comm"]["units"]
    assert units == 8 and s3["comm"]["collectives_per_step"] == {"all_gather": 16,
                                                                   "reduce_scatter": 8}
    assert s3["comm"]["all_gathers_per_step"] == {"forward": 8, "backward": 8}
    assert abs(s3["comm_bytes_per_step"] - 1.5 * ddp["comm_bytes_per_step"]) <= 4 * units
    mem = s3["memory"]
    assert mem["peak_point"] == ["in_step"] * 2
    for rank in range(2):
        for k, v in mem["predicted"].items():
            assert abs(mem[k][rank] - v[rank]) <= 4 * units, (k, rank, mem[k][rank], v[rank])
        assert abs(mem["excess_bytes"][rank]) <= 3 * 4 * units
    after = mem["points"]["after_optimizer"]
    assert abs(after["params_bytes"][0] - ddp["memory"]["params_bytes"][0] / 2) <= 4 * units


@pytest.mark.timeout(150)
@pytest.mark.parametrize("sync", [["sync=ring", "sync.zero=3"], ["sync=fsdp"]])
def test_evaluation_with_fewer_batches_on_one_rank_does_not_hang(sync, tmp_path):
    """17 validation samples, batches of 8, 2 ranks: rank 0 has 2 batches, rank 1 one. A
    forward all-gathers here, so rank 1 runs one unscored forward beside rank 0's second
    (train.py's unscored_batches); without it, rank 0 all-gathers alone until the group's
    timeout (20 s here) and the run fails."""
    proc = ranks(SMALL + sync + ["data.val_samples=17", "train.batch_size=8", "dist.timeout_s=20",
                                 f"hydra.run.dir={tmp_path}"], timeout=120)
    check(proc)
    assert 0 <= summary(tmp_path)["val_accuracy"] <= 1
