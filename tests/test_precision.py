"""precision= and the speed options on the CPU: what each precision sets (TF32 flags, the autocast
dtype, the GradScaler), and one 2-rank run that composes the options a GPU user would combine
(bf16 autocast, channels_last, a foreach optimizer, our ring sync, backward calibrated for the
exposed-communication split), end to end."""

import json
import os

import pytest
import torch

from ddp_lab.precision import setup_precision
from background import background
from helpers import check, compose_config, summary
from launchers import ranks
from reliab_helpers import NO_DROPOUT


@pytest.fixture
def restore_math_flags():
    """setup_precision sets process-wide flags: leave them as they were for the other tests."""
    flags = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
             torch.backends.cudnn.benchmark)
    yield
    (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
     torch.backends.cudnn.benchmark) = flags


@pytest.mark.parametrize("name,tf32,out_dtype,scaler", [
    ("fp32", False, torch.float32, False),
    ("tf32", True, torch.float32, False),
    ("bf16", True, torch.bfloat16, False),
    ("fp16", True, torch.float16, True),
])
def test_each_precision_sets_its_flags_autocast_dtype_and_scaler(name, tf32, out_dtype, scaler,
                                                                 restore_math_flags):
    precision = setup_precision(compose_config([f"precision={name}"]).precision,
                                torch.device("cpu"), cudnn_benchmark=False)
    assert torch.backends.cuda.matmul.allow_tf32 is tf32
    assert torch.backends.cudnn.allow_tf32 is tf32
    assert torch.backends.cudnn.benchmark is False
    assert precision.scaler.is_enabled() is scaler
    layer = torch.nn.Linear(8, 4)
    with precision.autocast():
        assert layer(torch.randn(2, 8)).dtype == out_dtype  # the matmul ran in that dtype


# bf16 convolutions are slow on a CPU: 2 images per rank.
COMBINED = NO_DROPOUT + ["sync=ring", "precision=bf16", "train.channels_last=true",
                         "optim.impl=foreach", "train.calibrate_steps=2", "train.max_steps=3",
                         "train.batch_size=2"]


@background(cost=25)
def combined(run_dir):
    return ranks(COMBINED + [f"hydra.run.dir={run_dir}"], timeout=240), run_dir


@pytest.mark.timeout(300)
def test_bf16_channels_last_foreach_ring_with_calibration_train_and_split_the_step(combined):
    proc, run = combined
    check(proc)
    s = summary(run)
    assert s["precision"] == "bf16" and s["sync"] == "ring" and s["steps"] == 3
    assert len(set(s["rank_param_digests"])) == 1, "replicas differ"
    rows = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]
    losses = [r["train/loss"] for r in rows if "train/loss" in r]
    assert len(losses) == 3 and all(l == l and abs(l) < 1e3 for l in losses)  # finite, sane
    t = s["time_ms"]
    # Backward was timed without communication, so the step splits into compute and the part of
    # the communication backward did not hide; ring also reports its all-reduces' busy time.
    assert {"compute", "exposed_comm", "comm_busy", "backward", "comm"} <= set(t), t
    assert t["compute"] > 0 and t["exposed_comm"] >= 0 and t["comm_busy"] > 0
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(run))
    acc.Reload()
    assert {"time/compute_ms", "time/exposed_comm_ms"} <= set(acc.Tags()["scalars"])
    ckpt = torch.load(run / "checkpoint.pt", weights_only=True)
    # autocast computes in bf16; the parameters stay fp32
    assert all(v.dtype == torch.float32 for v in ckpt["model"].values())
