"""Data-parallel training of AlexNet-style CNNs. Read top to bottom.

    torchrun --standalone --nproc_per_node=2 -m ddp_lab.train            # 2 CPU ranks, digits
    python -m ddp_lab.train model=alexnet data=synthetic sync=none       # one process
    torchrun --nproc_per_node=8 -m ddp_lab.train sync=ring precision=bf16 train.channels_last=true

torchrun sets the environment -> Hydra composes conf/ + overrides into a typed config ->
dist.init() -> model, data, optimizer, precision, synchroniser, logger -> the loop -> finally:
close the logger, destroy the process group.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import statistics
import subprocess
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.nn.functional as F
from omegaconf import OmegaConf

from ddp_lab import checkpoint, dist as ddp_dist, fault, guard
from ddp_lab.config import ConfigError, register_configs, validate
from ddp_lab.data import build_data
from ddp_lab.graph import EAGER_CALLS, DeviceLR, GraphedStep, check_supported
from ddp_lab.metrics import StepTimer, make_logger, with_exposed_comm
from ddp_lab.models import build_model
from ddp_lab.optim import build_optimizer, build_scheduler, float_lrs
from ddp_lab.precision import setup_precision
from ddp_lab.sync import build_sync

CONF_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conf")
log = logging.getLogger("ddp_lab")


def train(cfg, run_dir: str) -> dict:
    """Train per `cfg`, writing into `run_dir` (rank 0 only); returns the run summary."""
    validate(cfg)
    info = ddp_dist.init(cfg.dist.backend, cfg.dist.timeout_s)
    logger = None
    try:
        if cfg.train.cuda_graph:  # refused before anything is written
            check_supported(cfg, info.device)
        if info.is_main:
            os.makedirs(run_dir, exist_ok=True)
        _setup_logging(run_dir, info.is_main)
        with guard.collective_errors(cfg.dist.timeout_s):
            # Before anything is written: a run dir of another config is refused untouched.
            cfg_dict = OmegaConf.to_container(cfg, resolve=True)
            resumed = checkpoint.resume(cfg_dict, run_dir, cfg.train.resume, info.world_size,
                                        log.warning)
            logger = make_logger(run_dir, info.is_main)
            # From here on the config is plain dataclasses: a DictConfig attribute read costs
            # ~16 us, and the loop makes a dozen a step (with the LR schedule's), ~5% of a small
            # model's eager step.
            with contextlib.ExitStack() as closing:  # shut before the group goes
                return _train(OmegaConf.to_object(cfg), cfg_dict, run_dir, info, logger, resumed,
                              closing)
    except BaseException as e:
        # The traceback holds _train's frame and through it DDP's reducer, which holds the
        # process group: released here, cleanup() below really destroys the group and joins
        # gloo's threads (not left to run into interpreter shutdown; see dist.init).
        _release_frames(e)
        raise
    finally:
        if logger is not None:
            logger.close()
        ddp_dist.cleanup()


def _release_frames(exc: BaseException | None) -> None:
    """Clear the local variables of every finished frame in `exc`'s tracebacks (and those of
    its causes); file names and line numbers stay for printing."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        traceback.clear_frames(exc.__traceback__)  # (executing frames are skipped)
        exc = exc.__cause__ or exc.__context__


