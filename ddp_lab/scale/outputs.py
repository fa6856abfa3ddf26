"""What a sweep leaves behind: scaling.csv (+ .jsonl), TensorBoard scalars with the world size
as the step, scaling.png, report.md and manifest.json."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess

from ddp_lab.bench.common import format_table, write_rows

TABLE_COLUMNS = ["point", "status", "backend", "per_rank_batch", "global_batch", "img_per_s",
                 "img_per_s_per_gpu", "speedup", "efficiency", "step_ms", "compute_ms",
                 "exposed_comm_ms", "data_ms", "optim_ms", "other_ms", "comm_bytes_per_step",
                 "busbw_GBps", "rank_skew"]
PRED_COLUMNS = ["point", "exposed_comm_ms", "pred_exposed_comm_ms", "step_ms", "pred_step_ms",
                "efficiency", "pred_efficiency", "pred_err_pct", "comm_bytes_per_step",
                "pred_bytes_per_step", "pred_note"]


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


def plot(rows: list[dict], path: str, title: str = "") -> str:
    """Efficiency (left) and throughput (right) vs GPU count, one line per sync; the model's
    prediction dashed; ideal scaling dotted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_e, ax_t) = plt.subplots(1, 2, figsize=(11, 4.3))
    by_series: dict[str, list[dict]] = {}
    for r in rows:
        if r["status"] == "ok":
            by_series.setdefault(series_of(r), []).append(r)
    xs_all = sorted({r["world_size"] for r in rows}) or [1]
    for series, rs in sorted(by_series.items()):
        rs = sorted(rs, key=lambda r: r["world_size"])
        xs = [r["world_size"] for r in rs]
        line, = ax_e.plot(xs, [r["efficiency"] for r in rs], marker="o", label=series)
        pred = [(r["world_size"], r.get("pred_efficiency", float("nan"))) for r in rs]
        pred = [(x, y) for x, y in pred if y == y]
        if pred:
            ax_e.plot(*zip(*pred), ls="--", color=line.get_color(), alpha=0.7,
                      label=f"{series} (model)")
        ax_t.plot(xs, [r["img_per_s"] for r in rs], marker="o", color=line.get_color(),
                  label=series)
        one = [r for r in rs if r["world_size"] == 1]
        if one and one[0]["img_per_s"] == one[0]["img_per_s"]:
            ax_t.plot(xs_all, [x * one[0]["img_per_s"] for x in xs_all], ls=":",
                      color=line.get_color(), alpha=0.5)
    ax_e.axhline(1.0, color="gray", ls=":", lw=1)
    effs = [r["efficiency"] for r in rows if r["status"] == "ok" and r["efficiency"] == r["efficiency"]]
    ax_e.set_ylim(0, max([1.15] + [1.05 * e for e in effs]))
    for ax, ylabel in ((ax_e, "efficiency = thr_N / (N thr_1)"), (ax_t, "images / s")):
        ax.set_xlabel("GPUs (world size)")
        ax.set_ylabel(ylabel)
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs_all, [str(x) for x in xs_all])
        ax.grid(True, alpha=0.3)
    if by_series:
        ax_e.legend(fontsize=8)
        ax_t.legend(fontsize=8)
    ax_t.set_title("throughput (dotted: ideal)")
    ax_e.set_title("scaling efficiency")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


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


# The closing section of report.md.
HOW_TO_READ = [
    "- **efficiency** = img/s at N / (N x img/s at N=1 of the same sync and setting "
    "(`baseline`)). 1.0 is perfect; **speedup** = N x efficiency. In weak scaling "
    "(default) every GPU keeps its batch, so the lost fraction is time each step spends "
    "not computing: exposed communication, waiting for stragglers, contention. In strong "
    "scaling the global batch is fixed (per-rank batch = global / N), the same formula "
    "is T_1 / (N T_N) for one global batch, and it also loses the per-GPU efficiency of "
    "smaller batches and the optimizer step, which does not shrink with the batch.",
    "- **step breakdown** (ms, medians over timed steps): `compute` = forward + backward, "
    "`exposed_comm` = the time the step waits for gradients beyond compute, `data`, "
    "`optim`, and `other` = median step - the sum of the phase medians (medians do not "
    "add up exactly). DDP waits for its all-reduces inside backward: unless the loop "
    "reports `time_ms.exposed_comm`, the exposed part is estimated as backward at N - "
    "backward at N=1 (weak scaling only; `comm_source` says which was used).",
    "- **comm_bytes_per_step**: bytes rank 0 sends per step as the sync reports them; "
    "**busbw_GBps** = gradient bytes x 2(N-1)/N / communication time (nccl-tests' bus "
    "bandwidth), from the exposed time (`busbw_source=exposed`, an upper bound whenever "
    "communication overlaps backward) unless the sync reports its busy time.",
    "- **rank_skew** = slowest / fastest rank's median step - 1: stragglers.",
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
        f"{len(ok)} of {len(rows)} points ran; {mode} scaling; device: {dev}; torch "
        f"{prov['torch']}, CUDA {prov['cuda']}, NCCL {prov['nccl'] or 'n/a'}; commit "
        f"{prov['git_commit']}.",
        f"Point settings: profile `{man['profile']}`, training overrides "
        f"`{' '.join(man['point_overrides']) or '(none)'}`; each point's command is the first "
        "line of its `points/<name>/launcher.log`.",
        "", "## Measured", "", md_table(ok, TABLE_COLUMNS), "",
    ]
    if fits:
        lines += ["## Alpha-beta fits (all-reduce time = steps x alpha + critical bytes x beta)", "",
                  md_table([f.as_row() for f in fits.values()],
                           ["algo", "backend", "alpha_us", "bandwidth_GBps", "r2",
                            "max_rel_err_pct", "points", "world_sizes"]), ""]
    pred = [r for r in ok if r.get("pred_efficiency") == r.get("pred_efficiency")
            or r.get("pred_note")]
    if pred:
        lines += ["## Model vs measurement", "",
                  "Predicted from the N=1 point's phases, the buckets, the algorithm's cost, the "
                  "fitted alpha-beta and the overlap model (`ddp_lab/cost/network.py`). "
                  "`pred_err_pct` = (predicted - measured) / measured efficiency.", "",
                  md_table(pred, PRED_COLUMNS), ""]
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
