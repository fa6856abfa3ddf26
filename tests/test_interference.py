"""The interference probe (ddp_lab/scale/interfere.py) on 2 CPU ranks (gloo): its slowdowns, its
samples, and what the model reads from it."""

import json
import math

import pytest

from helpers import check, torchrun

POINT = ["model=alexnet_cifar", "data=synthetic", "precision=fp32", "data.num_samples=64",
         "data.val_samples=16", "train.batch_size=4", "sync=ring", "sync.bucket_mb=25"]


@pytest.fixture(scope="module")
def probe(tmp_path_factory, quiet_machine):
    out = tmp_path_factory.mktemp("probe") / "probe.json"
    proc = torchrun([str(out), "--algos", "native,ring", "--rounds", "2", "--", *POINT], nproc=2,
                    timeout=300, module="ddp_lab.scale.interfere",
                    extra_env={"OMP_NUM_THREADS": "1"})
    check(proc)
    with open(out) as f:
        return json.load(f), str(out)


@pytest.mark.slow
def test_probe_measures_slowdowns_with_its_samples(probe):
    result, path = probe
    d = result["derived"]
    assert result["world_size"] == 2 and result["rounds"] == 2
    # Every rank's samples of every condition: one round each, after the warm-up round.
    assert len(result["samples"]) == 2 and all(len(rs) == 2 for rs in result["samples"])
    first = result["samples"][0][0]
    assert set(first["solo"]) == {"forward", "backward", "guard", "optim"}
    for algo in ("native", "ring"):
        assert len(first[f"{algo}/comm"]) == len(d[algo]["bucket_bytes"])  # per bucket
        assert all(len(b) == 3 and min(b) >= 0 for b in first[f"{algo}/comm"])
        # Two ranks on two shared cores: compute and communication slow each other down.
        assert d[algo]["compute_slowdown"] >= 1 and d[algo]["comm_slowdown"] >= 1, d[algo]
        assert d[algo]["local_s_per_byte"] > 0
    assert d["native"]["bucket_bytes"][0] > 1 << 20  # DDP: its 1 MiB first bucket filled past it
    assert sum(d["ring"]["bucket_bytes"]) == sum(d["native"]["bucket_bytes"]) == 4 * sum(
        result["param_numels"])
    assert all(k > 0 for k in d["contention"].values()) and d["skew"]["guard"] >= 0
    # Each gradient's readiness: fractions of backward, the classifier's before the first conv's.
    ready = d["grad_ready"]
    assert len(ready) == len(result["param_numels"]) and all(0 <= f <= 1.05 for f in ready)
    assert ready[-1] < ready[0]


@pytest.mark.slow
def test_the_model_reads_and_pools_probes(probe):
    from ddp_lab.scale.predict import Probe

    result, path = probe
    one, two = Probe.load(path), Probe.load(path, path)
    assert two.rounds == 2 * one.rounds
    for p in (one, two):
        inter = p.interference("ring")
        assert inter.compute >= 1 and inter.comm >= 1
        grads = p.grads()
        assert [n for n, _ in grads] == result["param_numels"][::-1]  # backward order
    # Pooling the same rounds twice changes no median.
    assert two.interference("native") == one.interference("native")
    assert two.k("backward") == pytest.approx(one.k("backward"))
    assert math.isnan(Probe.load(path).algos.get("tree", {}).get("comm_ms", math.nan))
