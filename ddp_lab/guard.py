"""The guard around the training step: the non-finite policy and the replica check.

* Non-finite loss or gradients. After the gradient sync the guard checks the L2 norms of the loss
  and of every gradient on the device (one read pass; a norm is inf/NaN iff some element is, or
  when a tensor's finite squares sum past fp32's range, an element of about 1.8e19 or more: skip
  that too). Where the sync offers it (`GradSync.check_nonfinite`: our bucketed syncs, ZeRO
  too) each rank checks its 1/N of every bucket the sync averaged (all ranks hold the same
  average, so the parts cover it), on the communication thread beside backward, because the
  guard's own pass over every gradient after the sync sits on the step's critical path at
  memory bandwidth. With more than one rank it
  all-reduces a per-rank [loss, gradients] flag, so ranks decide together, never alone. The
  verdict stays on the device: a fused optimizer (the default) skips the update itself through its
  `found_inf` input, the mechanism GradScaler uses, so parameters, momentum and weight decay are
  untouched and the host never waits. fp16's GradScaler skips on its own (it sees the averaged
  gradients, so every rank skips alike). Verdicts are read at sync points (log steps,
  checkpoints, the end): `train.nonfinite=skip` logs and counts the skipped steps, `stop` raises
  `NonFiniteError` naming the step and ranks, `off` checks nothing per step and applies every
  step. `assert_finite` is the last line before a checkpoint, whatever the policy: a NaN never
  reaches one.
* Replicas. Every `train.consistency_every` steps (and at the end) the ranks compare an exact
  checksum of their parameters, computed on the device; a difference stops training with the
  ranks named. The summary's per-rank digests come from the same checksum. (sync=fsdp: each
  rank holds its rows of every parameter; the checksum is of the parameters gathered whole, and
  the non-finite checks read this rank's rows, their flags all-reduced as everywhere.)
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ddp_lab.errors import TrainingError
from ddp_lab.sync.base import GradSync, local_tensor, whole_tensor

log = logging.getLogger("ddp_lab")


class NonFiniteError(TrainingError):
    pass


class ReplicaDivergence(TrainingError):
    pass


@dataclass
class Verdict:
    """One step's non-finite check, still on the device until a sync point reads it."""
    step: int
    found: torch.Tensor | None = None  # 1.0: the step holds an inf/NaN (skipped)
    detail: torch.Tensor | None = None  # [loss, gradients] x rank flags; world size 1: the loss
    scale_before: torch.Tensor | None = None  # fp16: the GradScaler's scale around the step
    scale_after: torch.Tensor | None = None


