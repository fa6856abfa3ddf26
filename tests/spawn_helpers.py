"""Processes forked from one forkserver that imported torch, Hydra and ddp_lab once, so a test pays
for those imports once per session instead of once per process:

    spawn(fn, world_size, ...)          # a gloo process group running fn: distributed unit tests
    run_module(module, args, nproc=2)   # `torchrun -m module args` as torchrun would start it

Kept apart from helpers.py on purpose: every child unpickles its entry function and so imports
this module, which imports only what a child needs."""

from __future__ import annotations

import datetime
import faulthandler
import importlib
import multiprocessing as mp
import os
import queue
import signal
import socket
import sys
import tempfile
import time
import traceback
from multiprocessing.connection import wait
from types import SimpleNamespace

# What the forkserver imports before it forks anything. torch._dynamo: torch.optim and DDP import
# it on first use; torch.utils.tensorboard: every training run's logger.
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "torch.utils.tensorboard",
           "ddp_lab.comm", "ddp_lab.sync", "ddp_lab.train"]


def _forkserver():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # (only the first call, before the server starts, counts)
    return ctx


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
    ctx = _forkserver()
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


def run_module(module: str, args: list[str], nproc: int, env: dict, timeout: float, cwd: str):
    """`torchrun --standalone --nproc_per_node=nproc -m module args`, run as torchrun runs it but
    without its processes: each rank forks from the forkserver, takes the variables torchrun gives
    its workers (rank, world size, rendezvous address; rank 0 hosts the store) and `env`, and runs
    `module.main()` with `args` as its command line; nproc=0: one process as `python -m module
    args` runs it, without torchrun's variables. For the tests of what a run computes; the
    tests of the launcher itself (restarts, a hung or failed rank, the README's command) run
    torchrun. Variables read when torch is imported (TORCH_LOGS, say) keep the test process's
    values.

    A rank that fails stops the others, as torchrun's agent does; a job still running after
    `timeout` seconds is killed and fails the test with its output's tails. Returns, as
    helpers.run_cmd does, .returncode (0, or the first failed rank's), .stdout and .stderr (rank
    after rank) and .elapsed."""
    ctx, port, t0 = _forkserver(), free_port(), time.monotonic()
    with tempfile.TemporaryDirectory(prefix="ranks.") as logs:
        files = [(os.path.join(logs, f"{r}.out"), os.path.join(logs, f"{r}.err"))
                 for r in range(max(nproc, 1))]
        for path in sum(files, ()):
            open(path, "w").close()  # there to read even if a rank dies before it writes
        procs = [ctx.Process(target=_module_entry, args=(
                    module, args, {**env, **_torchrun_env(rank, nproc, port)}, *files[rank], cwd))
                 for rank in range(len(files))]
        for p in procs:
            p.start()
        try:
            returncode = _wait_ranks(procs, t0 + timeout)
        finally:
            for p in procs:
                _kill_group(p)
        stdout, stderr = ("".join(open(f[i]).read() for f in files) for i in (0, 1))
    if returncode is None:
        raise AssertionError(f"timed out after {timeout} s: {module} {args}\n{stdout[-3000:]}\n"
                             f"{stderr[-6000:]}")
    return SimpleNamespace(returncode=returncode, stdout=stdout, stderr=stderr,
                           elapsed=time.monotonic() - t0)


def _torchrun_env(rank: int, nproc: int, port: int) -> dict:
    """What torchrun --standalone sets for its worker `rank` on one node (less its agent's store);
    nothing for nproc=0."""
    if not nproc:
        return {}
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc),
            "LOCAL_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "TORCHELASTIC_RUN_ID": "test", "TORCHELASTIC_RESTART_COUNT": "0",
            "TORCHELASTIC_MAX_RESTARTS": "0"}


def _wait_ranks(procs, deadline: float) -> int | None:
    """The job's exit code once every rank has ended: 0, or the first failed rank's (the others
    are then terminated, as torchrun's agent does). None if ranks still run at `deadline`."""
    failed, pending = None, list(procs)
    while pending:
        if not wait([p.sentinel for p in pending], timeout=max(0.0, deadline - time.monotonic())):
            return None
        for p in [p for p in pending if not p.is_alive()]:
            pending.remove(p)
            if p.exitcode != 0 and failed is None:
                failed = p.exitcode
                for q in pending:
                    q.terminate()
    return failed or 0


def _kill_group(p) -> None:
    """Kill what is left of rank `p`: itself and its process group (a DataLoader's workers,
    Inductor's compile workers)."""
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if p.is_alive():
        p.kill()
    p.join()


def _module_entry(module, args, env, out_path, err_path, cwd):
    os.setsid()  # a process group of its own, for _kill_group
    for fd, path in ((1, out_path), (2, err_path)):
        f = os.open(path, os.O_WRONLY)
        os.dup2(f, fd)
        os.close(f)
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=True)  # what a killed rank printed still reaches the test
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    main = importlib.import_module(module)
    sys.argv = [main.__file__, *args]  # as `python -m module args` has it
    main.main()
