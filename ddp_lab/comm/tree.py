"""tree all-reduce: binomial-tree reduce to rank 0, then binomial-tree broadcast from rank 0.

Works for any N (not only powers of two). With L = ceil(log2 N) levels and d = 2^k:
    reduce, step k = 0 .. L-1:
        rank r with r mod 2d == d:             send whole (partial) tensor to r - d
        rank r with r mod 2d == 0, r + d < N:  recv whole tensor from r + d, add it
    broadcast, step L + j for j = 0 .. L-1 (level k = L-1-j, d = 2^k):
        rank r with r mod 2d == 0, r + d < N:  send whole tensor to r + d
        rank r with r mod 2d == d:             recv whole tensor from r - d
A rank takes part in the reduce until it has sent, and in the broadcast from when it received.
Cost: 2L steps. A rank sends S to its parent (all but rank 0) and S to each of its children
(rank 0 has L of them, a rank whose lowest set bit is k at most k < L), so rank 0 sends the most,
L*S; every rank but 0 sends S up once and every rank but 0 receives S down once, so the total is
exactly 2(N-1)S (`cost("tree", S, N)`).
Partial sums travel in the tensor's dtype (as in NCCL's tree).
"""

from __future__ import annotations

import math

import torch

from ddp_lab.comm.p2p import Channel


def levels(n: int) -> int:
    return math.ceil(math.log2(n)) if n > 1 else 0


def all_reduce_tree(flat: torch.Tensor, ch: Channel) -> None:
    n, r, L = ch.size, ch.rank, levels(ch.size)
    buf = None
    for k in range(L):
        d = 1 << k
        if r % (2 * d) == d:
            ch.exchange(k, sends=[(r - d, flat, None)])
        elif r % (2 * d) == 0 and r + d < n:
            if buf is None:
                buf = torch.empty_like(flat)
            ch.exchange(k, recvs=[(r + d, buf, None)])
            flat.add_(buf)
    del buf
    for j in range(L):
        d = 1 << (L - 1 - j)
        if r % (2 * d) == 0 and r + d < n:
            ch.exchange(L + j, sends=[(r + d, flat, None)])
        elif r % (2 * d) == d:
            ch.exchange(L + j, recvs=[(r - d, flat, None)])
