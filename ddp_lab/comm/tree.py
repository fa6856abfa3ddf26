"""tree all-reduce: binomial-tree reduce to rank 0, then binomial-tree broadcast from rank 0; and
reduce-scatter and all-gather on the same tree.

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

The subtree of rank r (all but the root) is the ranks r .. min(r + lowbit(r), N) - 1: contiguous,
so with torch.tensor_split's N chunks (chunk p is rank p's) its chunks are one contiguous piece of
the tensor, traced with the label range(r, end).
    reduce-scatter: the reduce above (the same sums, in the same order), then a scatter on the
        broadcast's steps: instead of the whole tensor, a parent sends a child only the chunks of
        the child's subtree. Each chunk c travels down popcount(c) levels.
    all-gather: a gather on the reduce's steps: a child sends its parent the chunks of its own
        subtree, received into place (no adding); then the broadcast above.
Cost, each: 2L steps; the whole-tensor half moves (N-1)S, the chunked half sum_c popcount(c)
|chunk c| (L*S/2 when N = 2^L and N divides the count; `cost("tree", S, N, op=...)`).
"""

from __future__ import annotations

import math

import torch

from ddp_lab.comm.collective import COLLECTIVES, Collective
from ddp_lab.comm.p2p import Channel, scratch


def levels(n: int) -> int:
    return math.ceil(math.log2(n)) if n > 1 else 0


def subtree(r: int, n: int) -> range:
    """The ranks of r's subtree (r > 0): r and its descendants."""
    return range(r, min(r + (r & -r), n))


def all_reduce_tree(flat: torch.Tensor, ch: Channel) -> None:
    _reduce(flat, ch)
    _broadcast(flat, ch)


def reduce_scatter_tree(flat: torch.Tensor, ch: Channel) -> None:
    """Leave the sum of chunk r in `flat`'s chunk r (rank 0: the whole sum)."""
    _reduce(flat, ch)
    _down(flat, ch, scatter=True)


def all_gather_tree(flat: torch.Tensor, ch: Channel) -> None:
    """`flat`'s chunk r holds this rank's shard; fill in every other rank's."""
    n, r = ch.size, ch.rank
    pieces = _pieces(flat, n)
    for k in range(levels(n)):
        d = 1 << k
        if r % (2 * d) == d:
            ch.exchange(k, sends=[(r - d, pieces(subtree(r, n)), subtree(r, n))])
        elif r % (2 * d) == 0 and r + d < n:
            ch.exchange(k, recvs=[(r + d, pieces(subtree(r + d, n)), subtree(r + d, n))])
    _broadcast(flat, ch)


def scratch_numel(op: str, numel: int, n: int, rank: int, elem: int) -> int:
    """Receive scratch of one call: a rank with a child (even, not the last) takes its partial
    sums into one whole-tensor buffer (all_gather receives into place: none)."""
    return numel if op != "all_gather" and rank % 2 == 0 and rank + 1 < n else 0


COLLECTIVES.register("tree", Collective(all_reduce_tree, reduce_scatter_tree, all_gather_tree,
                                        scratch_numel))


def _reduce(flat: torch.Tensor, ch: Channel) -> None:
    """Steps 0 .. L-1: partial sums up the tree, the whole sum at rank 0."""
    n, r = ch.size, ch.rank
    buf = None
    for k in range(levels(n)):
        d = 1 << k
        if r % (2 * d) == d:
            ch.exchange(k, sends=[(r - d, flat, None)])
        elif r % (2 * d) == 0 and r + d < n:
            if buf is None:
                buf = scratch(flat, flat.numel(), 1)[0]
            ch.exchange(k, recvs=[(r + d, buf, None)])
            flat.add_(buf)


def _broadcast(flat: torch.Tensor, ch: Channel) -> None:
    _down(flat, ch, scatter=False)


def _down(flat: torch.Tensor, ch: Channel, scatter: bool) -> None:
    """Steps L .. 2L-1, from rank 0 down the tree: the whole tensor (broadcast), or to each child
    the chunks of its subtree (scatter)."""
    n, r, L = ch.size, ch.rank, levels(ch.size)
    pieces = _pieces(flat, n)

    def what(child: int):
        return (pieces(subtree(child, n)), subtree(child, n)) if scatter else (flat, None)

    for j in range(L):
        d = 1 << (L - 1 - j)
        if r % (2 * d) == 0 and r + d < n:
            ch.exchange(L + j, sends=[(r + d, *what(r + d))])
        elif r % (2 * d) == d:
            ch.exchange(L + j, recvs=[(r - d, *what(r))])


def _pieces(flat: torch.Tensor, n: int):
    """ranks -> the contiguous piece of `flat` that holds their chunks."""
    q, extra = divmod(flat.numel(), n)  # tensor_split: the first `extra` chunks one longer
    bounds = [c * q + min(c, extra) for c in range(n + 1)]
    return lambda ranks: flat[bounds[ranks.start]:bounds[ranks.stop]]
