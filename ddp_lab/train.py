"""Data-parallel training of AlexNet-style CNNs. Read top to bottom: build the run, the loop, the
summary.

    torchrun --standalone --nproc_per_node=2 -m ddp_lab.train            # 2 CPU ranks, digits
    python -m ddp_lab.train model=alexnet data=synthetic sync=none       # one process
    torchrun --nproc_per_node=8 -m ddp_lab.train sync=ring precision=bf16 train.channels_last=true

torchrun sets the environment -> Hydra composes conf/ + overrides into a typed config (cli.py) ->
`init_group()` -> `build_run`: data, model, sync, optimizer, precision, guard, logger -> `loop`:
each step `train_step` (forward, backward, gradient sync, guard, optimizer), then logging,
evaluation and checkpoints at their intervals -> `write_summary` -> the group is destroyed,
whatever happened.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import os
import shutil
import sys
import traceback
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch import nn

from ddp_lab import checkpoint, provenance, trace
from ddp_lab.cli import run_hydra_app, setup_logging
from ddp_lab.config import Config, ConfigError, check_steps_reachable, validate
from ddp_lab.held_memory import MEMORY_KEYS, HeldMemory
from ddp_lab.perf.memory import predict_held
from ddp_lab.data import Data, build_data
from ddp_lab.dtypes import element_size
from ddp_lab.dist import DistInfo, Heartbeat, collective_errors, destroy_group, init_group
from ddp_lab.fault import Faults
from ddp_lab.graph import EAGER_CALLS, GraphedTrainStep, check_supported
from ddp_lab.guard import Guard, assert_finite
from ddp_lab.metrics import NullLogger, StepTimer, make_logger, medians, with_exposed_comm
from ddp_lab.models import build_model
from ddp_lab.optim import build_scheduler, float_lrs, optimizer_class
from ddp_lab.precision import Precision, setup_precision
from ddp_lab.sync import GradSync, build_sync
from ddp_lab.trace import Tracer

log = logging.getLogger("ddp_lab")


def train(cfg, run_dir: str) -> dict:
    """Train per `cfg` (a composed DictConfig), writing into `run_dir` (rank 0 only); returns the
    run summary."""
    validate(cfg)
    info = init_group(cfg.dist.backend, cfg.dist.timeout_s)
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
        loop(run)
        return write_summary(run)


def _release_frames(exc: BaseException | None) -> None:
    """Clear the local variables of every finished frame in `exc`'s tracebacks (and those of
    its causes); file names and line numbers stay for printing."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        traceback.clear_frames(exc.__traceback__)  # (executing frames are skipped)
        exc = exc.__cause__ or exc.__context__


# ---- 1. build the run -------------------------------------------------------------------------

@dataclass
class Run:
    """Everything one training run is made of, built once by `build_run`."""
    cfg: Config  # plain dataclasses: the loop reads them every step, and a DictConfig read is slow
    cfg_dict: dict  # the same, resolved, as plain dicts: run_info.json and the resume digest
    run_dir: str
    info: DistInfo
    data: Data
    model: nn.Module  # this rank's replica: its parameters, state dict and checkpoints
    train_model: nn.Module  # what the step calls: the model with the sync's hooks, DDP, compiled
    sync: GradSync
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    precision: Precision
    heartbeat: Heartbeat
    logger: NullLogger
    steps_per_epoch: int
    total_steps: int
    stop_step: int  # total_steps, or train.stop_at_step
    global_batch: int  # images per optimizer step, over all ranks
    memory_format: torch.memory_format
    timer: StepTimer
    guard: Guard = None
    faults: Faults = None
    tracer: Tracer | None = None  # train.trace: a timeline of a few steps
    memory: HeldMemory = None  # bytes this rank holds, counted at the first optimizer step
    start_step: int = 0  # the checkpoint's step when resuming
    local_backward_ms: float | None = None  # backward without communication (calibrated)
    compiled_before: int = 0  # graphs torch.compile had made before this run
    loss_sum: torch.Tensor = None  # the loss summed over the steps since the last log line
    logged_step: int = 0
    val_loss: float = math.nan
    val_accuracy: float = math.nan


