"""The performance model on its own (no processes): the alpha-beta fit against known synthetic
timings (perf/fit.py), the two-level ring's cost and the given networks (perf/collectives.py,
perf/params.py), model profiles (perf/compute.py), buckets and overlap (perf/step.py), the
simulation's shape (perf/simulate.py)."""

import math
import random

import pytest

from ddp_lab.perf import compute, fit, params, simulate, step
from ddp_lab.perf.collectives import cost, hierarchical_cost
from ddp_lab.tables import write_rows

MIB = 1 << 20

SIZES = [2 ** k for k in range(10, 29, 2)]  # 1 KiB ... 256 MiB


def synthetic_rows(algo, alpha, beta, world_sizes=(2, 4, 8), noise=0.0, backend="gloo", seed=0):
    rng = random.Random(seed)
    rows = []
    for n in world_sizes:
        for s in SIZES:
            t = cost(algo, s, n).time(alpha, beta) * (1 + noise * rng.uniform(-1, 1))
            rows.append({"algo": algo, "backend": backend, "world_size": n, "dtype": "float32",
                         "bytes": s, "time_us": t * 1e6, "algbw_GBps": 0.0, "busbw_GBps": 0.0,
                         "wrong": 0})
    return rows


@pytest.mark.parametrize("algo", ["naive", "ring", "tree", "native"])
@pytest.mark.parametrize("noise", [0.0, 0.03])
def test_fit_recovers_known_alpha_and_beta(algo, noise):
    alpha, beta = 25e-6, 1 / 10e9  # 25 us per round, 10 GB/s
    fits = fit.fit_alpha_beta(synthetic_rows(algo, alpha, beta, noise=noise, seed=1))
    f = fits[(algo, "gloo")]
    tol = 1e-6 if noise == 0 else 0.1
    assert f.alpha_s == pytest.approx(alpha, rel=tol)
    assert f.beta_s_per_byte == pytest.approx(beta, rel=tol)
    assert f.r2 > 0.99 and f.points == 3 * len(SIZES) and f.world_sizes == (2, 4, 8)
    assert f.time_s(1 << 20, 4) == pytest.approx(cost(algo, 1 << 20, 4).time(alpha, beta), rel=tol)


def test_fit_is_non_negative_and_per_backend():
    # Pure bandwidth (alpha = 0) plus noise pulls an unconstrained alpha below zero.
    rows = synthetic_rows("ring", 0.0, 1 / 5e9, noise=0.05, seed=3)
    rows += synthetic_rows("ring", 10e-6, 1 / 100e9, backend="nccl")
    fits = fit.fit_alpha_beta(rows)
    assert set(fits) == {("ring", "gloo"), ("ring", "nccl")}
    assert fits[("ring", "gloo")].alpha_s >= 0 and fits[("ring", "gloo")].beta_s_per_byte > 0
    assert fits[("ring", "nccl")].bandwidth_GBps == pytest.approx(100, rel=1e-6)


def test_fit_skips_wrong_rows_and_world_size_one(tmp_path):
    rows = synthetic_rows("ring", 20e-6, 1 / 8e9)
    bad = dict(rows[0], time_us=1e9, wrong=3)
    lone = dict(rows[1], world_size=1, time_us=1e9)
    write_rows(rows + [bad, lone], tmp_path, "allreduce")
    for name in ("allreduce.jsonl", "allreduce.csv"):  # the benchmark's two formats read alike
        table = fit.read_table(str(tmp_path / name))
        f = fit.fit_alpha_beta(table)[("ring", "gloo")]
        assert f.points == len(rows)
        assert f.alpha_s == pytest.approx(20e-6, rel=1e-6)


def test_two_level_ring_cost():
    s = 1e6
    intra, inter = hierarchical_cost(s, 8, 1)
    assert (intra.steps, inter.steps) == (cost("ring", s, 8).steps, 0)
    assert intra.critical_bytes == pytest.approx(cost("ring", s, 8).critical_bytes)
    intra, inter = hierarchical_cost(s, 8, 4)
    assert intra.steps == 14 and inter.steps == 6
    assert inter.critical_bytes == pytest.approx(2 * 3 / 4 * s)  # through each node's link
    # All ranks together move what a flat all-reduce moves: 2(N-1) S.
    assert intra.total_bytes + inter.total_bytes == pytest.approx(2 * (32 - 1) * s)


