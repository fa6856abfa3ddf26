"""The interference probe (ddp_lab/scale/interfere.py) on 2 CPU ranks (gloo): its slowdowns, its
samples, and what the model reads from it. The probes are the ones conftest.py's `scale_sweep` ran
at N=2, one per sync (2 rounds, nothing else running): n2-ddp.json times DDP's buckets with gloo's
own all-reduce (`native`), n2-ring.json ours with the ring."""

import json
import math
import statistics

import pytest

PROBES = {"native": "n2-ddp", "ring": "n2-ring"}  # algorithm -> the sweep point it was probed at


@pytest.fixture(scope="module")
def probes(scale_sweep):
    """Algorithm -> (the probe's JSON, its path)."""
    out, _ = scale_sweep
    paths = {algo: str(out / "interference" / f"{point}.json") for algo, point in PROBES.items()}
    def load(path):
        with open(path) as f:
            return json.load(f)

    return {algo: (load(path), path) for algo, path in paths.items()}


def test_probe_measures_slowdowns_with_its_samples(probes):
    for algo, (result, _) in probes.items():
        d = result["derived"]
        assert result["world_size"] == 2 and result["rounds"] == 2
        # Every rank's samples of every condition: one round each, after the warm-up round.
        assert len(result["samples"]) == 2 and all(len(rs) == 2 for rs in result["samples"])
        first = result["samples"][0][0]
        assert set(first["solo"]) == {"forward", "backward", "guard", "optim"}
        assert len(first[f"{algo}/comm"]) == len(d[algo]["bucket_bytes"])  # per bucket
        assert all(len(b) == 3 and min(b) >= 0 for b in first[f"{algo}/comm"])
        # The slowdowns as the module defines them, from rank 0's rounds. (Whether they exceed 1
        # is a measurement, noisy with 2 rounds on a busy host: the model floors them at 1.)
        rounds = result["samples"][0]
        med = lambda cond, key: statistics.median(r[cond][key] for r in rounds)
        comm = lambda cond: statistics.median(sum(map(sum, r[cond])) for r in rounds)
        assert d[algo]["compute_slowdown"] == pytest.approx(
            med(f"{algo}/bwd+comm", "backward") / med("all", "backward"))
        assert d[algo]["comm_slowdown"] == pytest.approx(
            comm(f"{algo}/comm+bwd") / comm(f"{algo}/comm"))
        assert d[algo]["local_s_per_byte"] > 0
        assert sum(d[algo]["bucket_bytes"]) == 4 * sum(result["param_numels"])
        assert all(k > 0 for k in d["contention"].values()) and d["skew"]["guard"] >= 0
        # Each gradient's readiness: fractions of backward, the classifier's before the first
        # conv's.
        ready = d["grad_ready"]
        assert len(ready) == len(result["param_numels"]) and all(0 <= f <= 1.05 for f in ready)
        assert ready[-1] < ready[0]
    # One model in both probes, so both syncs' buckets hold the same bytes.
    assert probes["native"][0]["param_numels"] == probes["ring"][0]["param_numels"]
    native = probes["native"][0]["derived"]["native"]
    assert native["bucket_bytes"][0] > 1 << 20  # DDP: its 1 MiB first bucket filled past it


def test_the_model_reads_and_pools_probes(probes):
    from ddp_lab.perf.probe import Probe

    result, path = probes["ring"]
    one, two = Probe.load(path), Probe.load(path, path)
    assert two.rounds == 2 * one.rounds
    for p in (one, two):
        inter = p.interference("ring")
        assert inter.compute >= 1 and inter.comm >= 1
        grads = p.grads()
        assert [n for n, _ in grads] == result["param_numels"][::-1]  # backward order
    # Pooling the same rounds twice changes no median.
    assert two.interference("ring") == one.interference("ring")
    assert two.k("backward") == pytest.approx(one.k("backward"))
    assert math.isnan(Probe.load(path).algos.get("tree", {}).get("comm_ms", math.nan))
