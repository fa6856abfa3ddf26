"""ring all-reduce: chunked reduce-scatter, then all-gather (bandwidth-optimal), pipelined; and each
half on its own: `reduce_scatter_ring` and `all_gather_ring` are the same loop over fewer steps.

The tensor is cut into N chunks with `torch.tensor_split` (sizes differ by at most one element;
some are empty when numel < N). Rank r sends to right = r+1 and receives from left = r-1 (mod N).

Schedule, all indices mod N, step s = 0 .. 2N-3:
    send chunk (r - s)     to   r+1
    recv chunk (r - s - 1) from r-1
    reduce-scatter, s = 0 .. N-2: the chunk comes into scratch and is added into the local one
        -> after N-1 steps rank r holds the full sum of chunk (r + 1), which it sends next
    all-gather, s = N-1 .. 2N-3: the chunk is a full sum: received straight into place
(the all-gather's step t = s - (N-1) sends chunk (r + 1 - t) and receives chunk (r - t)).

Alone, each half runs one chunk earlier round the ring (every chunk index above minus one), so
that rank r ends the reduce-scatter owning chunk r and starts the all-gather from chunk r, as
`comm.reduce_scatter` / `comm.all_gather` define shards (chunk r is rank r's):
    reduce_scatter_ring, step s = 0 .. N-2:  send chunk (r - s - 1), recv chunk (r - s - 2), add
    all_gather_ring,     step t = 0 .. N-2:  send chunk (r - t),     recv chunk (r - t - 1)
The sum of chunk c is then made in the rank order c+1, c+2, ..., c (the all-reduce's: c, c+1,
..., c-1): the same additions at N = 2, another rounding order from N = 3 on.

Pipelining: every chunk is cut, again with tensor_split, into the same number m of slices, and
each step moves its chunks slice by slice, k = 0 .. m-1, one step after the other. Slice k's send
and receive are posted together (one `batch_isend_irecv`: on NCCL a paired send+recv must be one
group); only then is the slice posted before it waited for and, in the reduce-scatter, added
(two scratch slices, alternating). So one slice is in flight while the one before is added,
across step boundaries too: slice k of step s+1 sends what slice k of step s received, which has
landed by then when m >= 2. With m = 1 a step sends what the one before is still receiving, so
each slice lands before the next is posted (the ring without pipelining).
m = ceil(|chunk 0| / SLICE_BYTES), but at least 2 once |chunk 0| >= 2 * MIN_SLICE_BYTES (sizes in
bytes). Both ends of a transfer cut the same chunk, so they agree on its slices.
Traced as (step, op, peer, (chunk, slice)); empty slices are not sent.

Cost: 2(N-1) steps; rank r sends every chunk but (r+1) in the reduce-scatter and every chunk but
(r+2) in the all-gather: 2S - |chunk r+1| - |chunk r+2| bytes, which is 2(N-1)S/N when N divides
the element count (`cost("ring", S, N)`) and never more than that plus two elements. Each chunk is
sent N-1 times in each phase, so the total is exactly 2(N-1)S. Slices change the number of
messages (m per step), not the bytes. Alone, each half takes N-1 steps and rank r sends every
chunk but r (reduce-scatter) or every chunk but r+1 (all-gather): (N-1)S in total, (N-1)S/N per
rank when N divides the count (`cost("ring", S, N, op=...)`), half the all-reduce.

Scratch: two slices (`p2p.scratch`: kept across calls on the CPU, where a fresh buffer per call
paid a page fault per 4 KiB on first touch, a large share of the ring's CPU time).
"""

from __future__ import annotations

import torch

from ddp_lab.comm.collective import COLLECTIVES, Collective
from ddp_lab.comm.p2p import Channel, scratch

SLICE_BYTES = 4 << 20  # largest slice: gloo pays per message, so not smaller (measured)
MIN_SLICE_BYTES = 1 << 20  # smaller slices: a second message cost more than the overlap gave


def all_reduce_ring(flat: torch.Tensor, ch: Channel) -> None:
    _ring(flat, ch, range(2 * (ch.size - 1)), shift=0)


def reduce_scatter_ring(flat: torch.Tensor, ch: Channel) -> None:
    """Leave the sum of chunk r in `flat`'s chunk r (the rest of `flat` holds partial sums)."""
    _ring(flat, ch, range(ch.size - 1), shift=-1)


def all_gather_ring(flat: torch.Tensor, ch: Channel) -> None:
    """`flat`'s chunk r holds this rank's shard; fill in every other rank's."""
    _ring(flat, ch, range(ch.size - 1, 2 * (ch.size - 1)), shift=-1)


def scratch_numel(op: str, numel: int, n: int, rank: int, elem: int) -> int:
    """Receive scratch of one call (any op, any rank): two slices of the largest chunk."""
    chunk = -(-numel // n)
    return 2 * -(-chunk // slices_per_chunk(chunk, elem)) if n > 1 and numel else 0


COLLECTIVES.register("ring", Collective(all_reduce_ring, reduce_scatter_ring, all_gather_ring,
                                        scratch_numel))


def _ring(flat: torch.Tensor, ch: Channel, steps: range, shift: int) -> None:
    """The schedule's steps `steps` (traced from 0), every chunk index moved by `shift`."""
    n, r = ch.size, ch.rank
    right, left = (r + 1) % n, (r - 1) % n
    chunks = torch.tensor_split(flat, n)  # the largest first
    m = slices_per_chunk(chunks[0].numel(), flat.element_size())
    # two, each of the largest slice, as two tensors: indexing the pair would make a view a message
    bufs = scratch(flat, -(-chunks[0].numel() // m), 2).unbind()
    pending, i = None, 0  # the slice in flight; slices posted so far (alternates the scratch)
    for s in steps:
        reduce = s < n - 1
        send_c, recv_c = (r - s + shift) % n, (r - s - 1 + shift) % n
        sends, recvs = _cut(chunks[send_c], m), _cut(chunks[recv_c], m)
        for k in range(m):
            into = bufs[i % 2][:recvs[k].numel()] if reduce else recvs[k]
            posted = ch.post(s - steps.start, sends=[(right, sends[k], (send_c, k))],
                             recvs=[(left, into, (recv_c, k))])
            if pending is not None:
                _land(*pending)
            pending, i = (posted, recvs[k], into if reduce else None), i + 1
            if m == 1:  # the next step sends this very slice: it must land first
                _land(*pending)
                pending = None
    if pending is not None:
        _land(*pending)


def slices_per_chunk(numel: int, element_size: int) -> int:
    """m for a largest chunk of `numel` elements: slices of at most SLICE_BYTES, and at least two
    (something to overlap) once each of them still holds MIN_SLICE_BYTES."""
    nbytes = numel * element_size
    return max(-(-nbytes // SLICE_BYTES), 2 if nbytes >= 2 * MIN_SLICE_BYTES else 1)


def _land(posted, dst: torch.Tensor, received) -> None:
    """Wait for a slice; in the reduce-scatter (it came into scratch, `received`), add it."""
    posted.wait()
    if received is not None:
        dst.add_(received)


def _cut(chunk: torch.Tensor, m: int):
    return (chunk,) if m == 1 else torch.tensor_split(chunk, m)


