"""sync=naive|ring|tree sync.zero=1|2: ZeRO, a small step from the bucketed sync (bucketed.py).

Plain data parallelism keeps N copies of everything: every rank holds the whole optimizer state
and makes the same update. ZeRO (Rajbhandari et al., 2020) shards what only the update needs:
rank r keeps optimizer state for shard r of the parameters only and updates only that shard, and
the ranks then all-gather the updated shards, so the replicas are equal again. Here a shard is
per bucket: bucket b's flat parameters cut as `comm.shard` cuts (torch.tensor_split, rank r's is
piece r).

prepare(model)
    BucketedSync's buckets (hooks, communication thread, overlap with backward: all as there),
    and for each bucket a flat buffer of its parameters: every parameter becomes a view into it,
    laid out as it was (channels_last too), so gathering a bucket's shards puts its parameters in
    place. This rank's optimizer (`build_optimizer`) gets one tensor per bucket: its shard of that
    buffer, a view, so updating the shard updates the model.
the step
    zero=1  each bucket is all-reduced, as at zero=0: the full averaged gradient, in the bucket.
    zero=2  each bucket is reduce-scattered: this rank gets the sum of its shard only, and sends
            (N-1)/N of the bucket instead of 2(N-1)/N. The rest of the bucket is scratch, so all
            buckets pack into one buffer of the largest one's size, one bucket at a time.
    Then this rank's shard of the sum, divided by N, becomes the shard's .grad (a tensor of 1/N
    of the bucket, kept across steps); finish() then releases the model's .grad of every
    parameter (on the training thread): nothing reads them again. After `optimizer.step()` (a
    hook the optimizer runs after every step) each bucket's parameters are all-gathered, at the
    end of the step, on the training thread: the next forward reads every parameter.
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
    Each rank writes its own shards, nothing is gathered (ddp_lab/sharded_checkpoint.py):
    `state_shards` gives DCP each bucket's optimizer state as this rank's flat shard under a key
    of its own, with an offsets map (where each rank's shard lies in its bucket) in the layout.
    At M ranks the buckets are the same and only the cuts move: `load_state_shards` reads the
    saved shards that overlap this rank's new one and cuts it out of them.
memory per rank (P parameter bytes, fp32)
    parameters P; gradients P/N (the shards'); optimizer state k P / N (k = 1 for SGD momentum,
    2 for AdamW); buckets P at zero=1 (the all-reduce needs the whole), the largest bucket at
    zero=2. (zero=0: gradients P and buckets P; state k P.)
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import nn

from ddp_lab import comm
from ddp_lab.errors import ConfigError
from ddp_lab.sync.bucketed import Bucket, BucketedSync, view_like


class ShardedSync(BucketedSync):
    def __init__(self, scfg, device: torch.device, world_size: int, group=None):
        super().__init__(scfg, device, world_size, group)
        self.stage = int(scfg.zero)
        self.rank = dist.get_rank(group)
        self.flats: list[torch.Tensor] = []  # per bucket: its parameters, one flat buffer
        self.shards: list[torch.Tensor] = []  # per bucket: this rank's shard of it (a view)
        self.grads: list[torch.Tensor] = []  # per bucket: the shard's gradient, kept across steps
        self._gather_bytes = 0  # sent by the last all-gather of the parameters
        self._gather_ms = float("nan")  # and its time (CPU), exposed: the step waits for it

    def prepare(self, model: nn.Module) -> nn.Module:
        super().prepare(model)  # rank 0's parameters everywhere, buckets, hooks
        with torch.no_grad():
            for bucket in self.buckets:
                flat = _flat_params(bucket)
                self.flats.append(flat)
                self.shards.append(comm.shard(flat, self.rank, self.world_size))
                self.grads.append(torch.zeros_like(self.shards[-1]))
        return model

    def _bucket_buffers(self, sizes: list[tuple]) -> list[torch.Tensor]:
        if self.stage < 2:
            return super()._bucket_buffers(sizes)
        # zero=2: the buckets are scratch, used one at a time: one buffer of the largest
        scratch = {}
        for numel, dtype, device in sizes:
            if numel > scratch.get((dtype, device), torch.empty(0)).numel():
                scratch[(dtype, device)] = torch.zeros(numel, dtype=dtype, device=device)
        return [scratch[(dtype, device)][:numel] for numel, dtype, device in sizes]

    # ---- the step ----

    def _reduce_bucket(self, b: int, ready_event) -> None:
        """Pack, reduce, keep this rank's shard of the average (the communication thread, or
        finish())."""
        bucket, n = self.buckets[b], self.world_size
        if ready_event is not None:
            torch.cuda.current_stream().wait_event(ready_event)
        with torch.no_grad():
            self._pack(bucket)
            mine = comm.shard(bucket.buffer, self.rank, n)
            if self.stage == 1:
                self._communicate(b, comm.all_reduce, bucket.buffer)
            else:
                self._communicate(b, comm.reduce_scatter, bucket.buffer, mine)
            if self.comm_dtype is None and n > 1:
                torch.div(mine, n, out=self.grads[b])  # SUM then divide, as zero=0 unpacks
            else:
                self.grads[b].copy_(mine)  # (low dtype: divided before the cast already)
            self.shards[b].grad = self.grads[b]

    def finish(self) -> None:
        super().finish()
        # The packed gradients are released here, on the training thread once every bucket is
        # reduced, not by the communication thread: a .grad reassigned there raced autograd's
        # own use of the field during backward (glibc: "corrupted double-linked list").
        for p in self.params:  # the optimizer reads the shards' gradients
            p.grad = None

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

    # ---- checkpoints: each rank writes its shards; they load at any world size ----

    def state_shards(self, model, optimizer) -> tuple[dict, dict]:
        """The model's tensors (every rank holds them whole: DCP writes each once), and this
        rank's shard of each bucket's optimizer state under a key of its own,
        `optim.<bucket>.<state>.<rank>`; the layout says where each rank's shard lies in its
        bucket (the offsets map) and which state there is."""
        tensors = {f"model.{k}": v for k, v in model.state_dict().items()}
        keys = sorted(optimizer.state[self.shards[0]]) if self.shards else []
        for b, shard in enumerate(self.shards):
            for key in keys:
                tensors[f"optim.{b}.{key}.{self.rank}"] = optimizer.state[shard][key]
        buckets = [{"numel": flat.numel(), "shards": shard_ranges(flat.numel(), self.world_size)}
                   for flat in self.flats]
        return tensors, {"world_size": self.world_size, "buckets": buckets, "state": keys}

    def load_state_shards(self, model, optimizer, shards, layout: dict) -> None:
        """The model whole, and this rank's shard of each bucket's state cut out of the saved
        shards it overlaps (at any world size the buckets are the same; only where they are cut
        moves). A per-shard value (`step`) is the same in every shard: rank 0's is read."""
        if [b["numel"] for b in layout["buckets"]] != [f.numel() for f in self.flats]:
            raise ConfigError(f"checkpoint {shards.path}: its buckets are not this run's "
                              "(another model or sync.bucket_mb): nothing was loaded")
        request = {f"model.{k}": v for k, v in model.state_dict().items()}
        wanted = {}  # (bucket, state) -> [(the key of a saved shard we need, where it lies)]
        for b, saved in enumerate(layout["buckets"]):
            mine = shard_ranges(saved["numel"], self.world_size)[self.rank]
            for key in layout["state"]:
                wanted[b, key] = [(f"optim.{b}.{key}.{r}", where)
                                  for r, where in enumerate(saved["shards"])
                                  if (r == 0 if key in SCALARS else _overlap(where, mine))]
                request.update({name: shards.empty(name) for name, _ in wanted[b, key]})
        shards.read(request)  # collective: one read of everything
        state = {b: {} for b in range(len(self.shards))}
        for (b, key), pieces in wanted.items():
            mine = shard_ranges(layout["buckets"][b]["numel"], self.world_size)[self.rank]
            dtype = shards.dtype(f"optim.{b}.{key}.0")
            state[b][key] = (request[pieces[0][0]] if key in SCALARS else
                             _cut([(request[name], where) for name, where in pieces], mine, dtype))
        optimizer.load_state_dict({"state": state,
                                   "param_groups": optimizer.state_dict()["param_groups"]})


