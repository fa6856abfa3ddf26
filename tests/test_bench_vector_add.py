"""Vector-add benchmark on the CPU with tiny sizes, and the crossover rule."""

import json

import pytest

from ddp_lab.bench.vector_add import VectorAddConfig, crossover, size_list
from background import background
from helpers import bench_rows
from launchers import ranks


@background(cost=6)
def vector_add(run_dir):
    return ranks(["device=cpu", "sizes=[1000,100000]", "iters=2", "plot=true",
                  f"hydra.run.dir={run_dir}"], nproc=0, module="ddp_lab.bench.vector_add",
                 timeout=120), run_dir


def test_cli_rows_are_consistent(vector_add):
    proc, run_dir = vector_add
    rows = bench_rows(proc, run_dir, "vector_add")
    assert [r["n"] for r in rows] == [1000, 100000]
    for r in rows:
        assert r["ok"] and r["cpu_ms"] > 0 and r["cpu1_ms"] > 0
        assert r["cpu_gbs"] == pytest.approx(12 * r["n"] / (r["cpu_ms"] / 1e3) / 1e9, rel=1e-9)
        assert r["mb"] == pytest.approx(12 * r["n"] / 1e6)
        assert "gpu_kernel_ms" not in r  # no GPU here
    info = json.load(open(run_dir / "vector_add_info.json"))
    assert info["provenance"]["device"] == "cpu"


def test_crossover_is_where_the_gpu_stays_faster():
    sizes = [1e3, 1e4, 1e5, 1e6]
    assert crossover(sizes, [1, 1, 1, 1], [5, 2, 0.5, 0.1]) == "1e+05"
    assert crossover(sizes, [1, 1, 1, 1], [0.5, 2, 0.5, 0.5]) == "1e+05"  # not the first dip
    assert crossover(sizes, [1, 1, 1, 1], [2, 2, 2, 2]) == "none"
    assert crossover(sizes, [1, 1, 1, 1], [0.5, 0.5, 0.5, 0.5]) == "<= 1e+03"
    assert crossover(sizes, [1, 1, 1, 1], [0.5, 0.5, 0.5, 2]) == "none"  # loses at the top


def test_default_sizes_per_device():
    import torch

    cfg = VectorAddConfig()
    cpu = size_list(cfg, torch.device("cpu"))
    assert cpu[0] == 1000 and cpu[-1] == 10**7 and len(cpu) == 9
    assert size_list(cfg, torch.device("cuda"))[-1] == 10**9
