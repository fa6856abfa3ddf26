"""A training run's checkpoint as the loop sees it: which one to resume from, what a new one holds
and how it comes back. The formats are checkpoint.py's (checkpoint.pt, written by rank 0, at
sync.zero=0) and sharded_checkpoint.py's (each rank its own shards: ZeRO, FSDP); what goes in,
and why each part, is in checkpoint.py's docstring.
"""

from __future__ import annotations

import logging
import os

import torch.distributed as dist

from ddp_lab import checkpoint, sharded_checkpoint
from ddp_lab.guard import assert_finite
from ddp_lab.optim import float_lrs
from ddp_lab.sync.config import shards_state

log = logging.getLogger("ddp_lab")


def find(cfg, cfg_dict: dict, run_dir: str, world_size: int) -> dict | None:
    """The checkpoint train.resume names in `run_dir` (auto: the newest), checked against this
    config before anything is written; None to start afresh."""
    resume = sharded_checkpoint.resume if shards_state(cfg.sync) else checkpoint.resume
    return resume(cfg_dict, run_dir, cfg.train.resume, world_size, log.warning)


def restore(parts, scheduler, resumed: dict, info, steps_per_epoch: int, accum_steps: int) -> None:
    """Continue from a checkpoint: weights, optimizer, schedule, loss scale, every RNG. `parts`:
    the step's (ddp_lab/step.py)."""
    checkpoint.check_position(resumed, steps_per_epoch, accum_steps)
    if "layout" in resumed:  # sharded: each rank reads its part, at any world size
        sharded_checkpoint.load(resumed, parts.sync, parts.model, parts.optimizer)
    else:
        parts.model.load_state_dict(resumed["model"])
        parts.optimizer.load_state_dict(resumed["optimizer"])
        if "sync" in resumed:  # sync.compress: this rank's error buffers, Q, step count
            parts.sync.load_state_dict(resumed["sync"][info.rank])
    scheduler.load_state_dict(resumed["scheduler"])
    parts.precision.scaler.load_state_dict(resumed["scaler"])
    if info.rank < len(resumed["rng"]):  # (a rank the writing run did not have keeps its seed)
        checkpoint.set_rng_state(resumed["rng"][info.rank], info.device)
    log.info("resumed from %s at step %d", resumed["path"], resumed["step"])


def clean_stale(run_dir: str) -> None:
    """Rank 0: temporaries an interrupted save left behind (never a finished checkpoint)."""
    for stale in (checkpoint.clean_stale_temporaries(run_dir)
                  + sharded_checkpoint.clean_stale_temporaries(run_dir)):
        log.warning("removed stale temporary %s", stale)


def save(ctx, parts, scheduler, steps_per_epoch: int, step: int) -> None:
    """Everything the next step depends on: rank 0 writes checkpoint.pt, or where each rank holds
    a part (ZeRO, FSDP) each writes its own shards. Every rank waits until it is on disk. `ctx`:
    the run's RunContext (ddp_lab/train.py: cfg, cfg_dict, run_dir, info)."""
    assert_finite(parts.optimizer, step)  # a NaN never reaches a checkpoint
    rng = checkpoint.gather_rng_states(ctx.info.device)
    sharded, n = shards_state(ctx.cfg.sync), ctx.info.world_size
    sync_states = [] if sharded else checkpoint.gather_sync_states(parts.sync)
    spe, accum = steps_per_epoch, ctx.cfg.train.accum_steps
    state = {"scaler": parts.precision.scaler.state_dict(), "step": step,
             "epoch": step // spe, "epoch_batch": (step % spe) * accum, "rng": rng,
             "config_digest": checkpoint.config_digest(ctx.cfg_dict, n, sharded),
             "world_size": n, "resume_config": checkpoint.resume_config(ctx.cfg_dict, n, sharded)}
    if sharded:  # the optimizer's tensors go in the shards, its hyperparameters here
        state |= float_lrs(parts.optimizer, scheduler,
                           {"param_groups": sharded_checkpoint.hyperparameters(parts.optimizer)})
        paths = [sharded_checkpoint.save(parts.sync, parts.model, parts.optimizer, state,
                                         ctx.run_dir, step, ctx.cfg.train.keep_every)]
    elif ctx.info.is_main:
        state |= {"model": parts.model.state_dict(), **float_lrs(parts.optimizer, scheduler),
                  **({"sync": sync_states} if sync_states else {})}
        paths = checkpoint.save(state, ctx.run_dir, step, ctx.cfg.train.keep_every)
    if ctx.info.is_main:
        log.info("step %d: checkpoint saved (%s)", step, ", ".join(map(os.path.basename, paths)))
    dist.barrier()  # nobody runs ahead of a checkpoint that is not on disk yet
