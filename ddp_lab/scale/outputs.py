"""What a sweep leaves behind: scaling.csv (+ .jsonl), TensorBoard scalars with the world size
as the step, scaling.png, report.md and manifest.json."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess

from ddp_lab.bench.common import format_table, write_rows

from ddp_lab.scale.predict import PHASES

TABLE_COLUMNS = ["point", "status", "backend", "per_rank_batch", "global_batch", "img_per_s",
                 "img_per_s_per_gpu", "speedup", "efficiency", "step_ms",
                 *(f"{ph}_ms" for ph in PHASES), "comm_bytes_per_step", "busbw_GBps",
                 "rank_skew", "passes", "load_avg", "other_cores"]
CONSOLE_COLUMNS = ["point", "status", "img_per_s", "efficiency", "step_ms",
                   *(f"{ph}_ms" for ph in PHASES), "busbw_GBps", "rank_skew", "other_cores"]
FIT_COLUMNS = ["algo", "backend", "fit", "r2", "max_rel_err_pct", "r2_one_line",
               "max_rel_err_one_line_pct", "points", "world_sizes"]
BANDWIDTH_COLUMNS = ["point", "contention", "compute_slowdown", "comm_slowdown",
                     "calib_busbw_GBps", "probe_busbw_GBps", "probe_loaded_busbw_GBps",
                     "busbw_GBps", "pred_slowdown_ms", "pred_wait_ms", "pred_straggler_ms",
                     "pred_note"]
PASS_COLUMNS = ["point", "passes", "pass", "efficiency_passes", "pred_efficiency_passes",
                "other_cores", "baseline_other_cores", "probe_other_cores"]
# A phase whose miss is at least this share of the measured step is named in the report.
MISS_SHARE = 0.05


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


def _fmt(v) -> str:
    if isinstance(v, float):
        if math.isnan(v):
            return ""
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"
    return str(v)


def md_table(rows: list[dict], columns: list[str]) -> str:
    head = "| " + " | ".join(columns) + " |\n| " + " | ".join("---" for _ in columns) + " |\n"
    return head + "\n".join("| " + " | ".join(_fmt(r.get(c, "")).replace("|", "/")
                                              for c in columns) + " |" for r in rows)


def _pair(measured: float, predicted: float) -> str:
    """`measured / predicted (error)`, the error relative to the measurement."""
    if measured != measured and predicted != predicted:
        return ""
    err = (f" ({100 * (predicted - measured) / measured:+.0f}%)"
           if measured == measured and predicted == predicted and measured > 0.05 else "")
    return f"{_fmt(float(measured))} / {_fmt(float(predicted))}{err}"


def phase_columns() -> list[str]:
    return ["point", "efficiency", "step", *PHASES, "worst phase"]


def phase_rows(ok: list[dict]) -> list[dict]:
    """One row per point, each cell `measured / predicted (error)`: efficiency, the step and
    every phase (ms), then the phase missed most."""
    out = []
    for r in ok:
        row = {"point": r["point"], "efficiency": _pair(r["efficiency"], r["pred_efficiency"]),
               "step": _pair(r["step_ms"], r.get("pred_step_ms", float("nan")))}
        for ph in PHASES:
            row[ph] = _pair(r.get(f"{ph}_ms", float("nan")), r.get(f"pred_{ph}_ms", float("nan")))
        miss = r.get("worst_phase_miss_ms", float("nan"))
        row["worst phase"] = f"{r.get('worst_phase')} {miss:+.1f} ms" if miss == miss else ""
        out.append(row)
    return out


def misses(ok: list[dict], tolerance_pct: float = 10.0) -> list[str]:
    """In words, for each point the model misses by more than `tolerance_pct` (efficiency): the
    phases whose miss is at least MISS_SHARE of the measured step, largest first."""
    lines = []
    for r in ok:
        err = r.get("pred_err_pct", float("nan"))
        if err != err or abs(err) <= tolerance_pct:
            continue
        parts = []
        for ph in sorted(PHASES, key=lambda ph: -abs(_miss(r, ph))):
            m = _miss(r, ph)
            if m == m and abs(m) >= MISS_SHARE * r["step_ms"]:
                parts.append(f"{ph} {m:+.1f} ms (predicted {_fmt(r[f'pred_{ph}_ms'])}, "
                             f"measured {_fmt(r[f'{ph}_ms'])})")
        lines.append(f"- **{r['point']}**: efficiency {_fmt(r['pred_efficiency'])} predicted vs "
                     f"{_fmt(r['efficiency'])} measured ({err:+.0f}%); step "
                     f"{_fmt(r['pred_step_ms'])} vs {_fmt(r['step_ms'])} ms: "
                     + ("; ".join(parts) or "no single phase; the misses add up") + "."
                     + _others(r))
    return lines


def _others(r: dict) -> str:
    """The machine's other load where it differed between what the prediction used (the N=1
    point, the probe) and the point it predicts: a cause no model of ours sees coming."""
    cores = [r.get(k, float("nan")) for k in ("other_cores", "baseline_other_cores",
                                              "probe_other_cores")]
    known = [c for c in cores if c == c]
    if len(known) < 2 or max(known) - min(known) < 0.25:
        return ""
    return (f" Other work on the machine (cores): {_fmt(cores[0])} during the point, "
            f"{_fmt(cores[1])} during its N=1 point, {_fmt(cores[2])} during its probe.")


def _miss(r: dict, ph: str) -> float:
    return r.get(f"pred_{ph}_ms", float("nan")) - r.get(f"{ph}_ms", float("nan"))


# The closing section of report.md.
HOW_TO_READ = [
    "- **efficiency** = img/s at N / (N x img/s at N=1 of the same sync and setting "
    "(`baseline`)). 1.0 is perfect; **speedup** = N x efficiency. In weak scaling "
    "(default) every GPU keeps its batch, so the lost fraction is time each step spends "
    "not computing: exposed communication, waiting for stragglers, contention. In strong "
    "scaling the global batch is fixed (per-rank batch = global / N), the same formula "
    "is T_1 / (N T_N) for one global batch, and it also loses the per-GPU efficiency of "
    "smaller batches and the optimizer step, which does not shrink with the batch.",
    "- **the step by phase** (ms, medians over timed steps): `data`, `forward`, `backward` "
    "(without communication: the loop's calibration, `time_ms.backward_local`), `sync` (the "
    "sync's own local work, measured at N=1 where nothing is sent: DDP copies every gradient "
    "into its buckets and back), `exposed_comm` (what the gradient sync costs beyond that: "
    "backward + comm - backward without communication - sync; 0 at N=1), `guard` (the "
    "non-finite check and, at N > 1, its all-reduce of the ranks' flags), `optim`, and `other` "
    "= median step - the sum of the phase medians (medians do not add up exactly).",
    "- **the model** predicts each phase from the N=1 point's, the interference probe at N "
    "(contention, the slowdowns, when each gradient is ready) and the all-reduce fit; "
    "`ddp_lab/scale/predict.py` has the formulas. Nothing is fitted to the points it is judged "
    "on; `measured / predicted (error)` in each cell.",
    "- **comm_bytes_per_step**: bytes rank 0 sends per step as the sync reports them; "
    "**busbw_GBps** = gradient bytes x 2(N-1)/N / communication time (nccl-tests' bus "
    "bandwidth), from the sync's busy time; `calib_busbw_GBps` is what the fit predicts for "
    "the same buckets, `probe_busbw_GBps` / `probe_loaded_busbw_GBps` what the probe measured "
    "alone / beside backward.",
    "- **rank_skew** = slowest / fastest rank's median step - 1: stragglers. **load_avg** and "
    "**other_cores** (cores busy with anything but the point while it ran): a shared machine's "
    "other users, whose share of the cores no model of ours can know in advance.",
    "- The CPU profile (gloo on a few cores) shows the machinery, not GPU scaling: ranks "
    "share cores and memory bandwidth with each other and with gloo's threads.",
]


def report(rows: list[dict], fits: dict, man: dict, out_dir: str, extra: str = "") -> str:
    """report.md: the table, the model's prediction next to it, failures, how to read it."""
    ok = [r for r in rows if r["status"] == "ok"]
    failed = [r for r in rows if r["status"] != "ok"]
    prov = man["provenance"]
    dev = ", ".join(prov["gpus"]) if prov["gpus"] else f"{prov['cpu_count']} CPU cores"
    mode = rows[0]["mode"] if rows else "weak"
    lines = [
        "# Scaling report", "",
        f"{len(ok)} of {len(rows)} points ran; {mode} scaling; device: {dev}; load average as "
        f"the points finished (1, 5, 15 min) "
        f"{_load(prov)}; torch {prov['torch']}, CUDA {prov['cuda']}, NCCL "
        f"{prov['nccl'] or 'n/a'}; commit {prov['git_commit']}.",
        f"Point settings: profile `{man['profile']}`, training overrides "
        f"`{' '.join(man['point_overrides']) or '(none)'}`; each point's command is the first "
        "line of its `points/<name>/launcher.log`.",
        "", "## Measured", "", md_table(ok, TABLE_COLUMNS), "",
    ]
    lines += model_sections(ok, fits)
    if failed:
        lines += ["## Points that did not run", "",
                  md_table(failed, ["point", "status", "error"]), ""]
    lines += timelines(ok, out_dir)
    lines += ["## How to read this", "", *HOW_TO_READ, ""]
    if extra:
        lines += [extra, ""]
    path = os.path.join(out_dir, "report.md")
    with open(path, "w") as f:
        f.write("\n".join(lines))
    return path


