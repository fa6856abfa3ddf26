"""report.md: the sweep's measured table, the all-reduce fits, the model against measurement
phase by phase, where it misses, interference and bandwidths, failed points, traced timelines,
how to read them and the simulation's section; and the same tables on the console."""

from __future__ import annotations

import json
import math
import os

from ddp_lab.perf.predict import PHASES
from ddp_lab.tables import format_table

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
    "`ddp_lab/perf/predict.py` has the formulas. Nothing is fitted to the points it is judged "
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
                  "made on their own at each N (`ddp_lab/perf/predict.py`).", "",
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