def build_run(cfg, run_dir: str, info: DistInfo, heartbeat: Heartbeat,
              closing: contextlib.ExitStack) -> Run:
    """Model, data, sync, optimizer, precision, guard, logger; resumed from the run dir's
    checkpoint if there is one. `closing` is shut before the process group goes."""
    cfg_dict = OmegaConf.to_container(cfg, resolve=True)
    # Before anything is written: a run dir of another config is refused untouched.
    resumed = checkpoint.resume(cfg_dict, run_dir, cfg.train.resume, info.world_size, log.warning)
    cfg = OmegaConf.to_object(cfg)
    device, tcfg = info.device, cfg.train
    torch.manual_seed(cfg.seed)  # the same initial weights everywhere (rank 0's are broadcast)
    data = build_data(cfg, info.rank, info.world_size, device)
    memory_format = torch.channels_last if tcfg.channels_last else torch.contiguous_format
    model = build_model(cfg.model.name, data.num_classes, cfg.model.dropout, cfg.model.stem,
                        cfg.model.fc_width)
    model = model.to(device, memory_format=memory_format)
    torch.manual_seed(cfg.seed + 1 + info.rank)  # then a stream per rank: dropout masks differ
    precision = setup_precision(cfg.precision, device, tcfg.cudnn_benchmark)
    sync = build_sync(cfg.sync, info)
    closing.callback(sync.close)  # its communication thread stops before the group does
    precision.scaler = sync.grad_scaler(precision.scaler)  # ZeRO: each rank sees a shard
    sync.tracer = Tracer(device) if tcfg.trace else None  # (DDP's hook is installed in prepare)
    compiled_before = compiled_graphs()
    train_model = sync.prepare(model)  # the model with our hooks installed, or DDP's wrapper
    if tcfg.compile:
        train_model = compile_model(train_model, device, tcfg.compile_mode)
    # ZeRO (sync.zero): over this rank's shards only; its step ends gathering the parameters
    optimizer = sync.build_optimizer(model, *optimizer_class(cfg.optim, device))
    steps_per_epoch = data.train.num_batches(0) // tcfg.accum_steps
    total_steps = tcfg.max_steps or tcfg.epochs * steps_per_epoch
    check_steps_reachable(cfg, total_steps, f"{tcfg.epochs} epochs of {steps_per_epoch} steps")
    stop_step = min(total_steps, tcfg.stop_at_step or total_steps)
    data.train.last_epoch = (stop_step - 1) // steps_per_epoch
    logger = make_logger(run_dir, info.is_main)
    closing.callback(logger.close)
    run = Run(cfg, cfg_dict, run_dir, info, data, model, train_model, sync, optimizer,
              build_scheduler(optimizer, cfg.optim, total_steps), precision, heartbeat, logger,
              steps_per_epoch, total_steps, stop_step,
              tcfg.batch_size * tcfg.accum_steps * info.world_size, memory_format,
              _make_timer(tcfg, device), compiled_before=compiled_before,
              loss_sum=torch.zeros((), device=device),
              memory=HeldMemory(model, optimizer, sync))
    checkpoint.check_keep_every(tcfg.keep_every, tcfg.checkpoint_every, steps_per_epoch)
    if info.is_main:
        for stale in checkpoint.clean_stale_temporaries(run_dir):
            log.warning("removed stale temporary %s", stale)
    if resumed is not None:
        restore(run, resumed)
    if sync.tracer is not None:  # the steps right after the timing warm-up
        run.tracer = sync.tracer
        run.tracer.first = run.start_step + run.timer.warmup + 1
        run.tracer.last = min(run.stop_step, run.tracer.first + tcfg.trace_steps - 1)
    run.faults = Faults(cfg.fault, info.rank, info.world_size, model)
    run.guard = Guard(tcfg, info, model, precision.scaler, total_steps)
    if tcfg.calibrate_steps:
        run.local_backward_ms = time_local_backward(run, tcfg.calibrate_steps)
    if info.is_main:
        record_run(run)
    return run


