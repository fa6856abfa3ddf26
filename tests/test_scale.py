"""`python -m ddp_lab.scale` end to end on CPU (gloo): a real sweep over world sizes 1 and 2, its
outputs and their consistency, failing points, the bytes the syncs send against the cost model,
strong-scaling plans, multi-node command lines, the simulation entry point."""

import csv
import json
import math
import os
import pytest

from background import background
from ddp_lab.cli import CONF_DIR
from helpers import SCALE_SWEPT, SCALE_TINY, check, scale

from ddp_lab.perf.predict import PHASES

def read_csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def num(x):
    return float(x) if x not in ("", None) else math.nan


# The other launches of this module (a failing sweep, a point past its timeout, a bad override,
# emit, the simulation) need nothing but a directory: they are background launches
# (tests/README.md), never run while the sweep runs.
# A missing sync (never launched), a point that fails at run time (too few samples for one step),
# then a good point: the sweep finishes and reports all three.
FAILING = ["nproc=[1]", "syncs=[nosuchsync,ddp]", "train.max_steps=3", "train.timing_warmup=1",
           'sweep=["data.num_samples=4",""]', "simulate=false"]
EMIT = {"torchrun": ["NNODES=2 NPROC=8", "scripts/multinode.sh", "NNODES=4"],
        "slurm": ["sbatch --nodes=2 --gpus-per-node=8", "scripts/slurm.sbatch"]}


@background(cost=35)
def failing_points(run_dir):
    return scale(SCALE_TINY + FAILING + [f"hydra.run.dir={run_dir}"]), run_dir


@background(cost=8)
def point_past_its_timeout(run_dir):
    return scale(SCALE_TINY + ["nproc=[1]", "syncs=[ddp]", "point_timeout_s=2", "simulate=false",
                               f"hydra.run.dir={run_dir}"], timeout=120), run_dir


@background(cost=4)
def bad_training_override(run_dir):
    return scale(["train.batchsize=3", f"hydra.run.dir={run_dir}"], timeout=120), run_dir


@background(cost=5, keys=EMIT)
def emit(name, run_dir):
    return scale(["emit=" + name, "nodes=[2,4]", "gpus_per_node=8", "syncs=[ddp]",
                  "model=alexnet", f"hydra.run.dir={run_dir}"], timeout=120), run_dir


SIMULATION_PAGE = os.path.join(os.path.dirname(CONF_DIR), "docs", "results",
                               "h200-scaling-and-simulation")


def published_simulation_args() -> list[str]:
    """The overrides of the command the simulation's results page prints (its only indented
    `python -m ddp_lab.scale simulate=only` line and those continuing it)."""
    import shlex

    with open(os.path.join(SIMULATION_PAGE, "README.md")) as f:
        lines = f.read().splitlines()
    start = next(i for i, line in enumerate(lines)
                 if line.strip().startswith("python -m ddp_lab.scale simulate=only"))
    command = ""
    for line in lines[start:]:
        command += line.strip().rstrip("\\") + " "
        if not line.rstrip().endswith("\\"):
            break
    return shlex.split(command)[3:]  # after `python -m ddp_lab.scale`


@background(cost=10)
def simulation(run_dir):
    """The results page's own command: its figures must follow from this code."""
    return scale(published_simulation_args() + [f"hydra.run.dir={run_dir}"], timeout=180), run_dir


