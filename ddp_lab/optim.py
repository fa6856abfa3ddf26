"""Optimizer and learning-rate schedule: SGD with momentum or AdamW; linear warm-up, then cosine or
constant. The schedule is a LambdaLR of the step, so it checkpoints as a plain state dict."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from omegaconf import MISSING

from ddp_lab.errors import ConfigError
from ddp_lab.keys import key, text

_SGD_ONLY, _ADAMW_ONLY = ("name", ("sgd",)), ("name", ("adamw",))  # keys one of them reads


@dataclass
class OptimConfig:
    name: str = key(MISSING, choices=("sgd", "adamw"))  # the other one's keys: refused off default
    lr: float = key(MISSING, positive=True)
    momentum: float = key(0.9, at_least=0, below=1, only_with=_SGD_ONLY)
    nesterov: bool = key(False, only_with=_SGD_ONLY)  # needs momentum > 0
    betas: list[float] = key(factory=lambda: [0.9, 0.999], only_with=_ADAMW_ONLY)  # two in [0, 1)
    eps: float = key(1e-8, positive=True, only_with=_ADAMW_ONLY)
    weight_decay: float = key(5e-4, at_least=0)
    impl: str = key("auto", choices=("auto", "fused", "foreach", "for_loop"))
    schedule: str = key("cosine", choices=("cosine", "constant"))  # after the linear warm-up
    # May exceed the run: it then ends still warming up (short test runs do, with sgd's 20)
    warmup_steps: int = key(0, at_least=0)
    # cosine floor, as a fraction of lr
    min_lr_ratio: float = key(0.0, at_least=0, at_most=1, only_with=("schedule", ("cosine",)))
    grad_clip: float = key(0.0, at_least=0)  # max global grad norm; 0 disables clipping


def check_optim(cfg) -> None:
    o = cfg.optim
    if o.name == "adamw" and not (len(o.betas) == 2 and all(0 <= b < 1 for b in o.betas)):
        raise ConfigError(f"optim.betas={text(o.betas)} must be two numbers in [0, 1), "
                          "e.g. optim.betas=[0.9,0.999]")
    if o.name == "sgd" and o.nesterov and o.momentum == 0:
        raise ConfigError("optim.nesterov=true needs optim.momentum > 0")


def state_tensors(ocfg) -> int:
    """Optimizer state tensors per parameter: AdamW's two moments, SGD's momentum buffer."""
    return {"adamw": 2, "sgd": int(ocfg.momentum > 0)}[ocfg.name]


def _impl_kwargs(impl: str, device: torch.device) -> dict:
    if impl in ("auto", "fused"):
        # Fused SGD/AdamW kernels exist for CUDA and CPU (torch >= 2.4). They also take a
        # device-side `found_inf` flag, which lets the guard skip a non-finite step without a
        # host sync (ddp_lab.guard).
        return {"fused": True}
    return {"fused": False, "foreach": impl == "foreach"}


def build_optimizer(ocfg, params, device: torch.device) -> torch.optim.Optimizer:
    cls, kwargs = optimizer_class(ocfg, device)
    return cls(params, **kwargs)


def optimizer_class(ocfg, device: torch.device) -> tuple[type, dict]:
    """(torch optimizer class, its keyword arguments): what the sync builds the optimizer from
    (over its shards with ZeRO, or as torch's ZeroRedundancyOptimizer)."""
    kwargs = _impl_kwargs(ocfg.impl, device)
    if ocfg.name == "sgd":
        return torch.optim.SGD, dict(lr=ocfg.lr, momentum=ocfg.momentum, nesterov=ocfg.nesterov,
                                     weight_decay=ocfg.weight_decay, **kwargs)
    return torch.optim.AdamW, dict(lr=ocfg.lr, betas=tuple(ocfg.betas), eps=ocfg.eps,
                                   weight_decay=ocfg.weight_decay, **kwargs)


def lr_factor(step: int, warmup_steps: int, total_steps: int, schedule: str,
              min_ratio: float) -> float:
    """Multiplier of the base LR for the update made at `step` (0-based)."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_scheduler(optimizer, ocfg, total_steps: int):
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, ocfg.warmup_steps, total_steps, ocfg.schedule,
                                          ocfg.min_lr_ratio))


def float_lrs(optimizer, scheduler, opt_state: dict | None = None) -> dict:
    """{"optimizer": ..., "scheduler": ...} state dicts with plain-float learning rates, whether
    the live ones are floats or device tensors (train.cuda_graph), so a checkpoint resumes either
    way. opt_state: the optimizer's state dict if already made (ZeRO gathers it from the shards)."""
    opt = optimizer.state_dict() if opt_state is None else opt_state
    sched = scheduler.state_dict()
    for group in opt["param_groups"]:  # state_dict() made these dicts: the live groups keep theirs
        group["lr"] = float(group["lr"])
    sched["_last_lr"] = [float(lr) for lr in sched["_last_lr"]]
    return {"optimizer": opt, "scheduler": sched}
