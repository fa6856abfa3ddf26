"""sync=ddp: torch's DistributedDataParallel, the reference every other sync is checked against;
with sync.zero=1 its optimizer is torch's ZeroRedundancyOptimizer (ZeRO-1: each rank holds the
state of, and updates, whole parameters assigned to it, then broadcasts them), the reference for
sync=naive|ring|tree sync.zero=1 (ddp_lab/sync/zero.py).

`sync.compress` runs torch's own comm hooks (bf16_compress_hook, fp16_compress_hook,
powerSGD_hook): the reference ddp_lab/compress is checked against. PowerSGD's state goes into
checkpoints by parameter, and follows DDP's buckets wherever they are laid out
(ddp_lab/compress/torch_powersgd.py).

Bytes and elements, counted where they are handed to the backend (what the backend then sends is
inside it): every tensor a comm hook all-reduces (torch's `allreduce_hook`, the divide-first
`compress_hook` for a 16-bit `sync.comm_dtype`, torch's compression hooks: their own code, run
from private copies of their modules whose `dist.all_reduce` counts, in whatever dtype and
however many elements they send), and with ZeRO-1 every parameter broadcast after the optimizer
step, seen at the dispatcher (`c10d.broadcast_`). They are reported as payload bytes and as bus
bytes by nccl-tests' convention: an all-reduce's payload x 2(N-1)/N, a broadcast's x 1, what a
ring-family algorithm sends per rank (`comm.cost`)."""

from __future__ import annotations

import importlib.util
import threading
from types import ModuleType, SimpleNamespace

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from ddp_lab import comm
from ddp_lab.compress.torch_powersgd import TorchPowerSGD
from ddp_lab.dtypes import DTYPES
from ddp_lab.sync.base import GradSync, NonfiniteFlag
from ddp_lab.sync.config import SYNCS


def compress_hook(dtype: torch.dtype, collectives):
    """A DDP comm hook: all-reduce each bucket in `dtype`, averaged, through `collectives`
    (torch.distributed, or Handed's counting stand-in for it).

    Unlike torch's fp16_compress_hook / bf16_compress_hook, which cast the bucket down *first* and
    divide by the world size afterwards (so any gradient above 65504 becomes inf in fp16 even
    when the average would fit), this divides in the bucket's own precision and then casts, as
    our own syncs do: the fp16 sum of averages overflows only where the average itself does."""

    def hook(process_group, bucket):
        group = process_group if process_group is not None else dist.group.WORLD
        buffer = bucket.buffer()
        compressed = torch.empty_like(buffer, dtype=dtype)
        torch.div(buffer, dist.get_world_size(group), out=compressed)
        fut = collectives.all_reduce(compressed, group=group, async_op=True).get_future()

        def decompress(fut):
            buffer.copy_(fut.value()[0])
            return buffer

        return fut.then(decompress)

    hook.__name__ = f"{str(dtype).replace('torch.', '')}_divide_first_compress_hook"
    return hook


def timed_hook(hook, tracer):
    """`hook` with its buckets stamped into `tracer` during traced steps: `bucket_ready` when DDP
    hands the bucket over (its gradients are all there), `allreduce` from launching the bucket's
    all-reduce to its future's callback. On gloo the callback runs when the collective has
    finished; on NCCL it is ordered after the collective on the stream, where its CUDA event is
    recorded. Either way the span bounds the collective from outside: it includes the time a
    bucket waited behind the ones launched before it."""

    def traced(process_group, bucket):
        if tracer.step is None:
            return hook(process_group, bucket)
        index, buffer = bucket.index(), bucket.buffer()
        start = tracer.stamp()
        tracer.instant("compute", "bucket_ready", start, bucket=index)

        def done(fut):
            tracer.span("comm", "allreduce", start, tracer.stamp(), bucket=index,
                        bytes=buffer.numel() * buffer.element_size(), algo="ddp")
            return fut.value()

        return hook(process_group, bucket).then(done)

    return traced


