"""The end of a training run: summary.json (rank 0) and TensorBoard's hparams, what the run measured
over all ranks: throughput over timed steps only, the phase medians with the exposed
communication, every rank's step time, the bytes sent, the memory held (counted) beside the
memory predicted, the guard's counts, and with train.trace the timeline's overlap block."""

from __future__ import annotations

import json
import logging
import math
import os

import torch
import torch.distributed as dist

from ddp_lab import trace
from ddp_lab.comm import scratch_numel
from ddp_lab.dist import nodes
from ddp_lab.held_memory import MEMORY_KEYS, POINTS, total
from ddp_lab.perf.memory import compress_state_numel, predict_held
from ddp_lab.dtypes import element_size
from ddp_lab.metrics import with_exposed_comm
from ddp_lab.optim import state_tensors
from ddp_lab.step import compiled_graphs
from ddp_lab.sync.config import wire_dtype
from ddp_lab.sync.zero3 import unit_numels

log = logging.getLogger("ddp_lab")


def write_summary(run, progress) -> dict:
    """Collective: the summary of `run` (ddp_lab.train.Run) after the loop's `progress`; rank 0
    writes it."""
    ctx, length, parts = run.ctx, run.length, run.parts
    cfg, info = ctx.cfg, ctx.info
    timing = run.rec.timer.summary()
    time_ms = {k[:-3]: v for k, v in timing.items() if k.endswith("_ms")}
    comm = parts.sync.comm_stats()
    summary = {
        "world_size": info.world_size, "backend": info.backend, "device": str(info.device),
        "model": cfg.model.name, "data": cfg.data.name, "sync": cfg.sync.name,
        "precision": cfg.precision.name, "per_rank_batch": cfg.train.batch_size,
        "accum_steps": cfg.train.accum_steps, "global_batch": length.global_batch,
        "steps": length.stop_step, "total_steps": length.total_steps,
        "stopped_early": length.stop_step < length.total_steps,
        "train_img_per_s": (length.global_batch * timing["timed_steps"] / timing["timed_total_s"]
                            if timing.get("timed_total_s") else math.nan),
        "val_accuracy": progress.val_accuracy, "val_loss": progress.val_loss,
        "time_ms": with_exposed_comm(time_ms, run.rec.local_backward_ms, cfg.train.accum_steps),
        "timed_steps": timing.get("timed_steps", 0),
        "rank_step_ms": _gather_floats(timing.get("step_ms", math.nan), info.device),
        "comm_bytes_per_step": parts.sync.bytes_per_step(),
        "comm": comm,
        "link_bytes_per_step": _link_bytes(comm, info.device),
        "parameters": sum(p.numel() for p in parts.model.parameters()),
        "memory": memory_block(run),
        "compiled_graphs": compiled_graphs() - run.rec.compiled_before,
        **run.guard.summary(),
    }
    tracer = run.rec.tracer
    if tracer is not None:  # collective
        if tracer.first > length.stop_step:
            log.warning("train.trace: the run ends before step %d, the first after the timing "
                        "warm-up: nothing traced", tracer.first)
        summary["overlap"] = trace.write(tracer, ctx.run_dir, info.is_main)
    if info.device.type == "cuda":  # the training's peak; the calibration's before it (None: none)
        summary["max_memory_allocated_GiB"] = torch.cuda.max_memory_allocated(info.device) / 2**30
        peak = run.rec.calibration_peak
        summary["calibration_max_memory_allocated_GiB"] = None if peak is None else peak / 2**30
    if info.is_main:
        _write(run, progress, summary)
    return summary


def _write(run, progress, summary: dict) -> None:
    """Rank 0: summary.json, TensorBoard's hparams and the last log line."""
    ctx = run.ctx
    cfg = ctx.cfg
    with open(os.path.join(ctx.run_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    run.rec.logger.hparams(
        {"world_size": ctx.info.world_size, "sync": cfg.sync.name, "precision": cfg.precision.name,
         "global_batch": run.length.global_batch, "lr": cfg.optim.lr, "model": cfg.model.name},
        {"hparam/val_accuracy": progress.val_accuracy, "hparam/val_loss": progress.val_loss,
         "hparam/train_img_per_s": summary["train_img_per_s"]})
    log.info("done: %d steps, val accuracy %.4f, %.0f img/s -> %s", run.length.stop_step,
             progress.val_accuracy, summary["train_img_per_s"], ctx.run_dir)


def memory_block(run) -> dict:
    """Collective: the bytes each rank held, counted at each point of held_memory.POINTS; at the
    point where it held the most (`peak_point`), each kind as a list by rank; beside them the
    bytes predicted (perf.memory.predict_held) and the excess of the counted peak over them."""
    info, s = run.ctx.info, run.ctx.cfg.sync
    every = [None] * info.world_size
    dist.all_gather_object(every, run.rec.memory.points)  # [{point: counts}] by rank
    peak = [max(p, key=lambda k: total(p[k])) if p else None for p in every]
    numels = [q.numel() for q in run.parts.model.parameters()]
    states = state_tensors(run.ctx.cfg.optim)
    units = unit_numels(run.parts.model) if s.zero == 3 else None
    predicted = [predict_held(numels, info.world_size, r, s.name, s.zero, states, s.bucket_mb,
                              element_size(wire_dtype(s)), s.overlap, scratch_numel, units=units,
                              reshard_after_forward=s.reshard_after_forward,
                              compress_numel=_compress_numel(run.parts.sync, s,
                                                             run.length.start_step))
                 for r in range(info.world_size)]
    by_rank = lambda rows, k: [None if row is None else row[k] for row in rows]
    counted = [None if k is None else p[k] for p, k in zip(every, peak)]
    return {**{k: by_rank(counted, k) for k in MEMORY_KEYS}, "peak_point": peak,
            "points": {point: {k: by_rank([p.get(point) for p in every], k)
                               for k in MEMORY_KEYS} for point in POINTS},
            "predicted": {k: by_rank(predicted, k) for k in MEMORY_KEYS},
            "excess_bytes": [None if c is None else total(c) - total(p)
                             for c, p in zip(counted, predicted)],
            "zero": s.zero}


def _compress_numel(sync, s, start_step: int) -> int | None:
    """What compression should keep at the counted points (held_memory.POINTS: this run's first
    step's end, its second's backward): nothing unless that first step compressed (it follows
    `start_step` steps, sync.compress_start the uncompressed ones); None where torch's PowerSGD
    hook keeps it (sync=ddp: not counted)."""
    if s.compress not in ("powersgd", "topk"):
        return 0
    if s.name == "ddp":
        return None
    if start_step < s.compress_start:
        return 0
    return compress_state_numel([[p.shape for p in b.params] for b in sync.buckets], s.compress,
                                s.compress_rank, s.min_compression_rate, s.error_feedback)


def _link_bytes(comm: dict, device) -> float | None:
    """Collective: the bytes the busiest link between nodes (ddp_lab.dist's nodes) carried in the
    last step, from every rank's count; None where the sync does not count them (torch's)."""
    counted = comm.get("cross_node_bytes_per_step")
    rank_bytes = _gather_floats(math.nan if counted is None else counted, device)
    return None if math.isnan(rank_bytes[0]) else nodes().busiest_link_bytes(rank_bytes)


def _gather_floats(value: float, device) -> list[float]:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    out = [torch.zeros_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return [o.item() for o in out]
