"""sync=ddp: torch's DistributedDataParallel, the reference every other sync is checked against;
with sync.zero=1 its optimizer is torch's ZeroRedundancyOptimizer (ZeRO-1: each rank holds the
state of, and updates, whole parameters assigned to it, then broadcasts them), the reference for
sync=naive|ring|tree sync.zero=1 (ddp_lab/sync/zero.py)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from ddp_lab.dtypes import DTYPES, element_size
from ddp_lab.sync.base import GradSync
from ddp_lab.sync.config import SYNCS


def compress_hook(dtype: torch.dtype):
    """A DDP comm hook: all-reduce each bucket in `dtype`, averaged.

    Unlike torch's fp16_compress_hook / bf16_compress_hook, which cast the bucket down *first* and
    divide by the world size afterwards (so any gradient above 65504 becomes inf in fp16 even
    when the average would fit), this divides in the bucket's own precision and then casts, as
    our own syncs do: the fp16 sum of averages overflows only where the average itself does."""

    def hook(process_group, bucket):
        group = process_group if process_group is not None else dist.group.WORLD
        buffer = bucket.buffer()
        compressed = torch.empty_like(buffer, dtype=dtype)
        torch.div(buffer, dist.get_world_size(group), out=compressed)
        fut = dist.all_reduce(compressed, group=group, async_op=True).get_future()

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


@SYNCS.register("ddp", reads=("bucket_mb", "comm_dtype", "gradient_as_bucket_view",
                              "static_graph", "zero"))  # zero: 1 only (sync/config.py)
class DDPSync(GradSync):
    name = "ddp"

    def __init__(self, scfg, device: torch.device, world_size: int):
        self.cfg, self.device, self.world_size = scfg, device, world_size
        self.ddp: DistributedDataParallel | None = None

    def prepare(self, model: nn.Module) -> nn.Module:
        self.ddp = DistributedDataParallel(
            model,
            device_ids=[self.device] if self.device.type == "cuda" else None,
            bucket_cap_mb=self.cfg.bucket_mb,
            gradient_as_bucket_view=self.cfg.gradient_as_bucket_view,
            static_graph=self.cfg.static_graph,
        )
        hook = None
        if self.cfg.comm_dtype != "fp32":
            # Divide by the world size, then cast down, then sum: see compress_hook.
            hook = compress_hook(DTYPES[self.cfg.comm_dtype])
        if self.tracer is not None:
            hook = timed_hook(hook or default_hooks.allreduce_hook, self.tracer)
        if hook is not None:
            self.ddp.register_comm_hook(None, hook)
        return self.ddp

    def no_sync(self):
        return self.ddp.no_sync()

    def build_optimizer(self, model: nn.Module, cls: type, kwargs: dict) -> torch.optim.Optimizer:
        if not self.cfg.zero:
            return super().build_optimizer(model, cls, kwargs)
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(model.parameters(), optimizer_class=cls, **kwargs)

    def comm_buffers(self):
        return None  # DDP's buckets live inside its C++ reducer: not counted

    def optimizer_state(self, optimizer) -> dict | None:
        if not self.cfg.zero:
            return super().optimizer_state(optimizer)
        optimizer.consolidate_state_dict(to=0)  # collective: every rank's part, to rank 0
        return optimizer.state_dict() if dist.get_rank() == 0 else None

    def bytes_per_step(self) -> int:
        # Estimated, not counted (DDP's traffic is inside the backend): DDP's ring (NCCL or gloo) moves 2(N-1)/N of the gradient bytes per rank.
        elem = element_size(self.cfg.comm_dtype)
        numel = sum(p.numel() for p in self.ddp.module.parameters() if p.requires_grad)
        return int(2 * (self.world_size - 1) / self.world_size * numel * elem)
