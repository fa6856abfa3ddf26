"""Process-group setup: the only module that reads torchrun's environment.

One process without torchrun is the same code with world size 1: it still gets a (single-member)
process group, so collectives, samplers and syncs never need an `if distributed` branch. Its group
meets in an in-process store, so a lone run (or many side by side) needs no TCP port.
"""

from __future__ import annotations

import datetime
import importlib
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ddp_lab.config import ConfigError


@dataclass(frozen=True)
class DistInfo:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    backend: str
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def env_ranks() -> tuple[int, int, int, int]:
    """(rank, local_rank, world_size, local_world_size) from torchrun's variables, or a lone process."""
    rank = int(os.environ.get("RANK", 0))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    return rank, local_rank, world_size, local_world_size


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_WORLD_SIZE" in os.environ


def choose_backend(requested: str, local_world_size: int) -> str:
    """auto -> NCCL when every local rank can have a CUDA device of its own, else gloo."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if requested == "auto":
        return "nccl" if gpus >= local_world_size and dist.is_nccl_available() else "gloo"
    if requested == "nccl":
        if gpus < local_world_size:
            raise ConfigError(
                f"dist.backend=nccl needs one CUDA device per local rank: {local_world_size} local "
                f"rank(s) but {gpus} CUDA device(s). Use dist.backend=gloo (CPU) or fewer processes "
                f"per node (--nproc_per_node<={gpus}).")
        if not dist.is_nccl_available():
            raise ConfigError("dist.backend=nccl: this torch build has no NCCL; use dist.backend=gloo")
    return requested


def init(backend: str = "auto", timeout_s: float = 300.0) -> DistInfo:
    """Create the default process group (world size 1 without torchrun) and pick this rank's device."""
    rank, local_rank, world_size, local_world_size = env_ranks()
    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if world_size > 1 and not under_torchrun() and missing:
        raise ConfigError(f"WORLD_SIZE={world_size} without torchrun needs {' and '.join(missing)} "
                          "set on every rank; launch with torchrun instead (README: Launching)")
    backend = choose_backend(backend, local_world_size)
    if backend == "nccl":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    kwargs = {"device_id": device} if backend == "nccl" else {}
    # Imported before the group exists, not after: a first import of torch._dynamo (which
    # torch.optim's first optimizer, DDP's constructor and torch.compile make) keeps ten
    # references to the default group where no destroy_process_group() reaches them. The group
    # then outlives cleanup(), and its gloo worker threads run into interpreter shutdown, where
    # one releasing a finished collective's tensors takes the GIL and aborts the process
    # ("terminate called without an active exception", SIGABRT after a successful run).
    # Imported first, cleanup() joins them.
    importlib.import_module("torch._dynamo")
    timeout = datetime.timedelta(seconds=timeout_s)
    store = (dist.HashStore() if world_size == 1 and not under_torchrun()
             else _restart_safe_store(world_size, local_world_size, timeout))
    if store is not None:
        kwargs["store"] = store
    dist.init_process_group(backend=backend, rank=rank, world_size=world_size, timeout=timeout,
                            **kwargs)
    return DistInfo(rank, local_rank, world_size, local_world_size, backend, device)


def _restart_safe_store(world_size: int, local_world_size: int, timeout):
    """torchrun (torch >= 2.5) shares its rendezvous TCPStore with the workers and keeps it across
    restarts, without a per-attempt prefix: a restarted group can read the previous attempt's
    gloo/NCCL addresses and fail to connect ("Connection refused", pytorch#135712). On one node
    every worker sees the same TORCHELASTIC_RESTART_COUNT, so scope the keys by it there. Across
    nodes the agents' counts can differ; there, launch torchrun with
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (a fresh store per attempt) when using --max-restarts."""
    if (os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
            or int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) == 0
            or world_size != local_world_size):
        return None
    base = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                         is_master=False, timeout=timeout)
    return dist.PrefixStore(f"ddp_lab/attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}",
                            base)


def cleanup() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def print0(*args, **kwargs) -> None:
    """print on global rank 0 only."""
    if int(os.environ.get("RANK", 0)) == 0:
        print(*args, **kwargs, flush=True)


def versions() -> dict:
    """torch / CUDA / NCCL versions and the devices in use: every run records how it was made."""
    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "hostname": socket.gethostname(),
            "cpu_count": os.cpu_count()}
    if torch.cuda.is_available():
        info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    info["nccl_env"] = {k: v for k, v in os.environ.items() if k.startswith("NCCL_")}
    return info
