"""naive all-reduce: everything through rank 0.

Schedule (N ranks, tensor of S bytes, chunk None = the whole tensor):
    step 0  rank r > 0: send whole tensor to rank 0
            rank 0:     recv whole tensor from every rank 1..N-1 (all posted at once)
            rank 0 sums in rank order 0, 1, ..., N-1, in the tensor's dtype (N-1 roundings per
            element, as in a ring; a float32 accumulator for bfloat16 would round once but costs
            3-6x on CPU, and the native all-reduce does not do it either)
    step 1  rank 0:     send the sum to every rank 1..N-1 (all posted at once)
            rank r > 0: recv whole tensor from rank 0
Cost: 2 rounds; rank 0 sends (N-1)S and receives (N-1)S, every other rank sends S;
total 2(N-1)S (`cost("naive", S, N)`). Rank 0 needs N-1 receive buffers of S.
"""

from __future__ import annotations

import torch

from ddp_lab.comm.p2p import Channel


def all_reduce_naive(flat: torch.Tensor, ch: Channel) -> None:
    n = ch.size
    if ch.rank == 0:
        bufs = [torch.empty_like(flat) for _ in range(n - 1)]
        ch.exchange(0, recvs=[(peer, bufs[peer - 1], None) for peer in range(1, n)])
        for b in bufs:
            flat.add_(b)
        del bufs
        ch.exchange(1, sends=[(peer, flat, None) for peer in range(1, n)])
    else:
        ch.exchange(0, sends=[(0, flat, None)])
        ch.exchange(1, recvs=[(0, flat, None)])
