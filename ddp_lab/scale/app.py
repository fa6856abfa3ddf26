"""The `python -m ddp_lab.scale` Hydra app: sweep, outputs, prediction, simulation."""

from __future__ import annotations

import os
import shlex
import sys
import time

from omegaconf import OmegaConf

from ddp_lab.config import ConfigError
from ddp_lab.cost import network as net
from ddp_lab.scale import outputs, simulate, sweep
from ddp_lab.scale.config import register_scale_config

# Training overrides taken off the command line by main() before Hydra parses it (the scale
# app's own schema has no model/train/... nodes: composing the training groups here would fix
# one `sync`, the very thing swept).
PASSTHROUGH: list[str] = []
# Scale keys that do not change results and so do not name the run directory.
NOT_IN_NAME = ("point_timeout_s", "keep_checkpoints", "predict.timeout_s", "train.progress")


class Say:
    """Progress lines on stdout, also appended to the sweep's scale.log."""

    def __init__(self, path: str):
        self.path = path

    def __call__(self, *parts) -> None:
        text = " ".join(str(p) for p in parts)
        print(text, flush=True)
        with open(self.path, "a") as f:
            f.write(text + "\n")


def _fits(cfg, points, sweep_dir, profile, env, say) -> dict:
    """alpha-beta fits: from predict.table, or calibrated here at each world size > 1."""
    if cfg.predict.table:
        rows = net.read_table(cfg.predict.table)
        say(f"alpha-beta fit from {cfg.predict.table} ({len(rows)} rows)")
        return net.fit_alpha_beta(rows)
    sizes = sorted({p.world_size for p in points if p.status == "ok" and p.world_size > 1})
    if not cfg.predict.calibrate or not sizes:
        return {}
    algos = ["native"]
    try:
        from ddp_lab.comm import all_reduce  # noqa: F401  (our collectives, once they exist)
        algos += [s for s in ("naive", "ring", "tree") if s in cfg.syncs]
    except ImportError:
        pass
    kb = list(cfg.predict.sizes_kb) or ([4 * 4 ** i for i in range(8)] if profile == "cpu"
                                        else [4 * 4 ** i for i in range(10)])
    rows = []
    for n in sizes:
        out = os.path.join(sweep_dir, "calibration", f"allreduce_n{n}.jsonl")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={n}", "-m", "ddp_lab.scale.calibrate", out,
               "--algos", ",".join(algos), "--sizes", ",".join(str(k * 1024) for k in kb)]
        t0 = time.perf_counter()
        os.makedirs(os.path.dirname(out), exist_ok=True)
        log_path = out.replace(".jsonl", ".log")
        returncode, timed_out = sweep.run_logged(cmd, env, log_path, cfg.predict.timeout_s)
        if timed_out:
            say(f"calibration at N={n} timed out; no fit for it ({log_path})")
            continue
        if returncode != 0 or not os.path.exists(out):
            say(f"calibration at N={n} failed (exit {returncode}): "
                f"{sweep.tail(log_path).strip().splitlines()[-1:]} ({log_path})")
            continue
        rows += net.read_table(out)
        say(f"calibrated all-reduce ({', '.join(algos)}) at N={n}: {len(kb)} sizes, "
            f"{time.perf_counter() - t0:.0f} s")
    if rows:
        from ddp_lab.bench.common import write_rows
        write_rows(rows, sweep_dir, "allreduce")
    return net.fit_alpha_beta(rows)


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
            ph = sweep.phases(p.summary)
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
    return mode