def _make_timer(tcfg, device: torch.device) -> StepTimer:
    """The loop's clock. With a CUDA graph the eager calls and the capture are not timed either."""
    warmup = max(tcfg.timing_warmup, EAGER_CALLS) + 1 if tcfg.cuda_graph else tcfg.timing_warmup
    return StepTimer(device, warmup)


def restore(run: Run, resumed: dict) -> None:
    """Continue from a checkpoint: weights, optimizer, schedule, loss scale, every RNG, step."""
    checkpoint.check_position(resumed, run.steps_per_epoch, run.cfg.train.accum_steps)
    run.model.load_state_dict(resumed["model"])
    run.sync.load_optimizer_state(run.optimizer, resumed["optimizer"])  # ZeRO: this rank's shard
    run.scheduler.load_state_dict(resumed["scheduler"])
    run.precision.scaler.load_state_dict(resumed["scaler"])
    checkpoint.set_rng_state(resumed["rng"][run.info.rank], run.info.device)
    run.start_step = run.logged_step = resumed["step"]
    log.info("resumed from %s at step %d", resumed["path"], run.start_step)


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


def time_local_backward(run: Run, passes: int) -> float:
    """Median backward time (ms) of `passes` micro-steps that do not communicate (after two
    untimed ones). DDP waits for its all-reduces inside backward, so its exposed communication is
    (synced backward + wait) - this. Runs under fork_rng and leaves no gradients, so training is
    unaffected."""
    x, y = next(run.data.train.epoch(0))
    x = x.contiguous(memory_format=run.memory_format)
    device = run.info.device
    timer = StepTimer(device, warmup=2)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        for _ in range(passes + 2):
            timer.restart()
            with run.sync.no_sync():
                with run.precision.autocast():
                    loss = F.cross_entropy(run.train_model(x), y)
                timer.mark("forward")
                run.precision.scaler.scale(loss).backward()
                timer.mark("backward")
            timer.end_step()
            run.train_model.zero_grad(set_to_none=True)
    return timer.summary()["backward_ms"]


def record_run(run: Run) -> None:
    """Rank 0: run_info.json (how this run was made) and the same in TensorBoard."""
    facts = {"world_size": run.info.world_size, "backend": run.info.backend,
             "global_batch": run.global_batch, "total_steps": run.total_steps,
             "train_samples": run.data.train_samples, "val_samples": run.data.val_samples}
    path = provenance.write(os.path.join(run.run_dir, "run_info.json"), run.cfg_dict,
                            run.info.device, run=facts)
    with open(path) as f:
        run.logger.text("run_info", f.read())
    run.logger.text("config", OmegaConf.to_yaml(run.cfg_dict))
    log.info("world size %d (%s on %s), global batch %d, %d steps, %d train / %d val samples",
             run.info.world_size, run.info.backend, run.info.device, run.global_batch,
             run.total_steps, run.data.train_samples, run.data.val_samples)


# ---- 2. the loop ------------------------------------------------------------------------------

