"""python -m ddp_lab.bench.allreduce: a real 2-rank gloo run through torchrun itself (every
algorithm's entry point, as a user starts it), its rows and files."""

import csv
import json
import os

import pytest

from background import background
from helpers import check, compose_config
from launchers import python_module, torchrun

COLUMNS = ["algo", "backend", "world_size", "dtype", "bytes", "time_us", "algbw_GBps",
           "busbw_GBps", "wrong"]


@background(cost=15)
def two_gloo_ranks(run_dir):
    return torchrun(["max_bytes=32768", "factor=8", "iters=2", "warmup=1",
                     f"hydra.run.dir={run_dir}"], module="ddp_lab.bench.allreduce",
                    timeout=180), run_dir


@background(cost=4)
def bad_option(run_dir):
    return python_module(["algos=[ring,fast]", f"hydra.run.dir={run_dir}"],
                         module="ddp_lab.bench.allreduce", timeout=50)


@pytest.mark.timeout(300)
def test_two_gloo_ranks_write_one_checked_row_per_algo_size_dtype(two_gloo_ranks):
    proc, run_dir = two_gloo_ranks
    check(proc)
    rows = [json.loads(line) for line in open(run_dir / "allreduce.jsonl")]
    sizes = [8, 64, 512, 4096, 32768]
    assert len(rows) == 5 * len(sizes) * 2
    for r in rows:
        assert list(r) == COLUMNS  # exactly these keys, in this order: the scaling model reads them
        assert r["backend"] == "gloo" and r["world_size"] == 2 and r["wrong"] == 0, r
        assert r["time_us"] > 0 and abs(r["busbw_GBps"] - r["algbw_GBps"]) < 1e-12  # 2(N-1)/N = 1
        assert r["algbw_GBps"] == pytest.approx(r["bytes"] / (r["time_us"] * 1e-6) / 1e9)
    assert {(r["algo"], r["dtype"], r["bytes"]) for r in rows} == {
        (a, d, s) for a in ("naive", "ring", "tree", "hring", "native")
        for d in ("float32", "bfloat16")
        for s in sizes}
    with open(run_dir / "allreduce.csv") as f:
        assert len(list(csv.DictReader(f))) == len(rows)
    assert os.path.getsize(run_dir / "allreduce_busbw.png") > 0
    assert "busbw_GBps" in proc.stdout and "all results correct" in proc.stdout
    # no size reaches 1 MiB: no ratio lines, and the target is stated but not judged
    assert " / native, " not in proc.stdout
    assert ("target: ring busbw >= 0.95x native at >= 64 MiB, fp32: not measured in this run"
            in proc.stdout)


def _row(algo, nbytes, time_us, dtype="float32"):
    return {"algo": algo, "backend": "gloo", "world_size": 2, "dtype": dtype, "bytes": nbytes,
            "time_us": time_us, "algbw_GBps": nbytes / time_us / 1e3,
            "busbw_GBps": nbytes / time_us / 1e3, "wrong": 0}


def test_ratio_lines_and_the_target_verdict():
    from ddp_lab.bench.allreduce import ratio_lines, target_line

    MiB = 1 << 20
    rows = [_row("native", 512 * 1024, 10.0), _row("ring", 512 * 1024, 30.0),
            _row("native", MiB, 100.0), _row("ring", MiB, 150.0), _row("tree", MiB, 50.0),
            _row("native", 64 * MiB, 1000.0), _row("ring", 64 * MiB, 1050.0),
            _row("native", 128 * MiB, 2000.0), _row("ring", 128 * MiB, 2000.0),
            _row("ring", 128 * MiB, 9999.0, dtype="bfloat16")]  # no native bf16 row: no ratio
    lines = ratio_lines(rows)
    assert lines[0].startswith("ring / native, float32 1 MiB: time 1.500 (busbw ")
    assert lines[1].startswith("tree / native, float32 1 MiB: time 0.500")
    assert [line.split(":")[0] for line in lines[2:]] == [
        "ring / native, float32 64 MiB", "ring / native, float32 128 MiB"]
    # busbw ratio = native time / ring time: 1000/1050 = 0.952 >= 0.95 at 64 MiB, 1.0 at 128 MiB
    assert target_line(rows) == ("target: ring busbw >= 0.95x native at >= 64 MiB, fp32: holds "
                                 "(0.952x at 64 MiB, 1.000x at 128 MiB)")
    rows[6] = _row("ring", 64 * MiB, 1100.0)  # 0.909x
    assert "fp32: does NOT hold (0.909x at 64 MiB, 1.000x at 128 MiB)" in target_line(rows)
    assert "not measured in this run" in target_line(rows[:5])


def test_config_and_size_sweep():
    from ddp_lab.bench import allreduce

    cfg = compose_config([], config_name="bench/allreduce")
    assert list(cfg.algos) == ["naive", "ring", "tree", "hring", "native"]
    assert list(cfg.dtypes) == ["float32", "bfloat16"]
    gloo, nccl = allreduce.sizes(cfg, "gloo"), allreduce.sizes(cfg, "nccl")
    assert gloo[0] == 8 and gloo[-1] == 128 << 20 and nccl[-1] == 1 << 30
    assert all(b == a * 2 for a, b in zip(nccl, nccl[1:])) and 64 << 20 in gloo


@pytest.mark.timeout(300)
def test_a_bad_option_is_one_line_and_exit_2(bad_option):
    assert bad_option.returncode == 2, bad_option.stderr[-2000:]
    assert bad_option.stderr.strip() == ("error: algos: 'fast' is not one of naive, ring, tree, "
                                         "hring, native")
