"""Numeric precision of the training step: fp32, TF32, fp16 autocast with loss scaling, bf16 autocast.

AMP order (the loop follows it, once): autocast forward -> scaled backward -> gradient sync ->
unscale_ -> clip -> step -> update. The scaler unscales after the sync, so every rank sees the same
averaged gradients and therefore makes the same skip decision on an inf/NaN.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from ddp_lab.config import ConfigError

AUTOCAST_DTYPES = {"none": None, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class Precision:
    device_type: str
    autocast_dtype: torch.dtype | None
    scaler: torch.amp.GradScaler

    def autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.autocast_dtype)


def setup_precision(pcfg, device: torch.device, cudnn_benchmark: bool = True) -> Precision:
    """Set the global math flags for `precision=` and build the autocast context and GradScaler."""
    # TF32 applies to fp32 matmuls/convolutions only; under autocast the big ops are 16-bit anyway.
    torch.backends.cuda.matmul.allow_tf32 = pcfg.tf32
    torch.backends.cudnn.allow_tf32 = pcfg.tf32
    torch.backends.cudnn.benchmark = cudnn_benchmark
    scaler = torch.amp.GradScaler(device.type, init_scale=pcfg.init_scale,
                                  growth_interval=pcfg.growth_interval, enabled=pcfg.grad_scaler)
    if pcfg.grad_scaler and not scaler.is_enabled():
        raise ConfigError(f"precision={pcfg.name}: the GradScaler would disable itself on "
                          f"device {device}; use precision=bf16 (no scaler needed)")
    return Precision(device.type, AUTOCAST_DTYPES[pcfg.autocast_dtype], scaler)
