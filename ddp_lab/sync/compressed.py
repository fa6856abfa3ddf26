"""sync.compress=powersgd|topk in our syncs (sync=naive|ring|tree|hring, sync.zero=0): each bucket,
once packed, is averaged by a compressor (ddp_lab/compress) instead of the sync's all-reduce.

    BucketedSync._reduce_bucket:  pack -> CompressedBuckets.reduce(b, bucket, ops) -> unpack

`ops` are the sync's own collectives (its algorithm, its group, `_communicate`): every byte a
compressor sends is counted by the sync's Recorder, timed in comm_busy_ms and traced like the
sync's own all-reduces (an all-gather as an `allgather` span).

sync.compress_start
    The first N synchronised steps go uncompressed: the bucket's all-reduce, divided by N, which
    is what the sync does without compression, bitwise. Steps are counted here (after a step's
    last bucket), and the count goes into checkpoints with the compressor's state.

Counting (comm_stats()["compression"], so summary.json's `comm.compression`), of the last step:
    elements_per_step          elements this rank handed to collectives: an all-reduce's tensor,
                               an all-gather's own piece (what torch's compression_stats counts)
    bucket_elements            the same per bucket
    bucket_bytes_sent          bytes this rank sent per bucket, counted by the Recorder (their
                               sum is the sync's bytes_per_step)
    gradient_elements          the elements of the gradients themselves (uncompressed)
    compress_ms / bucket_compress_ms   host time in the compressor outside its collectives
                               (the compression's compute; NaN on CUDA: the host clock does not
                               time device work)
    compressing                whether that step was compressed (false before compress_start)
and over the whole run, as torch's PowerSGDState.compression_stats: numel_before, numel_after,
rate.

Checkpoints: `state_dict()` (the compressor's error buffers, PowerSGD's Q and its seeds'
position, the step count) is per rank: error buffers differ between ranks. Rank 0's
checkpoint.pt holds every rank's (ddp_lab/resume.py's save).
"""

from __future__ import annotations

import math
import time

import torch
from torch.utils._pytree import tree_map_only

from ddp_lab.comm.p2p import recording
from ddp_lab.compress import COMPRESSORS, Ops


class CompressedBuckets:
    """A compressor and the step count behind one sync's buckets."""

    def __init__(self, scfg, device: torch.device):
        self.name = scfg.compress
        self.compressor = COMPRESSORS[scfg.compress].from_config(scfg)
        self.start = scfg.compress_start
        self.device = device
        self.steps = 0  # synchronised steps done (compress_start counts them)
        self._step = _StepCount()
        self._last = _StepCount()

    @property
    def compressing(self) -> bool:
        return self.steps >= self.start

    def reduce(self, b: int, bucket, ops: Ops, last: bool) -> None:
        """The average over the ranks of bucket b into its buffer; `last`: the step's last bucket."""
        counting = _Counting(ops)
        start = time.perf_counter()
        with recording() as rec:
            if self.compressing:
                self.compressor.reduce(b, bucket.buffer, [p.shape for p in bucket.params],
                                       counting.ops)
            else:  # the sync's own all-reduce, SUM then divide
                counting.ops.all_reduce(bucket.buffer)
                bucket.buffer.div_(ops.world_size)
        compute_s = time.perf_counter() - start - counting.seconds
        self._step.add(b, counting.elements, rec.bytes_sent, bucket.numel,
                       compute_s * 1e3 if self.device.type == "cpu" else math.nan)
        if last:
            self._last, self._step = self._step, _StepCount()
            self._last.compressing = self.compressing
            self.steps += 1

    def stats(self) -> dict:
        c = self.compressor
        return {"compress": self.name, **self._last.as_dict(), "steps": self.steps,
                "numel_before": c.numel_before, "numel_after": c.numel_after,
                "rate": c.numel_before / c.numel_after if c.numel_after else math.nan}

    def state_dict(self) -> dict:
        """This rank's state, on the CPU (rank 0 gathers every rank's into checkpoint.pt)."""
        state = {"steps": self.steps, "compressor": self.compressor.state_dict()}
        return tree_map_only(torch.Tensor, lambda t: t.cpu(), state)

    def load_state_dict(self, state: dict) -> None:
        state = tree_map_only(torch.Tensor, lambda t: t.to(self.device), state)
        self.compressor.load_state_dict(state["compressor"])
        self.steps = state["steps"]


class _StepCount:
    """One step's counts, by bucket."""

    def __init__(self):
        self.compressing = False
        self.elements: list[int] = []
        self.bytes: list[int] = []
        self.gradient_elements = 0
        self.compute_ms: list[float] = []

    def add(self, b: int, elements: int, nbytes: int, gradient_elements: int, ms: float) -> None:
        assert b == len(self.elements), "buckets are reduced in order, each once a step"
        self.elements.append(elements)
        self.bytes.append(nbytes)
        self.gradient_elements += gradient_elements
        self.compute_ms.append(ms)

    def as_dict(self) -> dict:
        return {"compressing": self.compressing, "elements_per_step": sum(self.elements),
                "bucket_elements": self.elements, "bucket_bytes_sent": self.bytes,
                "gradient_elements": self.gradient_elements,
                "compress_ms": sum(self.compute_ms), "bucket_compress_ms": self.compute_ms}


class _Counting:
    """`ops` counting the elements handed to them and timing them (host clock)."""

    def __init__(self, ops: Ops):
        self.elements, self.seconds = 0, 0.0
        self.ops = Ops(ops.world_size, self._timed(ops.all_reduce, lambda t: t.numel()),
                       self._timed(ops.all_gather, lambda mine, whole: mine.numel()))

    def _timed(self, collective, elements):
        def run(*tensors):
            self.elements += elements(*tensors)
            start = time.perf_counter()
            out = collective(*tensors)
            self.seconds += time.perf_counter() - start
            return out
        return run
