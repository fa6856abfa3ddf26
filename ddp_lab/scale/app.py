"""The `python -m ddp_lab.scale` Hydra app: sweep, outputs, prediction, simulation."""

from __future__ import annotations

import os
import shlex
import sys
import time

from omegaconf import OmegaConf

from ddp_lab.config import ConfigError
from ddp_lab.perf.fit import fit_alpha_beta, read_table
from ddp_lab.perf.predict import predict_rows
from ddp_lab.perf.probe import load_probes
from ddp_lab.scale import launch, outputs, report, results, sim_report, sweep
from ddp_lab.scale.config import check_from_nproc, check_sim, register_scale_config
from ddp_lab.tables import write_rows

# Training overrides taken off the command line by main() before Hydra parses it (the scale
# app's own schema has no model/train/... nodes: composing the training groups here would fix
# one `sync`, the very thing swept).
PASSTHROUGH: list[str] = []
# Keys that do not change results and so do not name the run directory (tabulate_only:
# bench.compression then reads the study its command wrote).
NOT_IN_NAME = ("point_timeout_s", "keep_checkpoints", "predict.timeout_s", "train.progress",
               "tabulate_only")


class Say:
    """Progress lines on stdout, also appended to the sweep's scale.log."""

    def __init__(self, path: str):
        self.path = path

    def __call__(self, *parts) -> None:
        text = " ".join(str(p) for p in parts)
        print(text, flush=True)
        with open(self.path, "a") as f:
            f.write(text + "\n")


def _measured_at(cfg, n: int) -> bool:
    """Whether the model's measurements are made (and read) at world size n: predict.from_nproc."""
    return not cfg.predict.from_nproc or n in cfg.predict.from_nproc


def _fits(cfg, points, sweep_dir, profile, env, say) -> dict:
    """alpha-beta fits: from predict.table, or calibrated here at each world size > 1 (of
    predict.from_nproc where given: pooled over those)."""
    only = tuple(cfg.predict.from_nproc)
    if cfg.predict.table:
        rows = read_table(cfg.predict.table)
        say(f"alpha-beta fit from {cfg.predict.table} ({len(rows)} rows)")
        return fit_alpha_beta(rows, cfg.predict.max_regimes, only)
    sizes = sorted({p.world_size for p in points if p.status in ("ok", "planned")
                    and p.world_size > 1 and _measured_at(cfg, p.world_size)})
    if not cfg.predict.calibrate or not sizes:
        return {}
    algos = ["native"] + [s for s in ("naive", "ring", "tree") if s in cfg.syncs]
    # Doubling sizes: enough of them in each protocol regime for the fit to see where it ends.
    kb = list(cfg.predict.sizes_kb) or [4 * 2 ** i for i in range(15 if profile == "cpu" else 17)]
    rows = []
    for n in sizes:
        out = os.path.join(sweep_dir, "calibration", f"allreduce_n{n}.jsonl")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={n}", "-m", "ddp_lab.scale.calibrate", out,
               "--algos", ",".join(algos), "--sizes", ",".join(str(k * 1024) for k in kb)]
        if _launch(cmd, env, out, cfg.predict.timeout_s, f"calibration at N={n}", say):
            rows += read_table(out)
            say(f"calibrated all-reduce ({', '.join(algos)}) at N={n}: {len(kb)} sizes")
    if rows:
        write_rows(rows, sweep_dir, "allreduce")
    return fit_alpha_beta(rows, cfg.predict.max_regimes, only)


def _launch(cmd: list[str], env: dict, out: str, timeout_s: float, what: str, say) -> bool:
    """Run a measurement job that writes `out`; say why not where it did not."""
    os.makedirs(os.path.dirname(out), exist_ok=True)
    log_path = os.path.splitext(out)[0] + ".log"
    t0 = time.perf_counter()
    returncode, timed_out = launch.run_logged(cmd, env, log_path, timeout_s)
    if timed_out:
        say(f"{what} timed out ({log_path})")
        return False
    if returncode != 0 or not os.path.exists(out):
        say(f"{what} failed (exit {returncode}): "
            f"{launch.tail(log_path).strip().splitlines()[-1:]} ({log_path})")
        return False
    say(f"{what}: {time.perf_counter() - t0:.0f} s")
    return True


