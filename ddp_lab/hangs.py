"""A collective that hangs or fails, turned into one line naming who and where.

gloo collectives (and send/recv) honour the process-group timeout (`dist.timeout_s`) and then
raise a bare "Timed out waiting 10000ms for recv operation"; NCCL's watchdog aborts the process
after the same timeout with its own message naming the operation
(`WorkNCCL(SeqNum=.., OpType=ALLREDUCE ..)`). `collective_errors` turns the gloo case into one
line that names the collective (from the traceback) and the ranks that were behind (each rank's
`Heartbeat` posts the step it began to the c10d store).
"""

from __future__ import annotations

import contextlib
import os
import traceback

import torch.distributed as dist

from ddp_lab.errors import TrainingError


class CollectiveError(TrainingError):
    every_rank = True


class Heartbeat:
    """Each rank posts the step it begins to the c10d store; when the others time out, the rank
    that stopped beating is named. `sync` names the gradient sync in those messages."""

    def __init__(self, rank: int, world_size: int, sync: str):
        self.rank, self.world_size, self.sync = rank, world_size, sync
        self.step: int | None = None
        self.store = _store() if world_size > 1 else None

    def beat(self, step: int) -> None:
        """At the start of `step` (1-based)."""
        self.step = step
        if self.store is not None:
            self.store.set(_heartbeat_key(self.rank), str(step))

    def ranks_behind(self) -> str:
        """Who had not begun this rank's step, as a clause for an error message."""
        if self.store is None or self.step is None:
            return ""
        behind = []
        try:
            for r in range(self.world_size):
                key = _heartbeat_key(r)
                step = int(self.store.get(key)) if self.store.check([key]) else 0
                if step < self.step:
                    behind.append(f"rank {r} (last began step {step})")
        except Exception:  # the store itself may be what failed
            return ""
        if behind:
            return f"; ranks behind: {', '.join(behind)}"
        return f"; every rank began step {self.step}, so the stall is inside it"


def _store():
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # private API: degrade to "rank unknown"
        return None


def _heartbeat_key(rank: int) -> str:
    return f"ddp_lab/step/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{rank}"


def _where(tb, sync: str) -> tuple[str, str]:
    """(collective, call site) for an exception from a collective, read off its traceback."""
    frames = traceback.extract_tb(tb)
    ours = [f for f in frames if f"{os.sep}ddp_lab{os.sep}" in f.filename]
    site = (f"{os.path.relpath(ours[-1].filename, os.path.dirname(os.path.dirname(__file__)))}:"
            f"{ours[-1].lineno} `{(ours[-1].line or '').strip()}`") if ours else "?"
    c10d = [f for f in frames if f.filename.endswith("distributed_c10d.py")]
    if c10d:
        # the outermost c10d frame is the public function our code called
        return f"{c10d[0].name}", site
    if any(f"{os.sep}autograd{os.sep}" in f.filename for f in frames):
        return f"the gradient all-reduce inside backward (sync={sync})", site
    ddp = [f for f in frames if f.filename.endswith(f"parallel{os.sep}distributed.py")]
    if ddp:
        line = ddp[-1].line or ""
        if "_rebuild_buckets" in line:  # DDP's forward after its first backward
            return "DDP's bucket-rebuild broadcast (forward of its second step)", site
        if "sync_buffers" in line or "_sync_buffers" in ddp[-1].name:
            return "DDP's buffer broadcast in forward", site
        return f"DistributedDataParallel.{ddp[-1].name}", site
    return f"a collective of sync={sync}", site


_DIST_PATTERNS = ("timed out", "timeout", "connection closed", "connection reset", "broken pipe",
                  "gloo", "nccl", "socket", "peer")


@contextlib.contextmanager
def collective_errors(timeout_s: float, beat: Heartbeat):
    """Turn a failed or timed-out collective into a `CollectiveError` naming what, where and (from
    `beat`) at which step and who was behind."""
    try:
        yield
    except TrainingError:
        raise
    except RuntimeError as e:  # DistBackendError / DistError subclass RuntimeError
        msg = str(e)
        if not (isinstance(e, getattr(dist, "DistError", ())) or
                any(p in msg.lower() for p in _DIST_PATTERNS)):
            raise
        what, site = _where(e.__traceback__, beat.sync)
        timed_out = "timed out" in msg.lower() or "timeout" in msg.lower()
        verdict = (f"timed out after dist.timeout_s={timeout_s:g}" if timed_out else
                   "failed (a peer closed its connection: did a rank die?)"
                   if "closed" in msg.lower() or "reset" in msg.lower() else "failed")
        behind = beat.ranks_behind() if timed_out else ""
        raise CollectiveError(
            f"rank {beat.rank}: collective {what} {verdict} at step {beat.step} (called at "
            f"{site}){behind}. "
            f"Original error: {msg.strip().splitlines()[-1][:300]}") from e
