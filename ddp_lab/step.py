"""One training step, built one way from a config, for everything that runs one: the training run
(ddp_lab/train.py), the throughput benchmark's two loops (ddp_lab/bench/train_throughput.py) and
the sweep's interference probe (ddp_lab/scale/interfere.py).

    parts = build_parts(cfg, info, num_classes)          # model, sync, optimizer, precision
    step = build_step(parts, guard, cfg)                 # eager, compiled or one CUDA graph
    step(step_number, micro_batches, mark)               # forward, backward, sync, guard, update

`build_parts` is the order things must be made in: the model (the same initial weights on every
rank: rank 0's are broadcast anyway), a random stream per rank (dropout masks differ), the
precision's flags and loss scaler, the sync (which installs its hooks, or wraps the model in DDP,
and may shard the optimizer: ZeRO), `torch.compile` around what the step calls, then the
optimizer over what this rank updates. `TrainStep` is the step's device work in AMP order:

    forward -> scaled backward -> sync -> guard -> unscale -> clip -> step -> update
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ddp_lab.compress.powersgd import nothing_compressed
from ddp_lab.dist import DistInfo
from ddp_lab.errors import ConfigError
from ddp_lab.graph import GraphedTrainStep
from ddp_lab.metrics import StepTimer
from ddp_lab.models import build_model
from ddp_lab.optim import optimizer_class
from ddp_lab.precision import Precision, setup_precision
from ddp_lab.sync import GradSync, build_sync


@dataclass(frozen=True)
class Parts:
    """What a training step is made of."""
    model: nn.Module  # this rank's replica: its parameters, state dict and checkpoints
    train_model: nn.Module  # what the step calls: the model with the sync's hooks, DDP, compiled
    sync: GradSync
    optimizer: torch.optim.Optimizer  # over what this rank updates (ZeRO: its shards)
    precision: Precision
    memory_format: torch.memory_format  # of the model and of every batch


def build_parts(cfg, info: DistInfo, num_classes: int, tracer=None,
                sync: GradSync | None = None) -> Parts:
    """The step's parts from the config's dataclasses (`OmegaConf.to_object`), in the order of the
    module docstring. `tracer`: the timeline the sync stamps its communication into
    (train.trace); `sync`: one built already (the probe times communication apart: none here)."""
    device, tcfg = info.device, cfg.train
    memory_format = torch.channels_last if tcfg.channels_last else torch.contiguous_format
    torch.manual_seed(cfg.seed)  # the same initial weights everywhere
    model = build_model(cfg.model.name, num_classes, cfg.model.dropout, cfg.model.stem,
                        cfg.model.fc_width).to(device, memory_format=memory_format)
    torch.manual_seed(cfg.seed + 1 + info.rank)  # then a stream per rank: dropout masks differ
    if cfg.sync.compress == "powersgd" and info.rank == 0:
        _warn_if_nothing_compressed(cfg.sync, model)
    precision = setup_precision(cfg.precision, device, tcfg.cudnn_benchmark)
    if sync is None:
        sync = build_sync(cfg.sync, info)
    sync.tracer = tracer  # (before prepare: DDP's hook is installed there)
    # ZeRO: each rank sees a shard of the gradients, so the loss scaler must agree across ranks.
    precision = dataclasses.replace(precision, scaler=sync.grad_scaler(precision.scaler))
    train_model = sync.prepare(model)
    if tcfg.compile:
        train_model = compile_model(train_model, device, tcfg.compile_mode)
    optimizer = sync.build_optimizer(model, *optimizer_class(cfg.optim, device))
    return Parts(model, train_model, sync, optimizer, precision, memory_format)


def _warn_if_nothing_compressed(scfg, model: nn.Module) -> None:
    warning = nothing_compressed([p.shape for p in model.parameters() if p.requires_grad],
                                 scfg.compress_rank, scfg.min_compression_rate)
    if warning:
        logging.getLogger("ddp_lab").warning(warning)


def compile_model(module: nn.Module, device: torch.device, mode: str) -> nn.Module:
    """torch.compile, refused up front (not deep inside the first step) where it cannot work."""
    import torch._dynamo

    if not torch._dynamo.is_dynamo_supported():
        raise ConfigError("train.compile=true: torch.compile is not supported on this Python/"
                          "platform; run with train.compile=false")
    if device.type == "cpu" and not (shutil.which(os.environ.get("CXX", "g++"))
                                     or shutil.which("c++")):
        raise ConfigError("train.compile=true on CPU needs a C++ compiler (g++), none found; "
                          "run with train.compile=false")
    return torch.compile(module, mode=mode)


def compiled_graphs() -> int:
    """How many graphs Dynamo has compiled in this process so far (a run reports its own: none
    under train.compile=true would mean the model ran eagerly after all)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def calibrate(parts: Parts, stream, passes: int) -> tuple[float | None, int | None]:
    """The loop's calibration: `time_local_backward` on the stream's first batch (None with no
    passes) and, on CUDA, the most allocated up to its end (the run's build included). The peak
    statistics are then reset, so the run's own peak is its training's: the calibration's first
    backward can take more than any step's (cuDNN trying algorithms, each with a workspace)."""
    if not passes:
        return None, None
    device = next(parts.model.parameters()).device
    # Epoch 0 alone (last_epoch=0: nothing fetched ahead, nothing left waiting in the stream),
    # its batch a temporary: no fetch of the calibration's is alive through the reset.
    return (time_local_backward(parts, next(stream.epoch(0, last_epoch=0)), passes),
            peak_and_reset(device))


