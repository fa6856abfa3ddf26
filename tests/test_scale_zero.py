"""ZeRO in the scaling model and the simulation, without launching anything: the halves of an
all-reduce priced from its fit, the step and bytes per stage, a sweep point's predicted optimizer
phase, and the simulation's ZeRO tables."""

import types

import pytest

from ddp_lab.config import ConfigError
from ddp_lab.perf import compute, fit, params, step
from ddp_lab.perf.collectives import cost

MIB = 1 << 20
FLAT = params.Network("flat", intra=params.Link.of(50.0, 2.0), gpus_per_node=8)


def _fit(algo="ring", alpha=100e-6, beta=1e-9):
    return fit.Fit(algo, "gloo", (fit.Regime(0.0, alpha, beta),), 1.0, 0.0, 10, (2, 4))


@pytest.mark.parametrize("algo", ["ring", "naive", "tree"])
@pytest.mark.parametrize("n", [2, 3, 4, 7])
def test_a_fit_prices_each_op_by_its_own_rounds_and_bytes(algo, n):
    f = _fit(algo)
    for op in ("reduce_scatter", "all_gather"):
        assert f.time_s(8 * MIB, n, op) == pytest.approx(
            cost(algo, 8 * MIB, n, op).time(100e-6, 1e-9), rel=1e-12)
    if algo == "ring":  # a ring all-reduce is one reduce-scatter and one all-gather
        halves = f.time_s(8 * MIB, n, "reduce_scatter") + f.time_s(8 * MIB, n, "all_gather")
        assert halves == pytest.approx(f.time_s(8 * MIB, n), rel=1e-12)


def test_given_networks_halve_the_ring_family_only():
    ib = params.PRESETS["ib400"]
    for algo in ("ring", "hring"):
        assert ib.collective_s("all_gather", algo, 64 * MIB, 16) == pytest.approx(
            ib.allreduce_s(algo, 64 * MIB, 16) / 2)
    assert ib.collective_s("all_reduce", "tree", MIB, 16) == ib.allreduce_s("tree", MIB, 16)
    with pytest.raises(ValueError, match="not 'naive'"):
        ib.collective_s("reduce_scatter", "naive", MIB, 16)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_stage_bytes_and_busy_time_on_a_ring(n):
    """Stage 2 moves what stage 0 does (reduce-scatter + all-gather = all-reduce), stage 1 half
    as much again; every stage's step is compute + exposed + the exposed all-gather."""
    g = 100 * MIB
    b0, b1, b2, b3 = (step.bytes_per_step("ring", g, n, z) for z in (0, 1, 2, 3))
    assert b2 == pytest.approx(b0) and b1 == pytest.approx(1.5 * b0)
    assert b3 == pytest.approx(1.5 * b0)  # the ZeRO paper's 1.5x: the parameters gathered twice
    assert step.bytes_per_step("ring", g, n, 3, reshard_after_forward=False) == pytest.approx(b0)
    assert step.bytes_per_step("naive", g, n, 2, param_bytes=2 * g) == pytest.approx(
        cost("naive", g, n, "reduce_scatter").bytes_per_rank
        + cost("naive", 2 * g, n, "all_gather").bytes_per_rank)
    profile = compute.profile_model("alexnet_cifar")
    kw = dict(forward_s=0.03, backward_s=0.06, other_s=0.01, bucket_mb=25.0)
    s0, s1, s2 = (step.predict_step(profile, FLAT, "ring", n, **kw, zero=z) for z in (0, 1, 2))
    assert s0.gather_s == 0 and s1.gather_s > 0 and s1.gather_s == pytest.approx(s2.gather_s)
    assert s2.busy_s == pytest.approx(s0.busy_s, rel=1e-9)
    assert s1.busy_s == pytest.approx(s0.busy_s + s1.gather_s, rel=1e-9)
    s3 = step.predict_step(profile, FLAT, "ring", n, **kw, zero=3)
    assert s3.gather_s == pytest.approx(2 * s2.gather_s) and s3.exposed_s == s2.exposed_s
    for s in (s0, s1, s2, s3):
        assert s.step_s == pytest.approx(0.1 + s.exposed_s + s.gather_s, rel=1e-12)
    assert s0.step_s < s2.step_s < s1.step_s  # nothing hides the all-gather


