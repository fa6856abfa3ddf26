"""Numeric precision of the training step: fp32, TF32, fp16 autocast with loss scaling, bf16 autocast.

AMP order (the loop follows it, once): autocast forward -> scaled backward -> gradient sync ->
unscale_ -> clip -> step -> update. The scaler unscales after the sync, so every rank sees the same
averaged gradients and therefore makes the same skip decision on an inf/NaN.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from omegaconf import MISSING

from ddp_lab.errors import ConfigError
from ddp_lab.keys import key, text

AUTOCAST_DTYPES = {"none": None, "float16": torch.float16, "bfloat16": torch.bfloat16}
# precision.name -> the autocast_dtype it means, and the tf32 it means (None: either, for the ops
# autocast leaves in fp32)
PRECISIONS = {"fp32": ("none", False), "tf32": ("none", True), "fp16": ("float16", None),
              "bf16": ("bfloat16", None)}


@dataclass
class PrecisionConfig:
    # fp32 | tf32 | fp16 | bf16: the group sets the keys below to agree
    name: str = key(MISSING, choices=tuple(PRECISIONS))
    # none | float16 | bfloat16; must be what name says
    autocast_dtype: str = key("none", choices=tuple(AUTOCAST_DTYPES))
    # Allow TF32 tensor-core math for fp32 matmul/conv: fp32 false, tf32 true, either under
    # autocast. CUDA only: on CPU it changes nothing.
    tf32: bool = False
    # Dynamic loss scaling, for fp16/bf16 only. precision=fp16 grad_scaler=false is allowed (it
    # shows why the scaler exists: small gradients underflow to zero).
    grad_scaler: bool = False
    init_scale: float = key(65536.0, positive=True, only_with=("grad_scaler", (True,)))
    growth_interval: int = key(2000, positive=True, only_with=("grad_scaler", (True,)))


def check_precision(cfg) -> None:
    """The keys agree with the precision they are named by."""
    p = cfg.precision
    autocast, tf32 = PRECISIONS[p.name]
    if p.autocast_dtype != autocast:
        raise ConfigError(f"precision.autocast_dtype={p.autocast_dtype} contradicts "
                          f"precision={p.name} (which autocasts to {autocast}); choose the "
                          "precision group instead (precision=fp16 or precision=bf16)")
    if tf32 is not None and p.tf32 != tf32:
        raise ConfigError(f"precision.tf32={text(p.tf32)} contradicts precision={p.name}; use "
                          f"precision={'tf32' if p.tf32 else 'fp32'} instead")
    if p.grad_scaler and autocast == "none":
        raise ConfigError(f"precision.grad_scaler=true: loss scaling keeps float16 gradients "
                          f"from underflowing, and precision={p.name} has none; use precision=fp16")


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
