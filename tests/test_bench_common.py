import csv
import json
import os

import pytest

from ddp_lab.bench.common import plot_lines
from ddp_lab.metrics import time_fn
from ddp_lab.perf.collectives import bus_bandwidth, cost
from ddp_lab.tables import format_table, write_rows
from background import background
from launchers import REPO, run_cmd


def test_time_fn_returns_median_of_calls():
    calls = []
    t = time_fn(lambda: calls.append(1), "cpu", warmup=2, iters=5)
    assert len(calls) == 7 and 0 <= t < 0.1


def test_rows_round_trip_and_table(tmp_path):
    rows = [{"size": 1, "t": 0.5}, {"size": 2, "t": 0.25, "extra": "x"}]
    jsonl, csv_path = write_rows(rows, tmp_path, "r")
    assert [json.loads(l) for l in open(jsonl)] == rows
    assert list(csv.DictReader(open(csv_path)))[1]["extra"] == "x"
    table = format_table(rows, ["size", "t"])
    assert table.splitlines()[0].split() == ["size", "t"] and "0.25" in table
    assert plot_lines({"a": ([1, 2], [3, 4])}, str(tmp_path / "p.png"), xlabel="x", ylabel="y")


@pytest.mark.parametrize("n", [2, 3, 4, 5, 8, 1024])
def test_all_algorithms_move_the_same_total(n):
    for algo in ("naive", "ring", "tree"):
        assert cost(algo, 1000, n).total_bytes == 2 * (n - 1) * 1000


def test_cost_shapes():
    assert cost("ring", 800, 8).bytes_per_rank == pytest.approx(2 * 7 / 8 * 800)
    assert cost("ring", 800, 8).steps == 14
    assert cost("tree", 800, 5).steps == 6 and cost("tree", 800, 5).bytes_per_rank == 2400
    assert cost("naive", 800, 4).critical_bytes == 6 * 800 and cost("naive", 800, 4).steps == 2
    assert cost("ring", 800, 1) == cost("tree", 0, 4)  # nothing to do
    with pytest.raises(ValueError, match="unknown all-reduce"):
        cost("butterfly", 1, 2)
    algbw, busbw = bus_bandwidth(1e9, 0.5, 4)
    assert algbw == 2e9 and busbw == pytest.approx(3e9)


@background(cost=5)
def plot_results(out):
    """scripts/plot_results.py on a copy of the committed H200 outputs (PNGs left out)."""
    import glob
    import shutil
    import sys

    (out / "r").mkdir()
    for pattern in ("h200-loop-vs-bare/loop_vs_bare_*.csv",
                    "h200-real-vs-synthetic/train_*_g*.json"):
        for path in glob.glob(os.path.join(REPO, "docs", "results", pattern)):
            shutil.copy(path, out / "r")
    return run_cmd([sys.executable, os.path.join(REPO, "scripts", "plot_results.py"),
                    str(out / "r")], 120), out


def test_plot_results_draws_both_plots_from_the_recorded_device_outputs(plot_results):
    """scripts/plot_results.py on a copy of the committed H200 outputs: both PNGs, one bar
    group per row of the benchmark CSVs."""
    proc, out = plot_results
    assert proc.returncode == 0, proc.stderr
    for name in ("loop_vs_bare.png", "real_vs_synthetic.png"):
        assert (out / "r" / name).stat().st_size > 10_000
    rows = sum(len(list(csv.DictReader(open(p)))) for p in (out / "r").glob("*.csv"))
    assert rows == 8


def test_plot_bars_draws_groups_with_a_missing_bar(tmp_path):
    from ddp_lab.bench.common import plot_bars

    path = plot_bars({"a": {"x": 1.0, "y": 2.0}, "b": {"x": 3.0}}, str(tmp_path / "p.png"),
                     ylabel="v", title="t")
    assert os.path.getsize(path) > 5_000
