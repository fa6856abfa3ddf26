"""sync=naive|ring|tree sync.zero=1|2: ZeRO, a small step from the bucketed sync (bucketed.py).

Plain data parallelism keeps N copies of everything: every rank holds the whole optimizer state
and makes the same update. ZeRO (Rajbhandari et al., 2020) shards what only the update needs:
rank r keeps optimizer state for shard r of the parameters only and updates only that shard, and
the ranks then all-gather the updated shards, so the replicas are equal again. Here a shard is
per bucket: bucket b's flat parameters cut as `comm.shard` cuts (torch.tensor_split, rank r's is
piece r). Stage 3 shards the parameters too: zero3.py, a subclass of this one.

prepare(model)
    BucketedSync's buckets (hooks, communication thread, overlap with backward: all as there),
    and for each bucket a flat buffer of its parameters: every parameter becomes a view into it,
    laid out as it was (channels_last too), so gathering a bucket's shards puts its parameters in
    place. This rank's optimizer (`build_optimizer`) gets one tensor per bucket: its shard of that
    buffer, a view, so updating the shard updates the model.
the step
    When a bucket's gradients are all made (in bucket order, as at zero=0) it is packed into a
    buffer here, on the thread that made them (the autograd thread's post-accumulate-grad hook,
    or finish()), and the parameters' `.grad` are released at once: the buffer owns the values
    now. The communication thread then reduces it:
    zero=1  all-reduced, as at zero=0: the full averaged gradient, in the bucket's own buffer
            (kept for the run: the all-reduce needs the whole).
    zero=2  reduce-scattered: this rank gets the sum of its shard only, and sends (N-1)/N of the
            bucket instead of 2(N-1)/N. The rest of the buffer is scratch, so the buckets are
            packed into a pool of buckets.IN_FLIGHT (2) buffers, as large as the two largest
            buckets (`BufferPool`), lent at launch and given back once reduced.
    Then this rank's shard of the sum, divided by N, becomes the shard's .grad (a tensor of 1/N
    of the bucket, kept across steps). After `optimizer.step()` (a hook the optimizer runs after
    every step) each bucket's parameters are all-gathered, at the end of the step, on the
    training thread: the next forward reads every parameter.
    A `.grad` is only ever released on the thread that made it: one reassigned on the
    communication thread raced autograd's own use of the field ("corrupted double-linked list").
numerics
    The buckets are those of zero=0, summed in the same order (zero=1: the same all-reduce;
    zero=2: naive and tree reduce as their all-reduce does; the ring does from N = 3 on in another
    order: comm/ring.py), divided the same way, and the optimizer's arithmetic is elementwise.
everything else that reads gradients reads the shards'
    GradScaler's unscale and inf/NaN check (each rank sees its shard only: `ShardedScaler` takes
    the max of every rank's verdict, so all skip alike), the guard's non-finite check (its flags
    are all-reduced anyway), clipping (`clip_grad_norm_`: the shards' squared norms summed over
    the ranks).
checkpoints
    Each rank writes its own shards, nothing is gathered (zero_checkpoint.py: each bucket's
    optimizer state as this rank's flat shard under a key of its own, an offsets map in the
    layout; at M ranks a rank cuts its new shard out of the saved ones it overlaps).
memory per rank (P parameter bytes, fp32; ddp_lab/perf/memory.py's `predict_held`)
    parameters P; the shards' gradients P/N, plus, in a step, the bucket whose gradients are
    made and not yet packed (a gradient made before its bucket's turn waits, whole: a
    convolution's weight comes before its bias); optimizer state k P / N (k = 1 for SGD momentum,
    2 for AdamW); buckets P at zero=1, the IN_FLIGHT largest at zero=2. `held_probe` is called
    just before each release: the most held in a step is there.
"""

from __future__ import annotations

import threading
import time

import torch
import torch.distributed as dist
from torch import nn

from ddp_lab import comm
from ddp_lab.buckets import IN_FLIGHT
from ddp_lab.errors import ConfigError
from ddp_lab.sync.bucketed import Bucket, BucketedSync, view_like
from ddp_lab.sync.zero_checkpoint import ShardCheckpointing