def test_networks():
    ib = params.PRESETS["ib100"]
    s = 64 * MIB
    # Inside one node every algorithm is its single-level cost on NVLink.
    assert ib.allreduce_s("ring", s, 8) == pytest.approx(
        cost("ring", s, 8).time(params.NVLINK.alpha_s, params.NVLINK.beta_s_per_byte))
    assert ib.allreduce_s("ring", s, 8) == ib.allreduce_s("hring", s, 8)
    # Across nodes: the two-level ring pays fewer slow latencies than the flat ring.
    assert ib.allreduce_s("hring", s, 1024) < ib.allreduce_s("ring", s, 1024)
    # naive grows linearly with N; ring stays ~flat for big messages.
    assert ib.allreduce_s("naive", s, 128) > 7 * ib.allreduce_s("naive", s, 16)
    assert ib.allreduce_s("ring", s, 128) < 1.3 * ib.allreduce_s("ring", s, 16)  # + latency
    # Small messages on many ranks: tree's log2(N) rounds beat the ring's 2(N-1).
    assert ib.allreduce_s("tree", 4096, 1024) < ib.allreduce_s("ring", 4096, 1024)
    assert ib.allreduce_s("tree", s, 1024) > ib.allreduce_s("hring", s, 1024)
    with pytest.raises(ValueError):
        ib.allreduce_s("ring", s, 12)  # not a whole number of 8-GPU nodes


def test_measured_network_uses_the_fits():
    fits = fit.fit_alpha_beta(synthetic_rows("native", 50e-6, 1 / 1e9))
    m = params.measured_network(fits, "gloo")
    assert m.algos() == ["native"]
    assert m.allreduce_s("ring", 1e6, 4) == pytest.approx(cost("ring", 1e6, 4).time(50e-6, 1e-9))
    assert params.measured_network(fits, "nccl") is None
    assert m.source == "native: measured: alpha-beta fit of 30 gloo timings at N=2,4,8"


def test_every_given_link_says_where_it_comes_from():
    for name, network in params.PRESETS.items():
        links = [link for link in (network.intra, network.inter) if link is not None]
        assert links and all(link.source.startswith(("given: ", "reconstructed: "))
                             for link in links), name
    assert "NVLink ~370 GB/s" in params.PRESETS["ib400"].source
    assert "inter: given: 400 Gb/s InfiniBand" in params.PRESETS["ib400"].source


@pytest.mark.parametrize("name, params_m", [("alexnet", 61.10), ("alexnet_cifar", 23.27),
                                            ("resnet50", 25.56), ("vgg16", 138.36)])
def test_model_profiles(name, params_m):
    p = compute.profile_model(name)
    assert p.parameters / 1e6 == pytest.approx(params_m, abs=0.01)
    grads = p.gradients_in_backward_order()
    fracs = [f for _, f in grads]
    assert fracs == sorted(fracs) and fracs[-1] == pytest.approx(1.0)
    assert sum(n for n, _ in grads) == p.parameters
    if name == "resnet50":  # 4.1 GMAC = 8.2 GFLOP per image forward
        assert p.flops_per_image / 1e9 == pytest.approx(8.2, rel=0.02)
    if name == "alexnet":  # the FC layers: most bytes, ready within the first few % of backward
        assert sum(n for n, f in grads if f < 0.1) > 0.9 * p.parameters


def test_buckets_and_overlap():
    p = compute.profile_model("alexnet")
    buckets = step.make_buckets(p, 25, 4)
    assert sum(b.nbytes for b in buckets) == 4 * p.parameters
    largest_param = max(n for layer in p.layers for n in layer.params) * 4
    assert all(b.nbytes < 25 * MIB + largest_param for b in buckets)
    assert [b.ready for b in buckets] == sorted(b.ready for b in buckets)
    assert len(step.make_buckets(p, 0, 4)) == 1
    assert step.make_buckets(p, 25, 4, first_bucket_mb=1)[0].nbytes < 25 * MIB
    t = lambda nbytes: nbytes / 1e9  # 1 GB/s, no latency
    busy = sum(t(b.nbytes) for b in buckets)
    exposed_off, busy_off = step.exposed_comm_s(buckets, 0.1, t, overlap=False)
    assert exposed_off == pytest.approx(busy) and busy_off == pytest.approx(busy)
    exposed_on, _ = step.exposed_comm_s(buckets, 0.1, t, overlap=True)
    assert 0 <= exposed_on < exposed_off
    # Only the last bucket is ready at the end: with a long backward only it stays exposed.
    exposed_long, _ = step.exposed_comm_s(buckets, 100.0, t, overlap=True)
    assert exposed_long == pytest.approx(t(buckets[-1].nbytes))


