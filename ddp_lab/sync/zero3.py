"""sync=naive|ring|tree sync.zero=3: ZeRO-3, the parameters sharded too (what FSDP does), one
step from ZeRO-2 (zero.py, whose buckets, pool, reduction and optimizer over shards it keeps).

units
    One per module that owns parameters (`unit_modules`: its own, `recurse=False`), the buckets
    of this sync in backward order: a convolution or a linear layer with its bias. A unit is one
    flat buffer holding its parameters, each a view into it (zero.py's `_flat_params`), so
    gathering the unit puts every parameter in place and freeing it (its storage resized to zero
    bytes) frees them all while each keeps its shape. Each rank keeps its shard of every unit
    (`comm.shard`), a tensor of its own, and the optimizer updates those. Nothing stays
    replicated: a bias travels with its weight, and a norm layer would be a unit of its own (one
    more small all-gather, latency-bound, where FSDP's wrapping policy would group it with a
    larger module). A unit's parameters must be used inside its module's forward (the hooks are
    the module's); prefetching assumes the modules run in registration order (our models do; in
    another order a unit is gathered when it is needed, with less overlap).
the step
    forward   a pre-hook gathers the module's unit (or waits for it: prefetched) and starts the
              next unit's all-gather on the communication thread (prefetch), so it overlaps
              this module's compute. After it, a hook frees the unit (reshard_after_forward=
              true) and puts a hook on its outputs' gradients.
    backward  that hook fires when the gradient reaches the module's output, before the
              module's backward: the unit is gathered again (or waited for) and the unit before
              it prefetched. When its last gradient is made (post-accumulate-grad hooks) it is
              reduce-scattered as a ZeRO-2 bucket (packed into a pool buffer on the autograd
              thread, its gradients released, reduced on the communication thread) and freed.
    update    the optimizer updates this rank's shards; nothing is gathered after it: the next
              forward gathers each unit as it comes.
    With B units a step runs B all-gathers in forward, B in backward (none with
    reshard_after_forward=false: a unit stays gathered from its forward to its backward), B
    reduce-scatters: 1.5x the all-reduce's bytes (1x without resharding). Under no_sync()
    (accumulation) the units are gathered and freed alike; only the gradients are not reduced.
    Outside a step (evaluation under no_grad) a unit is freed after its forward whatever the key;
    the replica check gathers every unit (`unsharded`). A checkpoint gathers nothing: each rank
    writes its shard of every unit and of its optimizer state, as at ZeRO-1/2, and a load cuts a
    rank's new shards out of the saved ones that overlap them (`state_shards`).
CUDA
    A unit's storage is allocated and freed by the thread that needs it, on its stream (the
    training or autograd stream); the communication stream only writes into it, after an event
    recorded at allocation, and the consumer waits for an event recorded after the all-gather.
    Freeing first makes the consumer's stream wait for that event too (a prefetched unit nobody
    read), so the caching allocator never hands out memory the side stream may still write.
memory per rank (ddp_lab/perf/memory.py's `predict_held`)
    parameters P/N plus the units gathered at a time (with prefetch: two, a unit and the next;
    all of them between forward and backward with reshard_after_forward=false); gradients P/N
    plus the unit whose gradients are being made; optimizer state k P / N; the pool, as large as
    the two largest units. AlexNet's 4096 x 4096 layer is one unit: it bounds what sharding saves.
"""

from __future__ import annotations

import contextlib
import threading
from functools import partial

import torch
from torch import nn

from ddp_lab import comm
from ddp_lab.sync.bucketed import view_like
from ddp_lab.sync.zero import ShardedSync, param_offsets


def unit_modules(model: nn.Module) -> list[nn.Module]:
    """The modules that own trainable parameters, in registration order: ZeRO-3's units."""
    return [m for m in model.modules()
            if any(p.requires_grad for p in m.parameters(recurse=False))]


def unit_numels(model: nn.Module) -> list[int]:
    """Each unit's parameter elements, in registration order (the memory prediction's units)."""
    return [sum(p.numel() for p in m.parameters(recurse=False) if p.requires_grad)
            for m in unit_modules(model)]


