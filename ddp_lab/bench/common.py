"""What every benchmark shares: a training loop's back-to-back step times, a printed table, rows
written as JSON lines and CSV, and an optional PNG plot. A call's timing is ddp_lab.metrics'
`time_fn` (a median over repeats after warm-up; on CUDA measured with events, no host clock
around asynchronous work), which the sweep's calibration shares."""

from __future__ import annotations

import os
import time
from typing import Callable, Sequence

import torch

from ddp_lab.tables import format_table, write_rows


def back_to_back_ms(step: Callable[[], object], device: torch.device | str,
                    steps: int) -> tuple[list[float], object]:
    """Milliseconds of each of `steps` back-to-back calls of step() and the last call's result,
    for a training loop: on CUDA one event at each call boundary and no host sync inside (so the
    host can run ahead, as a real loop does), on CPU the host clock."""
    device = torch.device(device)
    result = None
    if device.type == "cuda":
        marks = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)]
        marks[0].record()
        for i in range(steps):
            result = step()
            marks[i + 1].record()
        marks[-1].synchronize()
        return [a.elapsed_time(b) for a, b in zip(marks, marks[1:])], result
    t = [time.perf_counter()]
    for _ in range(steps):
        result = step()
        t.append(time.perf_counter())
    return [(b - a) * 1e3 for a, b in zip(t, t[1:])], result


def calls_per_sample(fn: Callable[[], object], device: torch.device | str,
                     target_s: float = 1e-3, max_calls: int = 1000) -> int:
    """How many back-to-back calls of fn() make about `target_s` of work (the `inner` of
    time_fn): one synchronised trial call, then a ratio. Also serves as one more warm-up call."""
    device = torch.device(device)
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    dt = time.perf_counter() - t0
    return max(1, min(max_calls, int(target_s / max(dt, 1e-9))))


def sync(device: torch.device | str) -> None:
    """Wait for queued work on `device` (a no-op on the CPU)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def resolve_device(name: str) -> torch.device:
    """`device=auto|cpu|cuda` -> a torch.device; asking for CUDA without one is a ConfigError."""
    from ddp_lab.config import ConfigError

    if name not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"device={name!r} is not one of auto, cpu, cuda")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device=cuda but torch sees no CUDA device here; use device=cpu or auto")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device("cuda", torch.cuda.current_device()) if name == "cuda" else torch.device("cpu")


def report(rows: Sequence[dict], out_dir: str, name: str, columns: Sequence[str] | None = None,
           title: str = "", notes: Sequence[str] = ()) -> str:
    """Print `title`, the table and `notes`; write the rows (JSON lines + CSV). Returns the table."""
    table = format_table(rows, columns)
    if title:
        print(f"\n== {title} ==", flush=True)
    print(table, flush=True)
    for note in notes:
        print(f"  * {note}", flush=True)
    write_rows(rows, out_dir, name)
    return table


def write_info(out_dir: str, name: str, cfg, device, **extra) -> str:
    """out_dir/name_info.json: how the benchmark was made (ddp_lab.provenance), the resolved
    config and anything in `extra`; the benchmark's last line says where its files are."""
    from omegaconf import OmegaConf

    from ddp_lab import provenance

    cfg_dict = OmegaConf.to_container(cfg, resolve=True) if cfg is not None else {}
    path = provenance.write(os.path.join(out_dir, f"{name}_info.json"), cfg_dict, device, **extra)
    print(f"-> {out_dir}", flush=True)
    return path


def entry(task, config_name: str):
    """A benchmark's `main()`: `task(cfg, run_dir)` as the Hydra app of conf/`config_name`.yaml."""
    def main() -> None:
        from ddp_lab.cli import run_hydra_app

        run_hydra_app(task, config_name)

    return main


def series_of(rows: Sequence[dict], name: str, x: str, y: str) -> dict[str, tuple[list, list]]:
    """Rows -> {row[name]: (xs, ys)}, for plot_lines: one line per value of `name`."""
    series: dict[str, tuple[list, list]] = {}
    for r in rows:
        xs, ys = series.setdefault(r[name], ([], []))
        xs.append(r[x])
        ys.append(r[y])
    return series


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


def plot_bars(groups: dict[str, dict[str, float]], path: str, *, ylabel: str, title: str = "",
              logy: bool = False) -> str:
    """Grouped bars -> PNG at `path`: one group per outer key, one bar per inner key (the same
    inner keys in every group, in the first group's order), each bar labelled with its value."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(next(iter(groups.values())))
    width = 0.8 / len(names)
    fig, ax = plt.subplots(figsize=(max(7, 1.4 * len(groups)), 4.5))
    for i, name in enumerate(names):
        xs = [g + (i - (len(names) - 1) / 2) * width for g in range(len(groups))]
        ys = [bars.get(name, float("nan")) for bars in groups.values()]
        drawn = ax.bar(xs, ys, width, label=name)
        ax.bar_label(drawn, labels=[f"{y:,.0f}" for y in ys], fontsize=7, rotation=90,
                     padding=2)
    ax.set_xticks(range(len(groups)), list(groups), fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if logy:
        ax.set_yscale("log")
    ax.margins(y=0.25)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=len(names), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