def _probe(cfg, p: sweep.Point, env: dict, say) -> str | None:
    """The interference probe (ddp_lab/scale/interfere.py) of point `p`, right after it ran: its
    world size, training settings and algorithm, under the load the point just saw (a shared
    machine's other users come and go). Its file, or None (none at a world size outside
    predict.from_nproc)."""
    if not cfg.predict.probe or p.status != "ok" or p.world_size < 2 or p.sync == "none" \
            or not _measured_at(cfg, p.world_size):
        return None
    out = sweep.probe_path(p.run_dir)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={p.world_size}", "-m", "ddp_lab.scale.interfere", out, "--algos",
           "native" if p.sync == "ddp" else p.sync, "--rounds", str(cfg.predict.probe_rounds),
           "--", *[a for a in p.args if not a.startswith("hydra.")]]
    return out if _launch(cmd, env, out, cfg.predict.timeout_s,
                          f"    interference probe of {p.name}", say) else None


def emit(cfg, points: list[sweep.Point], say) -> list[str]:
    """Print (and log to scale.log) the multi-node command lines instead of running them."""
    gpn = cfg.gpus_per_node or sweep.local_gpus() or 8
    seen, lines = set(), ["#!/usr/bin/env bash", "# ddp_lab.scale emit=" + cfg.emit,
                          "set -euo pipefail"]
    for p in points:
        key = (p.sync, p.extra)
        if key in seen or p.status == "missing":
            continue
        seen.add(key)
        for nodes in cfg.nodes:
            n = nodes * gpn
            args = [a for a in p.args if not a.startswith("train.batch_size=")]
            batch = (cfg.global_batch or p.per_rank_batch * n) // n if cfg.mode == "strong" \
                else p.per_rank_batch
            name = f"nodes{nodes}x{gpn}-{p.sync}" + (f"-{sweep.slug(p.extra)}" if p.extra else "")
            args = args + [f"train.batch_size={batch}"]
            q = " ".join(shlex.quote(a) for a in args)
            lines.append(f"# {name}: world size {n}")
            if cfg.emit == "torchrun":
                # scripts/multinode.sh: the same line on every node; NODE0 is the rendezvous host.
                lines.append(f"NNODES={nodes} NPROC={gpn} NODE0=${{NODE0:?}} RDZV_ID={name} "
                             f"scripts/multinode.sh {q} hydra.run.dir=outputs/scale_multinode/{name}")
            else:
                # scripts/slurm.sbatch names the run dir outputs/slurm/<job id>.
                lines.append(f"sbatch --nodes={nodes} --gpus-per-node={gpn} "
                             f"--job-name={name} scripts/slurm.sbatch {q}")
    lines.append("# afterwards: python -m ddp_lab.scale collect=[<run dir>,...] to tabulate them")
    say("\n".join(lines))
    return lines


def measured_compute(points: list[sweep.Point], batch_per_gpu: int) -> dict[str, float]:
    """model -> compute seconds per step at batch_per_gpu, from the sweep's N=1 GPU points."""
    out = {}
    for p in points:
        if p.status == "ok" and p.world_size == 1 and str(p.summary.get("device", "")).startswith("cuda"):
            ph = results.phases(p.summary)
            out.setdefault(p.summary["model"],
                           (ph["forward_ms"] + ph["backward_ms"]) * 1e-3 * batch_per_gpu
                           / p.per_rank_batch)
    return out


def _simulate_mode(cfg) -> str:
    """simulate= as one of true, false, only (emit= checked too: both fail before any work)."""
    mode = str(cfg.simulate).lower()
    if mode not in ("true", "false", "only"):
        raise ConfigError(f"simulate={cfg.simulate!r} is not one of true, false, only")
    if cfg.emit not in ("none", "torchrun", "slurm"):
        raise ConfigError(f"emit={cfg.emit!r} is not one of none, torchrun, slurm")
    if mode != "false":
        check_sim(cfg.sim)
    return mode


