"""Our collectives, written on point-to-point send/recv: one public call, `all_reduce`.

    from ddp_lab import comm
    comm.all_reduce(tensor, "ring")            # in place, SUM over the (default) group
    comm.cost("ring", nbytes, world_size)      # the analytic cost, as data

Algorithms (each module documents its message schedule and cost):
    naive   ddp_lab/comm/naive.py   everything through rank 0: 2 rounds, 2(N-1)S through rank 0
    ring    ddp_lab/comm/ring.py    chunked reduce-scatter + all-gather: 2(N-1) steps, 2(N-1)S/N per rank
    tree    ddp_lab/comm/tree.py    binomial reduce + broadcast: 2*ceil(log2 N) steps, any N
    native  the backend's own dist.all_reduce: the reference the others are checked against
All of them go through ddp_lab/comm/p2p.py, which counts the bytes, can trace the schedule and
turns a dead peer or a timeout into a `CommError` naming the algorithm, step and peer.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ddp_lab.comm.cost import Cost, bus_bandwidth, cost
from ddp_lab.comm.naive import all_reduce_naive
from ddp_lab.comm.p2p import Channel, CommError, Recorder, recording
from ddp_lab.comm.ring import all_reduce_ring
from ddp_lab.comm.tree import all_reduce_tree

ALGORITHMS = {"naive": all_reduce_naive, "ring": all_reduce_ring, "tree": all_reduce_tree}
ALGOS = (*ALGORITHMS, "native")
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64,
          torch.int8, torch.uint8, torch.int32, torch.int64)


def all_reduce(tensor: torch.Tensor, algo: str, group=None) -> torch.Tensor:
    """Sum `tensor` over `group` (default: the world) in place with algorithm `algo`; return it.

    Every rank must call it with a tensor of the same shape and dtype, in the same order. The
    tensor must be contiguous and live where the group's backend works: CPU for gloo, this rank's
    current CUDA device for NCCL; anything else is a ValueError raised before any communication.
    """
    _check(tensor, algo, group)
    if tensor.numel() == 0 or dist.get_world_size(group) == 1:
        return tensor
    if algo == "native":
        try:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
        except Exception as e:  # noqa: BLE001
            raise CommError(f"native all-reduce failed on rank {dist.get_rank(group)}: "
                            f"{str(e).strip().splitlines()[0] if str(e).strip() else e!r}") from e
        return tensor
    with torch.no_grad():
        ALGORITHMS[algo](tensor.view(-1), Channel(algo, group))
    return tensor


def _check(tensor, algo: str, group) -> None:
    if algo not in ALGOS:
        raise ValueError(f"unknown all-reduce algorithm {algo!r}: expected one of {', '.join(ALGOS)}")
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"all_reduce needs a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in DTYPES:
        raise ValueError(f"all_reduce({algo}): dtype {tensor.dtype} is not supported "
                         f"(use one of {', '.join(str(d) for d in DTYPES)})")
    if not tensor.is_contiguous():
        raise ValueError(
            f"all_reduce({algo}) needs a contiguous tensor, got shape {tuple(tensor.shape)} with "
            f"strides {tensor.stride()}: reduce t.contiguous() and copy the result back")
    backend = str(dist.get_backend(group)).lower()
    dev = tensor.device
    if backend == "gloo" and dev.type != "cpu":
        raise ValueError(f"all_reduce({algo}) on a gloo group needs a CPU tensor, got one on {dev} "
                         f"(move it with .cpu(), or use an NCCL group for CUDA tensors)")
    if backend == "nccl":
        here = torch.cuda.current_device() if torch.cuda.is_available() else None
        if dev.type != "cuda" or dev.index != here:
            raise ValueError(f"all_reduce({algo}) on an NCCL group needs a tensor on this rank's "
                             f"device cuda:{here}, got one on {dev}")


__all__ = ["ALGOS", "Channel", "CommError", "Cost", "Recorder", "all_reduce", "bus_bandwidth",
           "cost", "recording"]