def _overlap(a: list[int], b: list[int]) -> bool:
    return max(a[0], b[0]) < min(a[1], b[1])


def _cut(pieces: list[tuple[torch.Tensor, list[int]]], mine: list[int], dtype) -> torch.Tensor:
    """Elements [start, stop) of a flat tensor, from `pieces`: (a part of it, where that lies)."""
    out = torch.empty(mine[1] - mine[0], dtype=dtype)
    for piece, (s, e) in pieces:
        lo, hi = max(s, mine[0]), min(e, mine[1])
        out[lo - mine[0]:hi - mine[0]] = piece[lo - s:hi - s]
    return out


def shard_ranges(numel: int, world_size: int) -> list[list[int]]:
    """Where each rank's shard (`comm.shard`: torch.tensor_split's pieces) lies in `numel`
    elements: [start, stop) per rank, the first numel % world_size one element longer."""
    size, longer = divmod(numel, world_size)
    starts = [r * size + min(r, longer) for r in range(world_size + 1)]
    return [[starts[r], starts[r + 1]] for r in range(world_size)]


# Optimizer state with one value per parameter (per shard here), not one per element.
SCALARS = ("step",)


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


def _flat_params(bucket: Bucket) -> torch.Tensor:
    """One flat buffer holding the bucket's parameters, which become views into it."""
    dtypes = {p.dtype for p in bucket.params}
    if len(dtypes) > 1:
        raise ConfigError(f"sync.zero: a bucket holds parameters of dtypes {sorted(map(str, dtypes))}"
                          "; ZeRO shards one flat buffer per bucket, of one dtype (use "
                          "sync.comm_dtype=fp32, which buckets each dtype apart)")
    p0 = bucket.params[0]
    flat = torch.empty(sum(p.numel() for p in bucket.params), dtype=p0.dtype, device=p0.device)
    for p, off in _offsets(bucket):
        view = view_like(flat, off, p)
        view.copy_(p)
        p.data = view
    return flat


def _offsets(bucket: Bucket):
    off = 0
    for p in bucket.params:
        yield p, off
        off += p.numel()
