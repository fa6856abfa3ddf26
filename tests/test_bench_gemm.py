"""GEMM benchmark on the CPU with tiny sizes: the CLI runs, writes its files, and every row is
self-consistent (TFLOP/s recomputed from the row) and checked against float64."""

import json
import os

import pytest
import torch

from ddp_lab.bench import gemm
from background import background
from helpers import bench_rows
from launchers import ranks


@background(cost=5)
def gemm_on_the_cpu(out):
    return ranks(["device=cpu", "cpu_sizes=[64,96]", "cpu_dtypes=[fp32,tf32,bf16]",
                  "numpy_compare=true", "numpy_n=128", "numpy_single_thread_n=64",
                  "plot=true", f"hydra.run.dir={out}"], nproc=0, module="ddp_lab.bench.gemm",
                 timeout=120), out


@background(cost=4)
def gemm_cuda_without_a_gpu(_):
    """Launched only where its test runs: without a GPU (background.py skips a skipped test's)."""
    return ranks(["device=cuda"], nproc=0, module="ddp_lab.bench.gemm", timeout=60)


@pytest.fixture(scope="module")
def run_dir(gemm_on_the_cpu):
    proc, out = gemm_on_the_cpu
    bench_rows(proc, out, "gemm")  # printed, written and drawn
    return out


def rows(path):
    return [json.loads(line) for line in open(path)]


def test_files_and_self_consistent_rows(run_dir):
    for f in ("gemm.jsonl", "gemm.csv", "gemm.png", "gemm_info.json", "numpy_vs_gpu.jsonl"):
        assert os.path.exists(run_dir / f), f
    rs = rows(run_dir / "gemm.jsonl")
    assert {(r["dtype"], r["n"]) for r in rs} == {("fp32", 64), ("fp32", 96), ("bf16", 64),
                                                   ("bf16", 96)}  # tf32 skipped on the CPU
    for r in rs:
        assert r["device"] == "cpu" and r["ok"]
        assert r["tflops"] == pytest.approx(2 * r["n"] ** 3 / (r["time_ms"] / 1e3) / 1e12, rel=1e-9)
        assert 0 < r["rel_err"] <= gemm.TOLERANCE[r["dtype"]]
    fp32 = [r["rel_err"] for r in rs if r["dtype"] == "fp32"]
    assert max(fp32) < 1e-5  # true fp32, not TF32-like error
    np_rows = rows(run_dir / "numpy_vs_gpu.jsonl")
    assert np_rows[0]["speedup_vs_numpy"] == 1.0 and np_rows[0]["n"] == 128


def test_float64_check_catches_a_wrong_result():
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(64, 64), torch.randn(64, 64)
    good = a @ b
    assert gemm.relative_error(a, b, good, 16, gen) < gemm.TOLERANCE["fp32"]
    wrong = good.clone()
    wrong[:, 0] = 0  # one column lost
    assert gemm.relative_error(a, b, wrong, 64, gen) > gemm.TOLERANCE["bf16"]
    tf32_like = (a.bfloat16().float() @ b.bfloat16().float())  # reduced-precision inputs
    assert gemm.relative_error(a, b, tf32_like, 64, gen) > gemm.TOLERANCE["fp32"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error")
def test_cuda_without_a_gpu_is_one_clear_line(gemm_cuda_without_a_gpu):
    proc = gemm_cuda_without_a_gpu
    assert proc.returncode == 2 and "error: device=cuda" in proc.stderr
