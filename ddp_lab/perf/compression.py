"""Compression's term: what a compressed arm's step should cost on a slower link, and the link
speed below which compression starts to pay.

The link term. The emulated link (ddp_lab/comm/p2p.py's `Link.hold`) makes the posting thread
sleep bytes x 8 / gbps before each cross-node send, and our syncs post from their communication
thread, which takes the buckets one at a time, each as soon as backward has produced it and the
previous one is done (ddp_lab/sync/bucketed.py). The wire time is then more time on that thread:
where backward is still running it can hide under it (a sleep takes no core); after backward it
adds to the step. The model plays one step's buckets on the scaling model's schedule
(ddp_lab/perf/step.py's `schedule_times`: one channel, bucket order, each as soon as it is ready
and the previous one is done) with and without the wire, and adds the difference:

    step(arm, link) = step(arm, no link) + exposed(host_b + wire_b) - exposed(host_b)

- exposed: what the step loses to the thread beyond backward (`Schedule.exposed_s`), backward
  being the arm's `time_ms.backward` without a link (the median of its runs) and bucket b ready
  at the fraction of it done when its last gradient exists, by the forward FLOPs of the layers
  (the scaling model's `make_buckets` over `profile_model`, cut as the sync cuts them:
  `buckets.plan(..., "ours")`, DDP's rule for sync=ddp);
- host_b: bucket b's time on the thread without a link: the arm's host time inside its
  collectives (`time_ms.comm_busy`, the median of its runs without a link), split over the
  buckets in proportion to the bytes each sends (`comm.compression.bucket_bytes_sent`; without a
  compressor `comm.bucket_bytes`, in proportion to those), plus its compressor's own time in that
  bucket (`comm.compression.bucket_compress_ms`: it runs on the same thread);
- wire_b = the bytes bucket b puts on the busiest link x 8 / gbps: `link_bytes_per_step`
  (counted: with a node per rank every byte a rank sends, with shared links the node's
  crossings) split in the same proportion.

A bucket ready at backward's end gets its whole wire time added; one ready early whose host and
wire time both fit in what is left of backward adds nothing. The earlier model, step(arm, no
link) + link_bytes x 8 / gbps, is the case where nothing hides: an upper bound. Assumed: no
latency term (the studies' links have latency_us = 0); within a bucket the sleep adds to the
host's own sending (it hides under backward only, not under the bucket's other work nor under
waiting for a peer); backward as fast beside the thread as without it (no interference); the
ready fractions by FLOPs, not measured; the host time spread over the buckets as their bytes.

Its form was chosen after the 10 Gb/s miss of the change against fp32 in
docs/results/cpu-compression's one-bucket studies (n2-term), where the term is the earlier sum
exactly; the 1 MiB-bucket studies made after it (n2-buckets) are its test, and that page says
where it misses and what it leaves out (on a link backward runs faster, and part of the wire time
overlaps the host's own time in the collectives).

Compression pays where step(arm, link) < step(fp32, link): `breakeven_gbps` is the link speed
where the two meet (by bisection on 1 / gbps). Where nothing hides that is

    gbps  =  (bytes(fp32) - bytes(arm)) x 8 / (step(arm) - step(fp32))     (both without a link)

infinite when compressing costs no time at all, 0 when it saves no bytes.

The compression-compute term. The model above needs each arm run without a link first. With the
compressor's own time measured alone, one process, on random gradients of the run's bucket shapes
(`compress_alone_ms`: its collectives the identity, their time left out, as summary.json's
compress_ms leaves out the real ones), an arm is predicted from fp32's runs without a link, its
compressor's time and its bytes on fp32's thread, bucket by bucket:

    step(arm, link) = step(fp32, no link) + exposed(host_b + alone_b + wire_b) - exposed(host_b)

on the arm's own buckets (bf16 and fp16 cut fewer): host_b fp32's host time and alone_b =
compress_alone(arm), each split over them as their gradient bytes, backward fp32's, wire_b the
arm's counted bytes as above. With the compressor's time after backward's last bucket (one bucket,
as in the one-bucket studies) that is step(fp32) + compress_alone(arm) + the link term. It assumes
that fewer bytes over the host's own loopback save nothing worth counting (the host time is
fp32's) and that the compressor runs alone as fast as beside training (the same threads).
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from ddp_lab import buckets
from ddp_lab.compress import Ops
from ddp_lab.dist import seconds_per_byte
from ddp_lab.perf.step import schedule_times


def wire_ms(link_bytes: float, gbps: float) -> float:
    """Milliseconds the emulated link holds `link_bytes`; 0 without a link."""
    return link_bytes * seconds_per_byte(gbps) * 1e3


def split(total: float, weights: Sequence[float]) -> list[float]:
    """`total` shared over buckets in proportion to `weights` (evenly where they are all 0)."""
    whole = sum(weights)
    return [total * w / whole if whole else total / len(weights) for w in weights]


@dataclass(frozen=True)
class Thread:
    """One step's communication thread as measured without a link, bucket by bucket in the order
    backward fills them."""
    step_ms: float  # the step, without a link
    backward_ms: float  # its backward
    ready: tuple[float, ...]  # fraction of backward done when each bucket is ready
    busy_ms: tuple[float, ...]  # each bucket's time on it: its collectives' and compressor's

    def step_with(self, extra_ms: Sequence[float]) -> float:
        """The step with `extra_ms` more on the thread in each bucket: the measured step plus
        what that adds to the time exposed beyond backward."""
        assert len(extra_ms) == len(self.busy_ms), (len(extra_ms), len(self.busy_ms))
        more = [b + e for b, e in zip(self.busy_ms, extra_ms)]
        return self.step_ms + self._exposed_ms(more) - self._exposed_ms(self.busy_ms)

    def _exposed_ms(self, times_ms: Sequence[float]) -> float:
        return schedule_times(self.ready, self.backward_ms * 1e-3,
                              [t * 1e-3 for t in times_ms]).exposed_s * 1e3


def predict_step_ms(thread: Thread, link_bytes: Sequence[float], gbps: float,
                    compute_ms: Sequence[float] | None = None) -> float:
    """The step on a link of `gbps`: `thread`'s, with each bucket's `link_bytes` over the link (and
    its `compute_ms`: a compressor's, for an arm predicted from fp32's thread) on the thread."""
    compute_ms = compute_ms or [0.0] * len(link_bytes)
    return thread.step_with([c + wire_ms(b, gbps) for c, b in zip(compute_ms, link_bytes)])


def breakeven_gbps(arm_ms: Callable[[float], float], base_ms: Callable[[float], float],
                   saved_bytes: float) -> float:
    """The link speed (Gb/s) below which the arm's step is shorter than the base's (fp32), each
    given as the step (ms) on a link of gbps (0: none): inf where the arm is no slower without a
    link, 0 where it saves no bytes; else where the two meet, by bisection on 1 / gbps (the
    link's time grows with it; the arm's more slowly as it sends fewer bytes)."""
    if saved_bytes <= 0:
        return 0.0

    def slower(s: float) -> bool:  # on a link of 1 / s Gb/s
        return arm_ms(1 / s) > base_ms(1 / s)

    no_link = arm_ms(0.0) - base_ms(0.0)
    if math.isnan(no_link):
        return math.nan
    if no_link <= 0:
        return math.inf
    fast, slow = 0.0, 1.0  # 1 / gbps: the arm slower at `fast`, faster at `slow`
    while slower(slow):
        if slow > 1e30:  # no link slow enough: step times that do not grow with the bytes
            return 0.0
        fast, slow = slow, 2 * slow
    for _ in range(100):
        mid = (fast + slow) / 2
        fast, slow = (mid, slow) if slower(mid) else (fast, mid)
    return 1 / slow


def bucket_shapes(model: torch.nn.Module, bucket_mb: float) -> list[list[torch.Size]]:
    """The gradients' shapes in each of our syncs' buckets, as ddp_lab/sync/bucketed.py cuts them
    (backward order: the parameters reversed; one dtype)."""
    params = [p for p in model.parameters() if p.requires_grad][::-1]
    groups = buckets.plan([p.numel() * p.element_size() for p in params], bucket_mb, "ours")
    return [[params[i].shape for i in group] for group in groups]


def compress_alone_ms(compressor, shapes: list[list[torch.Size]], world_size: int,
                      steps: int = 5, warmup: int = 2, seed: int = 0) -> float:
    """`compressor`'s host time per step over buckets of `shapes` (bucket_shapes), measured here
    on random gradients: its collectives the identity (an all-gather: this rank's piece from each
    of `world_size` ranks), their own time left out. The median over `steps` after `warmup`."""
    spent = [0.0]

    def timed(fn):
        def run(*tensors):
            start = time.perf_counter()
            fn(*tensors)
            spent[0] += time.perf_counter() - start
        return run

    ops = Ops(world_size, timed(_sum_of_one), timed(_pieces_of_all))
    gen = torch.Generator().manual_seed(seed)
    numels = [sum(math.prod(s) for s in bucket) for bucket in shapes]
    per_step = []
    for _ in range(warmup + steps):
        spent[0], total = 0.0, 0.0
        for b, (bucket, numel) in enumerate(zip(shapes, numels)):
            grad = torch.randn(numel, generator=gen)
            start = time.perf_counter()
            compressor.reduce(b, grad, bucket, ops)
            total += time.perf_counter() - start
        per_step.append((total - spent[0]) * 1e3)
    return statistics.median(per_step[warmup:])


def _sum_of_one(t: torch.Tensor) -> None:
    """compress_alone_ms's all-reduce: leaves `t` as it is (a sum would be N t; what is timed,
    the compressor's compute, does not depend on the values)."""


def _pieces_of_all(mine: torch.Tensor, whole: torch.Tensor) -> None:
    """compress_alone_ms's all-gather: every rank's piece, each this one's."""
    whole.copy_(mine.repeat(whole.numel() // max(mine.numel(), 1)))
