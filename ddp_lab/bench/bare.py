"""The bare reference loop of the throughput benchmark (ddp_lab/bench/train_throughput.py): the
training step with nothing around it, to hold the ddp_lab loop against. Its parts are built as the
loop builds its own (ddp_lab.step.build_parts), so the two differ only in what runs around the
step: one fixed random batch on the device, autocast forward, (scaled) backward, optimizer step,
zero_grad(set_to_none); CUDA events at each step boundary (no host sync inside the timed steps),
warm-up steps left out."""

from __future__ import annotations

import gc
import statistics

import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from ddp_lab.bench.common import back_to_back_ms, sync
from ddp_lab.dist import DistInfo
from ddp_lab.graph import EAGER_CALLS, GraphedStep
from ddp_lab.step import build_parts


def make_bare_step(cfg, device: torch.device):
    """The whole reference training step: its parts built as the ddp_lab side builds its own
    (ddp_lab.step.build_parts: the same model, dropout, precision flags, optimizer and compile),
    then run bare on one fixed random batch. Returns (step, batch)."""
    cfg = OmegaConf.to_object(cfg)
    if cfg.train.compile:
        torch._dynamo.reset()  # each compiled model starts fresh (no cache-limit fallback to eager)
    classes, size, batch = cfg.model.default_classes, cfg.model.image_size, cfg.train.batch_size
    p = build_parts(cfg, DistInfo(0, 0, 1, 1, "none", device), classes)
    x = torch.randn(batch, 3, size, size, device=device).contiguous(memory_format=p.memory_format)
    y = torch.randint(0, classes, (batch,), device=device)

    def step() -> torch.Tensor:
        with p.precision.autocast():
            loss = F.cross_entropy(p.train_model(x), y)
        p.precision.scaler.scale(loss).backward()
        p.precision.scaler.step(p.optimizer)
        p.precision.scaler.update()
        p.optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    if cfg.train.cuda_graph:  # the same step, captured after GraphedStep's eager calls
        graphed = GraphedStep(step)
        return (lambda: graphed()[1]), batch
    return step, batch


def bare_loop(cfg, device: torch.device, steps: int, warmup: int) -> dict:
    """Time `steps` reference steps after `warmup`: img/s (mean and median), peak memory."""
    base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    step, batch = make_bare_step(cfg, device)
    if cfg.train.cuda_graph:  # captured within the warm-up, like the ddp_lab side
        warmup = max(warmup, EAGER_CALLS + 1)
    for _ in range(warmup):
        loss = step()
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times_ms, loss = back_to_back_ms(step, device, steps)
    peak = (torch.cuda.max_memory_allocated(device) - base if device.type == "cuda"
            else float("nan"))
    median_ms = statistics.median(times_ms)
    return {"img_s": batch * steps / sum(times_ms) * 1e3, "img_s_med": batch / median_ms * 1e3,
            "step_ms_med": median_ms, "peak_mem_bytes": peak, "loss": loss.float().item()}


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
