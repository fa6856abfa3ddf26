"""Every way a test starts processes. Each is killed whole at its timeout, so a distributed bug
fails the test instead of hanging CI:

    ranks(args, nproc=2, module="ddp_lab.train")  the ranks of `torchrun -m module args`, forked
    spawn(fn, world_size, *args)                   fn(rank, world_size, *args) on forked ranks in one
                                                   gloo group: the distributed unit tests
    torchrun(args, nproc=2, launcher_args=None)    torchrun itself
    python_module(args, module) / run_cmd(cmd)     one plain process: the CLI's errors, scripts

`ranks` and `spawn` are one mechanism with two entry points (a module's main() reports by its
exit code and output, as under torchrun; a function hands back what it returns). Each rank forks
from one forkserver that imported torch, Hydra and ddp_lab once per session: a 2-rank job costs
~1.5 s instead of torchrun's ~8.6 s (docs/results/test-suite-time). A forked rank gets what
torchrun gives its workers: the same variables (test_launchers.py compares them with torchrun's),
a store hosted by the launching process as torchrun's agent hosts one for its workers, and the
intra-op thread count OMP_NUM_THREADS asks for. A failed rank ends a module's job as torchrun's
agent ends it. Real torchrun is for what its agent does: restarts, ending a hung job, nodes
meeting at a rendezvous, the README's command.

Every forked child unpickles its entry function and so imports this module: it imports only what
a child needs."""

from __future__ import annotations

import datetime
import faulthandler
import importlib
import multiprocessing as mp
import os
import queue
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
from multiprocessing.connection import wait
from types import SimpleNamespace

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# What the forkserver imports before it forks anything. torch._dynamo: torch.optim and DDP import
# it on first use; torch.utils.tensorboard: every training run's logger.
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "torch.utils.tensorboard",
           "ddp_lab.comm", "ddp_lab.sync", "ddp_lab.train"]


def env(**extra) -> dict:
    """The environment of every launch: this process's, one OpenMP thread (the launches share 2
    cores with each other and the test process), no rendezvous variables of this process's."""
    e = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for k in ("RANK", "MASTER_ADDR", "MASTER_PORT"):
        e.pop(k, None)
    e.update(extra)
    return e


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- plain processes: torchrun, python -m, scripts --------------------------------------------

def run_cmd(cmd: list[str], timeout: float, extra_env=None, cwd: str = REPO):
    """Run `cmd` to completion in a session of its own, from the repo root. On timeout the whole
    process group is killed (torchrun's workers, a script's children: nothing outlives the test,
    and nothing holds the output pipes open) and the test fails with the output's tails. Returns
    .returncode, .stdout, .stderr and .elapsed (seconds)."""
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env(**(extra_env or {})), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"timed out after {timeout} s: {cmd}\n{out[-3000:]}\n{err[-6000:]}")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # stragglers of a failed job
        except ProcessLookupError:
            pass
    return SimpleNamespace(returncode=proc.returncode, stdout=out, stderr=err,
                           elapsed=time.monotonic() - t0)


def python_module(args: list[str], module: str = "ddp_lab.train", timeout: float = 240,
                  extra_env=None):
    """`python -m module args` in a fresh interpreter (what a user types, start-up included)."""
    return run_cmd([sys.executable, "-m", module, *args], timeout, extra_env)


def torchrun(args: list[str], nproc: int = 2, timeout: float = 240, extra_env=None,
             launcher_args: list[str] | None = None, module: str = "ddp_lab.train"):
    """`torchrun --standalone --nproc_per_node=nproc -m module args` (or `launcher_args` in place
    of torchrun's own arguments), to completion or killed at `timeout`."""
    launcher = launcher_args or ["--standalone", f"--nproc_per_node={nproc}"]
    return run_cmd([sys.executable, "-m", "torch.distributed.run", *launcher, "-m", module, *args],
                   timeout, extra_env)


