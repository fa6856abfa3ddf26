"""native: the backend's own collectives (NCCL's or gloo's), the reference ours are checked
against, behind the same in-place contract (ddp_lab/comm/collective.py).

reduce-scatter and all-gather use dist.reduce_scatter_single / all_gather_single where the pieces
are equal; uneven pieces, which they refuse, take an all-reduce (whose piece r is the answer) and
an all-gather of pieces padded to the largest. A failure becomes one `CommError` line, as ours do.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ddp_lab.comm.collective import COLLECTIVES, Collective
from ddp_lab.comm.p2p import CommError

_RS_SINGLE = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_AG_SINGLE = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def all_reduce_native(flat: torch.Tensor, group) -> None:
    _native("all-reduce", group, dist.all_reduce, flat)


def reduce_scatter_native(flat: torch.Tensor, group) -> None:
    n = dist.get_world_size(group)
    if flat.numel() % n:
        _native("reduce-scatter", group, dist.all_reduce, flat)
        return
    mine = torch.tensor_split(flat, n)[dist.get_rank(group)]
    out = torch.empty_like(mine)  # (never the input's own memory)
    _native("reduce-scatter", group, _RS_SINGLE, out, flat)
    mine.copy_(out)


def all_gather_native(flat: torch.Tensor, group) -> None:
    n = dist.get_world_size(group)
    mine = torch.tensor_split(flat, n)[dist.get_rank(group)].clone()
    if flat.numel() % n == 0:
        _native("all-gather", group, _AG_SINGLE, flat, mine)
        return
    # Uneven shards, which the backend refuses: gather shards padded to the largest, unpad.
    size = torch.tensor_split(flat, n)[0].numel()
    padded = flat.new_zeros(n * size)
    _native("all-gather", group, _AG_SINGLE, padded,
            torch.cat([mine, mine.new_zeros(size - mine.numel())]))
    for p, piece in enumerate(torch.tensor_split(flat, n)):
        piece.copy_(padded[p * size:p * size + piece.numel()])


COLLECTIVES.register("native", Collective(all_reduce_native, reduce_scatter_native,
                                          all_gather_native, lambda *_: 0, p2p=False))


def _native(what: str, group, fn, *tensors) -> None:
    try:
        fn(*tensors, group=group)
    except Exception as e:  # noqa: BLE001
        raise CommError(f"native {what} failed on rank {dist.get_rank(group)}: "
                        f"{str(e).strip().splitlines()[0] if str(e).strip() else e!r}") from e
