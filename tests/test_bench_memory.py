"""Memory-bandwidth benchmark on the CPU: bytes counted as read + written, rows consistent."""

import pytest

from background import background
from helpers import bench_rows
from launchers import ranks


@background(cost=5)
def host_copy(run_dir):
    return ranks(["device=cpu", "cpu_sizes_mb=[1,8]", "iters=3", "plot=true",
                  f"hydra.run.dir={run_dir}"], nproc=0, module="ddp_lab.bench.memory",
                 timeout=120), run_dir


def test_cli_host_copy_rows(host_copy):
    proc, run_dir = host_copy
    rows = bench_rows(proc, run_dir, "memory")
    assert [(r["kind"], r["size_mb"]) for r in rows] == [
        ("host_copy", 1), ("host_copy_1t", 1), ("host_copy", 8), ("host_copy_1t", 8)]
    for r in rows:
        assert r["ok"]
        assert r["bytes_counted"] == 2 * r["size_mb"] * 1e6  # read + write
        assert r["gbs"] == pytest.approx(r["bytes_counted"] / (r["time_ms"] / 1e3) / 1e9, rel=1e-9)
