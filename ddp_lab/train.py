"""Data-parallel training of AlexNet-style CNNs. Read top to bottom: build the run, the loop, the
summary.

    torchrun --standalone --nproc_per_node=2 -m ddp_lab.train            # 2 CPU ranks, digits
    python -m ddp_lab.train model=alexnet data=synthetic sync=none       # one process
    torchrun --nproc_per_node=8 -m ddp_lab.train sync=ring precision=bf16 train.channels_last=true

torchrun sets the environment -> Hydra composes conf/ + overrides into a typed config (cli.py) ->
`init_group()` -> `build_run`: the run's length, data, the step's parts (model, sync, optimizer,
precision: ddp_lab/step.py), guard, recorders -> `loop`: each step (forward, backward, gradient
sync, guard, optimizer), then logging, evaluation and checkpoints at their intervals ->
`write_summary` (ddp_lab/summary.py) -> the group is destroyed, whatever happened.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import sys
import traceback
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from omegaconf import OmegaConf

from ddp_lab import checkpoint, provenance, resume
from ddp_lab.cli import run_hydra_app, setup_logging
from ddp_lab.config import Config, check_steps_reachable, validate
from ddp_lab.held_memory import HeldMemory
from ddp_lab.data import Data, build_data
from ddp_lab.dist import DistInfo, destroy_group, init_group
from ddp_lab.hangs import Heartbeat, collective_errors
from ddp_lab.fault import Faults
from ddp_lab.graph import EAGER_CALLS, GraphedTrainStep, check_supported
from ddp_lab.guard import Guard
from ddp_lab.metrics import NullLogger, StepTimer, make_logger, medians, with_exposed_comm
from ddp_lab.optim import build_scheduler
from ddp_lab.step import Parts, TrainStep, build_parts, build_step, calibrate, compiled_graphs
from ddp_lab.summary import write_summary
from ddp_lab.trace import Tracer

log = logging.getLogger("ddp_lab")


def train(cfg, run_dir: str) -> dict:
    """Train per `cfg` (a composed DictConfig), writing into `run_dir` (rank 0 only); returns the
    run summary."""
    validate(cfg)
    info = init_group(cfg.dist.backend, cfg.dist.timeout_s, cfg.dist.node_size, cfg.dist.link)
    try:
        return _train(cfg, run_dir, info)
    except BaseException as e:
        # The traceback holds _train's frame and through it DDP's reducer, which holds the
        # process group: released here, destroy_group() below really destroys the group and
        # joins gloo's threads (not left to run into interpreter shutdown; see dist.init_group).
        _release_frames(e)
        raise
    finally:
        destroy_group()


def _train(cfg, run_dir: str, info: DistInfo) -> dict:
    """The whole run, in a frame of its own: nothing of it outlives the call."""
    if cfg.train.cuda_graph:  # refused before anything is written
        check_supported(cfg, info.device)
    if info.is_main:
        os.makedirs(run_dir, exist_ok=True)
    setup_logging(run_dir, info.is_main)
    heartbeat = Heartbeat(info.rank, info.world_size, cfg.sync.name)
    with collective_errors(cfg.dist.timeout_s, heartbeat), contextlib.ExitStack() as closing:
        run = build_run(cfg, run_dir, info, heartbeat, closing)  # closing: shut before the group
        progress = loop(run)
        return write_summary(run, progress)


def _release_frames(exc: BaseException | None) -> None:
    """Clear the local variables of every finished frame in `exc`'s tracebacks (and those of
    its causes); file names and line numbers stay for printing."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        traceback.clear_frames(exc.__traceback__)  # (executing frames are skipped)
        exc = exc.__cause__ or exc.__context__


# ---- 1. build the run -------------------------------------------------------------------------

@dataclass(frozen=True)
class RunContext:
    """Where and how this run is made."""
    cfg: Config  # plain dataclasses: the loop reads them every step, and a DictConfig read is slow
    cfg_dict: dict  # the same, resolved, as plain dicts: run_info.json and the resume digest
    run_dir: str
    info: DistInfo
    heartbeat: Heartbeat


@dataclass(frozen=True)
class Length:
    """How long the run is, in optimizer steps (1-based, as in the logs)."""
    steps_per_epoch: int
    total_steps: int
    start_step: int  # the checkpoint's step when resuming, else 0
    stop_step: int  # total_steps, or train.stop_at_step
    global_batch: int  # images per optimizer step, over all ranks

    @property
    def last_epoch(self) -> int:
        """The last epoch the run reads (its streams fetch nothing past it)."""
        return (self.stop_step - 1) // self.steps_per_epoch