def flagging_hook(hook, armed: list[NonfiniteFlag], rank: int, world_size: int):
    """`hook`, then, once `armed` holds the guard's flag (DDPSync.check_nonfinite), this rank's
    1/N of each averaged bucket checked for inf/NaN in the hook's callback: beside backward, as
    our syncs do (ddp_lab/sync/bucketed.py). Every rank holds the same average, so the parts
    cover it once. DDP launches its buckets in index order, once a step: bucket 0 clears the
    last step's flag. The hook must not hold the sync: DDP's C++ reducer holds the hook, and a
    cycle through it, which Python's collector cannot see, would keep the process group (and
    gloo's threads) alive after the run (tests/test_dist.py)."""

    def flagging(state, bucket):
        if not armed:
            return hook(state, bucket)
        flag = armed[0]
        if bucket.index() == 0:
            flag.clear()

        def check(fut):
            averaged = fut.value()
            flag.check([comm.shard(averaged, rank, world_size)])
            return averaged

        return hook(state, bucket).then(check)

    return flagging


def state_kept_when_nonfinite(hook, state):
    """torch's powerSGD_hook, but a bucket whose average holds an inf/NaN keeps the error
    buffer and warm-start Q it had before (as our compressors do: ddp_lab/compress). torch's
    hook would keep the poisoned ones, and every later step of the bucket would be non-finite:
    the guard (train.nonfinite=skip) or fp16's GradScaler would skip the rest of the run. Kept on
    the device (torch.where on the bucket's verdict), at the cost of a copy of each bucket's
    error buffer and Q per step; only a bucket's first compressed step, which has nothing to go
    back to, reads its verdict on the host, and then starts afresh next time."""
    kept = {"error": state.error_dict, "q": state.q_memory_dict}

    def keeping(process_group, bucket):
        i = bucket.index()
        before = {name: d[i].clone() for name, d in kept.items() if i in d}

        def keep(fut):
            averaged = fut.value()
            made = [d for d in kept.values() if i in d]  # none before compression starts
            if not made:
                return averaged
            finite = torch.isfinite(averaged).all()
            for name, old in before.items():
                kept[name][i] = torch.where(finite, kept[name][i], old)
            if len(before) < len(made) and not finite:  # its first compressed step: forget
                for d in (*made, state.p_memory_dict):  # it, as if it had not run
                    d.pop(i, None)
            return averaged

        return hook(process_group, bucket).then(keep)

    return keeping


def one_bucket_at_a_time(hook):
    """`hook`, each bucket launched only once the one before it has finished. torch's
    powerSGD_hook all-reduces P and Q from inside its futures' callbacks and waits there; on gloo
    those callbacks run on the group's worker threads (two), so two buckets in that wait hold
    both threads and the all-reduces they wait for never run: a deadlock, every time with small
    buckets (tests/test_compress_sync.py). With one bucket in flight a worker stays free. The
    price: on gloo, PowerSGD's buckets no longer overlap each other (a bucket still overlaps
    the backward that fills the next one)."""
    last = []

    def launch(state, bucket):
        if last:
            last.pop().wait()  # on the autograd thread: the next bucket waits, not a gloo worker
        last.append(hook(state, bucket))
        return last[0]

    return launch


class Handed:
    """Payload bytes and elements handed to the backend since the last `take()`, by collective:
    all-reduces as the hooks make them through `self.dist`, broadcasts as _Broadcasts sees them."""

    def __init__(self):
        self.allreduce = self.elements = self.broadcast = 0
        self._lock = threading.Lock()  # torch's hooks all-reduce from the backend's threads too
        self.dist = _CountingDist(self)

    def all_reduce(self, tensor: torch.Tensor, *args, **kwargs):
        with self._lock:
            self.allreduce += tensor.numel() * tensor.element_size()
            self.elements += tensor.numel()
        return dist.all_reduce(tensor, *args, **kwargs)

    def take(self) -> tuple[int, int, int]:
        """(all-reduce payload bytes, broadcast payload bytes, all-reduced elements)."""
        with self._lock:
            out = self.allreduce, self.broadcast, self.elements
            self.allreduce = self.broadcast = self.elements = 0
        return out


class _CountingDist:
    """torch.distributed as the comm hooks see it here: all_reduce counted by `handed` first."""

    def __init__(self, handed: Handed):
        self.all_reduce = handed.all_reduce

    def __getattr__(self, name):
        return getattr(dist, name)


def counting_copy(module: ModuleType, **globals_) -> ModuleType:
    """A private copy of `module` (its source run again) with `globals_` in place of its own:
    torch's powerSGD_hook all-reduces P and Q in future callbacks on the backend's threads, where
    no thread-local dispatch mode sees them, but every call looks up its module's `dist`."""
    spec = importlib.util.find_spec(module.__name__)
    copy = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(copy)
    vars(copy).update(globals_)
    return copy


