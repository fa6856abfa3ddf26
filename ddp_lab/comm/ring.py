"""ring all-reduce: chunked reduce-scatter, then all-gather (bandwidth-optimal).

The tensor is cut into N chunks with `torch.tensor_split` (sizes differ by at most one element;
some are empty when numel < N). Rank r sends to right = r+1 and receives from left = r-1 (mod N);
each step's send and receive are posted together (`batch_isend_irecv`).

Schedule, all indices mod N:
    reduce-scatter, step s = 0 .. N-2:
        send chunk (r - s)     to   r+1
        recv chunk (r - s - 1) from r-1, added into the local chunk
        -> after N-1 steps rank r holds the full sum of chunk (r + 1)
    all-gather, step s = N-1 .. 2N-3 (t = s - (N-1)):
        send chunk (r + 1 - t) to   r+1
        recv chunk (r - t)     from r-1, copied into place
Cost: 2(N-1) steps; rank r sends every chunk but (r+1) in the reduce-scatter and every chunk but
(r+2) in the all-gather: 2S - |chunk r+1| - |chunk r+2| bytes, which is 2(N-1)S/N when N divides
the element count (`cost("ring", S, N)`) and never more than that plus two elements. Each chunk is
sent N-1 times in each phase, so the total is exactly 2(N-1)S.
"""

from __future__ import annotations

import torch

from ddp_lab.comm.p2p import Channel


def all_reduce_ring(flat: torch.Tensor, ch: Channel) -> None:
    n, r = ch.size, ch.rank
    right, left = (r + 1) % n, (r - 1) % n
    chunks = torch.tensor_split(flat, n)
    scratch = torch.empty_like(chunks[0])  # tensor_split puts the largest chunks first
    for s in range(n - 1):
        send_c, recv_c = (r - s) % n, (r - s - 1) % n
        buf = scratch[:chunks[recv_c].numel()]
        ch.exchange(s, sends=[(right, chunks[send_c], send_c)], recvs=[(left, buf, recv_c)])
        chunks[recv_c].add_(buf)
    for t in range(n - 1):
        send_c, recv_c = (r + 1 - t) % n, (r - t) % n
        ch.exchange(n - 1 + t, sends=[(right, chunks[send_c], send_c)],
                    recvs=[(left, chunks[recv_c], recv_c)])