@dataclass(frozen=True)
class Recorders:
    """What the run measures beside training, and where it writes it."""
    timer: StepTimer
    logger: NullLogger
    tracer: Tracer | None  # train.trace: a timeline of a few steps
    memory: HeldMemory  # bytes this rank holds, counted at the first optimizer step
    local_backward_ms: float | None  # backward without communication (calibrated)
    calibration_peak: int | None  # CUDA: bytes allocated at most up to the calibration's end
    compiled_before: int  # graphs torch.compile had made before this run


@dataclass(frozen=True)
class Run:
    """Everything one training run is made of, built once by `build_run`."""
    ctx: RunContext
    length: Length
    data: Data
    parts: Parts
    scheduler: torch.optim.lr_scheduler.LRScheduler
    guard: Guard
    faults: Faults
    step: TrainStep | GraphedTrainStep
    rec: Recorders


@dataclass
class Progress:
    """What the loop itself changes as it goes."""
    logged_step: int  # the last step a log line covered
    val_loss: float = math.nan
    val_accuracy: float = math.nan


def build_run(cfg, run_dir: str, info: DistInfo, heartbeat: Heartbeat,
              closing: contextlib.ExitStack) -> Run:
    """Length, data, the step's parts, guard, recorders; resumed from the run dir's checkpoint if
    there is one. `closing` is shut before the process group goes."""
    cfg_dict = OmegaConf.to_container(cfg, resolve=True)
    # Before anything is written: a run dir of another config is refused untouched.
    resumed = resume.find(cfg, cfg_dict, run_dir, info.world_size)
    cfg = OmegaConf.to_object(cfg)
    ctx = RunContext(cfg, cfg_dict, run_dir, info, heartbeat)
    data = build_data(cfg, info.rank, info.world_size, info.device)
    length = run_length(cfg, data, info.world_size, resumed)
    timer = _make_timer(cfg.train, info.device)
    tracer = _make_tracer(cfg.train, info.device, length, timer.warmup)
    compiled_before = compiled_graphs()
    parts = build_parts(cfg, info, data.num_classes, tracer)
    closing.callback(parts.sync.close)  # its communication thread stops before the group does
    scheduler = build_scheduler(parts.optimizer, cfg.optim, length.total_steps)
    checkpoint.check_keep_every(cfg.train.keep_every, cfg.train.checkpoint_every,
                                length.steps_per_epoch)
    if resumed is not None:
        resume.restore(parts, scheduler, resumed, info, length.steps_per_epoch,
                       cfg.train.accum_steps)
    if info.is_main:  # (after restore: a checkpoint it refuses leaves the run dir untouched)
        resume.clean_stale(run_dir)
    guard = Guard(cfg.train, info, parts.model, parts.precision.scaler, length.total_steps,
                  sync=parts.sync)
    faults = Faults(cfg.fault, info.rank, info.world_size, parts.model)
    logger = make_logger(run_dir, info.is_main)
    closing.callback(logger.close)
    memory = HeldMemory(parts.model, parts.optimizer, parts.sync)
    local_backward_ms, calibration_peak = calibrate(parts, data.train, cfg.train.calibrate_steps)
    run = Run(ctx=ctx, length=length, data=data, parts=parts, scheduler=scheduler, guard=guard,
              faults=faults, step=build_step(parts, guard, cfg.train, cfg.optim),
              rec=Recorders(timer, logger, tracer, memory, local_backward_ms, calibration_peak,
                            compiled_before))
    if info.is_main:
        record_run(run)
    return run


def run_length(cfg, data: Data, world_size: int, resumed: dict | None) -> Length:
    """The run's steps: train.max_steps, or train.epochs of what the data allows per epoch."""
    tcfg = cfg.train
    length = planned_length(tcfg, data.train.num_batches(0), world_size,
                            resumed["step"] if resumed is not None else 0)
    check_steps_reachable(cfg, length.total_steps,
                          f"{tcfg.epochs} epochs of {length.steps_per_epoch} steps")
    return length


def planned_length(tcfg, batches_per_epoch: int, world_size: int, start_step: int = 0) -> Length:
    """train.max_steps, or train.epochs of `batches_per_epoch` (this rank's), and where
    train.stop_at_step stops the run: from the config alone (memory_fit predicts from it)."""
    steps_per_epoch = batches_per_epoch // tcfg.accum_steps
    total_steps = tcfg.max_steps or tcfg.epochs * steps_per_epoch
    return Length(steps_per_epoch=steps_per_epoch, total_steps=total_steps, start_step=start_step,
                  stop_step=min(total_steps, tcfg.stop_at_step or total_steps),
                  global_batch=tcfg.batch_size * tcfg.accum_steps * world_size)


def _make_timer(tcfg, device: torch.device) -> StepTimer:
    """The loop's clock. With a CUDA graph the eager calls and the capture are not timed either."""
    warmup = max(tcfg.timing_warmup, EAGER_CALLS) + 1 if tcfg.cuda_graph else tcfg.timing_warmup
    return StepTimer(device, warmup)


