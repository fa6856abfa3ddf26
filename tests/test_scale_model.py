"""The scaling model without launching anything: the all-reduce fit's regimes and per-world-size
fits against synthetic timings, the interference schedule against the model it extends, and the
per-phase prediction of sweep rows with its report and CSV."""

import random

import pytest

from ddp_lab.perf import compute, fit, params, step
from ddp_lab.perf.collectives import cost

KIB, MIB = 1024, 1 << 20
SIZES = [4 * KIB * 2 ** i for i in range(15)]  # the CPU calibration's sizes: 4 KiB ... 64 MiB


def timings(algo, regimes, world_sizes=(2, 4, 8), noise=0.0, seed=0, beta_of_n=None):
    """Rows of a calibration table: `regimes` = [(lo_bytes, alpha, beta), ...]."""
    rng = random.Random(seed)
    rows = []
    for n in world_sizes:
        for s in SIZES:
            lo, alpha, beta = max((r for r in regimes if s >= r[0]), key=lambda r: r[0])
            beta = beta_of_n(beta, n) if beta_of_n else beta
            t = cost(algo, s, n).time(alpha, beta) * (1 + noise * rng.uniform(-1, 1))
            rows.append({"algo": algo, "backend": "gloo", "world_size": n, "bytes": s,
                         "time_us": t * 1e6, "wrong": 0})
    return rows


@pytest.mark.parametrize("noise", [0.0, 0.02])
@pytest.mark.parametrize("algo", ["ring", "naive", "native"])
def test_fit_recovers_size_regimes(algo, noise):
    """Two protocols (eager below 256 KiB, rendezvous above): the fit finds the switch and each
    side's alpha and beta, where one line misses the small messages badly."""
    small, large = (0.0, 30e-6, 1 / 3e9), (256 * KIB, 200e-6, 1 / 1.5e9)
    f = fit.fit_alpha_beta(timings(algo, [small, large], noise=noise, seed=2))[(algo, "gloo")]
    tol = 1e-6 if noise == 0 else 0.15
    assert [r.lo_bytes for r in f.regimes] == [0.0, 256 * KIB]
    for got, (_, alpha, beta) in zip(f.regimes, (small, large)):
        assert got.alpha_s == pytest.approx(alpha, rel=tol)
        assert got.beta_s_per_byte == pytest.approx(beta, rel=tol)
    assert not f.by_world_size  # the same line at every N: pooled
    assert f.r2 >= 0.98 and f.max_rel_err <= (1e-6 if noise == 0 else 0.05)
    assert f.max_rel_err_one_line > 3 * max(f.max_rel_err, 0.01)  # one line does not fit
    assert f.time_s(MIB, 4) == pytest.approx(cost(algo, MIB, 4).time(*large[1:]), rel=tol)
    assert "256 KiB" in f.describe()


def test_one_line_stays_one_line():
    """Noise alone buys no regime and no per-world-size fit."""
    rows = timings("ring", [(0.0, 25e-6, 1 / 10e9)], noise=0.03, seed=5)
    f = fit.fit_alpha_beta(rows)[("ring", "gloo")]
    assert len(f.regimes) == 1 and not f.by_world_size
    assert f.alpha_s == pytest.approx(25e-6, rel=0.15) and f.bandwidth_GBps == pytest.approx(
        10, rel=0.1)


def test_fit_per_world_size_where_bandwidth_depends_on_n():
    """Ranks sharing one machine: the more ranks, the less bandwidth each link gets. No single
    beta fits all N; one fit per world size does, and it is used at those world sizes."""
    slower = lambda beta, n: beta * (1 + 0.6 * (n - 2))
    rows = timings("ring", [(0.0, 40e-6, 1 / 4e9)], world_sizes=(2, 4, 8), beta_of_n=slower)
    f = fit.fit_alpha_beta(rows)[("ring", "gloo")]
    assert [n for n, _ in f.by_world_size] == [2, 4, 8]
    for n, per_n in f.by_world_size:
        assert per_n.beta_s_per_byte == pytest.approx(slower(1 / 4e9, n), rel=1e-6)
        assert f.time_s(64 * MIB, n) == pytest.approx(
            cost("ring", 64 * MIB, n).time(40e-6, slower(1 / 4e9, n)), rel=1e-6)
    assert f.r2 >= 0.999 and f.r2_one_line < f.r2
    assert "N=2:" in f.as_row()["fit"]


