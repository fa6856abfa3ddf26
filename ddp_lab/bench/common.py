"""What every benchmark shares: honest timing, a printed table, rows written as JSON lines and CSV,
and an optional PNG plot. A timing is a median over repeats after warm-up; on CUDA it is measured
with events (no host clock around asynchronous work)."""

from __future__ import annotations

import csv
import json
import os
import statistics
import time
from typing import Callable, Sequence

import torch


def time_fn(fn: Callable[[], object], device: torch.device | str, warmup: int = 3,
            iters: int = 10, min_seconds: float = 0.0) -> float:
    """Median seconds per call of fn() after `warmup` calls; at least `iters` timed calls (more
    until `min_seconds` of timed work, for very fast calls)."""
    device = torch.device(device)
    for _ in range(warmup):
        fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < iters or (time.perf_counter() - start < min_seconds and len(times) < 10_000):
        if device.type == "cuda":
            t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0.record()
            fn()
            t1.record()
            t1.synchronize()
            times.append(t0.elapsed_time(t1) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def format_table(rows: Sequence[dict], columns: Sequence[str] | None = None) -> str:
    """A plain fixed-width table; floats to 4 significant digits."""
    if not rows:
        return "(no rows)"
    columns = list(columns or rows[0].keys())
    fmt = lambda v: f"{v:.4g}" if isinstance(v, float) else str(v)
    cells = [[fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    line = lambda vals: "  ".join(v.rjust(w) for v, w in zip(vals, widths))
    return "\n".join([line(columns), line(["-" * w for w in widths]), *map(line, cells)])


def write_rows(rows: Sequence[dict], out_dir: str, name: str) -> tuple[str, str]:
    """rows -> out_dir/name.jsonl and out_dir/name.csv; returns both paths."""
    os.makedirs(out_dir, exist_ok=True)
    jsonl, csv_path = os.path.join(out_dir, f"{name}.jsonl"), os.path.join(out_dir, f"{name}.csv")
    with open(jsonl, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    columns = list(dict.fromkeys(k for r in rows for k in r))
    with open(csv_path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    return jsonl, csv_path


def plot_lines(series: dict[str, tuple[Sequence[float], Sequence[float]]], path: str, *,
               xlabel: str, ylabel: str, title: str = "", logx: bool = False,
               logy: bool = False) -> str:
    """One line per series name -> PNG at `path` (matplotlib, no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, (xs, ys) in series.items():
        ax.plot(xs, ys, marker="o", label=name)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if logx:
        ax.set_xscale("log")
    if logy:
        ax.set_yscale("log")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
