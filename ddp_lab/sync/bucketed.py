"""sync=naive|ring|tree|hring: gradients averaged by our own all-reduce, bucketed, overlapped with
backward.

prepare(model)
    Broadcast parameters and buffers from rank 0, so every replica starts equal. Cut the gradients
    into buckets of at most `sync.bucket_mb` MiB (in the dtype they travel in) in *reverse*
    parameter order, the order backward produces them; a parameter larger than a bucket gets one
    of its own. Each bucket owns a flat buffer for the step's all-reduce (allocated once), each
    parameter's slice laid out as the parameter is (channels_last too).

overlap=false
    finish() does it all: for each bucket in order, pack the grads into its buffer, all-reduce,
    divide by the world size (SUM then divide: ReduceOp.AVG is NCCL-only), unpack.

overlap=true
    A post-accumulate-grad hook on every parameter counts the parameter ready in its bucket. When
    a bucket is full it is handed to a communication thread, but strictly in bucket order: a full
    bucket waits for every earlier one, so all ranks launch the same all-reduces in the same order
    whatever order their grads arrive in. The thread packs, all-reduces and unpacks while backward
    goes on. finish() hands over the buckets still waiting (a parameter that got no gradient this
    step counts as zeros: it gets a zero grad), waits until the thread has done them all, and
    re-raises anything that failed there.
    - CPU (gloo): gloo ops block the calling thread, hence the thread: all the step's
      communication runs there and the training thread only waits in finish(). Its copies and
      adds run on one core (ddp_lab/sync/comm_thread.py), as gloo's own workers reduce.
    - CUDA (NCCL): the same thread, issuing on a side stream of its own. The hook records an event
      on the stream that produced the gradient and the side stream waits on it before reading
      (packing) the grads; NCCL work is ordered after the side stream by the process group, and
      the side stream after NCCL by `work.wait()`; finish() makes the training stream wait on an
      event recorded after the last unpack. Memory: bucket buffers are allocated once and only
      the side stream touches them; scratch buffers of the all-reduce are allocated and freed on
      the side stream; grads are allocated by the training stream and are freed (zero_grad) only
      after it has waited for the side stream, so nothing is reused while still in flight. Zero
      grads for unused parameters are made on the training stream, in finish(), for that reason.

accumulation
    Under no_sync() the hooks do nothing; only the last micro-step's backward communicates.

comm_dtype=bf16|fp16 (or sync.compress=bf16|fp16, its other name)
    Each gradient is divided by the world size in its own precision and only then cast into the
    bucket (so an fp16 sum cannot overflow where the average would not), summed in the low
    dtype, and cast back up on unpack. fp32: buckets in the gradients' own dtype.

compress=powersgd|topk
    A packed bucket is averaged by a compressor through the sync's own collectives instead of
    the all-reduce (ddp_lab/sync/compressed.py: compress_start, the counts, the checkpointed
    state).

non-finite check (`check_nonfinite`, once the guard asks)
    After each bucket's all-reduce, this rank's 1/N of it (ZeRO: its shard, zero.py) sets the
    guard's inf/NaN flag, on the communication thread while backward goes on; the guard's
    all-reduce of the ranks' flags covers the rest, and it reads no gradient itself
    (ddp_lab/guard.py).

Counting: every byte goes through ddp_lab.comm's point-to-point layer; bytes_per_step() is what
this rank sent between two finish() calls, counted (comm_stats' messages_per_step: in how many
messages), and comm_busy_ms() the time the communication spent inside all-reduce calls in that
step (CUDA: events on the communication stream).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ddp_lab import buckets, comm
from ddp_lab.dtypes import DTYPES
from ddp_lab.comm.p2p import Recorder, recording
from ddp_lab.compress import COMPRESSORS, Ops
from ddp_lab.sync.base import GradSync, NonfiniteFlag
from ddp_lab.sync.busy_clock import BusyClock
from ddp_lab.sync.comm_thread import CommThread
from ddp_lab.sync.compressed import CompressedBuckets
from ddp_lab.sync.config import SYNCS, wire_dtype


@dataclass
class Bucket:
    index: int
    params: list[nn.Parameter]
    # flat, in the dtype the gradients travel in (ZeRO-2/3: a view of a pool's buffer, for its
    # size: packing borrows one, zero.py)
    buffer: torch.Tensor
    views: list[torch.Tensor]  # buffer slices shaped (and strided) like each parameter

    @property
    def numel(self) -> int:
        return self.buffer.numel()

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()


class BucketedSync(GradSync):
    def __init__(self, scfg, device: torch.device, world_size: int, group=None):
        if scfg.name not in comm.OURS:
            raise ValueError(f"BucketedSync runs one of {', '.join(comm.OURS)}, "
                             f"not {scfg.name!r}")
        self.name = self.algo = scfg.name
        self.bucket_mb = scfg.bucket_mb
        self.overlap = bool(scfg.overlap)
        self.comm_dtype = comm_dtype(wire_dtype(scfg))
        self.compression = (CompressedBuckets(scfg, device)
                            if scfg.compress in COMPRESSORS else None)
        self.device, self.world_size, self.group = device, world_size, group
        self.make_buffers = new_buffers  # the dry run lends every rank the same (dry_run.py)
        self.cuda = device.type == "cuda"
        self.params: list[nn.Parameter] = []
        self.buckets: list[Bucket] = []
        self._bucket_of: dict[nn.Parameter, int] = {}
        self._hooks = []
        self._worker: CommThread | None = None
        self._enabled = True  # False inside no_sync()
        self._recorder = Recorder()
        self._busy = BusyClock(self.cuda)  # time inside the collectives (comm_busy_ms)
        self._calls: dict[str, int] = {}  # collectives run this step, by name (counted ones)
        self._nonfinite: NonfiniteFlag | None = None  # the guard's, once it asks (below)
        self._last = {"bytes_per_step": 0, "messages_per_step": 0, "cross_node_bytes_per_step": 0,
                      "launched_in_backward": 0, "collectives": {}}
        self._reset_step()

    # ---- set-up ----

    def prepare(self, model: nn.Module) -> nn.Module:
        with torch.no_grad():
            for t in [*model.parameters(), *model.buffers()]:
                dist.broadcast(t.detach(), src=dist.get_global_rank(self.group, 0)
                               if self.group is not None else 0, group=self.group)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.buckets = self._build_buckets(self.params)
        self._bucket_of = {p: b.index for b in self.buckets for p in b.params}
        if self.overlap:
            self._worker = CommThread(self.device)
        self._hooks = self._install_hooks(model)
        self._reset_step()
        return model

    def _install_hooks(self, model: nn.Module) -> list:
        """overlap=true: a hook on every parameter that counts it ready in its bucket."""
        if not self.overlap:
            return []
        return [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in self.params]

    def _build_buckets(self, params) -> list[Bucket]:
        params = params[::-1]  # backward makes the last layers' grads first
        dtypes = [self.comm_dtype or p.dtype for p in params]
        groups = buckets.plan([p.numel() * d.itemsize for p, d in zip(params, dtypes)],
                              self.bucket_mb, "ours",
                              keys=[(p.device, d) for p, d in zip(params, dtypes)])
        return self._buckets_of(params, groups, dtypes)

    def _buckets_of(self, params, groups: list[list[int]], dtypes) -> list[Bucket]:
        """A Bucket per group of indices into `params`, in that order, with its buffer."""
        buffers = self._bucket_buffers([(sum(params[i].numel() for i in g), dtypes[g[0]],
                                         params[g[0]].device) for g in groups])
        out = []
        for i, (g, buffer) in enumerate(zip(groups, buffers)):
            views, off = [], 0
            for p in (params[j] for j in g):
                views.append(view_like(buffer, off, p))
                off += p.numel()
            out.append(Bucket(i, [params[j] for j in g], buffer, views))
        return out

    def _bucket_buffers(self, sizes: list[tuple]) -> list[torch.Tensor]:
        """A flat buffer per bucket, (numel, dtype, device) each, kept for the whole run."""
        return self.make_buffers(sizes)

    # ---- the step ----

    def no_sync(self):
        return _Disabled(self)

    def _reset_step(self) -> None:
        self._ready = [0] * len(self.buckets)
        self._ready_params: set[int] = set()
        self._launched = 0  # buckets handed to the communication thread, in order
        self._launched_in_backward = 0

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        """Post-accumulate-grad hook (the autograd thread; for CUDA not the training thread)."""
        if not self._enabled:
            return  # accumulating: this micro-step does not communicate
        if id(p) in self._ready_params:
            raise RuntimeError(
                f"sync={self.algo}: a parameter of shape {tuple(p.shape)} got its gradient twice "
                f"in one synchronised step; run backward once per step outside no_sync() "
                f"(other micro-steps inside it)")
        self._ready_params.add(id(p))
        b = self._bucket_of[p]
        self._ready[b] += 1
        if self._ready[b] == len(self.buckets[b].params) and self._tracing():
            self.tracer.instant("compute", "bucket_ready", self.tracer.stamp(), bucket=b)
        # Launch strictly in bucket order, so every rank issues the same sequence of all-reduces.
        while (self._launched < len(self.buckets)
               and self._ready[self._launched] == len(self.buckets[self._launched].params)):
            self._launch(self._launched)
            self._launched += 1
            self._launched_in_backward += 1

    def _launch(self, b: int) -> None:
        """Reduce bucket b, whose gradients are all made: on the communication thread (overlap),
        else here."""
        if self._worker is None:
            self._reduce_bucket(b, None)
        else:
            self._worker.submit(self._reduce_bucket, b, self._ready_event())

    def _ready_event(self):
        """CUDA: an event after the gradient-producing work on the current stream."""
        if not self.cuda:
            return None
        ev = torch.cuda.Event()
        ev.record()
        return ev

    def finish(self) -> None:
        if not self.buckets:
            return
        for p in self.params:  # no gradient this step (unused parameter): it contributes zeros
            if p.grad is None and id(p) not in self._ready_params:
                p.grad = torch.zeros_like(p)  # on the training stream, see the module docstring
        if not self.overlap and self._tracing():  # (no hooks: every bucket is ready now)
            now = self.tracer.stamp()
            for b in range(len(self.buckets)):
                self.tracer.instant("compute", "bucket_ready", now, bucket=b)
        try:
            for b in range(self._launched, len(self.buckets)):  # the rest, still in order
                self._launch(b)
            self._launched = len(self.buckets)
            if self._worker is not None:
                self._worker.flush()  # waits for every bucket; raises what failed in the thread
                if self.cuda:
                    torch.cuda.current_stream().wait_event(self._worker.done_event)
        finally:
            self._end_step()  # a failed step leaves the next one a clean slate

    def _reduce_bucket(self, b: int, ready_event) -> None:
        """Pack, all-reduce, average, unpack one bucket (the communication thread, or finish())."""
        bucket = self.buckets[b]
        if ready_event is not None:
            torch.cuda.current_stream().wait_event(ready_event)
        with torch.no_grad():
            self._pack(bucket.params, bucket.views)
            if self.compression is None:
                self._communicate(b, comm.all_reduce, bucket.buffer)
            else:  # the average, by the compressor, through the collectives below
                self.compression.reduce(b, bucket, self._ops(b), last=b == len(self.buckets) - 1)
            for p, view in zip(bucket.params, bucket.views):
                if self.comm_dtype is None and self.world_size > 1 and self.compression is None:
                    torch.div(view, self.world_size, out=p.grad)  # SUM then divide, in the unpack
                else:
                    p.grad.copy_(view)  # (low dtype: divided before the cast; compressed: averaged)
            self._flag_nonfinite(b, [self._my_part(bucket.buffer)])

    def check_nonfinite(self) -> torch.Tensor:
        if self._nonfinite is None:
            self._nonfinite = NonfiniteFlag(self.device)
        return self._nonfinite.flag

    def _my_part(self, buffer: torch.Tensor) -> torch.Tensor:
        """This rank's 1/N of an averaged bucket (ZeRO's shard of it): every rank holds the same
        result of the all-reduce, so the ranks' parts cover it once, and the guard's all-reduce
        of the flags gives every rank the whole verdict for 1/N of the reading."""
        if self.world_size == 1:
            return buffer
        return comm.shard(buffer, dist.get_rank(self.group), self.world_size)

    def _flag_nonfinite(self, b: int, parts: list[torch.Tensor]) -> None:
        """Once the guard asked (`check_nonfinite`): flag inf/NaN in `parts` of bucket b (this
        rank's part of the reduced bucket; ZeRO: its shard), on the communication thread beside
        backward. Buckets run in order, each once a step: the first clears the last step's flag.
        At fp32 the part still holds the sum (the unpack divides it into .grad), so the norm's
        overflow, which flags a finite part whose squares pass fp32's range, comes N times sooner
        than on the average: only for a part whose L2 norm nears 1.8e19 (the square root of
        fp32's largest value), far past any gradient worth keeping."""
        if self._nonfinite is None:
            return
        if b == 0:
            self._nonfinite.clear()
        self._nonfinite.check(parts)

    def _ops(self, b: int) -> Ops:
        """The collectives a compressor runs on bucket b: the sync's own, counted and traced."""
        return Ops(self.world_size, lambda t: self._communicate(b, comm.all_reduce, t),
                   lambda mine, whole: self._communicate(b, comm.all_gather, mine, whole,
                                                         span="allgather"))

    def _pack(self, params, views) -> None:
        """Each parameter's gradient into its view of a bucket buffer."""
        for p, view in zip(params, views):
            if self.comm_dtype is None:
                view.copy_(p.grad)
            else:  # divide before casting down: the fp16 sum of averages cannot overflow
                torch.div(p.grad, self.world_size, out=view)

    def _communicate(self, b: int, collective, *tensors, span: str = "allreduce",
                     counted: bool = True) -> None:
        """`collective(*tensors, algo, group)` for bucket b: counted, timed (comm_busy_ms) and
        traced (a `span` on the comm lane, with what crossed to other nodes where any did);
        `counted=False` (outside a training step): none of those."""
        if not counted:
            collective(*tensors, self.algo, self.group)
            return
        self._calls[collective.__name__] = self._calls.get(collective.__name__, 0) + 1
        crossed = self._recorder.cross_node_bytes
        with recording(self._recorder):
            start, end = self._busy.timed(lambda: collective(*tensors, self.algo, self.group))
        if self._tracing():  # the same stamps as the busy time: the two agree exactly
            crossed = self._recorder.cross_node_bytes - crossed
            self.tracer.span("comm", span, start, end, bucket=b, bytes=tensors[0].nbytes,
                             algo=self.algo, op=collective.__name__,
                             **({"cross_node_bytes": crossed} if crossed else {}))

    def _end_step(self) -> None:
        self._last = {"bytes_per_step": self._recorder.bytes_sent,
                      "messages_per_step": self._recorder.messages,
                      "cross_node_bytes_per_step": self._recorder.cross_node_bytes,
                      "launched_in_backward": self._launched_in_backward,
                      "collectives": self._calls}
        self._calls = {}
        self._busy.end_step()
        self._recorder.reset()
        self._reset_step()

    # ---- what it measured ----

    def bytes_per_step(self) -> int:
        """Bytes this rank sent in the last synchronised step (counted by the p2p layer)."""
        return int(self._last["bytes_per_step"])

    def comm_busy_ms(self) -> float:
        """Milliseconds spent inside the collectives in the last synchronised step. On CUDA the
        latest step whose events have completed (never a host sync: the loop asks every step)."""
        return self._busy.last_ms()

    def comm_stats(self) -> dict:
        return {"algo": self.algo, "overlap": self.overlap,
                "comm_dtype": str(self.comm_dtype or "grad dtype").replace("torch.", ""),
                "buckets": len(self.buckets), "bucket_bytes": [b.nbytes for b in self.buckets],
                "bytes_per_step": self.bytes_per_step(),
                "messages_per_step": self._last["messages_per_step"],
                "cross_node_bytes_per_step": self._last["cross_node_bytes_per_step"],
                "comm_busy_ms": self.comm_busy_ms(),
                "buckets_launched_in_backward": self._last["launched_in_backward"],
                "collectives_per_step": dict(self._last["collectives"]),
                **({"compression": self.compression.stats()} if self.compression else {})}

    def comm_buffers(self) -> list[torch.Tensor]:
        return [b.buffer for b in self.buckets]

    def compress_state(self) -> list[torch.Tensor]:
        return self.compression.compressor.kept() if self.compression else []

    def state_dict(self) -> dict:
        return self.compression.state_dict() if self.compression else {}

    def load_state_dict(self, state: dict) -> None:
        if self.compression:
            self.compression.load_state_dict(state)

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self._worker is not None:
            self._worker.close()
            self._worker = None


# Every collective of ours is a sync (with sync.zero>=1 zero.py's ShardedSync, at 3 zero3.py's
# ZeRO3Sync: build_sync).
for _algo in comm.OURS:
    SYNCS.register(_algo, BucketedSync, reads=("bucket_mb", "overlap", "comm_dtype", "compress",
                                               "zero", "reshard_after_forward"))


def new_buffers(sizes: list[tuple]) -> list[torch.Tensor]:
    """Fresh zeros, one flat tensor per (numel, dtype, device)."""
    return [torch.zeros(numel, dtype=dtype, device=device) for numel, dtype, device in sizes]


def comm_dtype(name: str) -> torch.dtype | None:
    """sync.comm_dtype as the dtype buckets hold: None for fp32, which means the gradients' own."""
    return None if name == "fp32" else DTYPES[name]


def view_like(flat: torch.Tensor, offset: int, p: torch.Tensor) -> torch.Tensor:
    """flat[offset : offset + p.numel()] as a tensor of p's shape and memory layout (strides):
    a channels_last weight's gradient then packs and unpacks as one straight copy."""
    dense = p.is_contiguous() or (p.dim() == 4 and p.is_contiguous(memory_format=torch.channels_last))
    if dense and flat.is_contiguous():
        return flat.as_strided(p.shape, p.stride(), flat.storage_offset() + offset)
    return flat[offset:offset + p.numel()].view(p.shape)


class _Disabled(contextlib.AbstractContextManager):
    def __init__(self, sync: BucketedSync):
        self.sync = sync

    def __enter__(self):
        self.prev, self.sync._enabled = self.sync._enabled, False
        return self

    def __exit__(self, *exc):
        self.sync._enabled = self.prev
        return False