def test_few_sizes_fit_one_line():
    rows = [r for r in timings("native", [(0.0, 50e-6, 1e-9)]) if r["bytes"] in SIZES[:2]]
    f = fit.fit_alpha_beta(rows)[("native", "gloo")]
    assert len(f.regimes) == 1 and f.alpha_s == pytest.approx(50e-6, rel=1e-6)


def _old_exposed(buckets, backward_s, t, overlap):
    """The model before interference (step.schedule before it learnt it): the reference."""
    end, busy = 0.0, 0.0
    for b in buckets:
        start = max(end, b.ready * backward_s if overlap else backward_s)
        end = start + t(b.nbytes)
        busy += t(b.nbytes)
    return max(0.0, end - backward_s), busy


@pytest.mark.parametrize("seed", range(20))
def test_no_interference_is_the_old_model(seed):
    rng = random.Random(seed)
    fracs = sorted(rng.random() for _ in range(rng.randint(1, 6)))
    buckets = [step.Bucket(rng.randint(1, 100) * MIB, f) for f in fracs]
    backward = rng.uniform(0.001, 0.5)
    t = lambda nb: 1e-4 + nb / rng.choice([1e8, 1e9, 1e10])
    t = {b.nbytes: t(b.nbytes) for b in buckets}.__getitem__  # one time per size
    for overlap in (True, False):
        exposed, busy = _old_exposed(buckets, backward, t, overlap)
        s = step.schedule(buckets, backward, t, overlap)
        assert s.exposed_s == pytest.approx(exposed, rel=1e-9, abs=1e-12)
        assert s.busy_s == pytest.approx(busy, rel=1e-12)
        assert s.slowdown_s == pytest.approx(0.0, abs=1e-12)
        assert s.backward_end_s == pytest.approx(backward, rel=1e-12)
    profile = compute.profile_model("alexnet_cifar")
    network = params.Network("flat", intra=params.Link.of(50.0, 2.0), gpus_per_node=8)
    kw = dict(forward_s=0.03, backward_s=backward, other_s=0.05, bucket_mb=25.0)
    p = step.predict_step(profile, network, "ring", 4, **kw)
    ref, _ = _old_exposed(step.make_buckets(profile, 25.0, 4), backward,
                          lambda nb: network.allreduce_s("ring", nb, 4), True)
    assert p.step_s == pytest.approx(0.03 + backward + 0.05 + ref, rel=1e-12)
    assert p == step.predict_step(profile, network, "ring", 4, **kw,
                                  interference=params.Interference(1.0, 1.0))


def test_interference_slows_both_sides():
    """One bucket ready at once, longer than backward: backward runs at 1/2 speed beside it, the
    all-reduce at 1/3 until backward ends, then at full speed."""
    b = [step.Bucket(1, 0.0)]
    s = step.schedule(b, 1.0, lambda nb: 4.0,
                      interference=params.Interference(compute=2.0, comm=3.0))
    assert s.backward_end_s == pytest.approx(2.0) and s.slowdown_s == pytest.approx(1.0)
    assert s.comm_end_s == pytest.approx(2.0 + (4.0 - 2.0 / 3))
    assert s.exposed_s == pytest.approx(s.comm_end_s - 1.0)
    # Nothing to overlap: no slowdown, whatever the interference.
    late = step.schedule([step.Bucket(1, 1.0)], 1.0, lambda nb: 4.0,
                         interference=params.Interference(2.0, 3.0))
    assert late.slowdown_s == 0 and late.exposed_s == pytest.approx(4.0)
    # More interference, longer step; no buckets, nothing lost.
    bs = [step.Bucket(1, 0.2), step.Bucket(1, 0.6), step.Bucket(1, 1.0)]
    steps = [step.schedule(bs, 1.0, lambda nb: 0.3,
                           interference=params.Interference(c, m)).exposed_s
             for c, m in ((1, 1), (1.5, 1), (1.5, 2), (3, 3))]
    assert steps == sorted(steps) and steps[0] < steps[-1]
    nothing = step.schedule([], 1.0, lambda nb: 1.0, interference=params.Interference(5, 5))
    assert nothing.exposed_s == 0