def run_points(cfg, run_dir: str, say) -> tuple[list[sweep.Point], str, dict] | None:
    """The sweep's points and profile and the environment they ran in: collected from run dirs,
    or planned and launched here one by one. None where emit= printed command lines instead."""
    if cfg.collect:
        return [sweep.collect_point(d) for d in cfg.collect], "collected", dict(os.environ)
    points, profile = sweep.plan(cfg, PASSTHROUGH, run_dir)
    runnable = [p for p in points if p.status == "planned"]
    if runnable:
        sweep.check_point_config(runnable[0])
    if cfg.emit != "none":
        emit(cfg, points, say)
        return None
    env = sweep.point_env(cfg, profile, max(p.world_size for p in points))
    timeout = cfg.point_timeout_s or (300.0 if profile == "cpu" else 600.0)
    say(f"sweep: {len(points)} points ({len(runnable)} to run), {cfg.mode} scaling, "
        f"profile {profile}, world sizes {sorted({p.world_size for p in points})}, "
        f"syncs {list(cfg.syncs)} -> {run_dir}")
    for i, p in enumerate(points, 1):
        if p.status == "planned":
            say(f"[{i}/{len(points)}] {p.name}: running (timeout {timeout:.0f} s)")
            sweep.launch(p, env, timeout, cfg.keep_checkpoints)
        say(f"[{i}/{len(points)}] {p.name}: {_result(p)}")
    return points, profile, env


def say_tables(rows: list[dict], fits: dict, say) -> None:
    """The measured table, the alpha-beta fits and the model against measurement, on the console."""
    ok = [r for r in rows if r["status"] == "ok"]
    say("\n" + outputs.console_table(
        rows, ["point", "status", "img_per_s", "img_per_s_per_gpu", "speedup", "efficiency",
               "step_ms", "compute_ms", "exposed_comm_ms", "data_ms", "optim_ms", "other_ms",
               "comm_bytes_per_step", "busbw_GBps", "rank_skew"]))
    if fits:
        say("\nalpha-beta fits:\n" + outputs.console_table(
            [f.as_row() for f in fits.values()],
            ["algo", "backend", "alpha_us", "bandwidth_GBps", "r2", "max_rel_err_pct",
             "points"]))
    if any(r["pred_efficiency"] == r["pred_efficiency"] for r in ok):
        say("\nmodel vs measured:\n" + outputs.console_table(
            ok, ["point", "exposed_comm_ms", "pred_exposed_comm_ms", "step_ms", "pred_step_ms",
                 "efficiency", "pred_efficiency", "pred_err_pct"]))


def tabulate(cfg, points, profile: str, env: dict, run_dir: str, say) -> tuple:
    """Rows, fits and predictions of the points, written (manifest, CSV, TensorBoard, plot) and
    printed; returns (rows, fits, manifest, csv path)."""
    man = outputs.write_manifest(os.path.join(run_dir, "manifest.json"),
                                 OmegaConf.to_container(cfg, resolve=True), PASSTHROUGH, profile,
                                 env)
    rows = sweep.rows_from_points(points)
    fits = {}
    if not cfg.collect or cfg.predict.table:  # collected runs: only a given table
        fits = _fits(cfg, points, run_dir, profile, env, say)
    sweep.predict_rows(rows, points, fits)
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
        points, profile, env = swept
        rows, fits, man, csv_path = tabulate(cfg, points, profile, env, run_dir, say)
    sim_md = ""
    if mode in ("true", "only"):
        say("\nsimulation:")
        sim_md = simulate.run(cfg.sim, run_dir, fits, measured_compute(points, cfg.sim.batch_per_gpu),
                              say)
    if mode != "only":
        outputs.report(rows, fits, man, run_dir, sim_md)
        say(f"\nwrote {csv_path}, scaling.png, report.md, manifest.json, tensorboard/ in {run_dir}")
    else:
        say(f"\nwrote simulation.csv, simulation.png, simulation.md in {run_dir}")


def _result(p: sweep.Point) -> str:
    if p.status != "ok":
        first = p.error.strip().splitlines()[:2]
        return f"{p.status.upper()}: " + " / ".join(first)
    s = p.summary
    ph = sweep.phases(s)
    return (f"ok, {s['train_img_per_s']:.1f} img/s ({s['train_img_per_s'] / p.world_size:.1f} per "
            f"GPU, {s.get('backend')}), step {ph['step_ms']:.1f} ms = compute "
            f"{ph['compute_ms']:.1f} + comm {ph['exposed_comm_ms']:.1f} + data {ph['data_ms']:.1f}"
            f" + optim {ph['optim_ms']:.1f}, {p.wall_s:.0f} s")


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