class Guard:
    """Called by the loop after the sync (`after_sync`) and after the optimizer (`end_step`);
    decides on every rank alike."""

    def __init__(self, tcfg, info, model: torch.nn.Module, scaler, total_steps: int,
                 sync: GradSync | None = None):
        self.policy, self.every = tcfg.nonfinite, tcfg.consistency_every
        self.info, self.scaler = info, scaler
        self.params = list(model.parameters())
        sync = sync or GradSync()
        self.unsharded = sync.unsharded  # ZeRO-3 gathers the parameters to compare them
        # The sync's inf/NaN flag over the gradients it averaged (see the module), or None: read
        # them here. Not asked for where nothing reads it.
        self._synced = (sync.check_nonfinite()
                        if self.policy != "off" and not scaler.is_enabled() else None)
        self.last_step = total_steps
        self.skipped: list[int] = []
        self.checks = 0
        self._checked: list[torch.Tensor] | None = None  # the checksums, while nothing changed
        self._pending: list[Verdict] = []
        self._captured: Verdict | None = None  # train.cuda_graph: the captured step's verdict
        self._one: torch.Tensor | None = None  # the check's scale of 1, made on the first step

    def after_sync(self, step: int, loss: torch.Tensor, optimizer) -> None:
        """Between the gradient sync and the optimizer step; no host sync (see the module)."""
        if self.scaler.is_enabled():
            # fp16: the scaler finds inf/NaN gradients and skips by itself (a non-finite loss
            # makes them so), whatever the policy; keep its scale (a device tensor) to report it.
            scale = self.scaler._scale.clone()  # noqa: SLF001 - get_scale() would sync the host
            self._pending.append(Verdict(step, scale_before=scale))
            return
        if self.policy == "off":  # every step is applied; assert_finite still guards checkpoints
            return
        loss = loss.detach()
        if self._one is None:
            self._one = torch.ones(1, device=loss.device)
        # The optimizer's gradients: the model's, or with ZeRO this rank's shards of them (the
        # flags below are all-reduced, so every rank sees every shard's verdict); none where the
        # sync flagged them.
        grads = [] if self._synced is not None else [
            local_tensor(p.grad) for g in optimizer.param_groups for p in g["params"]
            if p.grad is not None]
        # L2, not L1: the same one read pass, and on the CPU torch's L2 kernel is 3.3x faster
        # (docs/results/cpu-guard-cost)
        norms = torch._foreach_norm([loss, *grads], 2, dtype=torch.float32)
        if self.info.world_size == 1:
            # Made in the step (a graph replays it); a scalar, as fused AdamW's step counts are.
            found = torch.zeros((), device=loss.device)
            self._flag_gradients(norms[1:], found)
            self._flag_non_finite(norms[:1], found)
            detail = loss  # which one it was is worked out on the host, for a flagged step only
        else:
            # [loss, gradients] x rank, each rank filling its own column: all ranks decide
            # together and the message can say where the inf/NaN came from.
            r = self.info.rank
            detail = torch.zeros(2, self.info.world_size, device=loss.device)
            self._flag_non_finite(norms[:1], detail[0, r:r + 1])
            self._flag_gradients(norms[1:], detail[1, r:r + 1])
            dist.all_reduce(detail)  # columns are disjoint: entries stay 0/1
            found = detail.amax()
        if _fused(optimizer) and (optimizer.state or _stateless(optimizer)):
            optimizer.found_inf = found  # 1.0 skips the fused update, 0.0 applies it
        elif found.item():
            # Unfused optimizer, or the very first step (fused SGD would leave its new momentum
            # buffers uninitialised when skipped): decide on the host now.
            optimizer.zero_grad(set_to_none=True)  # no gradients: the optimizer step is a no-op
        self._pending.append(Verdict(step, found, detail))

    def _flag_gradients(self, norms: list[torch.Tensor], flag: torch.Tensor) -> None:
        """Set the zeroed `flag` to 1.0 if the gradients hold an inf/NaN: the sync's verdict
        (copied: the sync clears its flag next step), else from their `norms`."""
        if self._synced is not None:
            flag.copy_(self._synced.view_as(flag))
        else:
            self._flag_non_finite(norms, flag)

    def _flag_non_finite(self, tensors: list[torch.Tensor], flag: torch.Tensor) -> None:
        """Set the zeroed one-element `flag` to 1.0 if any value in `tensors` is inf/NaN:
        GradScaler's multi-tensor check, with a scale of 1 (the values are read, not changed)."""
        torch._amp_foreach_non_finite_check_and_unscale_(tensors, flag, self._one)

    def replayed(self, step: int) -> None:
        """train.cuda_graph: after a replay of the captured step. Its after_sync ran once, at
        capture, and every replay overwrites the same verdict tensors: keep this step's copy."""
        if self.policy == "off" or self.scaler.is_enabled():
            return
        if self._captured is None:
            self._captured = self._pending.pop()
        snap = torch.cat([self._captured.found.view(1), self._captured.detail.view(1)])  # one op
        self._pending.append(Verdict(step, snap[:1], snap[1]))

    def end_step(self, step: int, sync_point: bool) -> bool:
        """After the optimizer step. At a sync point (log step, checkpoint, end) read the
        pending verdicts; every `train.consistency_every` steps compare replicas. Returns whether
        it compared (that time is not step time)."""
        self._checked = None  # the step changed the parameters
        if self._pending and self._pending[-1].step == step and self.scaler.is_enabled():
            self._pending[-1].scale_after = self.scaler._scale.clone()  # noqa: SLF001
        if sync_point:
            self.resolve()
        if self.every and (step % self.every == 0 or step == self.last_step):
            self.check_replicas(step)
            return True
        return False

    def resolve(self) -> None:
        """Read the verdicts of the steps since the last call, in one copy to the host."""
        pending, self._pending = self._pending, []
        if not pending:
            return
        if self.scaler.is_enabled():
            self._resolve_scaled(pending)
            return
        found = torch.cat([v.found.view(1) for v in pending]).tolist()
        for v, flagged in zip(pending, found):
            if not flagged:
                continue
            flags = rank_flags(v.found, v.detail)
            where = "; ".join(f"non-finite {what} on rank(s) {row.nonzero().flatten().tolist()}"
                              for what, row in zip(("loss", "gradients"), flags) if row.any())
            if self.policy == "stop":
                raise NonFiniteError(
                    f"step {v.step}: {where}; stopping (train.nonfinite=stop). The step was not "
                    "applied and the last checkpoint holds no NaN; train.nonfinite=skip drops "
                    "such steps on every rank instead")
            self.skipped.append(v.step)
            log.warning("step %d: %s; step skipped on every rank (train.nonfinite=skip, %d "
                        "skipped so far)", v.step, where, len(self.skipped))

    def _resolve_scaled(self, pending: list[Verdict]) -> None:
        """fp16: a step whose loss scale went down was skipped by the GradScaler."""
        # No "after" where the step did not end (a stop).
        scales = torch.stack([t.view(()) for v in pending for t in (
            v.scale_before, v.scale_before if v.scale_after is None else v.scale_after)])
        for v, (before, after) in zip(pending, scales.view(-1, 2).tolist()):
            if after < before:
                self.skipped.append(v.step)
                log.info("step %d: GradScaler found inf/NaN gradients, step skipped on every "
                         "rank, loss scale %g -> %g", v.step, before, after)

    def check_replicas(self, step: int) -> None:
        """Collective: a difference between the ranks' parameters stops training."""
        with self.unsharded():
            every = self._checked = replica_checksums(self.params)
        self.checks += 1
        groups: dict[tuple, list[int]] = {}
        for r, c in enumerate(every):
            groups.setdefault(tuple(c.tolist()), []).append(r)
        if len(groups) == 1:
            return
        ranked = sorted(groups.values(), key=lambda rs: (-len(rs), rs[0]))
        detail = ", ".join(f"ranks {rs} have checksum {_digest(torch.tensor(k))}"
                           for k, rs in groups.items())
        odd = [r for rs in ranked[1:] for r in rs]
        raise ReplicaDivergence(
            f"replicas diverged by step {step}: rank(s) {odd} differ from rank(s) {ranked[0]} "
            f"({detail}). Data-parallel replicas must stay bitwise equal; stopping "
            "(train.consistency_every)")

    def summary(self) -> dict:
        """Collective: skipped steps and every rank's parameter digest, for summary.json."""
        self.resolve()
        every = [None] * self.info.world_size
        dist.all_gather_object(every, self.skipped)  # they must agree
        # (the last step's check, if it compared: the same parameters)
        checksums = self._checked
        if checksums is None:
            with self.unsharded():
                checksums = replica_checksums(self.params)
        digests = [_digest(c) for c in checksums]
        if len(set(digests)) > 1:
            log.error("replicas diverged: parameter digests per rank %s", digests)
        return {"nonfinite_skipped_steps": len(self.skipped),
                "rank_nonfinite_skipped_steps": every,
                "consistency_checks": self.checks,
                "rank_param_digests": digests}