def test_buckets_are_priced_by_the_probe_where_it_timed_them():
    """A bucket of a size the probe timed alone at the point's N costs what the probe measured;
    any other size, and ZeRO-2's reduce-scatter (not probed), what the fit says."""
    from types import SimpleNamespace

    from ddp_lab.perf.predict import bucket_time_s

    ring = fit.fit_alpha_beta(timings("ring", [(0, 1e-4, 1e-9)]), 1)[("ring", "gloo")]
    measured = {"bucket_bytes": [64 * MIB, 24 * MIB], "bucket_ms": [[1.0, 90.0, 2.0],
                                                                    [0.5, 30.0, 0.7]]}
    point = lambda zero: SimpleNamespace(world_size=4, config={"sync": {"zero": zero}})
    for zero in (0, 1):
        assert bucket_time_s(64 * MIB, point(zero), ring, measured) == pytest.approx(0.090)
        assert bucket_time_s(24 * MIB, point(zero), ring, measured) == pytest.approx(0.030)
        assert bucket_time_s(8 * MIB, point(zero), ring, measured) == pytest.approx(
            ring.time_s(8 * MIB, 4))
    assert bucket_time_s(64 * MIB, point(2), ring, measured) == pytest.approx(
        ring.time_s(64 * MIB, 4, "reduce_scatter"))
    assert bucket_time_s(64 * MIB, point(0), ring, {}) == pytest.approx(ring.time_s(64 * MIB, 4))


def test_bucket_rules_match_the_syncs():
    """DDP closes a bucket once it reaches the cap (the first at 1 MiB); ours starts a new one
    before a parameter would take it past the cap (0: one per parameter)."""
    numels = [10, 40_000, 4_000_000, 16_000_000, 1_000]  # backward order, 4-byte elements
    assert step.bucket_layout(numels, 4, 25, "ddp", 1.0) == [4 * (10 + 40_000 + 4_000_000),
                                                             4 * 16_000_000, 4 * 1_000]
    assert step.bucket_layout(numels, 4, 100, "ddp", 1.0) == [4 * (10 + 40_000 + 4_000_000),
                                                              4 * (16_000_000 + 1_000)]
    assert step.bucket_layout(numels, 4, 25, "ours") == [4 * (10 + 40_000 + 4_000_000),
                                                         4 * 16_000_000, 4 * 1_000]
    assert step.bucket_layout(numels, 4, 0, "ours") == [4 * n for n in numels]
    assert step.bucket_layout(numels, 4, 0, "ddp") == [4 * sum(numels)]
    grads = list(zip(numels, [0.0, 0.1, 0.3, 0.2, 1.0]))  # measured readiness may cross
    assert [b.ready for b in step.buckets_of(grads, 4, 25, "ours")] == [0.3, 0.2, 1.0]


def _row(point, n, measured, predicted, **extra):
    from ddp_lab.perf.predict import PHASES

    row = {"point": point, "status": "ok", "world_size": n, "sync": "ring", "setting": "",
           "mode": "weak", "device": "cpu", "img_per_s": 10.0 * n, "model": "alexnet_cifar",
           **{f"{ph}_ms": measured.get(ph, 1.0) for ph in PHASES},
           **{f"pred_{ph}_ms": predicted.get(ph, 1.0) for ph in PHASES}, **extra}
    row["step_ms"] = sum(row[f"{ph}_ms"] for ph in PHASES)
    row["pred_step_ms"] = sum(row[f"pred_{ph}_ms"] for ph in PHASES)
    return row


