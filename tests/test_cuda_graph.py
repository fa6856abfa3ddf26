"""train.cuda_graph: what is refused (CPU), checkpoints with device-tensor learning rates (CPU), and
on a GPU that the graphed loop trains bitwise like the eager one and skips a non-finite replayed
step.

    python -m pytest -q tests/test_cuda_graph.py        # the CUDA tests need a GPU
"""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
import torch

from ddp_lab.config import ConfigError
from ddp_lab.graph import EAGER_CALLS, DeviceLR, GraphedStep, check_supported
from ddp_lab.optim import build_scheduler, float_lrs
from helpers import compose_config

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("overrides, reason", [
    (["sync=ddp"], "sync=ddp drives its communication from the host"),
    (["precision=fp16"], "precision=fp16's GradScaler"),
    (["optim.impl=foreach"], "optim.impl=foreach: the step needs the fused optimizer"),
    (["optim=adamw"], "optim=adamw: only SGD's capture has been checked"),
    (["train.compile=true", "train.compile_mode=reduce-overhead"], "makes CUDA graphs of its own"),
    (["fault.nan_at_step=3"], "fault.nan_at_step"),
])
def test_what_a_captured_step_cannot_do_is_refused_by_name(overrides, reason):
    cfg = compose_config(["sync=none", "train.cuda_graph=true", *overrides])
    with pytest.raises(ConfigError, match="train.cuda_graph=true: ") as e:
        check_supported(cfg, torch.device("cuda"))
    assert reason in str(e.value) and "CUDA device" not in str(e.value)
    check_supported(compose_config(["sync=none", "train.cuda_graph=true", "precision=bf16"]),
                    torch.device("cuda"))  # the supported setting passes
    with pytest.raises(ConfigError, match="need a CUDA device"):
        check_supported(cfg, torch.device("cpu"))


def test_checkpoints_hold_float_learning_rates_while_the_live_ones_stay_tensors():
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = build_scheduler(opt, SimpleNamespace(warmup_steps=2, schedule="cosine",
                                                 min_lr_ratio=0.0), total_steps=10)
    device_lr = DeviceLR(opt)
    for _ in range(3):
        model(torch.randn(4, 3)).sum().backward()
        opt.step()
        sched.step()
        device_lr.update()
    live = opt.param_groups[0]["lr"]
    assert live is device_lr.tensors[0] and live.item() == pytest.approx(sched.get_last_lr()[0])
    state = float_lrs(opt, sched)
    assert isinstance(live, torch.Tensor) and opt.param_groups[0]["lr"] is live
    assert type(state["optimizer"]["param_groups"][0]["lr"]) is float
    assert state["optimizer"]["param_groups"][0]["lr"] == pytest.approx(live.item())
    fresh = torch.optim.SGD(torch.nn.Linear(3, 2).parameters(), lr=0.1, momentum=0.9)
    fresh_sched = build_scheduler(fresh, SimpleNamespace(warmup_steps=2, schedule="cosine",
                                                         min_lr_ratio=0.0), total_steps=10)
    fresh.load_state_dict(state["optimizer"])
    fresh_sched.load_state_dict(state["scheduler"])
    fresh_sched.step()
    sched.step()
    device_lr.update()
    assert fresh.param_groups[0]["lr"] == pytest.approx(opt.param_groups[0]["lr"].item())


def test_device_lr_keeps_its_tensor_when_a_scheduler_assigns_floats():
    """What older torch schedulers do: group["lr"] = value. The tensor takes the value and
    stays in the group (a captured graph reads that address)."""
    opt = torch.optim.SGD(torch.nn.Linear(3, 2).parameters(), lr=0.1)
    device_lr = DeviceLR(opt)
    lr = device_lr.tensors[0]
    opt.param_groups[0]["lr"] = 0.025
    device_lr.update()
    assert opt.param_groups[0]["lr"] is lr and lr.item() == pytest.approx(0.025)


def _run(tmp_path, name, overrides):
    from ddp_lab.train import train

    cfg = compose_config(["model=alexnet_cifar", "model.dropout=0", "data=synthetic", "sync=none",
                          "dist.backend=nccl", "precision=fp32", "train.cudnn_benchmark=false",
                          "train.batch_size=64", "train.max_steps=12", "train.log_every=1",
                          "train.timing_warmup=6", "train.eval_every_epochs=0",
                          "train.progress=false", "train.resume=never", "optim.warmup_steps=3",
                          *overrides])
    run_dir = str(tmp_path / name)
    summary = train(cfg, run_dir)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [r for r in map(json.loads, f) if "train/loss" in r]
    params = torch.load(os.path.join(run_dir, "checkpoint.pt"), map_location="cpu",
                        weights_only=False)["model"]
    return summary, rows, params