def _point(zero, n=2):
    """A sweep point with its resolved training config, as the sweep reads it from run_info.json."""
    from omegaconf import OmegaConf

    from helpers import compose_config

    config = OmegaConf.to_container(compose_config(["sync=ring", f"sync.zero={zero}"]),
                                    resolve=True)
    return types.SimpleNamespace(name=f"n{n}-ring", world_size=n, sync="ring", per_rank_batch=8,
                                 mode="weak", config=config)


def test_a_zero_point_updates_one_shard_then_gathers():
    from ddp_lab.perf import predict

    base = {"data_ms": 1.0, "forward_ms": 30.0, "backward_ms": 60.0, "sync_ms": 5.0,
            "guard_ms": 2.0, "optim_ms": 24.0, "other_ms": 1.0, "per_rank_batch": 8}
    row = {"model": "alexnet_cifar", "backend": "gloo"}
    fits = {("ring", "gloo"): _fit(), ("native", "gloo"): _fit("native")}
    p0 = predict.predict_phases(row, _point(0), base, fits, None)
    p2 = predict.predict_phases(row, _point(2), base, fits, None)
    gather = predict.gather_ms(row, _point(2), fits[("ring", "gloo")], None)
    buckets = predict._buckets(row, _point(2), None)
    assert gather == pytest.approx(1e3 * sum(_fit().time_s(b.nbytes, 2, "all_gather")
                                             for b in buckets))
    assert p0["pred_optim_ms"] == 24.0 and p0["pred_gather_ms"] == 0.0
    assert p2["pred_optim_ms"] == pytest.approx(24.0 / 2 + gather)
    assert p2["pred_gather_ms"] == pytest.approx(gather)
    assert p2["pred_guard_ms"] - p0["pred_guard_ms"] == pytest.approx(-2.0 / 2)  # one shard
    assert p2["pred_exposed_comm_ms"] < p0["pred_exposed_comm_ms"]  # half the bytes in backward
    assert predict.gather_ms(row, _point(2, n=1), fits[("ring", "gloo")], None) == 0.0
    three = _point(3)  # each unit gathered before forward and again before backward
    assert predict.gather_ms(row, three, fits[("ring", "gloo")], None) == pytest.approx(2 * gather)
    three.config["sync"]["reshard_after_forward"] = False
    assert predict.gather_ms(row, three, fits[("ring", "gloo")], None) == pytest.approx(gather)


def _sim(**kw):
    from ddp_lab.scale.config import SimConfig

    return types.SimpleNamespace(**{**SimConfig().__dict__, **kw})


def test_the_simulation_says_which_stage_fits_and_what_it_costs(tmp_path):
    from ddp_lab.perf import simulate
    from ddp_lab.scale.config import check_sim
    from ddp_lab.scale.sim_report import zero_memory_rows

    sim = _sim(world_sizes=[8, 64], zero_params_b=[7.0, 70.0])
    rows = {r["params"]: r for r in zero_memory_rows(FLAT, "ring", sim)}
    # 7 B: 112 GB unsharded; stage 1 keeps 4 B/param whole (28 GB) and shards 12 B/param
    assert rows["7 B"]["zero=0"] == "never" and rows["7 B"]["zero=1"].startswith("2; at 8: ")
    assert rows["70 B"]["zero=2"] == "never" and rows["70 B"]["zero=3"].startswith("14; at 16: ")
    steps = simulate.zero_step_rows(FLAT, "ring", {"alexnet_cifar": 0.02}, sim,
                                    params.NO_INTERFERENCE)
    assert len(steps) == 4 * 2
    eff = {(r["zero"], r["world_size"]): r["efficiency"] for r in steps}
    for n in (8, 64):
        assert eff[(1, n)] < eff[(2, n)] <= 1.0 and eff[(0, n)] <= 1.0
        # stage 3 = stage 2 + one more exposed gather; on a ring it is at best stage 1 (whose
        # all-reduce is a reduce-scatter + a gather, partly hidden by backward)
        assert eff[(3, n)] < eff[(2, n)] and eff[(3, n)] <= eff[(1, n)] * (1 + 1e-12)
    state = {(r["zero"], r["world_size"]): r["state_GB_per_gpu"] for r in steps}
    assert state[(3, 64)] < state[(2, 64)] < state[(1, 64)] < state[(0, 64)] == state[(0, 8)]
    with pytest.raises(ConfigError, match="sim.zero_stages"):
        check_sim(_sim(zero_stages=[0, 4]))
    with pytest.raises(ConfigError, match="sim.gpu_gb"):
        check_sim(_sim(gpu_gb=0))