def test_report_and_csv_have_the_phase_by_phase_table(tmp_path):
    """report.md: measured / predicted (error) per phase and point, and the phase a miss comes
    from in words; scaling.csv: each phase's measured and predicted column."""
    from ddp_lab.perf.predict import PHASES
    from ddp_lab.scale import outputs, report

    one = _row("n1-ring", 1, {"backward": 100.0}, {"backward": 100.0})
    two = _row("n2-ring", 2, {"backward": 100.0, "exposed_comm": 150.0},
               {"backward": 100.0, "exposed_comm": 50.0})
    for r, step1 in ((one, one["step_ms"]), (two, one["step_ms"])):
        r["efficiency"] = step1 / r["step_ms"]
        r["pred_efficiency"] = step1 / r["pred_step_ms"]
        r["pred_err_pct"] = 100 * (r["pred_efficiency"] / r["efficiency"] - 1)
    man = {"provenance": {"gpus": [], "cpu_count": 2, "torch": "x", "cuda": None, "nccl": None,
                          "git_commit": "abc", "loadavg_1_5_15min": [1.0, 2.0, 3.0]},
           "profile": "cpu", "point_overrides": []}
    text = open(report.report([one, two], {}, man, str(tmp_path))).read()
    assert "## Model vs measurement, phase by phase" in text and "1.00 / 2.00 / 3.00" in text
    section = text.split("## Model vs measurement, phase by phase")[1]
    line = next(x for x in section.splitlines() if x.startswith("| n2-ring | "))
    assert "150 / 50 (-67%)" in line  # exposed_comm: measured / predicted (error)
    miss = next(x for x in text.splitlines() if x.startswith("- **n2-ring**"))
    assert "exposed_comm -100.0 ms (predicted 50, measured 150)" in miss
    assert "n1-ring**" not in text  # on the mark: not a miss
    header = open(outputs.write_csv([one, two], str(tmp_path))).readline()
    assert all(f"{ph}_ms" in header and f"pred_{ph}_ms" in header for ph in PHASES)
    outputs.plot([one, two], str(tmp_path / "scaling.png"))
    assert (tmp_path / "scaling.png").stat().st_size > 0
    assert outputs.x_label([one, two]) == "CPU processes (world size)"


def test_a_sweep_without_n1_still_plots(tmp_path):
    """nproc=[2,4]: no baseline, so no efficiency; the plot still draws the rest."""
    from ddp_lab.scale import outputs

    rows = [_row(f"n{n}-ring", n, {"backward": 100.0}, {"backward": 100.0}) for n in (2, 4)]
    for r in rows:
        r["efficiency"] = r["pred_efficiency"] = float("nan")
    outputs.plot(rows, str(tmp_path / "scaling.png"))
    assert (tmp_path / "scaling.png").stat().st_size > 0


def test_phase_legend_names_phases_the_first_point_lacks():
    """N=1 has no exposed communication; its bar at N=2 must still be named in the legend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ddp_lab.scale import outputs

    none = {"backward": 100.0, "exposed_comm": 0.0}
    one = _row("n1-ring", 1, none, none)
    two = _row("n2-ring", 2, {"backward": 100.0, "exposed_comm": 150.0},
               {"backward": 100.0, "exposed_comm": 50.0})
    fig, ax = plt.subplots()
    outputs._plot_phases(ax, [one, two])
    names = [t.get_text() for t in ax.get_legend().get_texts()]
    plt.close(fig)
    assert "exposed_comm" in names and len(names) == len(set(names))


def test_a_missing_fit_is_replaced_by_native_s_and_said_so():
    """The model never substitutes silently: a sync without a fit of its own is priced with the
    backend's native all-reduce's, and the row's note says so; DDP's own fit is native's."""
    from ddp_lab.perf.predict import fit_for

    native = fit.fit_alpha_beta(timings("native", [(0, 1e-4, 1e-9)]), 1)[("native", "gloo")]
    fits = {("native", "gloo"): native}
    assert fit_for(fits, "ddp", "gloo") == (native, "")
    got, note = fit_for(fits, "ring", "gloo")
    assert got is native and note == "priced with native's fit (none of ring on gloo)"
    assert fit_for({}, "ring", "gloo") == (None, "")


# predict.from_nproc: N=8 predicted from the measurements at N <= 4 only.
NUMELS = [1_000, 2_000_000, 10_000, 4_000_000]  # registration order; 4 MiB buckets: several