def _make_tracer(tcfg, device: torch.device, length: Length, warmup: int) -> Tracer | None:
    """train.trace: the train.trace_steps steps right after the timing warm-up."""
    if not tcfg.trace:
        return None
    first = length.start_step + warmup + 1
    return Tracer(device, first, min(length.stop_step, first + tcfg.trace_steps - 1))


def record_run(run: Run) -> None:
    """Rank 0: run_info.json (how this run was made; a resumed run keeps the records of its
    earlier segments under `earlier`, oldest first) and the same in TensorBoard."""
    ctx, length, data = run.ctx, run.length, run.data
    facts = {"world_size": ctx.info.world_size, "backend": ctx.info.backend,
             "global_batch": length.global_batch, "total_steps": length.total_steps,
             "train_samples": data.train_samples, "val_samples": data.val_samples,
             "start_step": length.start_step}
    path = os.path.join(ctx.run_dir, "run_info.json")
    earlier = provenance.earlier_segments(path) if length.start_step else []
    path = provenance.write(path, ctx.cfg_dict, ctx.info.device, run=facts,
                            **({"earlier": earlier} if earlier else {}))
    with open(path) as f:
        run.rec.logger.text("run_info", f.read())
    run.rec.logger.text("config", OmegaConf.to_yaml(ctx.cfg_dict))
    log.info("world size %d (%s on %s), global batch %d, %d steps, %d train / %d val samples",
             ctx.info.world_size, ctx.info.backend, ctx.info.device, length.global_batch,
             length.total_steps, data.train_samples, data.val_samples)


# ---- 2. the loop ------------------------------------------------------------------------------

def loop(run: Run) -> Progress:
    """Steps start_step+1 .. stop_step (1-based, as in the logs), each followed by whatever is due
    after it: a log line, an evaluation, a checkpoint, a replica check."""
    from tqdm import tqdm

    length, timer, tracer = run.length, run.rec.timer, run.rec.tracer
    mark = run.rec.memory.watching(timer.mark)  # the phases timed, and the bytes held counted
    # disable=None: a bar only on a terminal; redirected output gets log lines instead.
    bar = tqdm(total=length.total_steps, initial=length.start_step, unit="step",
               dynamic_ncols=True, file=sys.stderr,
               disable=None if run.ctx.info.is_main and run.ctx.cfg.train.progress else True)
    progress = Progress(logged_step=length.start_step)
    batches = micro_batches(run)
    run.parts.model.train()
    timer.restart()
    for step in range(length.start_step + 1, length.stop_step + 1):
        run.faults.on_step(step)  # fault.* injection (tests, demos); off by default
        run.ctx.heartbeat.beat(step)  # (after it: a rank that hangs there never began the step)
        tracing = tracer is not None and tracer.begin_step(step)
        batch = next(batches)
        timer.mark("data")
        run.step(step, batch, mark)
        run.scheduler.step()
        timer.mark(run.step.last_phase)
        timer.note("comm_busy", run.parts.sync.comm_busy_ms())  # NaN where it cannot measure it
        marks = timer.end_step(keep=tracing)
        if tracing:
            tracer.marks(marks)
        bar.update(1)
        if after_step(run, progress, step, bar):
            timer.restart()  # that work's time is not step time
    bar.close()
    if length.stop_step < length.total_steps:
        log.info("stopped at step %d of %d (train.stop_at_step): run the same command without it "
                 "to continue from the checkpoint", length.stop_step, length.total_steps)
    if length.start_step >= length.stop_step:
        log.info("nothing to do: the checkpoint in %s is already at step %d of %d "
                 "(use train.resume=never or another hydra.run.dir to train again)",
                 run.ctx.run_dir, length.start_step, length.stop_step)
        evaluate(run, progress, length.start_step)
    return progress