def run_points(cfg, run_dir: str, say) -> tuple | None:
    """The sweep's passes (each a list of every point), its profile, the environment they ran in,
    the interference probes' files ({point name: [file or None per pass]}) and the alpha-beta
    fits: collected from run dirs (fits only from predict.table), or planned and launched here
    `repeats` times over (each pass: every point once, each followed by its probe; collected:
    where their sweep kept them). None where emit= printed command lines instead."""
    if cfg.collect:
        points = [sweep.collect_point(d) for d in cfg.collect]
        check_from_nproc(cfg.predict.from_nproc, [p.world_size for p in points])
        fits = _fits(cfg, points, run_dir, "collected", {}, say) if cfg.predict.table else {}
        return ([points], "collected", dict(os.environ),
                {p.name: [sweep.probe_path(p.run_dir)] for p in points}, fits)
    points, profile = sweep.plan(cfg, PASSTHROUGH, run_dir)
    listed = check_from_nproc(cfg.predict.from_nproc, [p.world_size for p in points])
    runnable = [p for p in points if p.status == "planned"]
    if runnable:
        sweep.check_point_config(runnable[0])
    if cfg.emit != "none":
        emit(cfg, points, say)
        return None
    env = launch.point_env(cfg, profile, max(p.world_size for p in points))
    timeout = cfg.point_timeout_s or (300.0 if profile == "cpu" else 600.0)
    threads = int(env.get("OMP_NUM_THREADS", 0) or 0) * max(p.world_size for p in points)
    if profile == "cpu" and threads > (os.cpu_count() or 1):
        say(f"warning: {threads} OpenMP threads at the largest world size on {os.cpu_count()} "
            "cores: oversubscribed ranks wait for descheduled threads, and their timings (the "
            "loop's own calibration included) jump between modes several times apart")
    repeats = cfg.repeats or auto_repeats(say)
    say(f"sweep: {len(points)} points ({len(runnable)} to run{f' x {repeats}' * (repeats > 1)}),"
        f" {cfg.mode} scaling, profile {profile}, world sizes "
        f"{sorted({p.world_size for p in points})}, syncs {list(cfg.syncs)} -> {run_dir}")
    if listed:
        say(f"predict.from_nproc: calibration and probes at N={list(listed)} only; every point "
            "is predicted from them")
    # Calibrated before the points: a sweep a time limit cuts short keeps its calibration
    # (allreduce.jsonl), so collect= with predict.table= can still predict the points it ran.
    fits = _fits(cfg, points, run_dir, profile, env, say)
    passes, probes = [], {}
    for r in range(repeats):
        passes.append([sweep.for_repeat(p, r) for p in points])
        for i, q in enumerate(passes[-1], 1):
            where = f"[{i}/{len(points)}{f' #{r + 1}' * (repeats > 1)}] {q.name}"
            if q.status == "planned":
                say(f"{where}: running (timeout {timeout:.0f} s)")
                launch.launch(q, env, timeout, cfg.keep_checkpoints)
            say(f"{where}: {_result(q)}")
            probes.setdefault(q.name, []).append(_probe(cfg, q, env, say))
    return passes, profile, env, probes, fits


def auto_repeats(say) -> int:
    """repeats=0: 3 passes where one stray process can move a point (a machine of 4 cores or
    fewer, or one whose 1-minute load average is above half its cores as the sweep starts),
    else 1."""
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    cores = os.cpu_count() or 1
    if cores > 4 and load <= 0.5 * cores:
        return 1
    say(f"load average {load:.1f} on {cores} cores: 3 passes over every point, each pass "
        "predicted on its own, a row its median pass (repeats=1 for one)")
    return 3


def say_tables(rows: list[dict], fits: dict, say) -> None:
    """The measured table, the alpha-beta fits and the model against measurement, on the console."""
    ok = [r for r in rows if r["status"] == "ok"]
    say("\n" + report.console_table(rows, report.CONSOLE_COLUMNS))
    if fits:
        say("\nalpha-beta fits:\n" + report.console_table(
            [f.as_row() for f in fits.values()], report.FIT_COLUMNS))
    if any(r["pred_efficiency"] == r["pred_efficiency"] for r in ok):
        say("\nmodel vs measured (ms: measured/predicted):\n"
            + report.console_table(report.phase_rows(ok), report.phase_columns()))