def loop(run: Run) -> None:
    """Steps start_step+1 .. stop_step (1-based, as in the logs), each followed by whatever is due
    after it: a log line, an evaluation, a checkpoint, a replica check."""
    from tqdm import tqdm

    # disable=None: a bar only on a terminal; redirected output gets log lines instead.
    bar = tqdm(total=run.total_steps, initial=run.start_step, unit="step", dynamic_ncols=True,
               disable=None if run.info.is_main and run.cfg.train.progress else True,
               file=sys.stderr)
    step_fn, last_phase = functools.partial(train_step, run), "optim"
    if run.cfg.train.cuda_graph:  # (the run does not hold it: no reference cycle keeps it alive)
        step_fn, last_phase = GraphedTrainStep(step_fn, run.optimizer, run.guard), "graph"
    batches = micro_batches(run)
    run.model.train()
    run.timer.restart()
    for step in range(run.start_step + 1, run.stop_step + 1):
        run.faults.on_step(step)  # fault.* injection (tests, demos); off by default
        run.heartbeat.beat(step)  # (after it: a rank that hangs there never began the step)
        tracing = run.tracer is not None and run.tracer.begin_step(step)
        batch = next(batches)
        run.timer.mark("data")
        step_fn(step, batch, run.timer.mark)
        run.scheduler.step()
        run.timer.mark(last_phase)
        run.timer.note("comm_busy", run.sync.comm_busy_ms())  # NaN where it cannot measure it
        marks = run.timer.end_step(keep=tracing)
        if tracing:
            run.tracer.marks(marks)
        bar.update(1)
        if after_step(run, step, bar):
            run.timer.restart()  # that work's time is not step time
    bar.close()
    if run.stop_step < run.total_steps:
        log.info("stopped at step %d of %d (train.stop_at_step): run the same command without it "
                 "to continue from the checkpoint", run.stop_step, run.total_steps)
    if run.start_step >= run.stop_step:
        log.info("nothing to do: the checkpoint in %s is already at step %d of %d "
                 "(use train.resume=never or another hydra.run.dir to train again)",
                 run.run_dir, run.start_step, run.stop_step)
        evaluate(run, run.start_step)


