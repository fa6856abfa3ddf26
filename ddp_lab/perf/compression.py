"""Compression's term: what a compressed arm's step should cost on a slower link, and the link
speed below which compression starts to pay. The smallest model that says it:

    step(arm, link) = step(arm, no link) + link_bytes(arm) x 8 / gbps

`step(arm, no link)` is measured (ddp_lab/bench/compression.py: the median of its runs without an
emulated link); it holds the compressor's own compute (summary.json's
`comm.compression.compress_ms`, the host time outside its collectives) and the host's part of
sending. The emulated link (ddp_lab/dist.py's dist.link) then holds every byte that crosses it
for bytes x beta (beta = 8 / (gbps 1e9) s a byte) on top: what this adds. `link_bytes` is what the
busiest link carries in a step (summary.json's `link_bytes_per_step`, counted): with a node per
rank (the study's default) every byte a rank sends; with shared links of several ranks (sync=hring
on `dist.node_size=G`, `dist.link.shared=true`) the node's crossings together. It assumes
none of that wait hides under backward (the link's waits run on the communication thread while
backward goes on, so some can: the prediction is then an upper bound) and no latency term (the
study's links have latency_us = 0).

Compression pays where step(arm, link) < step(fp32, link):

    step(arm) - step(fp32)  <  (bytes(fp32) - bytes(arm)) x 8 / gbps
    gbps  <  (bytes(fp32) - bytes(arm)) x 8 / (step(arm) - step(fp32))   = `breakeven_gbps`

(no link; infinite when compressing costs no time at all, 0 when it saves no bytes).

The compression-compute term. The model above needs each arm run without a link first. With the
compressor's own time measured alone, one process, on random gradients of the run's bucket shapes
(`compress_alone_ms`: its collectives the identity, their time left out, as summary.json's
compress_ms leaves out the real ones), an arm is predicted from fp32's step alone:

    step(arm, link) = step(fp32, no link) + compress_alone(arm) + link_bytes(arm) x 8 / gbps

It assumes the compressor's compute adds to the step whole (it runs on the communication thread,
mostly after backward's last bucket), that fewer bytes over the host's own loopback save nothing
worth counting, and that the compressor runs alone as fast as beside training (the same threads).
Its break-even speed is then `breakeven_gbps(step(fp32) + compress_alone(arm), ...)`.
"""

from __future__ import annotations

import math
import statistics
import time

import torch

from ddp_lab import buckets
from ddp_lab.compress import Ops
from ddp_lab.dist import seconds_per_byte


def wire_ms(link_bytes: float, gbps: float) -> float:
    """Milliseconds the emulated link holds `link_bytes`; 0 without a link."""
    return link_bytes * seconds_per_byte(gbps) * 1e3


def predict_step_ms(step_ms_no_link: float, link_bytes: float, gbps: float) -> float:
    """An arm's step at `gbps` from its own step without the link and the bytes its busiest link
    carries."""
    return step_ms_no_link + wire_ms(link_bytes, gbps)


def breakeven_gbps(step_ms: float, bytes_sent: float, base_step_ms: float,
                   base_bytes: float) -> float:
    """The link speed (Gb/s) below which the arm's step is shorter than the base's (fp32), both
    measured without a link: inf where the arm is no slower there, 0 where it saves no bytes."""
    saved = base_bytes - bytes_sent
    if saved <= 0:
        return 0.0
    extra_s = (step_ms - base_step_ms) / 1e3
    return math.inf if extra_s <= 0 else saved * 8 / extra_s / 1e9


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
