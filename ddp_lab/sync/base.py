"""The contract between the training loop and a gradient synchroniser.

The loop does, every step:
    with sync.no_sync():  ... forward + backward ...   # every micro-step but the last
    ... forward + backward ...                         # last micro-step: communication starts
    sync.finish()                                      # grads are now averaged over all ranks
and never asks which algorithm it is talking to. The optimizer is the sync's too
(`build_optimizer`): with ZeRO (sync.zero) or FSDP each rank's optimizer holds and updates only
its shard, so clipping, loss-scale checks and checkpoints go through the sync.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.distributed.tensor import DTensor


class NonfiniteFlag:
    """A one-element device flag that `check` sets to 1.0 when a tensor it is handed holds an
    inf/NaN: the guard's own test, each tensor's L2 norm (one read pass; inf/NaN iff an element
    is, or the squares overflow fp32) flagged by GradScaler's multi-tensor check with a scale of
    1 (`isfinite(t).all()` is several passes and a bool temporary: 17x slower on one thread).
    Nothing is read back to the host: a synchronised step clears it and checks its buckets as
    they are averaged (`GradSync.check_nonfinite`)."""

    def __init__(self, device: torch.device):
        self.flag = torch.zeros(1, device=device)
        self._one = torch.ones(1, device=device)

    def clear(self) -> None:
        self.flag.zero_()

    def check(self, parts: list[torch.Tensor]) -> None:
        norms = torch._foreach_norm(parts, 2, dtype=torch.float32)
        torch._amp_foreach_non_finite_check_and_unscale_(norms, self.flag, self._one)


class GradSync:
    name = "base"
    tracer = None  # train.trace: a ddp_lab.trace.Tracer the sync stamps its communication into
    # The memory count (ddp_lab/held_memory.py), for one step: a callable the sync calls just
    # before it releases memory inside a step (ZeRO: a bucket's gradients, a unit's parameters),
    # where what it holds is at a local maximum.
    held_probe = None
    # Whether a forward all-gathers (ZeRO-3, FSDP): every rank must then run as many forwards,
    # evaluation's too (ddp_lab/train.py's evaluate).
    forward_communicates = False

    def _tracing(self) -> bool:
        return self.tracer is not None and self.tracer.step is not None

    def prepare(self, model: nn.Module) -> nn.Module:
        """Make replicas equal (broadcast from rank 0) and install hooks; return the module to call."""
        raise NotImplementedError

    def no_sync(self):
        """Micro-steps inside this context accumulate gradients locally without communicating."""
        return contextlib.nullcontext()

    def finish(self) -> None:
        """Block (the optimizer) until every gradient is averaged across ranks."""

    def bytes_per_step(self) -> int:
        """Bytes this rank sends per synchronised step (0 where the sync cannot count them)."""
        return 0

    # ---- optional measurements, for the scaling work (safe defaults) ----

    def comm_busy_ms(self) -> float:
        """Milliseconds spent communicating in the last synchronised step (NaN if not measured).
        With bytes_per_step() it gives the achieved bandwidth: bytes / busy time."""
        return float("nan")

    def comm_stats(self) -> dict:
        """Everything the sync measured about its communication, as plain data."""
        return {"bytes_per_step": self.bytes_per_step(), "comm_busy_ms": self.comm_busy_ms()}

    def close(self) -> None:
        """Remove hooks and stop helper threads (optional: they are daemons)."""

    def check_nonfinite(self) -> torch.Tensor | None:
        """From now on flag inf/NaN in each step's averaged gradients as the sync makes them:
        returns the flag, a one-element device tensor that is 1.0 after a synchronised step
        where a gradient the optimizer reads held one (cleared as the next step's reduction
        starts), or None where the sync does not see every such gradient (the guard then reads
        them itself: ddp_lab/guard.py)."""
        return None

    # ---- the optimizer: every parameter here; with ZeRO, this rank's shard (sync/zero.py) ----

    def build_optimizer(self, model: nn.Module, cls: type, kwargs: dict) -> torch.optim.Optimizer:
        """The optimizer (`cls(params, **kwargs)`) over what this rank updates."""
        return cls(model.parameters(), **kwargs)

    def grad_scaler(self, scaler: torch.amp.GradScaler) -> torch.amp.GradScaler:
        """fp16's GradScaler, made to agree across ranks where each sees part of the gradients."""
        return scaler

    def clip_grad_norm_(self, optimizer, max_norm: float) -> torch.Tensor:
        """Clip the optimizer's gradients to a global L2 norm of `max_norm`; return the norm."""
        return torch.nn.utils.clip_grad_norm_(_params(optimizer), max_norm)

    def state_dict(self) -> dict:
        """What this rank's sync keeps from step to step beside the model and the optimizer
        (compression's error buffers, PowerSGD's Q: sync/compressed.py); {} where nothing. Rank 0's
        checkpoint.pt holds every rank's (ddp_lab/resume.py)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """This rank's part of what `state_dict` returned when the checkpoint was written."""

    # ---- checkpoints. Whole copies (sync.zero=0): rank 0 writes checkpoint.pt from the model's
    #      and optimizer's state dicts (ddp_lab/checkpoint.py). Where each rank holds a part
    #      (ZeRO, FSDP: sync.config.shards_state), each writes its own through these two
    #      (ddp_lab/sharded_checkpoint.py) ----

    def state_shards(self, model: nn.Module, optimizer) -> tuple[dict, dict]:
        """This rank's part of the model's and the optimizer's tensors, by key, as DCP writes
        them (tensors or DTensors), and the layout (plain data) that says how they are cut."""
        raise NotImplementedError(f"sync={self.name} keeps whole copies: checkpoint.pt")

    def load_state_shards(self, model: nn.Module, optimizer, shards, layout: dict) -> None:
        """This rank's part of a checkpoint `state_shards` wrote at any world size, read through
        `shards` (ddp_lab.sharded_checkpoint.Shards: collective, as DCP is)."""
        raise NotImplementedError(f"sync={self.name} keeps whole copies: checkpoint.pt")

    def unsharded(self):
        """Collective, outside a step: a context in which every parameter of the model is whole
        on every rank (what reads the whole model: the replica check; ZeRO-3's checkpoints
        write shards instead). ZeRO-3 gathers them, and on exit keeps its shard of what they
        then hold."""
        return contextlib.nullcontext()

    def kept_grads(self) -> list[torch.Tensor]:
        """Gradient tensors the sync keeps across steps beside the parameters' `.grad` (ZeRO: the
        shards'), for the memory count."""
        return []

    def comm_buffers(self) -> list[torch.Tensor] | None:
        """The sync's own buffers (buckets, scratch) for the memory count (summary.json); None
        where they cannot be counted."""
        return []

    def compress_state(self) -> list[torch.Tensor] | None:
        """What gradient compression keeps between steps (error feedback, PowerSGD's Q), for the
        memory count; None where it cannot be counted."""
        return []


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of `t`: a DTensor's local shard (sync=fsdp), any other tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def whole_tensor(t: torch.Tensor) -> torch.Tensor:
    """All of `t`: a DTensor gathered from every rank (a collective), any other tensor itself."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def _params(optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]
