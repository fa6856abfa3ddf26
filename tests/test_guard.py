"""The non-finite guard's per-step check, in one process: which flag an inf/NaN raises, and that
a flagged step leaves a fused optimizer's parameters and momentum bitwise untouched without the
host reading the flag."""

from types import SimpleNamespace

import pytest
import torch

from ddp_lab.guard import Guard, NonFiniteError, rank_flags


def setup(policy="skip", impl="fused"):
    """impl: the optimizer's (optim.impl): fused, foreach or for_loop."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    kwargs = {"fused": True} if impl == "fused" else {"foreach": impl == "foreach"}
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, **kwargs)
    tcfg = SimpleNamespace(nonfinite=policy, consistency_every=0)
    guard = Guard(tcfg, SimpleNamespace(rank=0, world_size=1), model,
                  torch.amp.GradScaler("cpu", enabled=False), total_steps=10)
    return model, opt, guard


def backward(model, poison=None):
    loss = model(torch.randn(5, 4)).square().mean()
    loss.backward()
    if poison in ("grad", "grad_inf"):
        model[1].bias.grad[0] = float("nan" if poison == "grad" else "-inf")
    if poison == "overflow":  # huge but finite gradients, each tensor's L2 norm finite (12 and
        model[0].weight.grad.fill_(1e18)  # 6 squares of 1e36, under fp32's 3.4e38): applied
        model[1].weight.grad.fill_(1e18)
    if poison == "loss":
        loss = loss.detach() * float("inf")
    return loss


def state(model, opt):
    return [t.clone() for t in model.parameters()] + [
        s["momentum_buffer"].clone() for s in opt.state.values()]


@pytest.mark.parametrize("poison,row", [(None, None), ("grad", 1), ("grad_inf", 1), ("overflow", None),
                                        ("loss", 0)])
def test_flags_name_what_was_not_finite_and_a_flagged_step_changes_nothing(poison, row):
    model, opt, guard = setup()
    backward(model)
    guard.after_sync(1, torch.tensor(1.0), opt)  # first step: momentum buffers get made
    opt.step()
    opt.zero_grad()
    before = state(model, opt)
    loss = backward(model, poison)
    grads = [p.grad.clone() for p in model.parameters()]
    guard.after_sync(2, loss, opt)
    verdict = guard._pending[-1]
    expected = torch.zeros(2, 1)
    if row is not None:
        expected[row, 0] = 1
    assert torch.equal(rank_flags(verdict.found, verdict.detail), expected)
    found = verdict.found
    assert opt.found_inf is found and found.item() == (row is not None)  # decided on the device
    if row is None:  # the check read the gradients and left them bitwise as they were
        assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))
    opt.step()
    after = state(model, opt)
    same = all(torch.equal(a, b) for a, b in zip(before, after))
    assert same == (row is not None)
    guard.end_step(2, sync_point=True)
    assert guard.skipped == ([] if row is None else [2])


def test_finite_values_whose_sum_overflows_are_skipped_too():
    """The check reads each gradient's L2 norm (one read pass): where finite values' squares sum
    past fp32's range (3.4e38: here 2 x (3e38)^2) the norm is inf and the step is skipped, like a
    step with an inf."""
    model, opt, guard = setup()
    backward(model)
    guard.after_sync(1, torch.tensor(1.0), opt)
    opt.step()
    opt.zero_grad()
    backward(model)
    model[0].weight.grad[0, :2] = 3e38  # each finite; their sum is not
    guard.after_sync(2, torch.tensor(1.0), opt)
    assert opt.found_inf.item() == 1.0
    guard.end_step(2, sync_point=True)
    assert guard.skipped == [2]


@pytest.mark.parametrize("impl", ["foreach", "for_loop"])
@pytest.mark.parametrize("poison", [None, "grad", "loss"])
def test_an_unfused_optimizer_skips_a_flagged_step_by_dropping_its_gradients(impl, poison):
    """Without a fused kernel's found_inf the guard decides on the host: a flagged step's
    gradients are dropped, so the optimizer step that follows changes nothing."""
    model, opt, guard = setup(impl=impl)
    backward(model)
    guard.after_sync(1, torch.tensor(1.0), opt)
    opt.step()
    opt.zero_grad()
    before = state(model, opt)
    guard.after_sync(2, backward(model, poison), opt)
    assert not hasattr(opt, "found_inf")  # nothing for an unfused step to read
    assert all((p.grad is None) == (poison is not None) for p in model.parameters())
    opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, state(model, opt))) == (poison is not None)
    guard.end_step(2, sync_point=True)
    assert guard.skipped == ([] if poison is None else [2])


def test_each_step_gets_its_own_zeroed_verdict_over_many_steps():
    """150 steps read at sync points every 40, poisoned at 3 of them: exactly those are skipped,
    and a flag never carries over."""
    model, opt, guard = setup()
    poisoned = {2, 65, 130}
    for step in range(1, 151):
        guard.after_sync(step, backward(model, "grad" if step in poisoned else None), opt)
        opt.step()
        opt.zero_grad()
        guard.end_step(step, sync_point=step % 40 == 0 or step == 150)
    assert guard.skipped == sorted(poisoned)


def test_stop_policy_raises_at_the_sync_point_naming_the_step():
    model, opt, guard = setup("stop")
    backward(model)
    guard.after_sync(1, torch.tensor(1.0), opt)
    opt.step()
    opt.zero_grad()
    guard.after_sync(2, backward(model, "grad"), opt)
    guard.end_step(2, sync_point=False)  # not read yet: no host sync between sync points
    with pytest.raises(NonFiniteError, match="step 2: non-finite gradients on rank"):
        guard.end_step(3, sync_point=True)


@pytest.mark.parametrize("poison", [None, "grad"])
def test_fused_adamw_applies_a_finite_step_and_skips_a_flagged_one_on_the_device(poison):
    """One rank's verdict is a scalar, like fused AdamW's step counts (a [1] flag made its
    found_inf arithmetic fail); a flagged step changes neither the weights nor the moments."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    tcfg = SimpleNamespace(nonfinite="skip", consistency_every=0)
    guard = Guard(tcfg, SimpleNamespace(rank=0, world_size=1), model,
                  torch.amp.GradScaler("cpu", enabled=False), total_steps=10)
    backward(model)
    opt.step()  # the first step makes the moments
    opt.zero_grad()
    before = [t.clone() for t in model.parameters()] + [
        v.clone() for s in opt.state.values() for v in s.values()]
    guard.after_sync(2, backward(model, poison), opt)
    assert opt.found_inf is not None
    opt.step()
    after = list(model.parameters()) + [v for s in opt.state.values() for v in s.values()]
    assert all(torch.equal(a, b) for a, b in zip(before, after)) == (poison is not None)
    guard.end_step(2, sync_point=True)
    assert guard.skipped == ([] if poison is None else [2])