def peak_and_reset(device: torch.device) -> int | None:
    """On CUDA, the most allocated since the peak statistics were last reset; then resets them."""
    if device.type != "cuda":
        return None
    peak = torch.cuda.max_memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    return peak


def time_local_backward(parts: Parts, batch: tuple, passes: int) -> float:
    """Median backward time (ms) of `passes` micro-steps that do not reduce gradients (after
    two untimed ones). DDP waits for its all-reduces inside backward, so its exposed
    communication is (synced backward + wait) - this. Where the sync's forward and backward
    all-gather (ZeRO-3, FSDP: `forward_communicates`) these gathers stay in: the figure then
    holds them. Runs under fork_rng and leaves no gradients, so training is unaffected."""
    x, y = batch
    x = x.contiguous(memory_format=parts.memory_format)
    device = x.device
    timer = StepTimer(device, warmup=2)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        for _ in range(passes + 2):
            timer.restart()
            with parts.sync.no_sync():
                with parts.precision.autocast():
                    loss = F.cross_entropy(parts.train_model(x), y)
                timer.mark("forward")
                parts.precision.scaler.scale(loss).backward()
                timer.mark("backward")
            timer.end_step()
            parts.train_model.zero_grad(set_to_none=True)
    return timer.summary()["backward_ms"]


class TrainStep:
    """One optimizer step's device work: forward and backward of each micro-batch, the gradient
    sync, the guard, the optimizer. `mark(phase)` is called as each phase ends (the loop's
    StepTimer; a probe's own clock). With train.cuda_graph this is what is captured and replayed
    (`build_step`), so it decides nothing on the host."""

    last_phase = "optim"  # the phase the loop's timer closes the step with

    def __init__(self, parts: Parts, guard, accum_steps: int, grad_clip: float):
        self.parts, self.guard = parts, guard
        self.accum_steps, self.grad_clip = accum_steps, grad_clip
        # The loss summed over the steps since the last log line (ddp_lab.train.log_window reads
        # and resets it): a device tensor, so a step never waits for the host.
        self.loss_sum = torch.zeros((), device=next(parts.model.parameters()).device)

    def __call__(self, step: int, batches: list, mark: Callable[[str], None]) -> None:
        loss = self.forward_backward(batches, mark)
        self.parts.sync.finish()  # gradients averaged over ranks from here on
        mark("comm")
        self.update(step, loss, mark)

    def forward_backward(self, batches: list, mark: Callable[[str], None]) -> torch.Tensor:
        """Every micro-batch's forward and scaled backward; only the last one communicates (the
        sync's hooks start its all-reduces). Returns the last micro-batch's loss."""
        p = self.parts
        for micro, (x, y) in enumerate(batches):
            last = micro == len(batches) - 1
            with contextlib.nullcontext() if last else p.sync.no_sync():
                with p.precision.autocast():
                    loss = F.cross_entropy(p.train_model(x), y)
                if self.accum_steps > 1:  # (one op fewer otherwise: small models are host-bound)
                    loss = loss / self.accum_steps
                mark("forward")
                p.precision.scaler.scale(loss).backward()
                mark("backward")
            self.loss_sum.add_(loss.detach())
        return loss

    def update(self, step: int, loss: torch.Tensor, mark: Callable[[str], None]) -> None:
        """After the sync: the guard (inf/NaN: skip on every rank, or stop), unscale, clip, the
        optimizer step (skipped on every rank alike if the gradients hold inf/NaN), the loss
        scale's update."""
        p = self.parts
        self.guard.after_sync(step, loss, p.optimizer)
        mark("guard")
        if self.grad_clip > 0:
            p.precision.scaler.unscale_(p.optimizer)
            p.sync.clip_grad_norm_(p.optimizer, self.grad_clip)  # ZeRO: over all shards
        p.precision.scaler.step(p.optimizer)
        p.precision.scaler.update()
        p.optimizer.zero_grad(set_to_none=True)


def build_step(parts: Parts, guard, tcfg, ocfg) -> TrainStep | GraphedTrainStep:
    """The step the loop calls: eager (compiled or not: `build_parts` compiled the model), or the
    whole of it as one CUDA graph (train.cuda_graph)."""
    step = TrainStep(parts, guard, tcfg.accum_steps, ocfg.grad_clip)
    return GraphedTrainStep(step, parts.optimizer, guard) if tcfg.cuda_graph else step