# ---- forked ranks -----------------------------------------------------------------------------

def ranks(args: list[str], nproc: int = 2, timeout: float = 240, extra_env=None,
          module: str = "ddp_lab.train"):
    """What `torchrun(args, nproc, ...)` computes, each rank forked and running `module.main()`
    with `args` as its command line; nproc=0: one process as `python -m module args` runs it,
    without torchrun's variables. Returns what run_cmd does: .returncode (0, or the first failed
    rank's), .stdout and .stderr (rank after rank), .elapsed. Variables read when torch is
    imported (TORCH_LOGS, say) keep the forkserver's values."""
    t0 = time.monotonic()
    with _Forked(nproc, env(**(extra_env or {}))) as job:
        job.start(_run_module, module, args)
        returncode = job.wait_exits(t0 + timeout)
        stdout, stderr = job.output()
    if returncode is None:
        raise AssertionError(f"timed out after {timeout} s: {module} {args}\n{stdout[-3000:]}\n"
                             f"{stderr[-6000:]}")
    return SimpleNamespace(returncode=returncode, stdout=stdout, stderr=stderr,
                           elapsed=time.monotonic() - t0)


def spawn(fn, world_size: int, *args, timeout: float = 120, pg_timeout_s: float = 60,
          final_barrier: bool = True, backend: str = "gloo") -> list:
    """Run `fn(rank, world_size, *args)` on `world_size` forked ranks that form one process group
    (backend="nccl": one CUDA device per rank, cuda:rank); return each rank's return value (None
    for a rank that ended without returning: a test may kill a peer on purpose, and the others go
    on). A rank that raises fails the caller with its traceback; a group still running after
    `timeout` seconds is killed and fails. `fn` must be a module-level (picklable) function."""
    with _Forked(world_size, env()) as job:
        results = job.ctx.Queue()
        job.start(_run_function, fn, args, pg_timeout_s, final_barrier, backend, results)
        returned, errors, ended = _collect(results, job.procs, time.monotonic() + timeout)
        _, stderr = job.output()
    if not ended:
        raise AssertionError(f"process group of {world_size} still running after {timeout} s "
                             f"(a hang?); results so far: {returned}" + "".join(
                                 f"\n{e}" for e in errors) + f"\n{stderr[-6000:]}")
    if errors:
        raise AssertionError("\n".join(errors) + f"\n{stderr[-3000:]}")
    return returned


class _Forked:
    """One job of forked ranks: their store (as torchrun's agent hosts it), their output files,
    and on exit every process they started, killed."""

    def __init__(self, nproc: int, base_env: dict):
        self.ctx = mp.get_context("forkserver")
        self.ctx.set_forkserver_preload(PRELOAD)  # (only the first call, before the server starts)
        self.nproc, self.base_env, self.procs = nproc, base_env, []
        self.logs = tempfile.TemporaryDirectory(prefix="ranks.")
        self.store = _agent_store() if nproc else None
        self.run_id = str(uuid.uuid4())

    def start(self, entry, *entry_args) -> None:
        for rank in range(max(self.nproc, 1)):
            out, err = self._log(rank, "out"), self._log(rank, "err")
            for path in (out, err):
                open(path, "w").close()  # there to read even if a rank dies before it writes
            p = self.ctx.Process(target=_rank_main, args=(
                self._env(rank), out, err, entry, (rank, self.nproc, *entry_args)))
            p.start()
            self.procs.append(p)

    def _env(self, rank: int) -> dict:
        if not self.nproc:
            return self.base_env
        return {**self.base_env, **_worker_env(rank, self.nproc, self.store.port, self.run_id,
                                               self._log(rank, "error.json"), self.base_env)}

    def _log(self, rank: int, what: str) -> str:
        return os.path.join(self.logs.name, f"{rank}.{what}")

    def wait_exits(self, deadline: float) -> int | None:
        """The job's exit code once every rank has ended: 0, or the first failed rank's (the
        others are then terminated, as torchrun's agent does). None if ranks still run at
        `deadline`."""
        failed, pending = None, list(self.procs)
        while pending:
            if not wait([p.sentinel for p in pending],
                        timeout=max(0.0, deadline - time.monotonic())):
                return None
            for p in [p for p in pending if not p.is_alive()]:
                pending.remove(p)
                if p.exitcode != 0 and failed is None:
                    failed = p.exitcode
                    for q in pending:
                        q.terminate()
        return failed or 0

    def output(self) -> tuple[str, str]:
        """(stdout, stderr), rank after rank."""
        return tuple("".join(open(self._log(r, what)).read() for r in range(len(self.procs)))
                     for what in ("out", "err"))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for p in self.procs:
            _kill_group(p)
        self.logs.cleanup()
        self.store = None  # its server stops with it