def micro_batches(run: Run) -> Iterator[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Each step's micro-batches, from the resumed position on, epoch after epoch."""
    accum = run.cfg.train.accum_steps
    epoch, step_in_epoch = divmod(run.start_step, run.steps_per_epoch)
    while True:
        batches = run.data.train.epoch(epoch, start_batch=step_in_epoch * accum)
        for _ in range(step_in_epoch, run.steps_per_epoch):
            yield [(x.contiguous(memory_format=run.memory_format), y)
                   for x, y in (next(batches) for _ in range(accum))]
        epoch, step_in_epoch = epoch + 1, 0


def train_step(run: Run, step: int, batches: list, mark: Callable[[str], None]) -> None:
    """One optimizer step's device work: forward and backward of each micro-batch, the gradient
    sync, the guard, the optimizer. With train.cuda_graph this is what is captured and replayed.
    AMP order: forward -> scaled backward -> sync -> unscale -> clip -> step -> update."""
    accum = run.cfg.train.accum_steps
    for micro, (x, y) in enumerate(batches):
        last = micro == accum - 1  # only the last micro-step communicates
        with contextlib.nullcontext() if last else run.sync.no_sync():
            with run.precision.autocast():
                loss = F.cross_entropy(run.train_model(x), y)
            if accum > 1:  # (one op fewer otherwise: small models are host-bound)
                loss = loss / accum
            mark("forward")
            run.precision.scaler.scale(loss).backward()  # the last one starts the gradient sync
            mark("backward")
        run.loss_sum.add_(loss.detach())
    run.sync.finish()  # gradients averaged over ranks from here on
    mark("comm")
    run.guard.after_sync(step, loss, run.optimizer)  # inf/NaN: skip on every rank, or stop
    mark("guard")
    if run.cfg.optim.grad_clip > 0:
        run.precision.scaler.unscale_(run.optimizer)
        run.sync.clip_grad_norm_(run.optimizer, run.cfg.optim.grad_clip)  # ZeRO: over all shards
    run.precision.scaler.step(run.optimizer)  # skipped on every rank alike if grads hold inf/NaN
    run.precision.scaler.update()
    run.optimizer.zero_grad(set_to_none=True)


def after_step(run: Run, step: int, bar) -> bool:
    """What is due after `step`; returns whether anything ran (its time is not step time)."""
    tcfg, spe = run.cfg.train, run.steps_per_epoch
    end_of_epoch = step % spe == 0
    log_now = step % tcfg.log_every == 0 or step == run.stop_step
    eval_now = step == run.total_steps or (
        end_of_epoch and tcfg.eval_every_epochs and (step // spe) % tcfg.eval_every_epochs == 0)
    checkpoint_now = step == run.stop_step or (
        tcfg.checkpoint_every and step % tcfg.checkpoint_every == 0) or (
        not tcfg.checkpoint_every and end_of_epoch)
    if log_now:
        log_window(run, step, bar)
    if eval_now:
        evaluate(run, step)
    # Non-finite verdicts are read where the host syncs anyway: log steps, checkpoints, the end.
    checked = run.guard.end_step(step, sync_point=log_now or checkpoint_now)
    if checkpoint_now:
        save_checkpoint(run, step)
    return log_now or eval_now or checkpoint_now or checked


def log_window(run: Run, step: int, bar) -> None:
    """The steps since the last log line: mean loss over every rank, throughput, phase medians."""
    dist.all_reduce(run.loss_sum)  # the global batch's loss: (sum over ranks) / ranks
    steps = step - run.logged_step
    mean_loss = run.loss_sum.item() / (steps * run.info.world_size)  # waits for the device
    run.loss_sum.zero_()
    run.logged_step = step
    metrics = {"train/loss": mean_loss, "train/lr": float(run.scheduler.get_last_lr()[0]),
               "train/epoch": step / run.steps_per_epoch}
    timed = run.timer.window()  # after the wait above: every step of the window has finished
    if timed:  # none in warm-up
        total_s = sum(s["step"] for s in timed) / 1e3
        metrics["throughput/img_per_s"] = len(timed) * run.global_batch / total_s
        metrics["time/step_ms"] = total_s / len(timed) * 1e3
        phases = with_exposed_comm(medians(timed), run.local_backward_ms,
                                   run.cfg.train.accum_steps)
        metrics.update({f"time/{k}_ms": v for k, v in phases.items() if k != "step"})
    if run.precision.scaler.is_enabled():
        metrics["precision/loss_scale"] = run.precision.scaler.get_scale()
    run.logger.log(step, metrics)
    speed = (f"{metrics['throughput/img_per_s']:.0f} img/s" if timed else "warming up")
    bar.set_postfix(loss=f"{mean_loss:.3f}", speed=speed)
    if bar.disable:
        log.info("step %d/%d: loss %.4f, %s", step, run.total_steps, mean_loss, speed)


def evaluate(run: Run, step: int) -> None:
    """Validation loss and accuracy over every sample once, reduced as (sum, count)."""
    run.model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=run.info.device)  # loss, correct, count
    with torch.no_grad(), run.precision.autocast():
        for x, y in run.data.val.epoch(0):
            logits = run.model(x.contiguous(memory_format=run.memory_format))
            totals[0] += F.cross_entropy(logits.float(), y, reduction="sum")
            totals[1] += (logits.argmax(1) == y).sum()
            totals[2] += len(y)
    dist.all_reduce(totals)  # SUM: ReduceOp.AVG is NCCL-only
    run.model.train()
    loss_sum, correct, count = totals.tolist()
    run.val_loss, run.val_accuracy = loss_sum / count, correct / count
    run.logger.log(step, {"val/loss": run.val_loss, "val/accuracy": run.val_accuracy})
    log.info("step %d epoch %.1f: val loss %.4f, accuracy %.4f", step,
             step / run.steps_per_epoch, run.val_loss, run.val_accuracy)


def save_checkpoint(run: Run, step: int) -> None:
    """Rank 0 writes everything the next step depends on; every rank waits until it is on disk."""
    assert_finite(run.model, run.optimizer, step)  # a NaN never reaches a checkpoint
    rng = checkpoint.gather_rng_states(run.info.device)
    optimizer = run.sync.optimizer_state(run.optimizer)  # collective: ZeRO gathers the shards
    if run.info.is_main:
        spe, accum = run.steps_per_epoch, run.cfg.train.accum_steps
        state = {"model": run.model.state_dict(),
                 **float_lrs(run.optimizer, run.scheduler, optimizer),
                 "scaler": run.precision.scaler.state_dict(), "step": step, "epoch": step // spe,
                 "epoch_batch": (step % spe) * accum, "rng": rng,
                 "config_digest": checkpoint.config_digest(run.cfg_dict, run.info.world_size),
                 "world_size": run.info.world_size,
                 "resume_config": checkpoint.resume_config(run.cfg_dict, run.info.world_size)}
        paths = checkpoint.save(state, run.run_dir, step, run.cfg.train.keep_every)
        log.info("step %d: checkpoint saved (%s)", step,
                 ", ".join(os.path.basename(p) for p in paths))
    dist.barrier()  # nobody runs ahead of a checkpoint that is not on disk yet


# ---- 3. the summary ---------------------------------------------------------------------------

def write_summary(run: Run) -> dict:
    """summary.json (rank 0) and TensorBoard's hparams: what the run measured, over all ranks."""
    timing = run.timer.summary()
    time_ms = {k[:-3]: v for k, v in timing.items() if k.endswith("_ms")}
    cfg, info = run.cfg, run.info
    summary = {
        "world_size": info.world_size, "backend": info.backend, "device": str(info.device),
        "model": cfg.model.name, "data": cfg.data.name, "sync": cfg.sync.name,
        "precision": cfg.precision.name, "per_rank_batch": cfg.train.batch_size,
        "accum_steps": cfg.train.accum_steps, "global_batch": run.global_batch,
        "steps": run.stop_step, "total_steps": run.total_steps,
        "stopped_early": run.stop_step < run.total_steps,
        "train_img_per_s": (run.global_batch * timing["timed_steps"] / timing["timed_total_s"]
                            if timing.get("timed_total_s") else math.nan),
        "val_accuracy": run.val_accuracy, "val_loss": run.val_loss,
        "time_ms": with_exposed_comm(time_ms, run.local_backward_ms, cfg.train.accum_steps),
        "timed_steps": timing.get("timed_steps", 0),
        "rank_step_ms": _gather_floats(timing.get("step_ms", math.nan), info.device),
        "comm_bytes_per_step": run.sync.bytes_per_step(),
        "comm": run.sync.comm_stats(),
        "parameters": sum(p.numel() for p in run.model.parameters()),
        "memory": memory_block(run),
        "compiled_graphs": compiled_graphs() - run.compiled_before,
        **run.guard.summary(),
    }
    if run.tracer is not None:  # collective
        if run.tracer.first > run.stop_step:
            log.warning("train.trace: the run ends before step %d, the first after the timing "
                        "warm-up: nothing traced", run.tracer.first)
        summary["overlap"] = trace.write(run.tracer, run.run_dir, info.is_main)
    if info.device.type == "cuda":
        summary["max_memory_allocated_GiB"] = torch.cuda.max_memory_allocated(info.device) / 2**30
    if info.is_main:
        with open(os.path.join(run.run_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        run.logger.hparams(
            {"world_size": info.world_size, "sync": cfg.sync.name, "precision": cfg.precision.name,
             "global_batch": run.global_batch, "lr": cfg.optim.lr, "model": cfg.model.name},
            {"hparam/val_accuracy": run.val_accuracy, "hparam/val_loss": run.val_loss,
             "hparam/train_img_per_s": summary["train_img_per_s"]})
        log.info("done: %d steps, val accuracy %.4f, %.0f img/s -> %s", run.stop_step,
                 run.val_accuracy, summary["train_img_per_s"], run.run_dir)
    return summary


def memory_block(run: Run) -> dict:
    """Collective: the bytes each rank held (lists by rank, counted), and those predicted."""
    every = [None] * run.info.world_size
    dist.all_gather_object(every, run.memory.counted)
    counted = {k: [None if c is None else c[k] for c in every] for k in MEMORY_KEYS}
    params = [p.numel() for p in run.model.parameters()]
    s, o = run.cfg.sync, run.cfg.optim
    states = {"adamw": 2, "sgd": int(o.momentum > 0)}[o.name]
    comm_elem = element_size(s.comm_dtype)
    predicted = predict_held(sum(params), max(params), run.info.world_size, s.name, s.zero,
                             states, s.bucket_mb * 2**20, comm_elem)
    return {**counted, "predicted": predicted, "zero": s.zero}


def _gather_floats(value: float, device) -> list[float]:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    out = [torch.zeros_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return [o.item() for o in out]


def main() -> None:
    run_hydra_app(train, "config")


if __name__ == "__main__":
    main()