def _train(cfg, cfg_dict, run_dir, info, logger, resumed, closing) -> dict:
    """`cfg`: the config as dataclasses; `cfg_dict`: the same, resolved, as plain dicts;
    `closing`: an ExitStack closed before the process group goes, whatever happens."""
    device, tcfg = info.device, cfg.train
    digest = checkpoint.config_digest(cfg_dict, info.world_size)

    # Same seed everywhere for the initial weights (rank 0's are broadcast anyway) ...
    torch.manual_seed(cfg.seed)
    data = build_data(cfg, info.rank, info.world_size, device)
    model = build_model(cfg.model.name, data.num_classes, cfg.model.dropout, cfg.model.stem)
    memory_format = torch.channels_last if tcfg.channels_last else torch.contiguous_format
    model = model.to(device, memory_format=memory_format)
    # ... then a different stream per rank, so dropout masks differ between ranks.
    torch.manual_seed(cfg.seed + 1 + info.rank)

    precision = setup_precision(cfg.precision, device, tcfg.cudnn_benchmark)
    sync = build_sync(cfg.sync, info)
    closing.callback(sync.close)  # its communication thread stops before the group does
    train_model = sync.prepare(model)  # DDP wrapper, or the model with our hooks installed
    if tcfg.compile:
        train_model = compile_model(train_model, device, tcfg.compile_mode)
    graphs_before = compiled_graphs()  # compiling happens on the first calls
    optimizer = build_optimizer(cfg.optim, model.parameters(), device)

    steps_per_epoch = data.train.num_batches(0) // tcfg.accum_steps
    total_steps = tcfg.max_steps or tcfg.epochs * steps_per_epoch
    scheduler = build_scheduler(optimizer, cfg.optim, total_steps)
    global_batch = tcfg.batch_size * tcfg.accum_steps * info.world_size

    start_step = 0
    if info.is_main:
        for stale in checkpoint.clean_stale_temporaries(run_dir):
            log.warning("removed stale temporary %s", stale)
    checkpoint.check_keep_every(tcfg.keep_every, tcfg.checkpoint_every, steps_per_epoch)
    if resumed is not None:
        checkpoint.check_position(resumed, steps_per_epoch, tcfg.accum_steps)
        model.load_state_dict(resumed["model"])
        optimizer.load_state_dict(resumed["optimizer"])
        scheduler.load_state_dict(resumed["scheduler"])
        precision.scaler.load_state_dict(resumed["scaler"])
        checkpoint.set_rng_state(resumed["rng"][info.rank], device)
        start_step = resumed["step"]
        log.info("resumed from %s at step %d", resumed["path"], start_step)

    device_lr = DeviceLR(optimizer) if tcfg.cuda_graph else None  # after resuming: floats there
    faults = fault.Faults(cfg.fault, info.rank, info.world_size, model)
    checks = guard.Guard(tcfg, cfg.sync.name, info, model, precision.scaler, total_steps)

    if info.is_main:
        _record_run(cfg_dict, run_dir, info, logger, global_batch, total_steps, data)

    def save_checkpoint(step: int) -> None:
        guard.assert_finite(model, optimizer, step)  # a NaN never reaches a checkpoint
        rng = checkpoint.gather_rng_states(device)
        if info.is_main:
            state = {"model": model.state_dict(), **float_lrs(optimizer, scheduler),
                     "scaler": precision.scaler.state_dict(),
                     "step": step, "epoch": step // steps_per_epoch,
                     "epoch_batch": (step % steps_per_epoch) * tcfg.accum_steps,
                     "rng": rng, "config_digest": digest, "world_size": info.world_size,
                     "resume_config": checkpoint.resume_config(cfg_dict, info.world_size)}
            paths = checkpoint.save(state, run_dir, step, tcfg.keep_every)
            log.info("step %d: checkpoint saved (%s)", step,
                     ", ".join(os.path.basename(p) for p in paths))
        dist.barrier()  # nobody runs ahead of a checkpoint that is not on disk yet

    def evaluate() -> tuple[float, float]:
        """Validation loss and accuracy over every sample once, reduced as (sum, count)."""
        model.eval()
        totals = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, count
        with torch.no_grad(), precision.autocast():
            for x, y in data.val.epoch(0):
                logits = model(x.contiguous(memory_format=memory_format))
                totals[0] += F.cross_entropy(logits.float(), y, reduction="sum")
                totals[1] += (logits.argmax(1) == y).sum()
                totals[2] += len(y)
        dist.all_reduce(totals)  # SUM: ReduceOp.AVG is NCCL-only
        model.train()
        loss_sum, correct, count = totals.tolist()
        return loss_sum / count, correct / count

    # Backward without communication, timed once up front: DDP waits for its all-reduces inside
    # backward, so its exposed communication is (synced backward + wait) - local backward.
    local_backward_ms = (time_local_backward(train_model, sync, precision, data, memory_format,
                                             device, tcfg.calibrate_steps)
                         if tcfg.calibrate_steps else None)

    # ---- the loop ----
    from tqdm import tqdm

    # disable=None: tqdm shows the bar only on a terminal; redirected output gets log lines instead.
    bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True,
               disable=None if info.is_main and tcfg.progress else True, file=sys.stderr)
    # With a graph, the eager calls before the capture are not timed either.
    timer = StepTimer(device, warmup=max(tcfg.timing_warmup, EAGER_CALLS * tcfg.cuda_graph),
                      phase_every=tcfg.phase_every if device.type == "cuda" else 1)
    comm_busy: list[float] = []  # per timed step, from the sync
    val_loss = val_acc = float("nan")
    loss_window = torch.zeros((), device=device)
    window_steps = 0  # steps whose loss is in loss_window
    clock_steps, clock_t0 = 0, time.perf_counter()  # steps timed since clock_t0 (eval excluded)
    stop_step = min(total_steps, tcfg.stop_at_step) if tcfg.stop_at_step else total_steps
    epoch = start_step // steps_per_epoch
    batches = data.train.epoch(epoch, start_batch=(start_step % steps_per_epoch) * tcfg.accum_steps)

    def compute_step(step: int, micro_batches: list, mark) -> None:
        """One optimizer step's device work: forward and backward of each micro-batch, gradient
        sync, guard, optimizer. With train.cuda_graph this is what is captured and replayed."""
        for micro, (x, y) in enumerate(micro_batches):
            last = micro == tcfg.accum_steps - 1
            with (contextlib.nullcontext() if last else sync.no_sync()):
                with precision.autocast():
                    loss = F.cross_entropy(train_model(x), y)
                if tcfg.accum_steps > 1:  # (one op fewer otherwise: small models are host-bound)
                    loss = loss / tcfg.accum_steps
                mark("forward")
                precision.scaler.scale(loss).backward()  # the last micro-step starts bucket syncs
                mark("backward")
            loss_window.add_(loss.detach())
        sync.finish()  # gradients averaged over ranks from here on
        checks.after_sync(step, loss, optimizer)  # inf/NaN: skip on every rank, or stop
        mark("comm")
        if cfg.optim.grad_clip > 0:
            precision.scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
        precision.scaler.step(optimizer)  # skipped (on every rank alike) if grads hold inf/NaN
        precision.scaler.update()
        optimizer.zero_grad(set_to_none=True)

    graphed = None
    if tcfg.cuda_graph:  # inputs: the micro-batches, flattened; `step`: the loop's, read per call
        graphed = GraphedStep(lambda *t: compute_step(
            step + 1, list(zip(t[::2], t[1::2])), lambda phase: None))
    model.train()
    timer.restart()
    for step in range(start_step, stop_step):
        faults.on_step(step + 1)  # fault.* injection (tests, demos); off by default
        checks.begin_step(step + 1)
        if step // steps_per_epoch != epoch:
            epoch = step // steps_per_epoch
            batches = data.train.epoch(epoch)
        micro_batches = []
        for _ in range(tcfg.accum_steps):
            x, y = next(batches)
            micro_batches.append((x.contiguous(memory_format=memory_format), y))
        timer.mark("data")
        if graphed is None:
            what = "eager"
            compute_step(step + 1, micro_batches, timer.mark)
        else:
            what, _ = graphed(*(t for pair in micro_batches for t in pair))
            if what != "eager":
                checks.replayed(step + 1)
        scheduler.step()
        if device_lr is not None:
            device_lr.update()
        # With a graph, forward, backward, guard and optimizer are one phase.
        timer.mark("optim" if graphed is None else "graph")
        window_steps += 1
        clock_steps += 1
        if what == "captured":  # capture time is not step time
            timer.restart()
            clock_steps, clock_t0 = 0, time.perf_counter()
        else:
            timer.end_step()
        if step - start_step >= tcfg.timing_warmup:
            comm_busy.append(sync.comm_busy_ms())  # NaN where the sync cannot measure it
        bar.update(1)

        done = step + 1
        if done % tcfg.log_every == 0 or done == stop_step:
            dist.all_reduce(loss_window)  # the global batch's loss: (sum over ranks) / ranks
            mean_loss = loss_window.item() / (window_steps * info.world_size)  # waits for the GPU
            elapsed = time.perf_counter() - clock_t0  # so the clock is read after the work is done
            metrics = {"train/loss": mean_loss,
                       "train/lr": float(scheduler.get_last_lr()[0]),
                       "train/epoch": done / steps_per_epoch}
            if clock_steps:  # none where the window held only a graph capture
                metrics["throughput/img_per_s"] = clock_steps * global_batch / elapsed
                metrics["time/step_ms"] = elapsed / clock_steps * 1e3
            # The phases' medians over the window (time/step_ms above is its wall clock).
            phases = with_exposed_comm(timer.window(), local_backward_ms, tcfg.accum_steps)
            metrics.update({f"time/{k}_ms": v for k, v in phases.items() if k != "step"})
            if precision.scaler.is_enabled():
                metrics["precision/loss_scale"] = precision.scaler.get_scale()
            logger.log(done, metrics)
            speed = (f"{metrics['throughput/img_per_s']:.0f} img/s" if clock_steps
                     else "CUDA graph captured, not timed")
            bar.set_postfix(loss=f"{metrics['train/loss']:.3f}", speed=speed)
            if bar.disable:
                log.info("step %d/%d: loss %.4f, %s", done, total_steps, metrics["train/loss"],
                         speed)
            loss_window.zero_()
            window_steps, clock_steps, clock_t0 = 0, 0, time.perf_counter()

        end_of_epoch = done % steps_per_epoch == 0
        eval_now = done == total_steps or (
            end_of_epoch and tcfg.eval_every_epochs
            and (done // steps_per_epoch) % tcfg.eval_every_epochs == 0)
        if eval_now:
            val_loss, val_acc = evaluate()
            logger.log(done, {"val/loss": val_loss, "val/accuracy": val_acc})
            log.info("step %d epoch %.1f: val loss %.4f, accuracy %.4f", done,
                     done / steps_per_epoch, val_loss, val_acc)
        checkpoint_now = done == stop_step or (
            tcfg.checkpoint_every and done % tcfg.checkpoint_every == 0) or (
            not tcfg.checkpoint_every and end_of_epoch)
        # Non-finite verdicts are read where the host syncs anyway: log steps, checkpoints, end.
        checked = checks.end_step(done, sync_point=(done % tcfg.log_every == 0 or checkpoint_now))
        if checkpoint_now:
            save_checkpoint(done)
        if eval_now or checkpoint_now or checked:
            timer.restart()  # eval and checkpoint time is not step time
            clock_steps, clock_t0 = 0, time.perf_counter()
    bar.close()
    if stop_step < total_steps:
        log.info("stopped at step %d of %d (train.stop_at_step): run the same command without it "
                 "to continue from the checkpoint", stop_step, total_steps)

    if start_step >= stop_step:
        log.info("nothing to do: the checkpoint in %s is already at step %d of %d "
                 "(use train.resume=never or another hydra.run.dir to train again)",
                 run_dir, start_step, stop_step)
        val_loss, val_acc = evaluate()

    timing = timer.summary()
    time_ms = {k[:-3]: v for k, v in timing.items() if k.endswith("_ms")}
    busy = [b for b in comm_busy if not math.isnan(b)]
    if busy:  # time the all-reduces were in flight, overlapped or not (our syncs only)
        time_ms["comm_busy"] = statistics.median(busy)
    time_ms = with_exposed_comm(time_ms, local_backward_ms, tcfg.accum_steps)
    rank_step_ms = _gather_floats(timing.get("step_ms", float("nan")), device)
    digests = [None] * info.world_size  # replicas must be identical: check, don't assume
    dist.all_gather_object(digests, parameter_digest(model))
    if len(set(digests)) > 1:
        log.error("replicas diverged: parameter digests per rank %s", digests)
    summary = {
        "world_size": info.world_size, "backend": info.backend, "device": str(device),
        "model": cfg.model.name, "data": cfg.data.name, "sync": cfg.sync.name,
        "precision": cfg.precision.name, "per_rank_batch": tcfg.batch_size,
        "accum_steps": tcfg.accum_steps, "global_batch": global_batch,
        "steps": stop_step, "total_steps": total_steps, "stopped_early": stop_step < total_steps,
        "train_img_per_s": (global_batch * timing["timed_steps"] / timing["timed_total_s"]
                            if timing.get("timed_total_s") else float("nan")),
        "val_accuracy": val_acc, "val_loss": val_loss,
        "time_ms": time_ms,
        "timed_steps": timing.get("timed_steps", 0),
        "phase_timed_steps": timing.get("phase_timed_steps", 0),  # train.phase_every
        "rank_step_ms": rank_step_ms,
        "rank_param_digests": digests,
        "comm_bytes_per_step": sync.bytes_per_step(),
        "comm": sync.comm_stats(),
        "parameters": sum(p.numel() for p in model.parameters()),
        "compiled_graphs": compiled_graphs() - graphs_before,
        **checks.summary(),
    }
    if device.type == "cuda":
        summary["max_memory_allocated_GiB"] = torch.cuda.max_memory_allocated(device) / 2**30
    if info.is_main:
        with open(os.path.join(run_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        logger.hparams(
            {"world_size": info.world_size, "sync": cfg.sync.name, "precision": cfg.precision.name,
             "global_batch": global_batch, "lr": cfg.optim.lr, "model": cfg.model.name},
            {"hparam/val_accuracy": val_acc, "hparam/val_loss": val_loss,
             "hparam/train_img_per_s": summary["train_img_per_s"]})
        log.info("done: %d steps, val accuracy %.4f, %.0f img/s -> %s", stop_step, val_acc,
                 summary["train_img_per_s"], run_dir)
    return summary


def compile_model(module: torch.nn.Module, device: torch.device, mode: str) -> torch.nn.Module:
    """torch.compile, refused up front (not deep inside the first step) where it cannot work."""
    import shutil

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


def time_local_backward(train_model, sync, precision, data, memory_format, device,
                        passes: int) -> float:
    """Median backward time (ms) of `passes` micro-steps that do not communicate (after two
    untimed ones). Runs under fork_rng and leaves no gradients, so training is unaffected."""
    x, y = next(data.train.epoch(0))
    x = x.contiguous(memory_format=memory_format)
    timer = StepTimer(device, warmup=2)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        for _ in range(passes + 2):
            timer.restart()
            with sync.no_sync():
                with precision.autocast():
                    loss = F.cross_entropy(train_model(x), y)
                timer.mark("forward")
                precision.scaler.scale(loss).backward()
                timer.mark("backward")
            timer.end_step()
            train_model.zero_grad(set_to_none=True)
    return timer.summary()["backward_ms"]


def parameter_digest(model: torch.nn.Module) -> str:
    """sha256 of every parameter's bytes: equal digests mean bitwise-equal replicas."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def _gather_floats(value: float, device) -> list[float]:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    out = [torch.zeros_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return [o.item() for o in out]


def git_commit() -> str:
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True,
                             text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=here, capture_output=True,
                               text=True, timeout=10).stdout.strip()
        return (sha + ("-dirty" if dirty else "")) if sha else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _record_run(cfg_dict, run_dir, info, logger, global_batch, total_steps, data) -> None:
    """Resolved config, versions, devices and git commit: how this run was made."""
    record = {"git_commit": git_commit(), "world_size": info.world_size, "backend": info.backend,
              "global_batch": global_batch, "total_steps": total_steps,
              "train_samples": data.train_samples, "val_samples": data.val_samples,
              "argv": sys.argv, **ddp_dist.versions()}
    with open(os.path.join(run_dir, "run_info.json"), "w") as f:
        json.dump({"run": record, "config": cfg_dict}, f, indent=2)
    logger.text("config", OmegaConf.to_yaml(cfg_dict))
    logger.text("run_info", json.dumps(record, indent=2))
    log.info("world size %d (%s on %s), global batch %d, %d steps, %d train / %d val samples",
             info.world_size, info.backend, info.device, global_batch, total_steps,
             data.train_samples, data.val_samples)


def _setup_logging(run_dir: str, is_main: bool) -> None:
    """Rank 0 logs INFO to stderr and train.log; the other ranks only warnings and errors."""
    log.handlers.clear()
    log.propagate = False
    log.setLevel(logging.INFO if is_main else logging.WARNING)
    fmt = logging.Formatter("[%(asctime)s %(levelname)s] %(message)s", "%H:%M:%S")
    handlers = [logging.StreamHandler(sys.stderr)]
    if is_main:
        handlers.append(logging.FileHandler(os.path.join(run_dir, "train.log")))
    for h in handlers:
        h.setFormatter(fmt)
        log.addHandler(h)


# ---- Hydra entry ------------------------------------------------------------------------------

def _register_resolvers() -> None:
    if not OmegaConf.has_resolver("ddp_lab.run_name"):
        # Deterministic run dir shared by all ranks: the overrides, or "default".
        OmegaConf.register_new_resolver("ddp_lab.run_name", lambda s: s or "default")
        # Only rank 0 writes Hydra's .hydra/ record, and only into a new run dir (or one started
        # over with train.resume=never): a resumed or refused start leaves the first one intact.
        OmegaConf.register_new_resolver("ddp_lab.rank0_only", _hydra_record_dir)


def _hydra_record_dir(subdir: str, *, _root_):
    if os.environ.get("RANK", "0") != "0":
        return None
    try:
        out = _root_.hydra.runtime.output_dir
        if (_root_.train.resume != "never"
                and os.path.exists(os.path.join(out, subdir, "config.yaml"))):
            return None
    except Exception:  # no run dir yet (or no train node): Hydra's default
        pass
    return subdir


def run_hydra_app(task, config_name: str) -> None:
    """Run `task(cfg, run_dir)` as a Hydra app; a ConfigError becomes one line and exit code 2."""
    import hydra
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    register_configs()
    _register_resolvers()

    @hydra.main(config_path=CONF_DIR, config_name=config_name, version_base=None)
    def entry(cfg):
        try:
            if HydraConfig.get().mode == RunMode.MULTIRUN and ddp_dist.under_torchrun():
                raise ConfigError("--multirun inside torchrun would start a sweep on every rank; "
                                  "sweep world sizes with `python -m ddp_lab.scale` instead")
            task(cfg, HydraConfig.get().runtime.output_dir)
        except ConfigError as e:
            if os.environ.get("RANK", "0") == "0":
                print(f"error: {e}", file=sys.stderr, flush=True)
            sys.exit(2)
        except guard.TrainingError as e:  # hang, dead peer, NaN (stop), diverged replicas
            if e.every_rank or os.environ.get("RANK", "0") == "0":
                print(f"error: {e}", file=sys.stderr, flush=True)
            sys.exit(3)

    entry()


def main() -> None:
    run_hydra_app(train, "config")


if __name__ == "__main__":
    main()