def test_sweep_writes_consistent_csv(scale_sweep):
    out, proc = scale_sweep
    rows = read_csv(out / "scaling.csv")
    assert {r["status"] for r in rows} == {"ok"}, [(r["point"], r["error"]) for r in rows]
    assert {(r["sync"], int(r["world_size"])) for r in rows} == {
        (s, n) for s in SCALE_SWEPT for n in (1, 2)}
    for r in rows:
        n = int(r["world_size"])
        summary = json.load(open(out / "points" / r["point"] / "summary.json"))
        assert summary["world_size"] == n and summary["sync"] == r["sync"]
        assert summary["backend"] == "gloo" and r["mode"] == "weak"
        assert num(r["img_per_s"]) == pytest.approx(summary["train_img_per_s"])
        assert num(r["img_per_s_per_gpu"]) == pytest.approx(num(r["img_per_s"]) / n)
        assert int(r["global_batch"]) == 8 * n  # weak scaling: the per-rank batch is fixed
        assert num(r["speedup"]) == pytest.approx(n * num(r["efficiency"]))
        assert r["baseline"] == f"n1-{r['sync']}"
        if n == 1:
            assert num(r["efficiency"]) == 1.0 and num(r["speedup"]) == 1.0
            assert num(r["rank_skew"]) == 0.0
        else:
            assert 0 < num(r["efficiency"]) < 3  # sanity only: 2 ranks share 2 busy cores
            assert num(r["rank_skew"]) >= 0
        parts = sum(num(r[f"{ph}_ms"]) for ph in PHASES)
        assert parts == pytest.approx(num(r["step_ms"]))  # adds up (other: what medians leave)
        assert num(r["compute_ms"]) == pytest.approx(num(r["forward_ms"]) + num(r["backward_ms"]))
        if n == 1:  # nothing sent: what the sync costs alone is booked as `sync`, not comm
            assert num(r["exposed_comm_ms"]) < 0.01 * num(r["step_ms"])
            assert num(r["sync_ms"]) >= 0 and int(r["passes"]) == 1
        assert "checkpoint.pt" not in os.listdir(out / "points" / r["point"])  # cleaned up
    assert "[1/" in proc.stdout and "img/s" in proc.stdout  # a progress line per point


def test_tensorboard_scalars_have_world_size_as_step(scale_sweep):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, _ = scale_sweep
    rows = {(r["sync"], int(r["world_size"])): r for r in read_csv(out / "scaling.csv")}
    for sync in SCALE_SWEPT:
        acc = EventAccumulator(str(out / "tensorboard" / sync))
        acc.Reload()
        assert {"scaling/efficiency", "scaling/img_per_s"} <= set(acc.Tags()["scalars"])
        eff = {e.step: e.value for e in acc.Scalars("scaling/efficiency")}
        thr = {e.step: e.value for e in acc.Scalars("scaling/img_per_s")}
        assert set(eff) == {1, 2} and eff[1] == 1.0
        for n in (1, 2):
            assert eff[n] == pytest.approx(num(rows[(sync, n)]["efficiency"]), rel=1e-5)
            assert thr[n] == pytest.approx(num(rows[(sync, n)]["img_per_s"]), rel=1e-5)


