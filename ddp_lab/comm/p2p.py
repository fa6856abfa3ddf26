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

Nodes (ddp_lab.dist's `nodes()`): a send to a rank on another node is counted again as
`rec.cross_node_bytes` and `rec.cross_node_messages`. With an emulated link (`dist.link`), `post`
holds this rank until such a message would have arrived (`Link.hold`): each message once, alpha +
bytes * beta after its link was free, where the link is this rank's own or, with
`dist.link.shared`, its node's, which every rank of the node queues on (a file they share holds
when it is next free). Holding the posting thread keeps it simple: the wire time is time the rank
does not compute, as with a CPU that copies into a socket, so the ring's one-slice overlap of an
add with a transfer does not hide the held time.

Transport: `post` counts, traces and holds, then hands the batch to the transport that moves it,
`torch_transport` (`dist.batch_isend_irecv`). The dry run (ddp_lab/dry_run.py) swaps in
`counting_transport` (`with transport(counting_transport):`), which moves nothing: on torch's
fake backend nothing would move either, and torch's batch took two thirds of the CPU time of a
ring message there (57 against 18 us at N=1024). The counts are the same: made before, by this code.

Transfers of empty tensors (a chunk of a tensor smaller than the group) are skipped: both ends know
the sizes, so both skip, and they appear neither in the trace nor in the byte counts.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import struct
import threading
import time
import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ddp_lab.dist import Nodes, nodes
from ddp_lab.errors import ConfigError


class CommError(RuntimeError):
    """A point-to-point transfer of one of our collectives failed (dead peer, timeout)."""


@dataclass(eq=False)  # one counter each: recording() removes the very one it added, not an equal one
class Recorder:
    """What one thread sent and received while this recorder was open."""

    trace: bool = False
    bytes_sent: int = 0
    bytes_received: int = 0
    messages: int = 0  # sends posted
    cross_node_bytes: int = 0  # of bytes_sent, to ranks on other nodes
    cross_node_messages: int = 0
    events: list[tuple[int, str, int, object]] = field(default_factory=list)

    def reset(self) -> None:
        self.bytes_sent = self.bytes_received = self.messages = 0
        self.cross_node_bytes = self.cross_node_messages = 0
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
        layout = nodes()
        mine = layout.node(self._global[self.rank])
        self._away = [layout.node(g) != mine for g in self._global]  # peer on another node
        self._crosses = any(self._away)  # else post skips counting crossings (one message: ~1 us)
        self._link = link(layout)

    def exchange(self, step: int, sends=(), recvs=()) -> None:
        """Post this rank's transfers of schedule step `step` and wait for all of them."""
        self.post(step, sends, recvs).wait()

    def post(self, step: int, sends=(), recvs=()) -> Pending:
        """Post this rank's transfers of schedule step `step`; wait() on the result.

        sends / recvs: (peer group rank, tensor, chunk label: None, c or (c, k))."""
        ops, what = [], []
        for kind, items in (("send", sends), ("recv", recvs)):
            for peer, tensor, chunk in items:
                if tensor.numel() == 0:
                    continue
                assert tensor.is_contiguous() and peer != self.rank, (kind, peer, self.rank)
                ops.append((kind, self._global[peer], tensor))
                what.append((kind, peer, chunk, tensor.nbytes))
        if not ops:
            return Pending(self, step, [], [])
        away = [nbytes for kind, peer, _, nbytes in what
                if kind == "send" and self._away[peer]] if self._crosses else []
        for rec in _recorders():
            for kind, peer, chunk, nbytes in what:
                if kind == "send":
                    rec.bytes_sent += nbytes
                    rec.messages += 1
                else:
                    rec.bytes_received += nbytes
                if rec.trace:
                    rec.events.append((step, kind, peer, chunk))
            rec.cross_node_bytes += sum(away)
            rec.cross_node_messages += len(away)
        if away and self._link is not None:
            self._link.hold(away)
        try:
            works = _transport(ops, self.group)
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


def torch_transport(ops: list[tuple[str, int, torch.Tensor]], group) -> list:
    """Post `ops`, (send | recv, global peer rank, tensor) each, as one batch through torch: a
    work per op to wait on."""
    return dist.batch_isend_irecv([dist.P2POp(dist.isend if kind == "send" else dist.irecv,
                                              tensor, peer=peer, group=group)
                                   for kind, peer, tensor in ops])


def counting_transport(ops: list[tuple[str, int, torch.Tensor]], group) -> list:
    """Post nothing, and so nothing to wait on: `Channel.post` has already counted and traced
    `ops`. For the dry run only, on torch's fake backend, where a transfer would move nothing
    either: its receives leave their buffers as they were, as they are left here."""
    return []


_transport = torch_transport


@contextlib.contextmanager
def transport(fn):
    """Every channel of this process posts through `fn` inside the block (torch_transport
    outside it). The process's, not the thread's: a sync posts from its communication thread."""
    global _transport
    before, _transport = _transport, fn
    try:
        yield
    finally:
        _transport = before


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


class Link:
    """This rank's side of the emulated link between nodes (`dist.link`): its own, or with
    `shared` its node's, whose next free time sits in a file every rank of the node has open
    (`clock_fd`, locked while read and moved on)."""

    def __init__(self, layout: Nodes):
        self.alpha, self.beta = layout.latency_s, layout.s_per_byte
        self.max_hold_s = layout.max_hold_s
        self.fd = layout.clock_fd if layout.shared else -1
        self.free = 0.0  # a link of this rank's own: when it is next free (time.monotonic)
        self.held = 0  # messages held, each once (what the tests count)
        self._lock = threading.Lock()

    def hold(self, sizes: list[int]) -> None:
        """Wait until messages of `sizes` bytes, sent now one after the other, would have
        arrived; refused at once where that is past `max_hold_s` (dist.timeout_s)."""
        wait = self.arrival(sizes, time.monotonic()) - time.monotonic()
        if wait > self.max_hold_s:
            gbps = 8 / self.beta / 1e9 if self.beta else 0.0
            raise ConfigError(
                f"the emulated link (dist.link.gbps={gbps:g}, dist.link.latency_us="
                f"{self.alpha * 1e6:g}) would hold {sum(sizes):,} bytes {wait:,.0f} s, past "
                f"dist.timeout_s={self.max_hold_s:g}: raise dist.link.gbps (or dist.timeout_s)")
        time.sleep(max(0.0, wait))

    def arrival(self, sizes: list[int], now: float) -> float:
        """Book the link for `sizes` from `now` (or when it is next free): when the last arrives."""
        with self._lock, _locked(self.fd):
            start = max(now, self._read_free())
            free = start + sum(sizes) * self.beta
            self._write_free(free)
            self.held += len(sizes)
        return free + self.alpha

    def _read_free(self) -> float:
        if self.fd < 0:
            return self.free
        raw = os.pread(self.fd, 8, 0)
        return struct.unpack("d", raw)[0] if len(raw) == 8 else 0.0

    def _write_free(self, free: float) -> None:
        if self.fd < 0:
            self.free = free
        else:
            os.pwrite(self.fd, struct.pack("d", free), 0)


@contextlib.contextmanager
def _locked(fd: int):
    if fd < 0:
        yield
        return
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)


_links: dict[Nodes, Link] = {}


def link(layout: Nodes) -> Link | None:
    """The emulated link of `layout`, one per process (None: no emulated link)."""
    if not layout.emulated:
        return None
    if layout not in _links:
        _links.clear()  # a new layout (set_nodes again): the old link is gone
        _links[layout] = Link(layout)
    return _links[layout]
