"""sync=ddp: torch's DistributedDataParallel, the reference every other sync is checked against."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from ddp_lab.sync.base import GradSync

COMPRESS_HOOKS = {"bf16": default_hooks.bf16_compress_hook, "fp16": default_hooks.fp16_compress_hook}


class DDPSync(GradSync):
    name = "ddp"

    def __init__(self, scfg, device: torch.device, world_size: int):
        self.cfg, self.device, self.world_size = scfg, device, world_size
        self.ddp: DistributedDataParallel | None = None

    def prepare(self, model: nn.Module) -> nn.Module:
        self.ddp = DistributedDataParallel(
            model,
            device_ids=[self.device] if self.device.type == "cuda" else None,
            bucket_cap_mb=self.cfg.bucket_cap_mb,
            gradient_as_bucket_view=self.cfg.gradient_as_bucket_view,
            static_graph=self.cfg.static_graph,
        )
        if self.cfg.comm_dtype in COMPRESS_HOOKS:
            # The hooks divide by world size before casting, so the sum cannot overflow fp16.
            self.ddp.register_comm_hook(None, COMPRESS_HOOKS[self.cfg.comm_dtype])
        return self.ddp

    def no_sync(self):
        return self.ddp.no_sync()

    def bytes_per_step(self) -> int:
        # DDP's ring (NCCL or gloo) moves 2(N-1)/N of the gradient bytes per rank.
        elem = {"fp32": 4, "bf16": 2, "fp16": 2}[self.cfg.comm_dtype]
        numel = sum(p.numel() for p in self.ddp.module.parameters() if p.requires_grad)
        return int(2 * (self.world_size - 1) / self.world_size * numel * elem)
