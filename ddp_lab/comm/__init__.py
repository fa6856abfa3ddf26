"""Our collectives, written on point-to-point send/recv: `all_reduce`, and its two halves
`reduce_scatter` and `all_gather` (what ZeRO runs on: ddp_lab/sync/zero.py).

    from ddp_lab import comm
    comm.all_reduce(tensor, "ring")                 # in place, SUM over the (default) group
    comm.reduce_scatter(tensor, shard, "ring")      # shard = rank r's piece of the sum
    comm.all_gather(shard, tensor, "ring")          # every rank's shard, in rank order
    comm.cost("ring", nbytes, world_size)           # the analytic cost, as data (op=...)

Shards are what `torch.tensor_split(tensor.view(-1), N)` makes (`comm.shard`): sizes differ by at
most one element, the larger first, and rank r's is piece r.

Algorithms (each module documents its message schedule and cost):
    naive   ddp_lab/comm/naive.py   everything through rank 0: 2 rounds, 2(N-1)S through rank 0
    ring    ddp_lab/comm/ring.py    chunked reduce-scatter + all-gather: 2(N-1) steps, 2(N-1)S/N per rank
    tree    ddp_lab/comm/tree.py    binomial reduce + broadcast: 2*ceil(log2 N) steps, any N
    hring   ddp_lab/comm/hring.py   two levels: ring inside each node, rings across nodes (Horovod's)
    native  ddp_lab/comm/native.py  the backend's own: the reference the others are checked against
Each module registers its three collectives in COLLECTIVES (ddp_lab/comm/collective.py, which
states their contract); ALGOS names them all, OURS the ones written here. Ours go through
ddp_lab/comm/p2p.py, which counts the bytes, can trace the schedule and turns a dead peer or a
timeout into a `CommError` naming the algorithm, step and peer.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ddp_lab.perf.collectives import Cost, bus_bandwidth, cost
from ddp_lab.comm import naive, ring, tree, hring
from ddp_lab.comm.p2p import Channel, CommError, Recorder, kept_scratch, recording
# Imported, so registered, after ours: listings (ALGOS, error messages) show the reference last.
from ddp_lab.comm import native  # noqa: E402,F401
from ddp_lab.comm.collective import COLLECTIVES

ALGOS = COLLECTIVES.names()
OURS = tuple(a for a in ALGOS if COLLECTIVES[a].p2p)  # each one a sync too (sync/bucketed.py)
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
    _run("all_reduce", tensor.view(-1), algo, group)
    return tensor


def scratch_numel(algo: str, op: str, numel: int, world_size: int, rank: int, elem: int) -> int:
    """Elements of receive scratch one `op` of `numel` elements (of `elem` bytes) keeps on `rank`
    (the backend's own: none that we hold)."""
    if world_size == 1 or numel == 0:
        return 0
    return COLLECTIVES[algo].scratch(op, numel, world_size, rank, elem)


def shard(tensor: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank `rank`'s shard of `tensor`: a flat view, piece `rank` of torch.tensor_split, cut
    directly (tensor_split makes all N views: O(N) a call, milliseconds at N=1024)."""
    q, extra = divmod(tensor.numel(), world_size)  # the first `extra` pieces one element longer
    start = rank * q + min(rank, extra)
    return tensor.view(-1)[start:start + q + (rank < extra)]


def reduce_scatter(input: torch.Tensor, output: torch.Tensor, algo: str,
                   group=None) -> torch.Tensor:
    """Sum `input` over `group` and put this rank's shard of the sum (`shard(sum, rank, N)`) into
    `output`; return `output`. `input` is a working buffer, its contents afterwards unspecified
    (ours leave partial sums there); `output` may be its own shard, a view of it. Same rules as
    `all_reduce`."""
    n, r = _check_pair(input, output, algo, group, "reduce_scatter", output_is_shard=True)
    if n > 1 and input.numel():
        _run("reduce_scatter", input.view(-1), algo, group)
    mine = shard(input, r, n)
    if mine.data_ptr() != output.data_ptr():
        output.view(-1).copy_(mine)
    return output


def all_gather(input: torch.Tensor, output: torch.Tensor, algo: str, group=None) -> torch.Tensor:
    """Every rank's shard (`input` holds this rank's: `shard(output, rank, N)`'s size) into
    `output`, in rank order; return `output`. `input` may be its own shard of `output`."""
    n, r = _check_pair(output, input, algo, group, "all_gather", output_is_shard=False)
    mine = shard(output, r, n)
    if mine.data_ptr() != input.data_ptr():
        mine.copy_(input.view(-1))
    if n == 1 or output.numel() == 0:
        return output
    _run("all_gather", output.view(-1), algo, group)
    return output


def _run(op: str, flat: torch.Tensor, algo: str, group) -> None:
    """`algo`'s `op` on `flat`, in place: ours through a Channel (every byte counted, a failure
    named by step and peer), the backend's own on the group."""
    collective = COLLECTIVES[algo]
    with torch.no_grad():
        where = Channel(algo, group, op.replace("_", "-")) if collective.p2p else group
        getattr(collective, op)(flat, where)


def _check_pair(full, part, algo: str, group, name: str, output_is_shard: bool):
    """Both tensors pass `all_reduce`'s checks, share a dtype, and `part` is the size of this
    rank's shard of `full`."""
    _check(full, algo, group, name)
    _check(part, algo, group, name)
    n, r = dist.get_world_size(group), dist.get_rank(group)
    want = shard(full, r, n).numel()
    if part.dtype != full.dtype or part.numel() != want:
        which = "output" if output_is_shard else "input"
        raise ValueError(f"{name}({algo}): {which} must be rank {r}'s shard of {full.numel()} "
                         f"elements over {n} ranks ({want} elements of {full.dtype}), got "
                         f"{part.numel()} of {part.dtype}")
    return n, r


def _check(tensor, algo: str, group, name: str = "all_reduce") -> None:
    if algo not in COLLECTIVES:
        what = name.replace("_", "-")
        raise ValueError(f"unknown {what} algorithm {algo!r}: expected one of "
                         f"{', '.join(COLLECTIVES)}")
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name} needs a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in DTYPES:
        raise ValueError(f"{name}({algo}): dtype {tensor.dtype} is not supported "
                         f"(use one of {', '.join(str(d) for d in DTYPES)})")
    if not tensor.is_contiguous():
        raise ValueError(
            f"{name}({algo}) needs a contiguous tensor, got shape {tuple(tensor.shape)} with "
            f"strides {tensor.stride()}: reduce t.contiguous() and copy the result back")
    backend = str(dist.get_backend(group)).lower()
    dev = tensor.device
    if backend == "gloo" and dev.type != "cpu":
        raise ValueError(f"{name}({algo}) on a gloo group needs a CPU tensor, got one on {dev} "
                         f"(move it with .cpu(), or use an NCCL group for CUDA tensors)")
    if backend == "nccl":
        here = torch.cuda.current_device() if torch.cuda.is_available() else None
        if dev.type != "cuda" or dev.index != here:
            raise ValueError(f"{name}({algo}) on an NCCL group needs a tensor on this rank's "
                             f"device cuda:{here}, got one on {dev}")


__all__ = ["ALGOS", "COLLECTIVES", "Channel", "CommError", "Cost", "OURS", "Recorder", "all_gather",
           "all_reduce", "bus_bandwidth", "cost", "recording", "reduce_scatter", "shard"]