def micro_batches(run: Run) -> Iterator[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Each step's micro-batches, from the resumed position on, epoch after epoch."""
    accum, spe = run.ctx.cfg.train.accum_steps, run.length.steps_per_epoch
    epoch, step_in_epoch = divmod(run.length.start_step, spe)
    while True:
        batches = run.data.train.epoch(epoch, start_batch=step_in_epoch * accum,
                                       last_epoch=run.length.last_epoch)
        for _ in range(step_in_epoch, spe):
            yield [(x.contiguous(memory_format=run.parts.memory_format), y)
                   for x, y in (next(batches) for _ in range(accum))]
        epoch, step_in_epoch = epoch + 1, 0


def after_step(run: Run, progress: Progress, step: int, bar) -> bool:
    """What is due after `step`; returns whether anything ran (its time is not step time)."""
    tcfg, length = run.ctx.cfg.train, run.length
    spe = length.steps_per_epoch
    end_of_epoch = step % spe == 0
    log_now = step % tcfg.log_every == 0 or step == length.stop_step
    eval_now = step == length.total_steps or (
        end_of_epoch and tcfg.eval_every_epochs and (step // spe) % tcfg.eval_every_epochs == 0)
    checkpoint_now = step == length.stop_step or (
        tcfg.checkpoint_every and step % tcfg.checkpoint_every == 0) or (
        not tcfg.checkpoint_every and end_of_epoch)
    if log_now:
        log_window(run, progress, step, bar)
    if eval_now:
        evaluate(run, progress, step)
    # Non-finite verdicts are read where the host syncs anyway: log steps, checkpoints, the end.
    checked = run.guard.end_step(step, sync_point=log_now or checkpoint_now)
    if checkpoint_now:
        resume.save(run.ctx, run.parts, run.scheduler, run.length.steps_per_epoch, step)
    return log_now or eval_now or checkpoint_now or checked


def log_window(run: Run, progress: Progress, step: int, bar) -> None:
    """The steps since the last log line: mean loss over every rank, throughput, phase medians."""
    loss_sum, world_size = run.step.loss_sum, run.ctx.info.world_size
    dist.all_reduce(loss_sum)  # the global batch's loss: (sum over ranks) / ranks
    steps = step - progress.logged_step
    mean_loss = loss_sum.item() / (steps * world_size)  # waits for the device
    loss_sum.zero_()
    progress.logged_step = step
    metrics = {"train/loss": mean_loss, "train/lr": float(run.scheduler.get_last_lr()[0]),
               "train/epoch": step / run.length.steps_per_epoch}
    timed = run.rec.timer.window()  # after the wait above: every step of the window has finished
    if timed:  # none in warm-up
        total_s = sum(s["step"] for s in timed) / 1e3
        metrics["throughput/img_per_s"] = len(timed) * run.length.global_batch / total_s
        metrics["time/step_ms"] = total_s / len(timed) * 1e3
        phases = with_exposed_comm(medians(timed), run.rec.local_backward_ms,
                                   run.ctx.cfg.train.accum_steps)
        metrics.update({f"time/{k}_ms": v for k, v in phases.items() if k != "step"})
    scaler = run.parts.precision.scaler
    if scaler.is_enabled():
        metrics["precision/loss_scale"] = scaler.get_scale()
    run.rec.logger.log(step, metrics)
    speed = (f"{metrics['throughput/img_per_s']:.0f} img/s" if timed else "warming up")
    bar.set_postfix(loss=f"{mean_loss:.3f}", speed=speed)
    if bar.disable:
        log.info("step %d/%d: loss %.4f, %s", step, run.length.total_steps, mean_loss, speed)


def evaluate(run: Run, progress: Progress, step: int) -> None:
    """Validation loss and accuracy over every sample once, reduced as (sum, count)."""
    model, info = run.parts.model, run.ctx.info
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=info.device)  # loss, correct, count
    batches = 0
    with torch.no_grad(), run.parts.precision.autocast():
        for x, y in run.data.val.epoch(0):
            logits = model(x.contiguous(memory_format=run.parts.memory_format))
            totals[0] += F.cross_entropy(logits.float(), y, reduction="sum")
            totals[1] += (logits.argmax(1) == y).sum()
            totals[2] += len(y)
            batches += 1
        for dummy in unscored_batches(run, batches):
            model(dummy)
    dist.all_reduce(totals)  # SUM: ReduceOp.AVG is NCCL-only
    model.train()
    loss_sum, correct, count = totals.tolist()
    progress.val_loss, progress.val_accuracy = loss_sum / count, correct / count
    run.rec.logger.log(step, {"val/loss": progress.val_loss, "val/accuracy": progress.val_accuracy})
    log.info("step %d epoch %.1f: val loss %.4f, accuracy %.4f", step,
             step / run.length.steps_per_epoch, progress.val_loss, progress.val_accuracy)


def unscored_batches(run: Run, batches: int) -> list[torch.Tensor]:
    """Dummy batches this rank runs forward after its `batches` of validation, scoring nothing.
    Where a forward is a collective (the sync's `forward_communicates`: ZeRO-3's and FSDP's
    all-gathers) every rank must run as many as rank 0, which holds the most samples of the
    round-robin shard: a rank with fewer would wait in evaluate's all-reduce while rank 0
    all-gathers alone, until the group timed out."""
    if not run.parts.sync.forward_communicates:
        return []
    most = math.ceil(run.data.val_samples / run.ctx.info.world_size)
    size = run.ctx.cfg.data.image_size
    dummy = torch.zeros(1, 3, size, size, device=run.ctx.info.device)
    dummy = dummy.contiguous(memory_format=run.parts.memory_format)
    return [dummy] * (math.ceil(most / run.ctx.cfg.train.batch_size) - batches)


def main() -> None:
    run_hydra_app(train, "config")


if __name__ == "__main__":
    main()
