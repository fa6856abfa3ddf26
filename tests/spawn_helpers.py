"""Process groups in fresh processes for distributed unit tests (no torchrun).

Kept apart from helpers.py on purpose: every child process unpickles `_spawn_entry` and so imports
this module, and helpers.py imports Hydra and the whole training stack (~2 s per process on the
test machine); this module imports only what a child needs."""

from __future__ import annotations

import datetime
import faulthandler
import multiprocessing as mp
import os
import queue
import socket
import time
import traceback

# torch._dynamo: DDP imports it on first construction, 2-3 s per process otherwise.
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "ddp_lab.comm", "ddp_lab.sync"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(fn, world_size: int, *args, timeout: float = 120, pg_timeout_s: float = 60,
          final_barrier: bool = True, backend: str = "gloo") -> list:
    """Run `fn(rank, world_size, *args)` in `world_size` fresh processes that form one gloo group
    (backend="nccl": one CUDA device per rank, cuda:rank);
    return each rank's return value (None for a rank that died without returning).

    Processes fork from a forkserver that imported torch once, so a group starts in well under a
    second. A rank that raises fails the caller with that rank's traceback; a group still running
    after `timeout` seconds is killed and fails. `fn` must be a module-level (picklable) function."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    port, results = free_port(), ctx.Queue()
    procs = [ctx.Process(target=_spawn_entry, daemon=True,
                         args=(fn, rank, world_size, port, pg_timeout_s, final_barrier, backend, args,
                               results))
             for rank in range(world_size)]
    for p in procs:
        p.start()
    out, errors, deadline = [None] * world_size, [], time.monotonic() + timeout
    try:
        pending = world_size
        while pending:
            try:
                kind, rank, value = results.get(timeout=0.1)
            except queue.Empty:
                if time.monotonic() > deadline:
                    raise AssertionError(f"process group of {world_size} still running after "
                                         f"{timeout} s (a hang?); results so far: {out}"
                                         + "".join(f"\n{e}" for e in errors))
                if not any(p.is_alive() for p in procs) and results.empty():
                    break
                continue
            pending -= 1
            if kind == "ok":
                out[rank] = value
            else:
                errors.append(f"--- rank {rank} ---\n{value}")
        for p in procs:
            p.join(timeout=max(0.1, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    if errors:
        raise AssertionError("\n".join(errors))
    return out


def _spawn_entry(fn, rank, world_size, port, pg_timeout_s, final_barrier, backend, args,
                 results):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    faulthandler.enable()  # a crash in C++ (gloo, say) prints each thread's stack to stderr
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), OMP_NUM_THREADS="1")
    try:
        kwargs = {}
        if backend == "nccl":
            torch.cuda.set_device(rank)
            kwargs["device_id"] = torch.device("cuda", rank)
        dist.init_process_group(backend, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=pg_timeout_s), **kwargs)
        value = fn(rank, world_size, *args)
        if final_barrier:
            dist.barrier()  # nobody leaves while a peer may still read from it
        results.put(("ok", rank, value))
    except BaseException:  # noqa: BLE001 - reported to the parent
        results.put(("err", rank, traceback.format_exc()))
    results.close()
    results.join_thread()
    os._exit(0)  # skip process-group teardown: a test may have killed a peer on purpose