def _worker_env(rank: int, nproc: int, port: int, run_id: str, error_file: str,
                base_env: dict) -> dict:
    """The variables torchrun --standalone gives worker `rank` of `nproc` on one node
    (torch/distributed/elastic/agent/server/local_elastic_agent.py's _start_workers, plus what
    its agent and its process context add: the error file, the signals it forwards)."""
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0", "ROLE_RANK": str(rank),
            "ROLE_NAME": "default", "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc),
            "GROUP_WORLD_SIZE": "1", "ROLE_WORLD_SIZE": str(nproc), "MASTER_ADDR": "localhost",
            "MASTER_PORT": str(port), "TORCHELASTIC_RESTART_COUNT": "0",
            "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_RUN_ID": run_id,
            "TORCHELASTIC_USE_AGENT_STORE": "True",
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": base_env.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
            "TORCHELASTIC_ERROR_FILE": error_file,
            "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT"}


def _agent_store():
    """The TCPStore torchrun's agent hosts for its workers: with TORCHELASTIC_USE_AGENT_STORE=True
    every rank connects to it as a client (no rank hosts it, so none takes it down by dying)."""
    import torch.distributed as dist

    return dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=60))


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


def _collect(results, procs, deadline: float):
    """(each rank's return value, the tracebacks of ranks that raised, whether every rank
    reported or ended before `deadline`)."""
    out, errors, pending = [None] * len(procs), [], len(procs)
    while pending:
        try:
            kind, rank, value = results.get(timeout=0.1)
        except queue.Empty:
            if time.monotonic() > deadline:
                return out, errors, False
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
    return out, errors, True


# ---- inside a forked rank ---------------------------------------------------------------------

def _rank_main(rank_env, out_path, err_path, entry, entry_args):
    """A forked rank's start: a process group of its own (for _kill_group), its output to files,
    the job's environment, and the thread count it asks for. Then `entry(*entry_args)`."""
    os.setsid()
    for fd, path in ((1, out_path), (2, err_path)):
        f = os.open(path, os.O_WRONLY)
        os.dup2(f, fd)
        os.close(f)
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=True)  # what a killed rank printed still reaches the test
    faulthandler.enable()  # a crash in C++ (gloo, say) prints each thread's stack
    os.environ.clear()
    os.environ.update(rank_env)
    os.chdir(REPO)
    import torch

    # torch read OMP_NUM_THREADS once, in the forkserver: what this rank's environment asks for
    # takes effect only through torch (threads started later, the autograd engine's, follow it).
    if "OMP_NUM_THREADS" in rank_env:
        torch.set_num_threads(int(rank_env["OMP_NUM_THREADS"]))
    entry(*entry_args)


def _run_module(rank, nproc, module, args):
    main = importlib.import_module(module)
    sys.argv = [main.__file__, *args]  # as `python -m module args` has it
    main.main()


def _run_function(rank, world_size, fn, args, pg_timeout_s, final_barrier, backend, results):
    import torch
    import torch.distributed as dist

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
