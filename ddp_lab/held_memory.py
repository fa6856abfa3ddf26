"""What a training run holds per rank, counted from tensor storages: the measurement behind
summary.json's memory block (ddp_lab/perf/memory.py's `predict_held` is what it should be, by
design; the block shows both, and the excess)."""

from __future__ import annotations

import torch

from ddp_lab.comm import kept_scratch
from ddp_lab.sync.base import local_tensor

MEMORY_KEYS = ("params_bytes", "grads_bytes", "optimizer_state_bytes", "comm_buffer_bytes",
               "comm_scratch_bytes", "compress_state_bytes")
# Where it is counted: after the first optimizer step (its state just made, every gradient still
# there); at the end of the next step's first backward (every gradient made); and inside that
# next step, each time the sync is about to release memory (`GradSync.held_probe`: ZeRO frees a
# bucket's gradients once packed, ZeRO-3 a unit's parameters after its forward and its backward),
# keeping the count with the most bytes. What is held only grows between releases, so the most a
# step holds outside autograd's activations is one of these counts.
POINTS = ("after_optimizer", "after_backward", "in_step")


class HeldMemory:
    """Bytes this rank holds at each of POINTS, counted from tensor storages: a storage shared by
    several tensors (views into one flat buffer) counted once, in the first of parameters,
    gradients, optimizer state, the sync's buffers, its receive scratch, what compression keeps. Parameters: the model's
    and the optimizer's (with ZeRO-3, the shards it keeps apart). Gradients: the `.grad` of both,
    and those the sync keeps between steps (with ZeRO, its shards')."""

    def __init__(self, model, optimizer, sync):
        self.model, self.optimizer, self.sync = model, optimizer, sync
        self.points: dict[str, dict] = {}
        self._hook = optimizer.register_step_post_hook(lambda *_: self._after_optimizer())

    def watching(self, mark):
        """The loop's phase mark `mark`, and the counts of the step after the first optimizer
        step: at its first backward mark, and (through the sync's probe) until its comm mark."""
        def mark_and_count(phase: str) -> None:
            mark(phase)
            if POINTS[0] not in self.points:
                return
            if phase == "backward" and POINTS[1] not in self.points:
                self.points[POINTS[1]] = self._counts()
            elif phase == "comm" and POINTS[1] in self.points:
                self.sync.held_probe = None

        return mark_and_count

    def _after_optimizer(self) -> None:
        self._hook.remove()
        self.points[POINTS[0]] = self._counts()
        self.sync.held_probe = self._probe

    def _probe(self) -> None:
        counts = self._counts()
        if POINTS[2] not in self.points or total(counts) > total(self.points[POINTS[2]]):
            self.points[POINTS[2]] = counts

    def _counts(self) -> dict:
        opt = getattr(self.optimizer, "optim", self.optimizer)  # ZeroRedundancyOptimizer: its part
        params = list(self.model.parameters())
        optimized = [p for g in opt.param_groups for p in g["params"]]
        buffers, compressed = self.sync.comm_buffers(), self.sync.compress_state()
        seen: set = set()
        return {
            "params_bytes": _storage_bytes(params + optimized, seen),
            "grads_bytes": _storage_bytes([p.grad for p in params + optimized]
                                          + self.sync.kept_grads(), seen),
            "optimizer_state_bytes": _storage_bytes(
                [v for s in opt.state.values() for v in s.values()], seen),
            "comm_buffer_bytes": None if buffers is None else _storage_bytes(buffers, seen),
            "comm_scratch_bytes": None if buffers is None else _storage_bytes(kept_scratch(),
                                                                              seen),
            "compress_state_bytes": None if compressed is None else _storage_bytes(compressed,
                                                                                   seen)}


def total(counts: dict) -> int:
    """The bytes of one count, leaving out what could not be counted (None)."""
    return sum(v for v in counts.values() if v is not None)


def _storage_bytes(tensors, seen: set) -> int:
    total_bytes = 0
    for t in tensors:
        if not torch.is_tensor(t):
            continue
        st = local_tensor(t).untyped_storage()  # (sync=fsdp: a DTensor holds its shard)
        if st.nbytes() and st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            total_bytes += st.nbytes()
    return total_bytes
