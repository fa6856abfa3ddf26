"""The guard's non-finite check where our bucketed syncs flag inf/NaN as they average each bucket
(`GradSync.check_nonfinite`, ddp_lab/guard.py: each rank its 1/N of each bucket), on real gloo
process groups in process: a NaN made in backward in one parameter's gradient on one rank skips
that step on every rank and only that step, for a parameter of the first bucket reduced and of
the last, at its first and last element (so in different ranks' parts), at ZeRO-0, 2 and 3,
with accumulation, at one rank, and under torch DDP (its comm hook checks the same way); and
the guard then reads no gradient itself."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from launchers import spawn
from test_sync import batch, make_model
from test_zero import make_sync, scfg

STEPS, POISONED = 4, 2


def _count_guard_norm_elements(counted: list[int]) -> None:
    """Wrap torch._foreach_norm (in this forked rank only) to count the elements ddp_lab.guard
    hands it: the guard's read of the gradients, if it makes one."""
    norm = torch._foreach_norm

    def counting(tensors, *args, **kwargs):
        if sys._getframe(1).f_globals.get("__name__") == "ddp_lab.guard":
            counted[-1] += sum(t.numel() for t in tensors)
        return norm(tensors, *args, **kwargs)

    torch._foreach_norm = counting


def _train(rank, n, name, zero, poison, accum, where=0):
    """STEPS steps of the small CNN under the guard (skip, fused SGD); at step POISONED, rank 0's
    backward makes `poison` (an index into the model's parameters) get a NaN gradient at element
    `where`, in the first micro-batch. Returns what was skipped, whether each step moved the
    parameters, the verdict's flags and the gradient elements the guard read per step."""
    from ddp_lab.guard import Guard, rank_flags

    counted: list[int] = []
    _count_guard_norm_elements(counted)
    model = make_model(0)
    sync = make_sync(scfg(name, zero, overlap=True), n)
    wrapped = sync.prepare(model)
    opt = sync.build_optimizer(model, torch.optim.SGD, dict(lr=0.1, momentum=0.9, fused=True))
    guard = Guard(SimpleNamespace(nonfinite="skip", consistency_every=0),
                  SimpleNamespace(rank=rank, world_size=n), model,
                  torch.amp.GradScaler("cpu", enabled=False), total_steps=STEPS, sync=sync)
    target = list(model.parameters())[poison]
    armed = [False]
    target.register_hook(lambda g: _nan_at(g, where) if armed[0] else g)  # in backward, pre-sync
    moved, flags = [], None
    for step in range(1, STEPS + 1):
        counted.append(0)
        for micro in range(accum):
            armed[0] = rank == 0 and step == POISONED and micro == 0
            x, y = batch(rank, step, micro)
            with sync.no_sync() if micro < accum - 1 else _Null():
                loss = nn.functional.cross_entropy(wrapped(x), y) / accum
                loss.backward()
        sync.finish()
        guard.after_sync(step, loss, opt)
        if step == POISONED:
            flags = rank_flags(guard._pending[-1].found, guard._pending[-1].detail).tolist()
        with sync.unsharded():
            before = [p.detach().clone() for p in model.parameters()]
        opt.step()
        opt.zero_grad(set_to_none=True)
        with sync.unsharded():
            moved.append(not all(torch.equal(a, p) for a, p in zip(before, model.parameters())))
    guard.resolve()
    index = {id(p): i for i, p in enumerate(model.parameters())}
    buckets = [[index[id(p)] for p in b.params] for b in getattr(sync, "buckets", [])]
    sync.close()
    return {"skipped": guard.skipped, "moved": moved, "flags": flags, "read": counted,
            "buckets": buckets, "params": sum(p.numel() for p in model.parameters())}


def _nan_at(g: torch.Tensor, where: int) -> torch.Tensor:
    g = g.clone()
    g.view(-1)[where] = float("nan")
    return g


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


# The small CNN's parameters: conv (0, 1), linear (2, 3), linear (4, 5); buckets in reverse
# order, so the last layer's weight (4) is in the first bucket reduced, the conv's weight (0) in
# the last.
FIRST_BUCKET, LAST_BUCKET = 4, 0


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n,name,zero,poison,accum,where", [
    (2, "ring", 0, FIRST_BUCKET, 1, 0), (2, "ring", 0, FIRST_BUCKET, 1, -1),
    (2, "ring", 0, LAST_BUCKET, 1, 0), (2, "ring", 0, LAST_BUCKET, 1, -1),
    (2, "ring", 2, FIRST_BUCKET, 1, 0), (2, "ring", 2, LAST_BUCKET, 1, 0),
    (2, "ring", 3, LAST_BUCKET, 1, 0), (2, "ring", 2, LAST_BUCKET, 2, 0),
    (2, "ring", 0, FIRST_BUCKET, 2, 0), (1, "ring", 0, LAST_BUCKET, 1, 0),
    # DDP: one bucket for this model (its first bucket may hold 1 MiB), so the last layer's
    # weight starts it, in rank 0's part, and the conv's weight ends it, in rank 1's.
    (2, "ddp", 0, FIRST_BUCKET, 1, 0), (2, "ddp", 0, LAST_BUCKET, 1, -1),
    (2, "ddp", 0, LAST_BUCKET, 2, -1), (1, "ddp", 0, LAST_BUCKET, 1, 0)])
def test_a_nan_in_one_gradient_on_one_rank_skips_that_step_only_on_every_rank(
        n, name, zero, poison, accum, where):
    results = spawn(_train, n, name, zero, poison, accum, where, timeout=110)
    buckets = results[0]["buckets"]
    if name != "ddp":  # (DDP's buckets live in its C++ reducer)
        assert poison in (buckets[0] if poison == FIRST_BUCKET else buckets[-1]) and len(buckets) > 2
    for r in results:
        assert r["skipped"] == [POISONED], r  # and the flag was cleared for the steps after it
        assert r["moved"] == [s != POISONED for s in range(1, STEPS + 1)], r
        loss_row, grad_row = r["flags"]
        # Averaged, the NaN is on every rank; the rank whose part of the bucket holds it flags it.
        assert not any(loss_row) and any(grad_row), r
        assert r["read"] == [1] * STEPS, r  # the loss only: the sync flagged the gradients
