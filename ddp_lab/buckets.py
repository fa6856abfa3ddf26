"""How gradients are cut into buckets, in the order backward produces them: defined once, for the
syncs that cut them (ddp_lab/sync/bucketed.py) and for the model that prices them (ddp_lab/perf).

    ours  a gradient that would take a bucket past the cap starts the next one, so a gradient
          larger than the cap gets a bucket of its own (a cap of 0: a bucket per gradient)
    ddp   torch DDP's: a bucket closes once it holds at least the cap, its first one at
          DDP_FIRST_BUCKET_MB (a cap <= 0: one bucket for everything, as the simulation sweeps)

A gradient is never split, and a bucket never mixes two keys (ours: device and dtype).
"""

from __future__ import annotations

import math
from typing import Sequence

DEFAULT_BUCKET_MB = 25.0  # sync.bucket_mb's default: ours, and DDP's bucket_cap_mb
DDP_FIRST_BUCKET_MB = 1.0  # torch DDP's first bucket (dist._DEFAULT_FIRST_BUCKET_BYTES)
# Buffers ZeRO-2/3 pack their buckets into, lent in turn (ddp_lab/sync/zero.py's BufferPool), as
# large as the largest buckets: one bucket reduced on the communication thread while the next one
# packs. More would let backward run further ahead of a slow reduction, for a bucket's bytes each.
IN_FLIGHT = 2
MiB = 1 << 20
RULES = ("ours", "ddp")


def sync_rule(ddp: bool) -> tuple[str, float | None]:
    """(rule, first bucket MiB) of a sync's buckets: torch DDP's for sync=ddp, ours otherwise."""
    return ("ddp", DDP_FIRST_BUCKET_MB) if ddp else ("ours", None)


def plan(sizes: Sequence[int], bucket_mb: float, rule: str = "ours",
         first_bucket_mb: float | None = None, keys: Sequence | None = None) -> list[range]:
    """The buckets of gradients of `sizes` bytes each (backward order) as consecutive index
    ranges, cut by `rule` at `bucket_mb` MiB (see the module)."""
    if rule not in RULES:
        raise ValueError(f"unknown bucket rule {rule!r}: expected one of {', '.join(RULES)}")
    cap = bucket_mb * MiB if bucket_mb > 0 or rule == "ours" else math.inf
    first = first_bucket_mb * MiB if first_bucket_mb and rule == "ddp" else cap
    out, start, size = [], 0, 0
    for i, nbytes in enumerate(sizes):
        other_key = keys is not None and i > start and keys[i] != keys[i - 1]
        if i > start and (other_key or (rule == "ours" and size + nbytes > cap)):
            out.append(range(start, i))
            start, size = i, 0
        size += nbytes
        if rule == "ddp" and size >= (first if not out else cap):
            out.append(range(start, i + 1))
            start, size = i + 1, 0
    if start < len(sizes):
        out.append(range(start, len(sizes)))
    return out