class ShardedSync(ShardCheckpointing, BucketedSync):
    def __init__(self, scfg, device: torch.device, world_size: int, group=None):
        super().__init__(scfg, device, world_size, group)
        self.stage = int(scfg.zero)
        self.rank = dist.get_rank(group)
        self.flats: list[torch.Tensor] = []  # per bucket: its parameters, one flat buffer
        self.shards: list[torch.Tensor] = []  # per bucket: this rank's shard (the optimizer's)
        self.grads: list[torch.Tensor] = []  # per bucket: the shard's gradient, kept across steps
        self._pools: dict[tuple, BufferPool] = {}  # zero>=2: by (dtype, device) of the buckets
        self._gather_bytes = 0  # sent by the last all-gather of the parameters
        self._gather_ms = float("nan")  # and its time (CPU), exposed: the step waits for it

    def prepare(self, model: nn.Module) -> nn.Module:
        super().prepare(model)  # rank 0's parameters everywhere, buckets, hooks
        with torch.no_grad():
            for bucket in self.buckets:
                flat = _flat_params(bucket)
                self.flats.append(flat)
                self.shards.append(self._own_shard(flat))
                self.grads.append(torch.zeros_like(self.shards[-1]))
        return model

    def _own_shard(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's shard of a bucket's parameters: a view, so updating it updates the model."""
        return comm.shard(flat, self.rank, self.world_size)

    def _bucket_buffers(self, sizes: list[tuple]) -> list[torch.Tensor]:
        if self.stage < 2:
            return super()._bucket_buffers(sizes)
        # zero>=2: a pool (per dtype) of buffers as large as the IN_FLIGHT largest buckets; each
        # bucket's `buffer` is only its size, a view of the pool's largest (packing borrows one)
        for numel, dtype, device in sizes:
            if (dtype, device) not in self._pools:
                numels = [n for n, d, v in sizes if (d, v) == (dtype, device)]
                self._pools[(dtype, device)] = BufferPool(numels, dtype, device,
                                                          self.make_buffers)
        return [self._pools[(dtype, device)].buffers[0][:numel] for numel, dtype, device in sizes]

    # ---- the step ----

    def _launch(self, b: int) -> None:
        """Pack bucket b here and release its parameters' gradients (the buffer owns the values
        now), then reduce it: on the communication thread (overlap), else here."""
        bucket = self.buckets[b]
        self._probe()  # what this rank holds is at its most just before a release
        lent, buffer = self._borrow(bucket)
        with torch.no_grad():
            self._pack(bucket.params,
                       [view_like(buffer, off, p) for p, off in param_offsets(bucket)])
        for p in bucket.params:
            p.grad = None
        if self._worker is None:
            self._reduce_packed(b, lent, buffer, None)
        else:
            self._worker.submit(self._reduce_packed, b, lent, buffer, self._ready_event())

    def _borrow(self, bucket: Bucket) -> tuple[int | None, torch.Tensor]:
        """(which pool buffer, the buffer to pack bucket into): its own at zero=1."""
        if self.stage < 2:
            return None, bucket.buffer
        pool, numel = self._pools[(bucket.buffer.dtype, bucket.buffer.device)], bucket.numel
        lent = pool.lend(numel, self._worker.check if self._worker is not None else lambda: None)
        return lent, pool.buffers[lent][:numel]

    def _reduce_packed(self, b: int, lent: int | None, buffer: torch.Tensor, ready_event) -> None:
        """Reduce a packed bucket, keep this rank's shard of the average, give the buffer back
        (the communication thread, or _launch)."""
        n = self.world_size
        try:
            if ready_event is not None:
                torch.cuda.current_stream().wait_event(ready_event)
            with torch.no_grad():
                mine = comm.shard(buffer, self.rank, n)
                if self.stage == 1:
                    self._communicate(b, comm.all_reduce, buffer)
                else:
                    self._communicate(b, comm.reduce_scatter, buffer, mine)
                if self.comm_dtype is None and n > 1:
                    torch.div(mine, n, out=self.grads[b])  # SUM then divide, as zero=0 unpacks
                else:
                    self.grads[b].copy_(mine)  # (low dtype: divided before the cast already)
                self._flag_nonfinite(b, [self.grads[b]])  # what the optimizer reads: the shard's
        finally:
            if lent is not None:
                self._pools[(buffer.dtype, buffer.device)].give_back(lent)

    def _probe(self) -> None:
        if self.held_probe is not None:
            self.held_probe()

    def finish(self) -> None:
        super().finish()  # the rest launched, every bucket reduced
        for shard, grad in zip(self.shards, self.grads):  # what the optimizer reads
            shard.grad = grad

    def gather_params(self) -> None:
        """Every rank's updated shards into every bucket's parameters (after optimizer.step).
        Counted with the next step's reduction (bytes_per_step: from one finish() to the next)."""
        before, start = self._recorder.bytes_sent, time.perf_counter()
        with torch.no_grad():
            for b, (shard, flat) in enumerate(zip(self.shards, self.flats)):
                self._communicate(b, comm.all_gather, shard, flat, span="all_gather")
        self._gather_bytes = self._recorder.bytes_sent - before
        # (CUDA: the host only launched it; its time is in comm_busy_ms, from events)
        self._gather_ms = (time.perf_counter() - start) * 1e3 if not self.cuda else float("nan")

    def kept_grads(self) -> list[torch.Tensor]:
        return self.grads

    def comm_buffers(self) -> list[torch.Tensor]:
        if not self._pools:
            return super().comm_buffers()
        return [b for pool in self._pools.values() for b in pool.buffers]

    def comm_stats(self) -> dict:
        return {**super().comm_stats(), "zero": self.stage,
                "gather_bytes_per_step": self._gather_bytes, "gather_ms": self._gather_ms,
                "shard_numel": [s.numel() for s in self.shards]}

    # ---- the optimizer over this rank's shards ----

    def build_optimizer(self, model: nn.Module, cls: type, kwargs: dict) -> torch.optim.Optimizer:
        optimizer = cls(self.shards, **kwargs)  # optimizer parameter b: bucket b's shard
        optimizer.register_step_post_hook(lambda *_: self.gather_params())
        return optimizer

    def grad_scaler(self, scaler: torch.amp.GradScaler) -> torch.amp.GradScaler:
        return ShardedScaler.like(scaler, self.group)

    def clip_grad_norm_(self, optimizer, max_norm: float) -> torch.Tensor:
        """torch's clip_grad_norm_ over the whole gradient, from the shards: the global norm is
        the square root of the shards' squared norms summed over the ranks."""
        grads = [g for g in self.grads if g.numel()]
        total = torch.zeros(1, device=self.device)
        if grads:
            total += torch.stack(torch._foreach_norm(grads, 2.0)).pow(2).sum()
        dist.all_reduce(total, group=self.group)
        total = total.sqrt().squeeze(0)
        torch._foreach_mul_(grads, torch.clamp(max_norm / (total + 1e-6), max=1.0))
        return total


