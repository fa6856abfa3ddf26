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
"""

from __future__ import annotations

import math

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