def _probe(n, k=1.2, bucket_ms=(1.0, 20.0, 0.5), slowdown=1.1):
    """A probe's result (interfere.py's OUT.json, `derived` only) of ring at world size n."""
    from ddp_lab.perf.probe import Probe

    buckets = step.bucket_layout(NUMELS[::-1], 4, 4.0, "ours")
    return Probe({"world_size": n, "param_numels": NUMELS, "derived": {
        "contention": dict.fromkeys(("forward", "backward", "guard", "optim", "step"), k),
        "skew": {"backward": 0.05, "guard": 0.1}, "store_ms": 0.1,
        "grad_ready": [0.9, 0.6, 0.3, 0.1],
        "ring": {"bucket_bytes": buckets, "bucket_ms": [list(bucket_ms)] * len(buckets),
                 "comm_ms": 1.0, "comm_loaded_ms": 1.0, "local_s_per_byte": 1e-10,
                 "compute_slowdown": slowdown, "forward_slowdown": 1.0,
                 "comm_slowdown": slowdown}}})


def _sweep_point(n):
    from ddp_lab.scale.sweep import Point

    t = {"step": 80.0 + 20 * n, "data": 1.0, "forward": 20.0, "backward": 40.0,
         "backward_local": 38.0, "comm": 6.0, "guard": 4.0, "optim": 10.0}
    return Point(f"n{n}-ring", n, "ring", "", "weak", 8, [], "", status="ok", config={
        "sync": {"comm_dtype": "fp32", "bucket_mb": 4.0, "zero": 0, "overlap": True}},
        summary={"time_ms": t, "train_img_per_s": 800.0 * n / t["step"], "backend": "gloo",
                 "parameters": sum(NUMELS)})


def _predict_n8(probes, fits, from_nproc):
    from ddp_lab.perf.predict import predict_rows
    from ddp_lab.scale import results

    points = [_sweep_point(n) for n in (1, 2, 4, 8)]
    rows = results.rows_from_points(points)
    predict_rows(rows, points, fits, probes, results.bases(points), from_nproc)
    return rows[-1]


def test_n8_extrapolated_from_n_up_to_4_reads_nothing_measured_at_8():
    """predict.from_nproc=[1,2,4]: a planted, absurd N=8 probe changes nothing at N=8, nor do
    the N=4 probe's bucket times (N=4's own), while its contention does; without the key the
    N=8 probe is what predicts N=8."""
    fits = fit.fit_alpha_beta(timings("ring", [(0, 1e-4, 1e-9)], (2, 4)), 1, (1, 2, 4))
    sane = {f"n{n}-ring": _probe(n) for n in (2, 4)}
    planted = {**sane, "n8-ring": _probe(8, k=50.0, bucket_ms=(9e3, 9e4, 9e3), slowdown=9.0)}
    listed = _predict_n8(planted, fits, (1, 2, 4))
    assert listed["pred_step_ms"] == _predict_n8(sane, fits, (1, 2, 4))["pred_step_ms"]
    assert listed["pred_step_ms"] < 1000 and listed["contention"] == 1.2
    assert "from N=[1, 2, 4] only" in listed["pred_note"]
    assert "interference of the N=4 probe" in listed["pred_note"]
    slow4 = {**planted, "n4-ring": _probe(4, bucket_ms=(9e3, 9e4, 9e3))}
    assert _predict_n8(slow4, fits, (1, 2, 4))["pred_step_ms"] == listed["pred_step_ms"]
    busy4 = {**planted, "n4-ring": _probe(4, k=2.0)}
    assert _predict_n8(busy4, fits, (1, 2, 4))["pred_step_ms"] > listed["pred_step_ms"]
    own = _predict_n8(planted, fits, ())
    assert own["pred_step_ms"] > 10 * listed["pred_step_ms"] and own["pred_note"] == ""