def test_bytes_per_step_matches_the_cost_model():
    g = 4 * 23_272_266
    assert step.bytes_per_step("ddp", g, 2) == pytest.approx(g)  # 2(N-1)/N = 1 at N=2
    assert step.bytes_per_step("ring", g, 4) == pytest.approx(1.5 * g)
    assert step.bytes_per_step("naive", g, 4) == pytest.approx(3 * g)  # rank 0 sends to 3
    assert step.bytes_per_step("tree", g, 4) == pytest.approx(2 * g)  # rank 0: 2 broadcast rounds


def test_simulation_shows_what_the_issue_asks():
    times = {"alexnet": 256 / 12000, "resnet50": 256 / 3000}
    rows = simulate.simulate(times, [params.PRESETS["ib100"]], [8, 64, 512], ["fp32", "bf16"],
                             [1.0, 25.0], batch_per_gpu=256)
    get = lambda **kw: next(r for r in rows if all(r[k] == v for k, v in kw.items()))
    assert all(0 < r["efficiency"] <= 1 + 1e-9 for r in rows)
    common = dict(model="alexnet", grad_dtype="fp32", bucket_mb=25.0)
    naive = [get(algo="naive", world_size=n, **common)["efficiency"] for n in (8, 64, 512)]
    assert naive == sorted(naive, reverse=True) and naive[-1] < 0.1  # naive collapses
    for n in (64, 512):  # AlexNet scales worse than ResNet-50; bf16 gradients help it
        for algo in ("hring", "ring"):
            a = get(algo=algo, world_size=n, **common)["efficiency"]
            r = get(algo=algo, world_size=n, model="resnet50", grad_dtype="fp32",
                    bucket_mb=25.0)["efficiency"]
            assert a < r
        assert get(algo="hring", world_size=n, model="alexnet", grad_dtype="bf16",
                   bucket_mb=25.0)["efficiency"] > get(algo="hring", world_size=n, **common)["efficiency"]
    # Small buckets on many ranks: the tree beats the flat ring.
    assert get(algo="tree", world_size=512, model="resnet50", grad_dtype="bf16", bucket_mb=1.0)[
        "efficiency"] > get(algo="ring", world_size=512, model="resnet50", grad_dtype="bf16",
                            bucket_mb=1.0)["efficiency"]
    r = get(algo="ring", world_size=64, **common)
    assert r["img_per_s"] == pytest.approx(64 * 256 / (r["step_ms"] / 1e3))
    assert r["efficiency"] == pytest.approx(r["compute_ms"] / r["step_ms"])
    assert not math.isnan(r["exposed_comm_ms"])


def test_simulation_band_brackets_the_assumed_interference():
    """Each simulated efficiency comes with the band's ends: no slowdown (the most) and
    sim.interference_band[1] on both sides (the least), the assumption in between; where
    nothing overlaps (one bucket, after backward) the three agree."""
    from ddp_lab.scale.config import SimConfig

    sim = SimConfig(world_sizes=[8, 64], grad_dtypes=["fp32"])
    times = {"alexnet": 256 / 12000}
    rows = simulate.simulate_with_band(sim, times, [params.PRESETS["ib100"]], [25.0, 0.0],
                                       {"alexnet": "assumed"})
    assert rows and all(r["efficiency_lo"] <= r["efficiency"] <= r["efficiency_hi"] for r in rows)
    assert any(r["efficiency_hi"] - r["efficiency_lo"] > 0.01
               for r in rows if r["bucket_mb"] == 25.0)
    assert all(r["efficiency_lo"] == pytest.approx(r["efficiency_hi"])
               for r in rows if r["bucket_mb"] == 0.0)
