"""Gradient compression, one bucket at a time (`sync.compress`): what a bucket's gradients become
on their way between ranks, and what each rank keeps back for the next step.

    powersgd  a rank-r approximation M ~ P Q^T of every matrix (Vogels et al., NeurIPS 2019): one
              warm-started power-iteration step a step, P and Q all-reduced (ddp_lab/compress/
              powersgd.py). It is linear in M, so all-reducing P and Q sums what the all-reduce
              of the matrices would sum; vectors (biases) go uncompressed.
    topk      each rank's k largest |values| and their indices, all-gathered, summed where they
              land (ddp_lab/compress/topk.py). Not an all-reduce: two ranks pick different
              indices, a sum of sparse vectors has the union of their supports, and a ring would
              carry that growing union round; an all-gather carries k pairs from each rank.
    (none, bf16 and fp16 are the sync's own all-reduce, in the dtype sync.comm_dtype names.)

A compressor's `reduce(key, flat, shapes, ops)` takes one bucket (`flat`: this rank's gradients,
packed one parameter after the other; `shapes`: theirs) and leaves in `flat` the average over
the ranks of what the compressor let through, running its collectives through `ops` (the sync's
algorithm and group: every byte counted by ddp_lab.comm's Recorder). `key` names the bucket: a
compressor keeps state per bucket (error feedback, PowerSGD's Q) across steps, all of it in
`state_dict()` for checkpoints.

Error feedback (ddp_lab/compress/feedback.py): what compression left out of a rank's gradient is
kept and added to its next one, so that over T steps what was applied and what is still kept add
up to the gradients (`applied_1 + ... + applied_T + kept_T = g_1 + ... + g_T`).

sync=ddp runs torch's own powerSGD_hook instead; its state goes into checkpoints by parameter
(ddp_lab/compress/torch_powersgd.py).

Adding a compressor: a class with `reduce`, `state_dict`, `load_state_dict`, registered in
COMPRESSORS beside its code (`@COMPRESSORS.register("name")`).
"""

from __future__ import annotations

from ddp_lab.compress.base import COMPRESSORS, Compressor, Ops
from ddp_lab.compress import powersgd, topk  # noqa: F401,E402  (registered on import)

__all__ = ["COMPRESSORS", "Compressor", "Ops"]
