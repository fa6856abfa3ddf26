"""What a sweep leaves behind: scaling.csv (+ .jsonl), TensorBoard scalars with the world size
as the step, scaling.png and manifest.json (report.md: report.py)."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess

from ddp_lab.perf.predict import PHASES
from ddp_lab.tables import write_rows


def series_of(row: dict) -> str:
    return row["sync"] + (f" {row['setting']}" if row.get("setting") else "")


def write_csv(rows: list[dict], out_dir: str) -> str:
    return write_rows(rows, out_dir, "scaling")[1]


def write_tensorboard(rows: list[dict], out_dir: str) -> str:
    """tensorboard/<series>/: scaling/* scalars with the world size as the step, one run per
    sync (and swept setting), so TensorBoard draws them as lines over the GPU count."""
    from torch.utils.tensorboard import SummaryWriter

    root = os.path.join(out_dir, "tensorboard")
    if os.path.isdir(root):
        shutil.rmtree(root)
    by_series: dict[str, list[dict]] = {}
    for r in rows:
        if r["status"] == "ok":
            by_series.setdefault(series_of(r), []).append(r)
    tags = {"scaling/efficiency": "efficiency", "scaling/img_per_s": "img_per_s",
            "scaling/img_per_s_per_gpu": "img_per_s_per_gpu", "scaling/speedup": "speedup",
            "scaling/step_ms": "step_ms", "scaling/exposed_comm_ms": "exposed_comm_ms",
            "scaling/pred_efficiency": "pred_efficiency"}
    for series, rs in by_series.items():
        w = SummaryWriter(log_dir=os.path.join(root, series.replace(" ", ",").replace("/", "_")))
        for r in sorted(rs, key=lambda r: r["world_size"]):
            for tag, key in tags.items():
                v = r.get(key)
                if isinstance(v, (int, float)) and not math.isnan(v):
                    w.add_scalar(tag, v, r["world_size"])
        w.close()
    return root


def x_label(rows: list[dict]) -> str:
    """What the x-axis counts: GPUs, or CPU processes where the points ran on CPUs."""
    devices = {str(r.get("device", "")) for r in rows if r["status"] == "ok"}
    if devices and all(d.startswith("cpu") for d in devices):
        return "CPU processes (world size)"
    return "GPUs (world size)"


def plot(rows: list[dict], path: str, title: str = "") -> str:
    """Efficiency (measured solid, the model dashed), throughput (ideal dotted) and each point's
    step by phase, measured (M) next to predicted (P)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r["status"] == "ok"]
    fig, (ax_e, ax_t, ax_p) = plt.subplots(
        1, 3, figsize=(17, 4.6), gridspec_kw={"width_ratios": [1, 1, 1.5]})
    _plot_lines(ax_e, ax_t, ok, sorted({r["world_size"] for r in rows}) or [1])
    effs = [r["efficiency"] for r in ok if r["efficiency"] == r["efficiency"]]
    preds = [r["pred_efficiency"] for r in ok
             if r.get("pred_efficiency") == r.get("pred_efficiency")]
    ax_e.set_ylim(0, max([1.15] + [1.05 * e for e in effs + preds]))
    _plot_phases(ax_p, ok)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _plot_lines(ax_e, ax_t, ok: list[dict], xs_all: list[int]) -> None:
    by_series: dict[str, list[dict]] = {}
    for r in ok:
        by_series.setdefault(series_of(r), []).append(r)
    for series, rs in sorted(by_series.items()):
        rs = sorted(rs, key=lambda r: r["world_size"])
        xs = [r["world_size"] for r in rs]
        line, = ax_e.plot(xs, [r["efficiency"] for r in rs], marker="o", label=series)
        pred = [(r["world_size"], r.get("pred_efficiency", float("nan"))) for r in rs]
        pred = [(x, y) for x, y in pred if y == y]
        if pred:
            ax_e.plot(*zip(*pred), ls="--", marker="x", color=line.get_color(), alpha=0.8,
                      label=f"{series} (model)")
        ax_t.plot(xs, [r["img_per_s"] for r in rs], marker="o", color=line.get_color(),
                  label=series)
        one = [r for r in rs if r["world_size"] == 1]
        if one and one[0]["img_per_s"] == one[0]["img_per_s"]:
            ax_t.plot(xs_all, [x * one[0]["img_per_s"] for x in xs_all], ls=":",
                      color=line.get_color(), alpha=0.5)
    ax_e.axhline(1.0, color="gray", ls=":", lw=1)
    for ax, ylabel in ((ax_e, "efficiency = thr_N / (N thr_1)"), (ax_t, "images / s")):
        ax.set_xlabel(x_label(ok) if ok else "world size")
        ax.set_ylabel(ylabel)
        ax.set_xscale("log", base=2)
        # Limits of their own: a sweep without N=1 has no efficiency to draw, and a log axis
        # with no data has none.
        ax.set_xlim(min(xs_all) / 1.25, max(xs_all) * 1.25)
        ax.set_xticks(xs_all, [str(x) for x in xs_all])
        ax.grid(True, alpha=0.3)
        if by_series:
            ax.legend(fontsize=7)
    ax_t.set_title("throughput (dotted: ideal)")
    ax_e.set_title("scaling efficiency (solid: measured, dashed: model)")


PHASE_COLORS = {"data": "tab:gray", "forward": "tab:blue", "backward": "tab:cyan",
                "sync": "tab:olive", "exposed_comm": "tab:red", "guard": "tab:purple",
                "optim": "tab:green", "other": "lightgray"}


def _plot_phases(ax, ok: list[dict]) -> None:
    """Stacked bars per point: measured (M) and predicted (P) step, by phase (ms)."""
    ok = sorted(ok, key=lambda r: (series_of(r), r["world_size"]))
    xs, labels, named = [], [], set()
    for i, r in enumerate(ok):
        for j, (kind, prefix) in enumerate((("M", ""), ("P", "pred_"))):
            x, bottom = 3 * i + j, 0.0
            for ph in PHASES:
                v = r.get(f"{prefix}{ph}_ms", float("nan"))
                if v == v and v > 0:
                    # Name each phase at its first bar: N=1 points have no exposed_comm bar.
                    ax.bar(x, v, bottom=bottom, color=PHASE_COLORS[ph], width=0.9,
                           label=None if ph in named else ph)
                    named.add(ph)
                    bottom += v
            xs.append(x)
            labels.append(f"{r['point']} {kind}" if j == 0 else kind)
    ax.set_xticks(xs, labels, rotation=60, fontsize=7, ha="right")
    ax.set_ylabel("ms per step (medians)")
    ax.set_title("step by phase: M measured, P predicted")
    ax.grid(True, axis="y", alpha=0.3)
    if ok:
        ax.legend(fontsize=7, ncol=2)


def _cmd(args: list[str], timeout: float = 20) -> str | None:
    if not shutil.which(args[0]):
        return None
    try:
        out = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
        return out.stdout if out.returncode == 0 else (out.stdout + out.stderr).strip() or None
    except (OSError, subprocess.SubprocessError) as e:
        return f"({args[0]} failed: {e})"


def write_manifest(path: str, cfg_dict: dict, passthrough: list[str], profile: str,
                   env: dict) -> dict:
    """manifest.json: how the sweep was made (ddp_lab.provenance), the GPUs' topology, the
    environment the points ran in, the configuration. Returns what it wrote."""
    from ddp_lab import provenance

    provenance.write(path, cfg_dict, profile=profile, point_overrides=passthrough,
                     nvidia_smi_topo=_cmd(["nvidia-smi", "topo", "-m"]),
                     nvidia_smi=_cmd(["nvidia-smi", "--query-gpu=name,memory.total,"
                                      "driver_version,clocks.max.sm,power.limit", "--format=csv"]),
                     point_env={k: v for k, v in env.items()
                                if k.startswith("NCCL_") or k == "OMP_NUM_THREADS"})
    with open(path) as f:
        return json.load(f)