def _load(prov: dict) -> str:
    load = prov.get("loadavg_1_5_15min")
    return " / ".join(f"{x:.2f}" for x in load) if isinstance(load, (list, tuple)) else "n/a"


def model_sections(ok: list[dict], fits: dict) -> list[str]:
    """report.md: the fits, the model phase by phase, its misses, the interference measured."""
    lines = []
    if fits:
        lines += ["## All-reduce fits (time = steps x alpha + critical bytes x beta, per "
                  "message-size regime)", "", md_table([f.as_row() for f in fits.values()],
                                                       FIT_COLUMNS), "",
                  "`r2_one_line` / `max_rel_err_one_line_pct`: one alpha-beta line over the "
                  "whole table, for comparison.", ""]
    pred = [r for r in ok if r.get("pred_efficiency") == r.get("pred_efficiency")
            or r.get("pred_note")]
    if pred:
        lines += ["## Model vs measurement, phase by phase", "",
                  "Each cell: measured / predicted (error), in ms except efficiency. The "
                  "prediction starts from the N=1 point of the same sync and the measurements "
                  "made on their own at each N (`ddp_lab/scale/predict.py`).", "",
                  md_table(phase_rows(pred), phase_columns()), ""]
        worst = misses(pred)
        lines += ["### Where the model misses (efficiency off by more than 10%)", "",
                  *(worst or ["- nowhere: every point within 10%."]), ""]
        lines += ["## Interference and bandwidth", "",
                  "`contention`: backward with every rank computing / with one (probe); "
                  "`compute_slowdown`, `comm_slowdown`: backward with all-reduces beside it / "
                  "without, all-reduces with backward beside them / without; bandwidths of the "
                  "point's gradient buckets as the fit prices them, as the probe measured them "
                  "alone and beside backward, and as the training achieved them (`busbw_GBps`, "
                  "our syncs).", "", md_table(pred, BANDWIDTH_COLUMNS), ""]
    if any(r.get("passes", 1) > 1 for r in ok):
        lines += ["## Passes", "",
                  "Every point ran `passes` times, each followed by its probe; a row is the pass "
                  "(`pass`) with the median efficiency, whole: the point against its N=1 point of "
                  "the same pass, predicted from that pass's measurements. Every pass's "
                  "efficiency and prediction, and the cores other work kept busy during the "
                  "point, its N=1 point and its probe:", "", md_table(ok, PASS_COLUMNS), ""]
    return lines


