"""Top-k sparsification (Aji and Heafield 2017; with error feedback, as Deep Gradient Compression
keeps it): each rank sends the k = ceil(fraction x n) entries of its bucket largest in magnitude,
as values and int32 indices, and every rank sums all ranks' entries where they land, divided by N.

Why an all-gather, not an all-reduce: two ranks pick different indices, so the sum of their sparse
vectors has the union of both supports. A ring all-reduce would carry that union round, growing
at every step towards the dense vector; an all-gather carries exactly k (value, index) pairs from
each rank, N k in all, and the sum is made where they arrive.

Where it would not pay (2k elements, values and indices, not fewer than n) the bucket goes dense
through the sync's all-reduce: at k = n that is the uncompressed sync, bitwise. Error feedback:
what this rank did not send (its bucket less its k entries) is kept for its next step.

An inf or NaN in a rank's bucket is always among what it sends (torch.topk ranks NaN above every
number, and |inf| is the largest), so the average on every rank holds it and the guard skips the
step on every rank; such a step leaves the kept error as it was.
"""

from __future__ import annotations

import math

import torch

from ddp_lab.compress.base import COMPRESSORS, Compressor, Ops
from ddp_lab.compress.feedback import Feedback


@COMPRESSORS.register("topk")
class TopK(Compressor):
    def __init__(self, fraction: float = 0.01, error_feedback: bool = True):
        self.fraction = fraction
        self.feedback = Feedback(error_feedback)
        self.numel_before = self.numel_after = 0  # elements, values and indices both counted

    @classmethod
    def from_config(cls, scfg) -> "TopK":
        return cls(scfg.topk_fraction, scfg.error_feedback)

    def reduce(self, key: int, flat: torch.Tensor, shapes, ops: Ops) -> None:
        n = flat.numel()
        k = min(n, math.ceil(self.fraction * n))
        self.numel_before += n
        x = self.feedback.add(key, flat)
        if 2 * k >= n:  # would not pay: the dense average, what this rank sent is all of it
            self.numel_after += n
            sent = x  # (e = x - x: nothing kept)
            ops.all_reduce(flat)
            flat.div_(ops.world_size)
        else:
            self.numel_after += 2 * k
            sent = _sparse_average(flat, k, ops)
        # the same verdict on every rank: see the module
        self.feedback.keep(key, x, sent, torch.isfinite(flat).all())

    def state_dict(self) -> dict:
        return {"feedback": self.feedback.state_dict(),
                "numel": torch.tensor([self.numel_before, self.numel_after])}

    def load_state_dict(self, state: dict) -> None:
        self.feedback.load_state_dict(state["feedback"])
        self.numel_before, self.numel_after = (int(v) for v in state["numel"])


def _sparse_average(flat: torch.Tensor, k: int, ops: Ops) -> torch.Tensor:
    """Every rank's k largest entries, all-gathered and averaged where they land, into `flat`;
    returns what this rank sent, as a dense tensor."""
    idx = flat.abs().topk(k, sorted=False).indices.to(torch.int32)
    mine = torch.zeros_like(flat).index_copy_(0, idx.long(), flat[idx.long()])
    values = torch.empty(ops.world_size * k, dtype=flat.dtype, device=flat.device)
    indices = torch.empty(ops.world_size * k, dtype=torch.int32, device=flat.device)
    ops.all_gather(flat[idx.long()], values)
    ops.all_gather(idx, indices)
    flat.zero_()
    for r in range(ops.world_size):  # rank by rank: one rank's k indices never repeat, so each
        # call adds in one order; all N*k at once, CUDA's index_add_ adds repeats in any order,
        # and ranks could round their averages differently (replicas would drift apart)
        part = slice(r * k, (r + 1) * k)
        flat.index_add_(0, indices[part].long(), values[part])
    flat.div_(ops.world_size)
    return mine
