"""hring: the two-level all-reduce (Horovod's hierarchical algorithm). N = M*G ranks sit on M
nodes of G consecutive ranks (ddp_lab.dist's `nodes()`: dist.node_size); rank r = m*G + l is
local rank l of node m.

    1. reduce-scatter inside each node (a ring of G): local rank l ends with its node's sum of
       piece l of G;
    2. all-reduce of piece l across nodes (a ring of M: the ranks with local rank l, one on each
       node); the G rings run side by side, each carrying 1/G of the tensor;
    3. all-gather inside each node (a ring of G): every rank gets every piece.

Each node's link to the others then carries 2(M-1)/M * S, all G rings together; the flat ring's
one crossing per node carries 2(N-1)/N * S: at 2 nodes of 4, 1.0 S against 1.75 S
(`node_link_bytes`, ddp_lab/perf/collectives.py). Inside a node a rank moves 2(G-1)/G * S, as a
ring of G does. Sums are made in another order than the flat ring's: equal up to rounding, and
bitwise on integer-valued data.

The levels run on subgroups from torch.distributed.new_subgroups (the nodes) and
new_subgroups_by_enumeration (across nodes), made once (ddp_lab.dist's `node_groups`), through
channels of their own: every byte is counted, and held by the emulated link, as the ring's are.
One node (G = N) or one rank a node (G = 1) leaves one level: the flat ring itself, the same
schedule and the same bits.

reduce_scatter and all_gather: rank r's shard is chunk r of N (ddp_lab.comm's contract), so the
piece local rank l reduces inside its node must hold chunks l, G+l, 2G+l, ...: every G-th chunk.
They are copied into a permuted tensor, piece after piece (allocated per call: only ZeRO runs
these), the levels run on it, and the shard (or everything) is copied back. The permuted pieces
are exactly what torch.tensor_split cuts it into, uneven sizes included: of the R larger chunks
(numel mod N of them, the first), piece l holds the ones with m*G + l < R, floor(R/G) + [l < R mod
G] of them, as tensor_split gives piece l of G, and they come first within it, as tensor_split
cuts piece l into M.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ddp_lab.comm import ring
from ddp_lab.comm.collective import COLLECTIVES, Collective
from ddp_lab.comm.p2p import Channel
from ddp_lab.dist import node_groups, nodes


def _or_ring(flat_ring):
    """Make a two-level function `f(flat, ch, node, across)` a collective `(flat, ch)` that runs
    `flat_ring` on `ch` where there is one level (G = 1, or one node)."""
    def collective(two_levels):
        def run(flat: torch.Tensor, ch: Channel) -> None:
            levels = _levels(ch)
            if levels is None:
                flat_ring(flat, ch)
            else:
                two_levels(flat, ch, *levels)
        run.__name__ = run.__qualname__ = two_levels.__name__
        run.__doc__ = two_levels.__doc__
        return run
    return collective


@_or_ring(ring.all_reduce_ring)
def all_reduce_hring(flat: torch.Tensor, ch: Channel, node: Channel, across: Channel) -> None:
    ring.reduce_scatter_ring(flat, node)
    ring.all_reduce_ring(torch.tensor_split(flat, node.size)[node.rank], across)
    ring.all_gather_ring(flat, node)


@_or_ring(ring.reduce_scatter_ring)
def reduce_scatter_hring(flat: torch.Tensor, ch: Channel, node: Channel,
                         across: Channel) -> None:
    """Leave the sum of chunk r in `flat`'s chunk r (the rest of `flat` is left as it was)."""
    permuted = torch.cat(_chunks_in_piece_order(flat, ch.size, node.size))
    ring.reduce_scatter_ring(permuted, node)
    piece = torch.tensor_split(permuted, node.size)[node.rank]
    ring.reduce_scatter_ring(piece, across)
    torch.tensor_split(flat, ch.size)[ch.rank].copy_(
        torch.tensor_split(piece, across.size)[across.rank])


@_or_ring(ring.all_gather_ring)
def all_gather_hring(flat: torch.Tensor, ch: Channel, node: Channel, across: Channel) -> None:
    """`flat`'s chunk r holds this rank's shard; fill in every other rank's."""
    permuted = torch.empty_like(flat)
    piece = torch.tensor_split(permuted, node.size)[node.rank]
    torch.tensor_split(piece, across.size)[across.rank].copy_(
        torch.tensor_split(flat, ch.size)[ch.rank])
    ring.all_gather_ring(piece, across)
    ring.all_gather_ring(permuted, node)
    order = _chunks_in_piece_order(flat, ch.size, node.size)
    for chunk, part in zip(order, torch.split(permuted, [c.numel() for c in order])):
        chunk.copy_(part)


def scratch_numel(op: str, numel: int, n: int, rank: int, elem: int) -> int:
    """Receive scratch one call keeps (the rings' buffer, grown to the larger level's): a ring of
    G over the whole tensor, then one of M over this rank's piece."""
    g = nodes().size
    if g in (1, n):
        return ring.scratch_numel(op, numel, n, rank, elem)
    piece = numel // g + (rank % g < numel % g)  # tensor_split's piece l of G
    return max(ring.scratch_numel(op, numel, g, rank % g, elem),
               ring.scratch_numel(op, piece, n // g, rank // g, elem))


COLLECTIVES.register("hring", Collective(all_reduce_hring, reduce_scatter_hring, all_gather_hring,
                                         scratch_numel))


def _levels(ch: Channel) -> tuple[Channel, Channel] | None:
    """Channels on this rank's node and across nodes; None where there is one level."""
    layout = nodes()
    if layout.size in (1, ch.size):
        return None
    if ch.group not in (None, dist.group.WORLD) or ch.size != layout.size * layout.count:
        raise ValueError(f"hring runs over the whole world, whose {layout.count} nodes of "
                         f"{layout.size} ranks it knows (dist.node_size), not a group of "
                         f"{ch.size} ranks")
    node, across = node_groups()
    return Channel(ch.algo, node, ch.op), Channel(ch.algo, across, ch.op)


def _chunks_in_piece_order(flat: torch.Tensor, n: int, g: int) -> list[torch.Tensor]:
    """flat's N chunks, every G-th together: l, G+l, 2G+l, ... for l = 0 .. G-1."""
    chunks = torch.tensor_split(flat, n)
    return [chunks[m * g + l] for l in range(g) for m in range(n // g)]
