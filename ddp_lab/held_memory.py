"""What a training run holds per rank, counted from tensor storages at its first optimizer step:
the measurement behind summary.json's memory block (ddp_lab/perf/memory.py's `predict_held` is
what it should be, by design)."""

from __future__ import annotations

import torch

MEMORY_KEYS = ("params_bytes", "grads_bytes", "optimizer_state_bytes", "comm_buffer_bytes")


class HeldMemory:
    """Bytes this rank holds, counted from tensor storages (a storage shared by several tensors,
    e.g. views into one flat buffer, counted once, in the first of: parameters, gradients,
    optimizer state, the sync's buffers), at the end of the first optimizer step that runs: the
    gradients are still there, the optimizer state just made. Gradients: the `.grad` of the
    model's parameters and of the optimizer's tensors (with ZeRO, its shards)."""

    def __init__(self, model, optimizer, sync):
        self.model, self.optimizer, self.sync = model, optimizer, sync
        self.counted: dict | None = None
        self._hook = optimizer.register_step_post_hook(lambda *_: self.count())

    def count(self) -> None:
        self._hook.remove()
        opt = getattr(self.optimizer, "optim", self.optimizer)  # ZeroRedundancyOptimizer: its part
        params = list(self.model.parameters())
        optimized = [p for g in opt.param_groups for p in g["params"]]
        buffers = self.sync.comm_buffers()
        seen: set = set()
        self.counted = {
            "params_bytes": _storage_bytes(params, seen),
            "grads_bytes": _storage_bytes([p.grad for p in params + optimized], seen),
            "optimizer_state_bytes": _storage_bytes(
                [v for s in opt.state.values() for v in s.values()], seen),
            "comm_buffer_bytes": None if buffers is None else _storage_bytes(buffers, seen)}


def _storage_bytes(tensors, seen: set) -> int:
    total = 0
    for t in tensors:
        if not torch.is_tensor(t):
            continue
        st = t.untyped_storage()
        if st.nbytes() and st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            total += st.nbytes()
    return total