class ZeRO3Sync(ShardedSync):
    forward_communicates = True
    def __init__(self, scfg, device: torch.device, world_size: int, group=None):
        super().__init__(scfg, device, world_size, group)
        self.reshard_after_forward = bool(scfg.reshard_after_forward)
        self.units: list[nn.Module] = []  # unit b's module is units[b]: backward order
        self._gathers: list[threading.Event | None] = []  # None: freed; set: gathered
        self._gathered_events: list = []  # CUDA: after each unit's all-gather
        self._made: list[int] = []  # per unit: gradients made since its forward
        self._in_backward: list[bool] = []  # per unit: its backward has begun
        self._gather_calls = {"forward": 0, "backward": 0}  # this step's all-gathers, by phase
        self._last_gathers = dict(self._gather_calls)  # the last step's

    def prepare(self, model: nn.Module) -> nn.Module:
        self.units = unit_modules(model)[::-1]
        super().prepare(model)  # buckets = units, each a flat buffer; this rank's shards
        b = len(self.buckets)
        self._gathers, self._gathered_events = [threading.Event() for _ in range(b)], [None] * b
        self._made, self._in_backward = [0] * b, [False] * b
        for gathered in self._gathers:
            gathered.set()  # (prepare left every unit whole)
        for u in range(b):
            self._free(u)
        return model

    def _build_buckets(self, params):
        """One bucket per unit, in backward order; in each, its parameters reversed (as zero<3
        lays out a bucket). (`params`, every trainable one, are all in some unit.)"""
        params, groups = [], []
        for m in self.units:
            own = [p for p in m.parameters(recurse=False) if p.requires_grad][::-1]
            groups.append(list(range(len(params), len(params) + len(own))))
            params += own
        return self._buckets_of(params, groups, [self.comm_dtype or p.dtype for p in params])

    def _own_shard(self, flat: torch.Tensor) -> torch.Tensor:
        return comm.shard(flat, self.rank, self.world_size).clone()  # the unit's flat is freed

    def _install_hooks(self, model: nn.Module) -> list:
        hooks = [p.register_post_accumulate_grad_hook(self._on_grad_made) for p in self.params]
        for u, module in enumerate(self.units):
            hooks.append(module.register_forward_pre_hook(partial(self._before_forward, u)))
            hooks.append(module.register_forward_hook(partial(self._after_forward, u)))
        return hooks

    def build_optimizer(self, model: nn.Module, cls: type, kwargs: dict) -> torch.optim.Optimizer:
        return cls(self.shards, **kwargs)  # nothing gathered after a step: forward does it

    # ---- the hooks ----

    def _before_forward(self, u: int, module, args) -> None:
        self._made[u], self._in_backward[u] = 0, False
        phase = "forward" if torch.is_grad_enabled() else "eval"
        self._gather(u, phase)
        if u > 0:
            self._prefetch(u - 1, phase)  # the next module's, in forward order

    def _after_forward(self, u: int, module, args, output) -> None:
        if torch.is_grad_enabled():
            for t in output if isinstance(output, (tuple, list)) else (output,):
                if torch.is_tensor(t) and t.requires_grad:
                    t.register_hook(partial(self._before_backward, u))
        if self.reshard_after_forward or not torch.is_grad_enabled():
            self._free(u)

    def _before_backward(self, u: int, grad: torch.Tensor) -> None:
        """The gradient reached the unit's output: its backward is next."""
        if not self._in_backward[u]:
            self._in_backward[u] = True
            self._gather(u, "backward")
            if u + 1 < len(self.buckets):
                self._prefetch(u + 1, "backward")

    def _on_grad_made(self, p: nn.Parameter) -> None:
        """Post-accumulate-grad hook (the autograd thread)."""
        if self.overlap:
            self._on_grad_ready(p)  # counted in its bucket; launched in bucket order
        u = self._bucket_of[p]
        self._made[u] += 1
        if self._made[u] == len(self.buckets[u].params):
            self._free(u)  # its backward is over: nothing reads these parameters again

    # ---- gathering and freeing a unit ----

    def _gather(self, u: int, phase: str) -> None:
        """Unit u whole here (the calling thread and its stream), gathering it if need be."""
        if self._gathers[u] is None:
            self._start_gather(u, phase)
        if self._worker is not None:
            self._worker.wait(self._gathers[u])
        if self.cuda:
            torch.cuda.current_stream().wait_event(self._gathered_events[u])

    def _prefetch(self, u: int, phase: str) -> None:
        if self._worker is not None and self._gathers[u] is None:
            self._start_gather(u, phase)

    def _start_gather(self, u: int, phase: str) -> None:
        """Allocate unit u's storage here and all-gather into it (the communication thread)."""
        flat = self.flats[u]
        flat.untyped_storage().resize_(flat.numel() * flat.element_size())
        counted = phase in self._gather_calls  # a training step's, not evaluation's
        if counted:
            self._gather_calls[phase] += 1
        if self._worker is None:
            self._all_gather(u, None, counted)
            self._gathers[u] = threading.Event()
            self._gathers[u].set()
        else:
            self._gathers[u] = self._worker.submit(self._all_gather, u, self._ready_event(),
                                                   counted)

    def _all_gather(self, u: int, ready_event, counted: bool, into=None) -> None:
        """Every rank's shard of unit u into its storage (`into`: a buffer of the same size)."""
        if ready_event is not None:
            torch.cuda.current_stream().wait_event(ready_event)
        with torch.no_grad():
            self._communicate(u, comm.all_gather, self.shards[u],
                              self.flats[u] if into is None else into, span="all_gather",
                              counted=counted)
        if self.cuda:
            self._gathered_events[u] = torch.cuda.Event()
            self._gathered_events[u].record()

    def _free(self, u: int) -> None:
        """Release unit u's parameters (their storage), once its all-gather is done."""
        if self._gathers[u] is None:
            return
        self._probe()  # what this rank holds is at its most just before a release
        if self._worker is not None:
            self._worker.wait(self._gathers[u])
        if self.cuda and self._gathered_events[u] is not None:
            torch.cuda.current_stream().wait_event(self._gathered_events[u])
        self.flats[u].untyped_storage().resize_(0)
        self._gathers[u] = None

    # ---- the step's end, and the whole model outside a step ----

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            for u in range(len(self.buckets)):  # a unit whose backward never came
                self._free(u)

    def _end_step(self) -> None:
        self._last_gathers, self._gather_calls = self._gather_calls, {"forward": 0, "backward": 0}
        super()._end_step()

    @contextlib.contextmanager
    def unsharded(self):
        """Every parameter whole, in buffers of this call's own: whatever is done to them inside
        (torch.save's numpy view makes a storage unresizable) leaves the units' storages as the
        step needs them. On exit this rank keeps its shard of what they hold."""
        own = [p.data for p in self.params]  # views into the units' storages, restored on exit
        whole = [torch.empty_like(flat) for flat in self.flats]
        for u, bucket in enumerate(self.buckets):
            self._run(self._all_gather, u, self._ready_event(), False, whole[u])
            if self.cuda:
                torch.cuda.current_stream().wait_event(self._gathered_events[u])
            for p, off in param_offsets(bucket):
                p.data = view_like(whole[u], off, p)
        try:
            yield
        finally:
            with torch.no_grad():
                for u, flat in enumerate(whole):
                    self.shards[u].copy_(comm.shard(flat, self.rank, self.world_size))
            for p, view in zip(self.params, own):
                p.data = view

    # ---- checkpoints: this rank's shards, of the parameters too; nothing is gathered ----
    # (zero_checkpoint.py's state_shards and load_state_shards, with the parameters' shards as
    # `param.<unit>.<rank>` and where each parameter lies in its unit in the layout: what a load
    # checks the model against, and how `sharded_checkpoint.read_whole` makes it whole)

    def _param_shards(self) -> dict[tuple[int, str], torch.Tensor]:
        return {(u, f"param.{u}"): shard for u, shard in enumerate(self.shards)}

    def _layout(self, model: nn.Module, optimizer) -> dict:
        return super()._layout(model, optimizer) | {"params": self._param_layout(model)}

    def _whole_entries(self, model: nn.Module) -> dict:
        """The model's state_dict without the units' parameters (whose storage is freed)."""
        sharded = {name for name, p in model.named_parameters() if p in self._bucket_of}
        return {k: v for k, v in model.state_dict().items() if k not in sharded}

    def _param_layout(self, model: nn.Module) -> dict:
        """name -> its unit, offset in the unit's flat buffer, shape and strides (channels_last
        lies in the flat buffer as it does in memory)."""
        names = {p: name for name, p in model.named_parameters()}
        return {names[p]: {"unit": u, "offset": off, "shape": list(p.shape),
                           "stride": list(p.stride())}
                for u, bucket in enumerate(self.buckets) for p, off in param_offsets(bucket)}

    def _run(self, fn, *args) -> None:
        """fn(*args) where this sync communicates (the communication thread, or here), waited."""
        if self._worker is None:
            fn(*args)
        else:
            self._worker.wait(self._worker.submit(fn, *args))

    def comm_stats(self) -> dict:
        return {**super().comm_stats(), "units": len(self.buckets),
                "reshard_after_forward": self.reshard_after_forward,
                "all_gathers_per_step": dict(self._last_gathers)}