class ShardedScaler(torch.amp.GradScaler):
    """GradScaler whose inf/NaN verdict is every rank's: each unscales and checks only its shards,
    so the verdicts are all-reduced (max: a fused optimizer skips on exactly 1.0) before anything
    reads them, and every rank skips, or not, and moves its scale alike."""

    def __init__(self, device, init_scale, growth_factor, backoff_factor, growth_interval,
                 group=None):
        super().__init__(device, init_scale=init_scale, growth_factor=growth_factor,
                         backoff_factor=backoff_factor, growth_interval=growth_interval)
        self.group = group

    @classmethod
    def like(cls, scaler: torch.amp.GradScaler, group=None) -> torch.amp.GradScaler:
        """`scaler`'s settings, its verdicts agreed over `group` (a disabled one as it is)."""
        if not scaler.is_enabled():
            return scaler
        return cls(scaler._device, scaler._init_scale, scaler._growth_factor,  # noqa: SLF001
                   scaler._backoff_factor, scaler._growth_interval, group=group)  # noqa: SLF001

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
        found = super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
        if not found:  # no gradient here at all: still take part
            found = {found_inf.device: found_inf}
        for flag in found.values():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return found


class BufferPool:
    """Flat buffers as large as the IN_FLIGHT largest buckets, each lent to one bucket at a time:
    a bucket borrows the smallest free one that holds it when its turn comes (in bucket order),
    and its reduction gives it back. Waiting for one cannot deadlock: only buckets already handed
    to the communication thread hold them, and the largest holds any bucket. CUDA: the borrowing
    stream waits for the last user's work on the buffer."""

    def __init__(self, numels: list[int], dtype: torch.dtype, device: torch.device,
                 make_buffers):  # the sync's: (numel, dtype, device) each -> a buffer each
        self.buffers = make_buffers([(n, dtype, device)
                                     for n in sorted(numels, reverse=True)[:IN_FLIGHT]])
        self._free = set(range(len(self.buffers)))
        self._returned = threading.Condition()
        self._released: list = [None] * len(self.buffers)  # CUDA: after the last user's work

    def lend(self, numel: int, check) -> int:
        """The index of a free buffer of at least `numel` elements, waiting for one; `check()`
        raises if none can come back (the communication thread failed)."""
        with self._returned:
            while True:
                fits = [i for i in self._free if self.buffers[i].numel() >= numel]
                if fits:
                    i = min(fits, key=lambda j: self.buffers[j].numel())
                    self._free.remove(i)
                    break
                self._returned.wait(1.0)
                check()
        if self._released[i] is not None:
            torch.cuda.current_stream().wait_event(self._released[i])
        return i

    def give_back(self, i: int) -> None:
        if self.buffers[i].is_cuda:
            self._released[i] = torch.cuda.Event()
            self._released[i].record()
        with self._returned:
            self._free.add(i)
            self._returned.notify_all()


def _flat_params(bucket: Bucket) -> torch.Tensor:
    """One flat buffer holding the bucket's parameters, which become views into it."""
    dtypes = {p.dtype for p in bucket.params}
    if len(dtypes) > 1:
        raise ConfigError(f"sync.zero: a bucket holds parameters of dtypes {sorted(map(str, dtypes))}"
                          "; ZeRO shards one flat buffer per bucket, of one dtype (use "
                          "sync.comm_dtype=fp32, which buckets each dtype apart)")
    p0 = bucket.params[0]
    flat = torch.empty(sum(p.numel() for p in bucket.params), dtype=p0.dtype, device=p0.device)
    for p, off in param_offsets(bucket):
        view = view_like(flat, off, p)
        view.copy_(p)
        p.data = view
    return flat


def param_offsets(bucket: Bucket):
    """(parameter, its offset in the bucket's flat buffers), in the bucket's order."""
    off = 0
    for p in bucket.params:
        yield p, off
        off += p.numel()
