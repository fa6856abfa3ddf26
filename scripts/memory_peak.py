"""What is alive at the peak of a training step on the GPU, against what ddp_lab.perf.memory
predicts: the runs of `python -m ddp_lab.bench.memory_fit measure_zero=[...]` (ddp_lab's loop,
sync=ring, AdamW, world size 1) under the CUDA caching allocator's history
(`torch.cuda.memory._record_memory_history`). The history is replayed to the moment the allocated
bytes peak after the loop's calibration (summary.json's max_memory_allocated_GiB starts there too),
and the blocks alive then are grouped by the code that allocated them.

    python scripts/memory_peak.py OUT_DIR [memory_fit overrides, e.g. 'measure_zero=[0,2]']

Prints, per run, the predicted parts and the live blocks by allocating code; writes
OUT_DIR/peak_<precision>_zero<stage>.csv (label, bytes, blocks) and the run's summary.json. The
raw snapshot (for https://pytorch.org/memory_viz) is OUT_DIR/snapshot_<precision>_zero<stage>.pickle.
"""

from __future__ import annotations

import argparse
import csv
import os
import pickle
import sys
from collections import defaultdict

import torch

GB = 1e9
ENGINE = "(no Python frame: autograd engine)"


def peak_index(trace: list[dict], start: int = 0) -> int:
    """Index of the allocation from `start` on at which the bytes allocated (alloc -
    free_completed, counted from the start of the history) reach their maximum."""
    sizes, total, best, at = {}, 0, -1, -1
    for i, event in enumerate(trace):
        if event["action"] == "alloc":
            sizes[event["addr"]] = event["size"]
            total += event["size"]
            if total > best and i >= start:
                best, at = total, i
        elif event["action"] == "free_completed" and event["addr"] in sizes:
            total -= sizes.pop(event["addr"])
    return at


def training_start(trace: list[dict]) -> int:
    """The first event after the loop's calibration (the last allocated under
    `time_local_backward`), where summary.json's max_memory_allocated_GiB starts (the loop resets
    the peak statistics there); 0 without a calibration."""
    marks = [i for i, event in enumerate(trace)
             if any(f["name"] == "time_local_backward" for f in event.get("frames", []))]
    return marks[-1] + 1 if marks else 0


def live_at(trace: list[dict], index: int) -> list[dict]:
    """The allocations alive just after trace[index]."""
    live = {}
    for event in trace[:index + 1]:
        if event["action"] == "alloc":
            live[event["addr"]] = event
        elif event["action"] == "free_completed":
            live.pop(event["addr"], None)
    return list(live.values())


def label(frames: list[dict]) -> str:
    """Where a block was allocated: the innermost ddp_lab frame, and the innermost frame of all
    where that is torch's (frames run innermost first)."""
    def short(f):
        path = f["filename"]
        for root in ("ddp_lab/", "torch/"):
            if root in path:
                path = root + path.rsplit(root, 1)[1]
        return f"{path}:{f['name']}"
    python = [f for f in frames if f["filename"].endswith(".py")]
    if not python:
        return ENGINE
    ours = next((short(f) for f in python if "ddp_lab/" in f["filename"]), "(outside ddp_lab)")
    inner = short(python[0])
    return ours if inner == ours else f"{ours} > {inner}"


def by_label(blocks: list[dict]) -> list[dict]:
    groups = defaultdict(lambda: [0, 0])
    for b in blocks:
        g = groups[label(b.get("frames", []))]
        g[0] += b["size"]
        g[1] += 1
    return [{"label": k, "bytes": v[0], "blocks": v[1]}
            for k, v in sorted(groups.items(), key=lambda kv: -kv[1][0])]


def measure(cfg, stage: int, precision: str, out_dir: str) -> None:
    from ddp_lab.bench import zero_peak
    from ddp_lab.bench.bare import free_memory
    from ddp_lab.bench.train_throughput import ddp_loop

    device = torch.device("cuda")
    free_memory(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.memory._record_memory_history(max_entries=500_000)
    run_dir = os.path.join(out_dir, f"zero{stage}_{precision}")
    summary = ddp_loop(zero_peak.zero_train_config(cfg, stage, precision, device),
                       run_dir)["summary"]
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    name = f"{precision}_zero{stage}"
    with open(os.path.join(out_dir, f"snapshot_{name}.pickle"), "wb") as f:
        pickle.dump(snapshot, f)
    trace = snapshot["device_traces"][device.index or torch.cuda.current_device()]
    at = peak_index(trace, training_start(trace))  # the training's peak, as summary.json's
    rows = by_label(live_at(trace, at))
    with open(os.path.join(out_dir, f"peak_{name}.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["label", "bytes", "blocks"])
        writer.writeheader()
        writer.writerows(rows)
    parts = zero_peak.predicted_peak_parts(cfg, precision, summary)
    peak = sum(r["bytes"] for r in rows)
    # the loop resets the peak statistics after its calibration: the two peaks, in summary.json
    training, calibration = (summary[k] or float("nan") for k in (
        "max_memory_allocated_GiB", "calibration_max_memory_allocated_GiB"))
    print(f"\n== {precision}, zero={stage}: peak {peak / GB:.3f} GB at event {at} of {len(trace)} "
          f"(max_memory_allocated {training * 2**30 / GB:.3f} GB in training, "
          f"{calibration * 2**30 / GB:.3f} GB up to the calibration's end, "
          f"{before / GB:.3f} GB allocated before), predicted {sum(parts.values()) / GB:.3f} GB")
    print("predicted: " + ", ".join(f"{k[:-6]} {v / GB:.3f}" for k, v in parts.items()))
    print(f"{'GB':>7} {'blocks':>6}  allocated in")
    for r in rows:
        print(f"{r['bytes'] / GB:7.3f} {r['blocks']:6d}  {r['label']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir")
    parser.add_argument("overrides", nargs="*", help="keys of conf/bench/memory_fit.yaml")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("error: memory_peak.py needs a CUDA GPU (the allocator's history is CUDA's)")
    from ddp_lab.bench.memory_fit import image_shape
    from ddp_lab.cli import compose

    os.makedirs(args.out_dir, exist_ok=True)
    cfg = compose(args.overrides, "bench/memory_fit")
    image_shape(cfg)  # bad measure_* keys fail before any run
    if not cfg.measure_zero:
        sys.exit("error: measure_zero is empty: give the stages, e.g. 'measure_zero=[0,1,2]'")
    for precision in cfg.measure_precisions:
        for stage in cfg.measure_zero:
            measure(cfg, stage, precision, args.out_dir)


if __name__ == "__main__":
    main()