def test_sgd_without_momentum_skips_on_the_device_from_the_first_step():
    """No momentum: no optimizer state to be made, so even step 1 needs no host decision."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.0, fused=True)
    tcfg = SimpleNamespace(nonfinite="skip", consistency_every=0)
    guard = Guard(tcfg, SimpleNamespace(rank=0, world_size=1), model,
                  torch.amp.GradScaler("cpu", enabled=False), total_steps=10)
    before = [p.clone() for p in model.parameters()]
    model(torch.randn(3, 4)).sum().backward()
    model.bias.grad[0] = float("nan")
    guard.after_sync(1, torch.tensor(1.0), opt)
    assert opt.found_inf.item() == 1.0 and model.bias.grad is not None  # left to the device
    opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    guard.end_step(1, sync_point=True)
    assert guard.skipped == [1]


def test_off_policy_checks_nothing_per_step_and_applies_every_step():
    model, opt, guard = setup("off")
    backward(model)
    opt.step()
    opt.zero_grad()
    before = state(model, opt)
    loss = backward(model, "grad")
    guard.after_sync(2, loss, opt)
    assert guard._pending == [] and getattr(opt, "found_inf", None) is None  # no op at all
    opt.step()
    assert not torch.isfinite(model[1].bias).all()  # applied: the NaN went into the weights
    assert not all(torch.equal(a, b) for a, b in zip(before, state(model, opt)))
    guard.replayed(2)  # train.cuda_graph: nothing to copy out either
    guard.end_step(2, sync_point=True)
    assert guard.skipped == []


def test_off_policy_still_refuses_to_checkpoint_a_nan(tmp_path):
    """End to end, one process on CPU: the poisoned step is applied (nothing skipped), and the
    checkpoint that would hold the NaN is refused, so the last one on disk stays finite."""
    from ddp_lab.train import train
    from helpers import FAST, compose_config

    # (a 512-wide classifier: each checkpoint 8x smaller than the default 23 M parameters')
    cfg = compose_config(FAST + ["data=synthetic", "data.num_samples=64", "data.val_samples=8",
                                 "model.fc_width=512", "train.batch_size=8", "train.max_steps=4",
                                 "train.checkpoint_every=2", "train.resume=never",
                                 "train.nonfinite=off", "fault.nan_at_step=3"])
    with pytest.raises(NonFiniteError, match="refusing to checkpoint step 4"):
        train(cfg, str(tmp_path))
    ckpt = torch.load(tmp_path / "checkpoint.pt", map_location="cpu", weights_only=False)
    assert ckpt["step"] == 2 and all(torch.isfinite(v).all() for v in ckpt["model"].values())