class _TorchWithoutCuda:
    """torch as the hook's copy sees it for CPU buckets: powerSGD_hook's decompress calls
    torch.cuda.synchronize(the bucket's device) whenever CUDA is available, which raises
    "Expected a cuda device, but got: cpu" when gloo trains on the CPU of a machine with a GPU."""

    cuda = SimpleNamespace(is_available=lambda: False)

    def __getattr__(self, name):
        return getattr(torch, name)


class _Broadcasts(TorchDispatchMode):
    """Adds to `handed.broadcast` the bytes of every tensor given to a c10d broadcast inside the
    block: the dispatcher sees exactly what reaches the backend, whichever way the optimizer
    cuts its parameters (one by one, or as buckets)."""

    def __init__(self, handed: Handed):
        super().__init__()
        self.handed = handed

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.c10d.broadcast_.default:
            self.handed.broadcast += sum(t.numel() * t.element_size() for t in args[0])
        return func(*args, **(kwargs or {}))


def counting_zero_optimizer(handed: Handed):
    """torch's ZeroRedundancyOptimizer whose step counts the parameter broadcasts it ends with."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    class CountingZeroRedundancyOptimizer(ZeroRedundancyOptimizer):
        def step(self, closure=None, **kwargs):
            with _Broadcasts(handed):
                return super().step(closure, **kwargs)

    return CountingZeroRedundancyOptimizer


@SYNCS.register("ddp", reads=("bucket_mb", "comm_dtype", "compress", "gradient_as_bucket_view",
                              "static_graph", "zero"))  # zero: 1 only (sync/config.py)
class DDPSync(GradSync):
    name = "ddp"

    def __init__(self, scfg, device: torch.device, world_size: int):
        self.cfg, self.device, self.world_size = scfg, device, world_size
        self.ddp: DistributedDataParallel | None = None
        self.handed = Handed()
        self.powersgd: TorchPowerSGD | None = None  # torch's state, with sync.compress=powersgd
        self._last = (0, 0, 0)  # the last step's Handed.take()
        self._nonfinite: list[NonfiniteFlag] = []  # the guard's, once it asks (flagging_hook)

    def prepare(self, model: nn.Module) -> nn.Module:
        self.ddp = DistributedDataParallel(
            model,
            device_ids=[self.device] if self.device.type == "cuda" else None,
            bucket_cap_mb=self.cfg.bucket_mb,
            gradient_as_bucket_view=self.cfg.gradient_as_bucket_view,
            static_graph=self.cfg.static_graph,
        )
        hook, state = self._hook(model)
        if self.tracer is not None:
            hook = timed_hook(hook, self.tracer)
        rank = dist.get_rank() if self.world_size > 1 else 0
        self.ddp.register_comm_hook(
            state, flagging_hook(hook, self._nonfinite, rank, self.world_size))
        return self.ddp

    def check_nonfinite(self) -> torch.Tensor:
        if not self._nonfinite:
            self._nonfinite.append(NonfiniteFlag(self.device))
        return self._nonfinite[0].flag

    def _hook(self, model: nn.Module):
        """(DDP's comm hook, its state), its all-reduces counted by self.handed: torch's own hooks
        for sync.compress (the reference for ours); otherwise divide by the world size, then (a
        16-bit sync.comm_dtype: cast down, see compress_hook) sum."""
        c, counting = self.cfg, self.handed.dist
        default = counting_copy(default_hooks, dist=counting)
        if c.compress == "powersgd":
            state = powerSGD_hook.PowerSGDState(
                None, matrix_approximation_rank=c.compress_rank,
                start_powerSGD_iter=c.compress_start, min_compression_rate=c.min_compression_rate,
                use_error_feedback=c.error_feedback, warm_start=True, random_seed=0)
            self.powersgd = TorchPowerSGD(state, model)
            cpu = {"torch": _TorchWithoutCuda()} if self.device.type == "cpu" else {}
            ours = counting_copy(powerSGD_hook, dist=counting, default=default,
                                 **cpu).powerSGD_hook
            ours = self.powersgd.rekeyed(state_kept_when_nonfinite(ours, state))
            gloo = dist.get_backend() == "gloo"
            return one_bucket_at_a_time(ours) if gloo else ours, state
        if c.compress in ("bf16", "fp16"):
            torchs = getattr(default, f"{c.compress}_compress_hook")
            # under another name: DDP refuses one named bf16_compress_hook where torch was built
            # without NCCL, though gloo all-reduces bf16
            return (lambda state, bucket: torchs(state, bucket)), None
        if c.comm_dtype != "fp32":
            return compress_hook(DTYPES[c.comm_dtype], counting), None
        return default.allreduce_hook, None

    def finish(self) -> None:
        # A step's bytes: from one finish() to the next, so ZeRO-1's broadcasts after a step
        # count with the next one's all-reduces (as ddp_lab/sync/zero.py counts its gathers).
        self._last = self.handed.take()

    def no_sync(self):
        return self.ddp.no_sync()

    def build_optimizer(self, model: nn.Module, cls: type, kwargs: dict) -> torch.optim.Optimizer:
        if not self.cfg.zero:
            return super().build_optimizer(model, cls, kwargs)
        zero = counting_zero_optimizer(self.handed)
        return zero(model.parameters(), optimizer_class=cls, **kwargs)

    def comm_buffers(self):
        return None  # DDP's buckets live inside its C++ reducer: not counted

    def compress_state(self):
        return None if self.powersgd is not None else []  # torch's hook keeps it: not counted

    def state_dict(self) -> dict:
        return {"powersgd": self.powersgd.state_dict()} if self.powersgd is not None else {}

    def load_state_dict(self, state: dict) -> None:
        if self.powersgd is not None:
            self.powersgd.load_state_dict(state["powersgd"], self.device)

    # ---- checkpoints at sync.zero=1: each rank writes the state of the parameters it updates ----

    def state_shards(self, model: nn.Module, optimizer) -> tuple[dict, dict]:
        """The model's tensors (every rank holds them: DCP writes each once) and the state of
        the whole parameters ZeroRedundancyOptimizer gave this rank, `optim.<name>.<state>`."""
        tensors = {f"model.{k}": v for k, v in model.state_dict().items()}
        names = {p: name for name, p in model.named_parameters()}
        for p, state in optimizer.optim.state.items():
            tensors.update({f"optim.{names[p]}.{k}": v for k, v in state.items()})
        kinds = sorted(next(iter(optimizer.optim.state.values()), {}))
        return tensors, {"world_size": self.world_size, "state": kinds}

    def load_state_shards(self, model: nn.Module, optimizer, shards, layout: dict) -> None:
        """The model, and the state of the parameters this rank updates now (at another world
        size ZeroRedundancyOptimizer deals them out again: other ranks wrote some)."""
        request = {f"model.{k}": v for k, v in model.state_dict().items()}
        names = {p: name for name, p in model.named_parameters()}
        local = optimizer.optim
        mine = [names[p] for group in local.param_groups for p in group["params"]]
        keys = {(name, k): f"optim.{name}.{k}" for name in mine for k in layout["state"]}
        request.update({key: shards.empty(key) for key in keys.values()})
        shards.read(request)  # collective
        state = {i: {k: request[keys[name, k]] for k in layout["state"]}
                 for i, name in enumerate(mine)}
        local.load_state_dict({"state": state, "param_groups": local.state_dict()["param_groups"]})

    def bytes_per_step(self) -> int:
        """Bus bytes of the last step (nccl-tests' convention; see the module)."""
        allreduce, broadcast, _ = self._last
        n = self.world_size
        return int(allreduce * 2 * (n - 1) / n) + broadcast

    def comm_stats(self) -> dict:
        allreduce, broadcast, elements = self._last
        stats = {**super().comm_stats(), "payload_bytes_per_step": allreduce + broadcast,
                 "allreduce_payload_bytes": allreduce, "broadcast_payload_bytes": broadcast,
                 "bytes_per_step_is": "bus bytes by nccl-tests' convention: payload handed to "
                                      "the backend x 2(N-1)/N for all-reduces, x 1 for broadcasts"}
        if self.cfg.compress != "none":  # the last step's, counted; with PowerSGD torch's own
            # count too, elements before and after compression over the whole run
            stats["compression"] = {"compress": self.cfg.compress, "elements_per_step": elements}
        if self.powersgd is not None:
            rate, before, after = self.powersgd.state.compression_stats()
            stats["compression"] |= {"numel_before": before, "numel_after": after, "rate": rate}
        return stats
