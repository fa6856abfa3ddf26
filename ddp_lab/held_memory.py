"""What a training run holds per rank, counted from tensor storages: the measurement behind
summary.json's memory block (ddp_lab/perf/memory.py's `predict_held` is what it should be, by
design; the block shows both, and the excess)."""

from __future__ import annotations

import torch

from ddp_lab.comm import kept_scratch
from ddp_lab.sync.base import local_tensor

MEMORY_KEYS = ("params_bytes", "grads_bytes", "optimizer_state_bytes", "comm_buffer_bytes",
               "comm_scratch_bytes")
# Where it is counted: after the first optimizer step (its state just made, every gradient still
# there), and at the end of the next step's first backward (every gradient made, none released
# yet, the state there too). Between them lies the most a step holds outside autograd's
# activations.
POINTS = ("after_optimizer", "after_backward")


class HeldMemory:
    """Bytes this rank holds at each of POINTS, counted from tensor storages: a storage shared by
    several tensors (views into one flat buffer) counted once, in the first of parameters,
    gradients, optimizer state, the sync's buffers, its receive scratch. Gradients: the `.grad`
    of the model's parameters and of the optimizer's tensors, and those the sync keeps between
    steps (with ZeRO, its shards')."""

    def __init__(self, model, optimizer, sync):
        self.model, self.optimizer, self.sync = model, optimizer, sync
        self.points: dict[str, dict] = {}
        self._hook = optimizer.register_step_post_hook(lambda *_: self._count(POINTS[0]))

    def watching(self, mark):
        """The loop's phase mark `mark`, and the second count at the backward mark after it."""
        def mark_and_count(phase: str) -> None:
            mark(phase)
            if phase == "backward" and list(self.points) == [POINTS[0]]:
                self._count(POINTS[1])

        return mark_and_count

    def _count(self, point: str) -> None:
        if point == POINTS[0]:
            self._hook.remove()
        opt = getattr(self.optimizer, "optim", self.optimizer)  # ZeroRedundancyOptimizer: its part
        params = list(self.model.parameters())
        optimized = [p for g in opt.param_groups for p in g["params"]]
        buffers = self.sync.comm_buffers()
        seen: set = set()
        self.points[point] = {
            "params_bytes": _storage_bytes(params, seen),
            "grads_bytes": _storage_bytes([p.grad for p in params + optimized]
                                          + self.sync.kept_grads(), seen),
            "optimizer_state_bytes": _storage_bytes(
                [v for s in opt.state.values() for v in s.values()], seen),
            "comm_buffer_bytes": None if buffers is None else _storage_bytes(buffers, seen),
            "comm_scratch_bytes": None if buffers is None else _storage_bytes(kept_scratch(),
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