def test_plot_report_and_manifest(scale_sweep):
    out, _ = scale_sweep
    with open(out / "scaling.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    report = open(out / "report.md").read()
    assert "| n2-ddp | ok |" in report and "How to read this" in report
    m = json.load(open(out / "manifest.json"))
    for key in ("gpus", "gpu_count", "cpu_count", "torch", "cuda", "nccl", "nccl_env",
                "git_commit"):
        assert key in m["provenance"]
    assert "config" in m and "nvidia_smi_topo" in m
    assert m["config"]["nproc"] == [1, 2] and m["provenance"]["cpu_count"] == os.cpu_count()
    assert m["point_overrides"][:2] == SCALE_TINY[:2]


def test_model_predicts_every_point_phase_by_phase(scale_sweep):
    """scaling.csv keeps its columns and has each phase measured and predicted; the prediction
    at N=1 is the measurement it starts from; report.md has the table, phase by phase."""
    out, _ = scale_sweep
    fits = read_csv(out / "allreduce.csv")
    assert {r["algo"] for r in fits} >= {"native"} and {r["world_size"] for r in fits} == {"2"}
    rows = read_csv(out / "scaling.csv")
    assert {"world_size", "sync", "status", "efficiency", "pred_efficiency", "step_ms",
            "exposed_comm_ms"} <= set(rows[0])
    for r in rows:
        assert not math.isnan(num(r["pred_efficiency"])), r["pred_note"]
        assert num(r["pred_exposed_comm_ms"]) >= 0
        pred = [num(r[f"pred_{ph}_ms"]) for ph in PHASES]
        assert sum(pred) == pytest.approx(num(r["pred_step_ms"]))
        if r["world_size"] == "1":
            assert num(r["pred_efficiency"]) == pytest.approx(1.0)
            assert num(r["pred_exposed_comm_ms"]) == 0
            assert pred == pytest.approx([num(r[f"{ph}_ms"]) for ph in PHASES])
        else:  # measured on its own, right after the point
            assert os.path.exists(out / "interference" / f"{r['point']}.json")
            assert num(r["compute_slowdown"]) >= 1 and num(r["comm_slowdown"]) >= 1
            assert r["worst_phase"] in PHASES
            assert num(r["calib_busbw_GBps"]) > 0 and num(r["probe_busbw_GBps"]) > 0
    report = open(out / "report.md").read()
    assert "## Model vs measurement, phase by phase" in report
    assert "Where the model misses" in report
    section = report.split("## Model vs measurement, phase by phase")[1]
    n2 = next(line for line in section.splitlines() if line.startswith("| n2-ring | "))
    assert n2.count(" / ") >= 2 + len(PHASES)  # efficiency, step and every phase: measured / pred
    assert "## All-reduce fits" in report and "r2_one_line" in report


def test_the_models_buckets_are_the_syncs(scale_sweep):
    """The bucket layout the model (and the probe) assume is the one the sync built."""
    from ddp_lab.perf import step

    out, _ = scale_sweep
    summary = json.load(open(out / "points" / "n2-ring" / "summary.json"))
    probe = json.load(open(out / "interference" / "n2-ring.json"))
    numels = probe["param_numels"][::-1]
    assert summary["comm"]["bucket_bytes"] == step.bucket_layout(numels, 4, 25.0, "ours")
    assert probe["derived"]["ring"]["bucket_bytes"] == summary["comm"]["bucket_bytes"]


@pytest.mark.parametrize("sync", SCALE_SWEPT)
def test_predicted_bytes_equal_the_bytes_the_sync_sends(scale_sweep, sync):
    """The cost model's bytes per step (rank 0, who sends the most under naive and tree) against
    the bytes the sync reports it sent (comm_bytes_per_step in summary.json)."""
    out, _ = scale_sweep
    row = next(r for r in read_csv(out / "scaling.csv")
               if r["sync"] == sync and r["world_size"] == "2")
    sent = num(row["comm_bytes_per_step"])
    assert sent > 0, "the sync reports no bytes"
    predicted = num(row["pred_bytes_per_step"])
    # Ring chunks of numel/N round per bucket: allow a few elements per bucket, nothing more.
    assert abs(sent - predicted) <= 64 * 4 * 16, (sent, predicted)
    if sync == "ddp":
        params = json.load(open(out / "points" / row["point"] / "summary.json"))["parameters"]
        assert predicted == pytest.approx(2 * (2 - 1) / 2 * params * 4)


def test_failing_points_do_not_stop_the_sweep(failing_points):
    proc, run_dir = failing_points
    check(proc)
    rows = {r["point"]: r for r in read_csv(run_dir / "scaling.csv")}
    assert rows["n1-nosuchsync-data.num_samples_4"]["status"] == "missing"
    assert rows["n1-nosuchsync"]["status"] == "missing"
    failed = rows["n1-ddp-data.num_samples_4"]
    assert failed["status"] == "failed" and "fewer than one step" in failed["error"]
    assert rows["n1-ddp"]["status"] == "ok" and num(rows["n1-ddp"]["efficiency"]) == 1.0
    assert "FAILED" in proc.stdout and "Points that did not run" in open(run_dir / "report.md").read()


def test_a_point_past_its_timeout_is_stopped(point_past_its_timeout):
    proc, run_dir = point_past_its_timeout
    check(proc)
    (row,) = read_csv(run_dir / "scaling.csv")
    assert row["status"] == "timeout" and "killed after 2 s" in row["error"]
    assert os.path.exists(run_dir / "scaling.png")


def test_bad_training_override_fails_before_any_point(bad_training_override):
    proc, run_dir = bad_training_override
    assert proc.returncode == 2 and "batchsize" in proc.stderr
    assert not os.path.exists(run_dir / "points")


def test_strong_scaling_plan():
    from hydra import compose, initialize_config_dir

    from ddp_lab.config import ConfigError
    from ddp_lab.scale import sweep
    from ddp_lab.scale.config import register_scale_config
    from ddp_lab.cli import register_resolvers

    register_scale_config()
    register_resolvers()
    with initialize_config_dir(CONF_DIR, version_base=None):
        cfg = compose("scale", overrides=["mode=strong", "global_batch=16", "nproc=[1,2,4]",
                                          "syncs=[ddp]", "profile=cpu"])
        points, profile = sweep.plan(cfg, ["train.max_steps=5"], "/tmp/x")
        assert profile == "cpu"
        assert [(p.world_size, p.per_rank_batch) for p in points] == [(1, 16), (2, 8), (4, 4)]
        assert all(p.mode == "strong" and f"train.batch_size={p.per_rank_batch}" in p.args
                   and "train.max_steps=5" in p.args for p in points)
        bad = compose("scale", overrides=["mode=strong", "global_batch=16", "nproc=[1,3]",
                                          "profile=cpu"])
        with pytest.raises(ConfigError, match="not divisible by world size"):
            sweep.plan(bad, [], "/tmp/x")
        weak = compose("scale", overrides=["nproc=[1,2]", "syncs=[none,ddp]", "profile=cpu",
                                           'sweep=["train.batch_size=4","train.batch_size=16"]'])
        points, _ = sweep.plan(weak, [], "/tmp/x")
        # sync=none only alone; the swept per-rank batch is kept at every world size.
        assert [(p.sync, p.world_size, p.per_rank_batch) for p in points] == [
            ("none", 1, 4), ("ddp", 1, 4), ("ddp", 2, 4),
            ("none", 1, 16), ("ddp", 1, 16), ("ddp", 2, 16)]
        # The GPU profile's point defaults, unless told otherwise
        gpu = compose("scale", overrides=["nproc=[1]", "syncs=[ddp]", "profile=gpu"])
        [point], _ = sweep.plan(gpu, [], "/tmp/x")
        assert "train.timing_warmup=10" in point.args
        [point], _ = sweep.plan(gpu, ["train.timing_warmup=5"], "/tmp/x")
        assert "train.timing_warmup=5" in point.args and "train.timing_warmup=10" not in point.args


@pytest.mark.parametrize("name", list(EMIT))
def test_emit_prints_multinode_commands(emit, name):
    proc, run_dir = emit[name]
    check(proc)
    for needle in EMIT[name] + ["model=alexnet", "sync=ddp"]:
        assert needle in proc.stdout, proc.stdout
    assert not os.path.exists(run_dir / "points")


def test_simulation_entry_point_reproduces_its_results_page(simulation):
    """`simulate=only` with the page's command writes the page's simulation.csv and simulation.md
    again: every row, every number (the same code and inputs: the same floats), and says where each
    model's compute came from (measured from a named file, or assumed)."""
    proc, run_dir = simulation
    check(proc)
    rows = read_csv(run_dir / "simulation.csv")
    published = read_csv(os.path.join(SIMULATION_PAGE, "simulation.csv"))
    assert rows == published
    with open(run_dir / "simulation.md") as ours, \
            open(os.path.join(SIMULATION_PAGE, "simulation.md")) as theirs:
        assert ours.read() == theirs.read()  # its tables, which docs/zero.md quotes, too
    assert {r["network"] for r in rows} == {"ib400", "ib100", "eth25"}
    assert {r["algo"] for r in rows} == {"naive", "ring", "hring", "tree"}
    sources = {r["model"]: r["compute_source"] for r in rows}
    assert sources["alexnet"].startswith("measured: docs/results/h200-loop-vs-bare/")
    assert sources["resnet50"].startswith("assumed: ")
    assert os.path.getsize(run_dir / "simulation.png") > 0
    for needle in ("naive falls below 50%", "best bucket", "Sanity", "tree < ring below"):
        assert needle in proc.stdout


def test_the_report_shows_the_largest_world_sizes_timelines(tmp_path):
    """Points run with train.trace=true keep trace.json and timeline.png; report.md shows the
    timelines of the largest world size, with their overlap figures."""
    from ddp_lab.scale.report import timelines

    ok = [{"point": "n1-ring", "world_size": 1}, {"point": "n2-ring", "world_size": 2},
          {"point": "n2-ddp", "world_size": 2}]
    for name in ("n1-ring", "n2-ring"):  # n2-ddp was not traced
        (tmp_path / "points" / name).mkdir(parents=True)
        (tmp_path / "points" / name / "timeline.png").write_bytes(b"png")
        (tmp_path / "points" / name / "summary.json").write_text(json.dumps(
            {"overlap": {"steps": [4, 5], "comm_busy_ms": 10.0, "exposed_comm_ms": 2.5,
                         "overlap_fraction": 0.75}}))
    text = "\n".join(timelines(ok, str(tmp_path)))
    assert "![n2-ring timeline](points/n2-ring/timeline.png)" in text
    assert "n1-ring" not in text and "n2-ddp" not in text
    assert "overlap_fraction 0.75" in text and "points/n2-ring/trace.json" in text
    assert timelines(ok[:1] + ok[2:], str(tmp_path)) == []  # nothing traced at N=2: no section