@cuda
@pytest.mark.timeout(300)
@pytest.mark.parametrize("setting", [[], ["train.accum_steps=2"],
                                     ["data=digits", "data.augment=true"]],
                         ids=["synthetic", "accum_steps=2", "digits-augmented"])
def test_graphed_training_is_bitwise_the_eager_run(tmp_path, monkeypatch, setting):
    """12 steps of a warm-up + cosine schedule: the same losses and weights, bit for bit, as the
    eager loop; with gradient accumulation (two static micro-batches) and with real augmented
    data (fetched eagerly, copied into the static inputs) too. (cuDNN's deterministic algorithms
    on both sides: its default ones already differ between two eager runs, by ~0.5% of the
    weights' movement after 12 steps.)"""
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", True)
    eager, e_rows, e_params = _run(tmp_path, "eager", setting)
    graph, g_rows, g_params = _run(tmp_path, "graph", ["train.cuda_graph=true", *setting])
    assert [r["train/lr"] for r in g_rows] == pytest.approx([r["train/lr"] for r in e_rows],
                                                            rel=1e-6)
    assert len({r["train/lr"] for r in g_rows}) > 6  # the schedule moved, in the graph too
    assert [r["train/loss"] for r in g_rows] == [r["train/loss"] for r in e_rows]
    assert e_params.keys() == g_params.keys()
    assert all(torch.equal(e_params[k], g_params[k]) for k in e_params)
    assert "graph" in graph["time_ms"] and "forward" not in graph["time_ms"]
    assert graph["timed_steps"] == 12 - 6 - 1  # the capture step is not timed
    assert graph["nonfinite_skipped_steps"] == 0 and eager["timed_steps"] == 6


@cuda
def test_a_non_finite_replayed_step_is_skipped_and_reported():
    """A NaN loss, then an inf gradient under a finite loss, in consecutive replays: both skipped
    (parameters untouched) and reported with their cause."""
    from ddp_lab.guard import Guard, rank_flags

    torch.manual_seed(0)
    dev = torch.device("cuda")
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                                torch.nn.Linear(16, 4)).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, fused=True)
    DeviceLR(opt)
    tcfg = SimpleNamespace(nonfinite="skip", consistency_every=0)
    guard = Guard(tcfg, SimpleNamespace(rank=0, world_size=1), model,
                  torch.amp.GradScaler("cuda", enabled=False), total_steps=100)
    step_no = [0]
    grad_scale = torch.ones((), device=dev)  # inf: the first layer's gradients overflow

    def step(x, y):
        hidden = model[0](x)
        hidden.register_hook(lambda g: g * grad_scale)  # runs in the graph too (captured)
        loss = torch.nn.functional.mse_loss(model[2](model[1](hidden)), y)
        loss.backward()
        guard.after_sync(step_no[0], loss, opt)
        opt.step()
        opt.zero_grad(set_to_none=True)

    graphed = GraphedStep(step)
    x, y = torch.randn(16, 8, device=dev), torch.randn(16, 4, device=dev)
    nan_loss, inf_grad = EAGER_CALLS + 2, EAGER_CALLS + 3  # two replays in a row
    flags = {}
    for i in range(1, EAGER_CALLS + 5):
        step_no[0] = i
        grad_scale.fill_(float("inf") if i == inf_grad else 1.0)
        before = [p.detach().clone() for p in model.parameters()]
        what, _ = graphed(x * float("nan") if i == nan_loss else x, y)
        assert what == ("eager" if i <= EAGER_CALLS else
                        "captured" if i == EAGER_CALLS + 1 else "replayed")
        if what != "eager":
            guard.replayed(i)
            verdict = guard._pending[-1]
            flags[i] = rank_flags(verdict.found, verdict.detail).flatten().tolist()
        same = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
        assert same == (i in (nan_loss, inf_grad)), i
    guard.end_step(EAGER_CALLS + 4, sync_point=True)
    assert guard.skipped == [nan_loss, inf_grad]
    assert flags[nan_loss] == [1.0, 0.0] and flags[inf_grad] == [0.0, 1.0]  # [loss, gradients]
