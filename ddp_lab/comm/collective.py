"""What one algorithm is (`Collective`: its all-reduce and the two halves of it) and COLLECTIVES,
the registry every algorithm module adds itself to with one line beside its code:

    COLLECTIVES.register("ring", Collective(all_reduce_ring, reduce_scatter_ring, all_gather_ring,
                                            scratch_numel))

`ddp_lab.comm`'s `all_reduce` / `reduce_scatter` / `all_gather` check the tensors and resolve the
name here; each function then works in place on the flat tensor (N ranks, pieces as
torch.tensor_split cuts it into N):
    all_reduce      the sum, on every rank
    reduce_scatter  piece r of the sum in piece r, on rank r (the rest: scratch)
    all_gather      every rank's piece r in piece r, on every rank (rank r's piece r on entry)
and `scratch(op, numel, n, rank, elem)` says how many elements of receive scratch one call keeps
on rank r (ddp_lab/comm/p2p.py's `scratch`: kept per thread and dtype across calls on the CPU),
what the memory prediction adds for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ddp_lab.registry import Registry


@dataclass(frozen=True)
class Collective:
    all_reduce: Callable
    reduce_scatter: Callable
    all_gather: Callable
    scratch: Callable[[str, int, int, int, int], int]  # (op, numel, n, rank, elem) -> elements
    # Ours, written on the point-to-point layer: each function takes (flat, Channel) and every byte
    # goes through p2p.py. False: the backend's own collectives, (flat, process group).
    p2p: bool = True


COLLECTIVES = Registry("collective algorithm", "algo")
