"""The one point-to-point layer every algorithm goes through.

An algorithm sees the group through a `Channel`: group ranks only (translated to global ranks with
`dist.get_global_rank`), and one call, `post(step, sends, recvs)`, that posts this rank's sends and
receives of one schedule step (or of one slice of it) as a batch (`dist.batch_isend_irecv`: on
NCCL a paired send+recv must be issued as one group or the ring deadlocks) and returns a handle
to `wait()` on; `exchange` is post-then-wait. Posting and waiting apart lets an algorithm compute
while a transfer is in flight (the ring adds one slice while the next one arrives). Because every
byte passes through `post`, it is where bytes are counted, where the schedule can be traced as
(step, op, peer, chunk), and where a failed or timed-out transfer becomes one clear error that
names the algorithm, the step and the peer (raised by `post` or by the handle's `wait`).
The chunk label is the algorithm's: None for the whole tensor, c for chunk c, (c, k) for slice k
of chunk c, range(a, b) for chunks a .. b-1 in one message.

Counting: `with recording() as rec:` collects, on this thread, every transfer made inside it
(`rec.bytes_sent`, `rec.bytes_received`, `rec.messages`; `rec.trace` too with `trace=True`).
Recorders nest; each open recorder on the thread sees every transfer.

Transfers of empty tensors (a chunk of a tensor smaller than the group) are skipped: both ends know
the sizes, so both skip, and they appear neither in the trace nor in the byte counts.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


class CommError(RuntimeError):
    """A point-to-point transfer of one of our collectives failed (dead peer, timeout)."""


@dataclass(eq=False)  # one counter each: recording() removes the very one it added, not an equal one
class Recorder:
    """What one thread sent and received while this recorder was open."""

    trace: bool = False
    bytes_sent: int = 0
    bytes_received: int = 0
    messages: int = 0  # sends posted
    events: list[tuple[int, str, int, object]] = field(default_factory=list)

    def reset(self) -> None:
        self.bytes_sent = self.bytes_received = self.messages = 0
        self.events.clear()


# Receive buffers, per thread: the sync's communication thread has its own, freed with it.
_kept = threading.local()
_every_kept: weakref.WeakSet = weakref.WeakSet()  # the same buffers, every thread's, to count


def scratch(like: torch.Tensor, numel: int, count: int) -> torch.Tensor:
    """`count` buffers of `numel` elements of like's dtype to receive into, as the rows of one
    tensor. On the CPU they are kept per thread and dtype across calls (grown when too small): a
    fresh buffer of many MiB is a fresh mapping, and receiving into it faults in every page
    (docs/results/cpu-ring-vs-native). On CUDA they are allocated per call: the caching allocator
    makes that cheap, and it stays safe whatever stream the next call runs on."""
    if like.device.type != "cpu":
        return torch.empty(count, numel, dtype=like.dtype, device=like.device)
    kept = _kept.__dict__.setdefault("by_dtype", {})
    buf = kept.get(like.dtype)
    if buf is None or buf.numel() < count * numel:
        buf = kept[like.dtype] = torch.empty(count * numel, dtype=like.dtype)
        _every_kept.add(buf)
    return buf[:count * numel].view(count, numel)


def kept_scratch() -> list[torch.Tensor]:
    """Every receive buffer kept now, of every thread (the memory count: summary.json)."""
    return list(_every_kept)


_local = threading.local()


def _recorders() -> list[Recorder]:
    if not hasattr(_local, "stack"):
        _local.stack = []
    return _local.stack


@contextlib.contextmanager
def recording(recorder: Recorder | None = None, trace: bool = False):
    """Count (and with trace=True, trace) every transfer this thread makes inside the block."""
    rec = recorder if recorder is not None else Recorder(trace=trace)
    stack = _recorders()
    stack.append(rec)
    try:
        yield rec
    finally:
        stack.remove(rec)


class Channel:
    """One collective call's view of a process group."""

    def __init__(self, algo: str, group=None, op: str = "all-reduce"):
        self.algo, self.op = algo, op  # op: all-reduce | reduce-scatter | all-gather, for errors
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self._global = [dist.get_global_rank(group, r) if group is not None else r
                        for r in range(self.size)]

    def exchange(self, step: int, sends=(), recvs=()) -> None:
        """Post this rank's transfers of schedule step `step` and wait for all of them."""
        self.post(step, sends, recvs).wait()

    def post(self, step: int, sends=(), recvs=()) -> Pending:
        """Post this rank's transfers of schedule step `step`; wait() on the result.

        sends / recvs: (peer group rank, tensor, chunk label: None, c or (c, k))."""
        ops, what = [], []
        for kind, items, fn in (("send", sends, dist.isend), ("recv", recvs, dist.irecv)):
            for peer, tensor, chunk in items:
                if tensor.numel() == 0:
                    continue
                assert tensor.is_contiguous() and peer != self.rank, (kind, peer, self.rank)
                ops.append(dist.P2POp(fn, tensor, peer=self._global[peer], group=self.group))
                what.append((kind, peer, chunk, tensor.numel() * tensor.element_size()))
        if not ops:
            return Pending(self, step, [], [])
        for rec in _recorders():
            for kind, peer, chunk, nbytes in what:
                if kind == "send":
                    rec.bytes_sent += nbytes
                    rec.messages += 1
                else:
                    rec.bytes_received += nbytes
                if rec.trace:
                    rec.events.append((step, kind, peer, chunk))
        try:
            works = dist.batch_isend_irecv(ops)
        except Exception as e:  # noqa: BLE001 - re-raised with the schedule position
            raise self._error(step, what, e) from e
        return Pending(self, step, what, works)

    def _error(self, step: int, what, cause: Exception) -> CommError:
        desc = ", ".join(
            f"{kind} {'to' if kind == 'send' else 'from'} rank {peer} (global {self._global[peer]})"
            + _piece(chunk) for kind, peer, chunk, _ in what)
        first = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
        return CommError(
            f"{self.algo} {self.op} failed at step {step} on rank {self.rank} "
            f"(global {self._global[self.rank]}) of {self.size}: {desc} did not complete: {first}. "
            f"A peer process probably died or the process group timed out.")


def _piece(chunk) -> str:
    if chunk is None:
        return ""
    if isinstance(chunk, tuple):
        return f" of slice {chunk[1]} of chunk {chunk[0]}"
    if isinstance(chunk, range):
        return f" of chunks {chunk.start}..{chunk.stop - 1}"
    return f" of chunk {chunk}"


@dataclass
class Pending:
    """Transfers posted by `Channel.post`, not yet waited for."""

    channel: Channel
    step: int
    what: list  # (kind, peer, chunk, nbytes) per transfer
    works: list

    def wait(self) -> None:
        # gloo returns one work per op (so a failure names its peer); NCCL may coalesce the batch
        # into one work, and the failure then names every transfer of the step.
        for i, work in enumerate(self.works):
            try:
                work.wait()  # gloo: blocks, up to the group's timeout; NCCL: the stream waits
            except Exception as e:  # noqa: BLE001
                one = len(self.works) == len(self.what)
                raise self.channel._error(self.step, [self.what[i]] if one else self.what, e) from e
