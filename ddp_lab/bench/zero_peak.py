"""ZeRO's memory at world size 1, measured: `python -m ddp_lab.bench.memory_fit measure_zero=[...]`
(table `zero_measured`) trains each stage with ddp_lab's loop on synthetic data and reports
the bytes held (counted) and the peak, predicted and measured. The predicted peak
(`predicted_peak_parts`) is the held bytes predicted + a step's activations and autocast copies +
what the data source holds on the device (`data_device_bytes`): the training stream's fetch
window, whole batches in the compute dtype with their int64 labels, all kept alive by the batch
in use (`pred_data_window_gb`), and the two synthetic sets as stored (`pred_data_sets_gb`). Pages
measured before these two parts counted one fp32 batch instead (docs/results/h100-zero-memory).
The measured peak is the training's (steps, evaluation, checkpoint): the loop resets the peak
statistics after its calibration, whose own peak is `calibration_peak_gb`.
"""

from __future__ import annotations

import os

import torch

from ddp_lab.bench.common import report, resolve_device
from ddp_lab.bench.memory_fit import GB, image_shape
from ddp_lab.held_memory import MEMORY_KEYS
from ddp_lab.perf import memory as mem


def report_measured(cfg, run_dir: str) -> None:
    """Table zero_measured: each stage trained at world size 1, held and peak (see the module)."""
    report(measure_zero_rows(cfg, run_dir), run_dir, "zero_measured",
           ["precision", "stage", "params_gb", "grads_gb", "optimizer_state_gb",
            "comm_buffer_gb", "pred_held_gb", "pred_data_window_gb", "pred_data_sets_gb",
            "pred_peak_gb", "measured_peak_gb", "calibration_peak_gb", "measured_over_pred"],
           title=f"ZeRO at world size 1: {cfg.measure_model} batch {cfg.measure_batch}, "
                 "sync=ring, AdamW; held (counted) and peak (predicted vs measured), GB",
           notes=["held: counted from tensor storages, the most a step held (summary.json's "
                  "memory block); pred_peak = the held bytes predicted + activations and "
                  "autocast copies (ddp_lab.perf.memory) + the data source's device bytes: "
                  "the training stream's fetch window (pred_data_window) and the two "
                  "synthetic sets (pred_data_sets), where one fp32 batch was counted before",
                  "measured = torch.cuda.max_memory_allocated over the training: its steps, "
                  "evaluation and checkpoint; calibration_peak = up to the end of the "
                  "calibration before them (the whole run's peak, which measured was "
                  "before, is the larger of the two; nan on the CPU)"])


def measure_zero_rows(cfg, run_dir: str) -> list[dict]:
    """Each stage of cfg.measure_zero trained by ddp_lab's loop (sync=ring, AdamW) at world size
    1: the bytes its rank held (counted from storages, summary.json's memory block) and its peak,
    predicted and measured. At N=1 a shard is the whole, so the stages differ only by what each
    keeps besides the shards: the buckets (all of them, or a pool of two), the gradients in
    flight, and at zero=3 the units gathered (two at a time) beside the shards."""
    from ddp_lab.bench.bare import free_memory
    from ddp_lab.bench.train_throughput import ddp_loop

    device = resolve_device(cfg.device)
    rows = []
    for precision in cfg.measure_precisions:
        for stage in cfg.measure_zero:
            free_memory(device)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            summary = ddp_loop(zero_train_config(cfg, stage, precision, device),
                               os.path.join(run_dir, f"zero{stage}_{precision}"))["summary"]
            rows.append(_zero_row(cfg, stage, precision, summary))
    return rows


def zero_train_config(cfg, stage: int, precision: str, device: torch.device):
    """The training config of one measure_zero run: cfg.measure_* on synthetic data, sync=ring at
    sync.zero=stage, AdamW, then cfg.measure_overrides."""
    from ddp_lab.bench.train_throughput import row_overrides
    from ddp_lab.cli import compose

    overrides = [o for o in row_overrides(
        cfg.measure_model, precision, cfg.measure_channels_last, False, cfg.measure_batch,
        cfg.measure_steps, 2, device, 0) if o != "sync=none"]
    return compose(overrides + ["sync=ring", f"sync.zero={stage}", "optim=adamw",
                                *cfg.measure_overrides])