def timelines(ok: list[dict], out_dir: str) -> list[str]:
    """report.md lines: the traced timelines (train.trace=true) of the largest world size's
    points, each with its overlap figures (ddp_lab/trace.py)."""
    largest = max((r["world_size"] for r in ok), default=0)
    lines = []
    for r in ok:
        path = os.path.join("points", r["point"], "timeline.png")
        if r["world_size"] != largest or not os.path.exists(os.path.join(out_dir, path)):
            continue
        with open(os.path.join(out_dir, "points", r["point"], "summary.json")) as f:
            block = json.load(f).get("overlap") or {}
        figures = ", ".join(f"{k} {_fmt(block[k])}" for k in
                            ("comm_busy_ms", "exposed_comm_ms", "overlap_fraction") if k in block)
        trace = os.path.join("points", r["point"], "trace.json")
        lines += [f"### {r['point']}", "", f"![{r['point']} timeline]({path})", "",
                  f"Traced steps {block.get('steps')}: {figures}; `{trace}` opens in "
                  "https://ui.perfetto.dev.", ""]
    return ["## Timelines (largest world size)", "", *lines] if lines else []


def console_table(rows: list[dict], columns: list[str]) -> str:
    return format_table([{c: r.get(c, "") for c in columns} for r in rows], columns)


def write_json(obj, path: str) -> str:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, default=str)
    return path