def test_the_fit_for_extrapolation_is_pooled_over_the_listed_world_sizes_only():
    """world_sizes=(1, 2, 4): absurd N=8 calibration rows are not read, and the fit is one pooled
    over N=2 and 4 (no fit per world size, which N=8 would lack), even where the table would
    rather have one per N; N=8 is priced through the formulas."""
    true = (0, 1e-4, 1e-9)
    rows = timings("ring", [true], (2, 4)) + [
        {**r, "time_us": r["time_us"] * 100} for r in timings("ring", [true], (8,))]
    f = fit.fit_alpha_beta(rows, 1, (1, 2, 4))[("ring", "gloo")]
    assert f.world_sizes == (2, 4) and not f.by_world_size and f.points == 2 * len(SIZES)
    assert f.time_s(64 * MIB, 8) == pytest.approx(cost("ring", 64 * MIB, 8).time(*true[1:]))
    assert fit.fit_alpha_beta(rows, 1)[("ring", "gloo")].world_sizes == (2, 4, 8)
    split = timings("ring", [true], (2, 4, 8), beta_of_n=lambda beta, n: beta * n)
    assert fit.fit_alpha_beta(split, 1)[("ring", "gloo")].by_world_size
    assert not fit.fit_alpha_beta(split, 1, (2, 4))[("ring", "gloo")].by_world_size


def test_from_nproc_is_checked_against_the_sweep_in_one_line():
    from ddp_lab.errors import ConfigError
    from ddp_lab.scale.config import check_from_nproc

    assert check_from_nproc([], [1, 2, 4, 8]) == ()
    assert check_from_nproc([4, 1, 2], [1, 2, 4, 8]) == (1, 2, 4)
    assert check_from_nproc([1, 2], [1, 2]) == (1, 2)  # nothing to extrapolate
    with pytest.raises(ConfigError, match=r"N=\[16\] not among the sweep's world sizes"):
        check_from_nproc([1, 2, 16], [1, 2, 4, 8])
    with pytest.raises(ConfigError, match=r"predicting N=\[4, 8\] needs at least 2"):
        check_from_nproc([1, 2], [1, 2, 4, 8])


def test_from_nproc_calibrates_and_probes_only_the_listed_world_sizes(monkeypatch, tmp_path):
    """The sweep's cost: no calibration and no probe at a world size outside the list; the
    probes of a kept sweep are found beside its points (collect=)."""
    from types import SimpleNamespace

    from ddp_lab.scale import app, sweep

    launched = []
    monkeypatch.setattr(app, "_launch", lambda cmd, env, out, t, what, say: launched.append(
        next(a for a in cmd if a.startswith("--nproc_per_node="))) or False)
    predict = SimpleNamespace(table="", calibrate=True, sizes_kb=[4], max_regimes=1, probe=True,
                              probe_rounds=1, timeout_s=1.0, from_nproc=[1, 2, 4])
    cfg = SimpleNamespace(predict=predict, syncs=["ring"])
    points = [_sweep_point(n) for n in (1, 2, 4, 8)]
    for p in points:
        p.run_dir = str(tmp_path / "points" / p.name)
    assert app._fits(cfg, points, str(tmp_path), "cpu", {}, print) == {}
    assert [app._probe(cfg, p, {}, print) for p in points] == [None] * 4
    assert launched == ["--nproc_per_node=2", "--nproc_per_node=4"] * 2
    assert sweep.probe_path(str(tmp_path / "points" / "n8-ring.r2")) == str(
        tmp_path / "interference" / "n8-ring.r2.json")


def test_the_calibration_runs_before_the_points(monkeypatch, tmp_path):
    """A sweep a time limit cuts short keeps its calibration: it is timed before any point
    (it ran after the last pass, so a cut sweep had nothing to predict its points from)."""
    from hydra import compose, initialize_config_dir

    from ddp_lab.cli import CONF_DIR, register_resolvers
    from ddp_lab.scale import app, launch
    from ddp_lab.scale.config import register_scale_config

    register_scale_config()
    register_resolvers()
    with initialize_config_dir(CONF_DIR, version_base=None):
        cfg = compose("scale", overrides=["nproc=[1,2]", "syncs=[ring]", "profile=cpu",
                                          "repeats=1", "predict.sizes_kb=[4]"])
    order = []
    monkeypatch.setattr(app, "_launch", lambda cmd, env, out, t, what, say: order.append(what))

    def point(p, *args, **kwargs):
        order.append(p.name)
        p.status, p.error = "failed", "not launched in this test"

    monkeypatch.setattr(launch, "launch", point)
    passes, _, _, _, fits = app.run_points(cfg, str(tmp_path), lambda *a: None)
    assert order == ["calibration at N=2", "n1-ring", "n2-ring"] and fits == {}
