"""scripts/gpu_bench.sh's own logic on the CPU (SMOKE=1: tiny sizes, not a measurement): ONLY=
runs the named steps, refuses names it does not know, and the summary shows this run's results,
not what an earlier run left in the output folder."""

import json
import os
import sys

from background import background
from launchers import REPO, run_cmd

SCRIPT = os.path.join(REPO, "scripts", "gpu_bench.sh")


def run_bench(out, **extra):
    return run_cmd(["bash", SCRIPT, str(out)], 300, dict(PYTHON=sys.executable, SMOKE="1", **extra))


def test_an_unknown_step_name_is_refused_before_anything_runs(tmp_path):
    proc = run_bench(tmp_path, ONLY="train_cifar gemmm")
    assert proc.returncode == 2
    assert "no step named 'gemmm'" in proc.stdout and not (tmp_path / "steps.tsv").exists()


@background(cost=30)
def only_train_cifar_over_stale_results(out):
    stale = out / "train_stem"
    stale.mkdir()
    (stale / "train_throughput.jsonl").write_text(json.dumps({"model": "stale_model_row"}) + "\n")
    return run_bench(out, ONLY="train_cifar"), out


def test_only_runs_the_named_step_and_the_summary_ignores_stale_results(
        only_train_cifar_over_stale_results):
    """A stale train_stem result is left in the output folder, then ONLY=train_cifar runs (in the
    background, with the other launches)."""
    proc, out = only_train_cifar_over_stale_results
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    steps = dict(line.split("\t")[:2] for line in (out / "steps.tsv").read_text().splitlines())
    assert steps.pop("train_cifar") == "ok"
    assert set(steps.values()) == {"not selected"} and "train_stem" in steps
    summary = (out / "summary.txt").read_text()
    assert "alexnet_cifar" in summary and "stale_model_row" not in summary
    assert "NOT OK" not in summary
