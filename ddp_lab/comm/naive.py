"""naive all-reduce: everything through rank 0; and reduce-scatter and all-gather the same way.

Schedule (N ranks, tensor of S bytes, chunk None = the whole tensor):
    step 0  rank r > 0: send whole tensor to rank 0
            rank 0:     recv whole tensor from every rank 1..N-1 (all posted at once)
            rank 0 sums in rank order 0, 1, ..., N-1, in the tensor's dtype (N-1 roundings per
            element, as in a ring; a float32 accumulator for bfloat16 would round once but costs
            3-6x on CPU, and the native all-reduce does not do it either)
    step 1  rank 0:     send the sum to every rank 1..N-1 (all posted at once)
            rank r > 0: recv whole tensor from rank 0
Cost: 2 rounds; rank 0 sends (N-1)S and receives (N-1)S, every other rank sends S;
total 2(N-1)S (`cost("naive", S, N)`). Rank 0 needs N-1 receive buffers of S (`p2p.scratch`: on
the CPU kept across calls, and held between them).

reduce-scatter: step 0 as above (the same sums, in the same order); step 1 rank 0 sends chunk p
(torch.tensor_split's, N chunks) to rank p only. Rank 0 sends S - |chunk 0|, every other rank S.
all-gather: step 0 rank r > 0 sends its chunk r to rank 0, which receives each into place;
step 1 as above (rank 0 sends the whole tensor to every rank). Rank 0 sends (N-1)S.
Each moves NS - |chunk 0| bytes in total, (N - 1/N)S when N divides the count
(`cost("naive", S, N, op=...)`).
"""

from __future__ import annotations

import torch

from ddp_lab.comm.collective import COLLECTIVES, Collective
from ddp_lab.comm.p2p import Channel, scratch


def all_reduce_naive(flat: torch.Tensor, ch: Channel) -> None:
    _sum_at_root(flat, ch)
    _broadcast(flat, ch)


def reduce_scatter_naive(flat: torch.Tensor, ch: Channel) -> None:
    """Leave the sum of chunk r in `flat`'s chunk r (rank 0: the whole sum)."""
    _sum_at_root(flat, ch)
    chunks = torch.tensor_split(flat, ch.size)
    if ch.rank == 0:
        ch.exchange(1, sends=[(p, chunks[p], p) for p in range(1, ch.size)])
    else:
        ch.exchange(1, recvs=[(0, chunks[ch.rank], ch.rank)])


def all_gather_naive(flat: torch.Tensor, ch: Channel) -> None:
    """`flat`'s chunk r holds this rank's shard; fill in every other rank's."""
    chunks = torch.tensor_split(flat, ch.size)
    if ch.rank == 0:
        ch.exchange(0, recvs=[(p, chunks[p], p) for p in range(1, ch.size)])
    else:
        ch.exchange(0, sends=[(0, chunks[ch.rank], ch.rank)])
    _broadcast(flat, ch)


def scratch_numel(op: str, numel: int, n: int, rank: int, elem: int) -> int:
    """Receive scratch of one call: rank 0 takes N-1 whole tensors to sum (all_gather: none)."""
    return (n - 1) * numel if rank == 0 and op != "all_gather" else 0


COLLECTIVES.register("naive", Collective(all_reduce_naive, reduce_scatter_naive, all_gather_naive,
                                         scratch_numel))


def _sum_at_root(flat: torch.Tensor, ch: Channel) -> None:
    """Step 0: every rank's tensor to rank 0, summed there in rank order."""
    n = ch.size
    if ch.rank == 0:
        bufs = scratch(flat, flat.numel(), n - 1)
        ch.exchange(0, recvs=[(peer, bufs[peer - 1], None) for peer in range(1, n)])
        for b in bufs:
            flat.add_(b)
    else:
        ch.exchange(0, sends=[(0, flat, None)])


def _broadcast(flat: torch.Tensor, ch: Channel) -> None:
    """Step 1: rank 0's tensor to every other rank."""
    if ch.rank == 0:
        ch.exchange(1, sends=[(peer, flat, None) for peer in range(1, ch.size)])
    else:
        ch.exchange(1, recvs=[(0, flat, None)])