def rank_flags(found: torch.Tensor, detail: torch.Tensor) -> torch.Tensor:
    """[loss, gradients] x rank, 1.0 where that rank's loss / gradients were not finite."""
    if detail.dim() == 2:
        return detail
    # World size 1: `detail` is the step's loss. A non-finite loss makes the gradients so too:
    # name the cause.
    bad_loss = ~torch.isfinite(detail)
    return torch.stack([bad_loss, found.view(()).bool() & ~bad_loss]).float().view(2, 1)


def _fused(optimizer) -> bool:
    """A fused torch optimizer, which reads `found_inf` (a wrapper such as ZeroRedundancyOptimizer
    would not pass it on to the one inside)."""
    return isinstance(optimizer, (torch.optim.SGD, torch.optim.AdamW)) and bool(
        optimizer.defaults.get("fused"))


def _stateless(optimizer) -> bool:
    """SGD without momentum keeps no state, so its first step may be skipped on the device too."""
    return isinstance(optimizer, torch.optim.SGD) and all(
        g["momentum"] == 0 for g in optimizer.param_groups)


def assert_finite(optimizer, step: int) -> None:
    """Collective, before a checkpoint: what the optimizer updates (ZeRO: this rank's shards,
    which at stage 3 are all it holds of the parameters) and its state must be finite
    everywhere."""
    tensors = [local_tensor(t) for g in optimizer.param_groups for t in g["params"]] + [
        local_tensor(v) for s in optimizer.state.values() for v in s.values()
        if isinstance(v, torch.Tensor) and v.is_floating_point()]
    bad = ~torch.stack([torch.isfinite(t.detach()).all() for t in tensors]).all()
    device = tensors[0].device
    flag = bad.to(torch.float32).reshape(1).to(device)
    dist.all_reduce(flag)
    if flag.item():
        raise NonFiniteError(f"refusing to checkpoint step {step}: non-finite parameters or "
                             f"optimizer state on {int(flag.item())} rank(s); the previous "
                             "checkpoint is kept")


# ---- the replica checksum ---------------------------------------------------------------------

_WEIGHTS: dict = {}
_CHUNK = 1 << 22


def replica_checksums(params) -> list[torch.Tensor]:
    """Collective: every rank's `param_checksum`, in rank order."""
    mine = param_checksum(params)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return every


def param_checksum(params) -> torch.Tensor:
    """Exact checksum of parameter bits, on their device: per chunk, sum of (16-bit word + 2^15)
    x (odd position weight) in int64. Any single changed bit changes it; no overflow (each chunk's
    sum < 2^55); integer sums do not depend on reduction order, so equal bits give equal sums."""
    sums = []
    for p in params:
        words = whole_tensor(p.detach()).reshape(-1).view(torch.int16)
        key = words.device
        if key not in _WEIGHTS:
            _WEIGHTS[key] = (torch.arange(_CHUNK, device=key) % 65536) * 2 + 1
        w = _WEIGHTS[key]
        for s in range(0, words.numel(), _CHUNK):
            c = words[s:s + _CHUNK].to(torch.int64) + 32768
            sums.append((c * w[:c.numel()]).sum())
    return torch.stack(sums)


def _digest(checksum: torch.Tensor) -> str:
    """A short name for a checksum: equal names, bitwise-equal replicas."""
    return hashlib.sha256(checksum.cpu().numpy().tobytes()).hexdigest()[:16]