def tabulate(cfg, passes: list, profile: str, env: dict, run_dir: str, say,
             probe_files: dict | None = None, fits: dict | None = None) -> tuple:
    """Rows, fits and predictions of the points, written (manifest, CSV, TensorBoard, plot) and
    printed; returns (rows, fits, manifest, csv path). Each pass is tabulated and predicted on
    its own (each point against its N=1 point and with its probe of the same pass, minutes
    apart at most), then every column is the median over the passes (results.merge_passes)."""
    man = outputs.write_manifest(os.path.join(run_dir, "manifest.json"),
                                 OmegaConf.to_container(cfg, resolve=True), PASSTHROUGH, profile,
                                 env)
    fits = fits or {}
    per_pass = []
    for r, points in enumerate(passes):
        rows = results.rows_from_points(points)
        probes = load_probes({name: fs[r:r + 1] for name, fs in (probe_files or {}).items()})
        predict_rows(rows, points, fits, probes, results.bases(points),
                     tuple(cfg.predict.from_nproc))
        per_pass.append(rows)
    rows = results.merge_passes(per_pass)
    csv_path = outputs.write_csv(rows, run_dir)
    outputs.write_tensorboard(rows, run_dir)
    outputs.plot(rows, os.path.join(run_dir, "scaling.png"),
                 f"{rows[0]['model'] if rows else ''} {cfg.mode} scaling, profile {profile}")
    say_tables(rows, fits, say)
    return rows, fits, man, csv_path


def task(cfg, run_dir: str) -> None:
    run_dir = os.path.abspath(run_dir)
    os.makedirs(run_dir, exist_ok=True)
    say = Say(os.path.join(run_dir, "scale.log"))
    mode = _simulate_mode(cfg)
    points, fits = [], {}
    if mode != "only":
        swept = run_points(cfg, run_dir, say)
        if swept is None:  # emit=: command lines only
            return
        passes, profile, env, probe_files, fits = swept
        points = passes[0]
        rows, fits, man, csv_path = tabulate(cfg, passes, profile, env, run_dir, say, probe_files,
                                             fits)
    sim_md = ""
    if mode in ("true", "only"):
        say("\nsimulation:")
        sim_md = sim_report.run(cfg.sim, run_dir, fits,
                                measured_compute(points, cfg.sim.batch_per_gpu), say)
    if mode != "only":
        report.report(rows, fits, man, run_dir, sim_md)
        say(f"\nwrote {csv_path}, scaling.png, report.md, manifest.json, tensorboard/ in {run_dir}")
    else:
        say(f"\nwrote simulation.csv, simulation.png, simulation.md in {run_dir}")


def _result(p: sweep.Point) -> str:
    if p.status != "ok":
        first = p.error.strip().splitlines()[:2]
        return f"{p.status.upper()}: " + " / ".join(first)
    s = p.summary
    ph = results.phases(s)
    return (f"ok, {s['train_img_per_s']:.1f} img/s ({s['train_img_per_s'] / p.world_size:.1f} per "
            f"rank, {s.get('backend')}), step {ph['step_ms']:.1f} ms = forward "
            f"{ph['forward_ms']:.1f} + backward {ph['backward_ms']:.1f} + sync and comm "
            f"{ph['lost_ms']:.1f} + guard {ph['guard_ms']:.1f} + optim {ph['optim_ms']:.1f} + data "
            f"{ph['data_ms']:.1f}, {p.wall_s:.0f} s, load {p.load_avg:.1f}, others' cores "
            f"{p.other_cores:.2f}")


def run_name(overrides: list[str]) -> str:
    keep = sorted(o for o in overrides if not o.startswith(("hydra.", "-"))
                  and o.split("=", 1)[0].lstrip("+~") not in NOT_IN_NAME)
    name = ",".join(keep) or "default"
    return "".join(c if c.isalnum() or c in "=,._-+[]" else "_" for c in name)[:200]


def main(argv: list[str] | None = None) -> None:
    from ddp_lab.cli import run_hydra_app

    argv = list(sys.argv[1:] if argv is None else argv)
    scale_args = [a for a in argv if not sweep.PASS_THROUGH.match(a)]
    PASSTHROUGH[:] = [a for a in argv if sweep.PASS_THROUGH.match(a)]
    if not any(a.startswith("hydra.run.dir=") for a in scale_args):
        scale_args.append(f"hydra.run.dir=outputs/scale/{run_name(argv)}")
    sys.argv = [sys.argv[0], *scale_args]
    register_scale_config()
    run_hydra_app(task, "scale")