def predicted_peak_parts(cfg, precision: str, summary: dict) -> dict[str, float]:
    """The predicted peak of a measure_zero run, part by part (bytes): the most its rank holds
    in a step (summary.json's `memory.predicted`), a step's activations and autocast copies
    (ddp_lab.perf.memory), and what the data source holds on the device (`data_device_bytes`).
    Their sum: the activations peak as backward begins, the held bytes where the largest bucket
    is packed, so it overestimates by what the activations have shrunk by then."""
    from ddp_lab.models import MODELS

    # world size 1: rank 0's prediction (the block has one per rank)
    predicted = {k: v[0] or 0 for k, v in summary["memory"]["predicted"].items()}
    size, classes = image_shape(cfg)
    step = mem.predict_training_memory(MODELS[cfg.measure_model](num_classes=classes),
                                       cfg.measure_batch, size, precision, "adamw",
                                       cfg.measure_channels_last)
    run_cfg = zero_train_config(cfg, summary["memory"]["zero"], precision,
                                torch.device(summary["device"]))
    return {**predicted, **{f"{k}_bytes": step[k] for k in ("activations", "autocast_copies")},
            **data_device_bytes(run_cfg)}


def data_device_bytes(run_cfg) -> dict[str, int]:
    """What the data source of a measure_zero run (data=synthetic, one rank) holds on the device
    while it trains: the training stream's fetch window, which a batch in use keeps alive
    (`data_window_bytes`: `fetch_window`'s samples, each an image in the compute dtype and an
    int64 label), and the two sets as stored (`data_sets_bytes`: each a pool of data.pool_size
    images and its labels, `SyntheticImages`). Left out: the epoch's indices (8 B a sample) and
    validation's window, alive only while it evaluates."""
    from ddp_lab.data.build import compute_dtype
    from ddp_lab.data.streams import fetch_window
    from ddp_lab.train import planned_length

    d, t = run_cfg.data, run_cfg.train
    sample, label = 3 * d.image_size**2 * compute_dtype(run_cfg).itemsize, torch.int64.itemsize
    batches = d.num_samples // t.batch_size  # an epoch's, the last partial one dropped
    # the epochs the run reads: the stream fetches none past them
    epochs = planned_length(t, batches, world_size=1).last_epoch + 1
    _, window = fetch_window(t.batch_size, sample, batches * t.batch_size, epochs_ahead=True,
                             epochs_left=epochs)
    return {"data_window_bytes": window * (sample + label),
            "data_sets_bytes": 2 * d.pool_size * sample + (d.num_samples + d.val_samples) * label}


def _zero_row(cfg, stage: int, precision: str, summary: dict) -> dict:
    held = summary["memory"]
    counted = {k: v[0] for k, v in held.items() if k in MEMORY_KEYS}
    pred_held = sum(v[0] or 0 for v in held["predicted"].values())
    parts = predicted_peak_parts(cfg, precision, summary)
    pred_peak = sum(parts.values())
    measured = summary.get("max_memory_allocated_GiB", float("nan")) * 2**30
    calibration = summary.get("calibration_max_memory_allocated_GiB")  # None: not calibrated
    calibration = float("nan") if calibration is None else calibration * 2**30
    return {"model": cfg.measure_model, "batch": cfg.measure_batch, "precision": precision,
            "stage": stage, **{f"{k[:-6]}_gb": v / GB for k, v in counted.items()},
            "pred_held_gb": pred_held / GB, "pred_data_window_gb": parts["data_window_bytes"] / GB,
            "pred_data_sets_gb": parts["data_sets_bytes"] / GB, "pred_peak_gb": pred_peak / GB,
            "measured_peak_gb": measured / GB, "calibration_peak_gb": calibration / GB,
            "measured_over_pred": measured / pred_peak}
