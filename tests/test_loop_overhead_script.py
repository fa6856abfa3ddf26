"""scripts/loop_overhead.sh's own logic on the CPU (tiny sizes, not a measurement): one row per
tree and per variant, each variant's overrides reaching the ddp_lab loop, paths relative to where
it is run from, and a failed run named (not stopping the others, not showing an old result,
and failing the script at the end)."""

import json
import os
import shutil
import sys

import pytest

from background import background
from launchers import REPO, run_cmd

SCRIPT = os.path.join(REPO, "scripts", "loop_overhead.sh")


@background(cost=40)
def this_tree_a_missing_tree_and_a_variant(out):
    (out / "summary.txt").write_text("an earlier invocation's row\n")
    (out / "tree2_1.jsonl").write_text('{"ratio_paired": 0.5}\n')  # stale: must not be shown
    # run from `out`, every path relative to it: this repo as a tree, a missing tree, the dirs
    cmd = f"cd {out} && bash {SCRIPT} {os.path.relpath(REPO, out)} no_such_tree"
    return run_cmd(["bash", "-c", cmd], 300, dict(
        PYTHON=sys.executable, OUT_DIR=".", RUNS_DIR="runs", ROUNDS="1",
        REPEATS="1", HOST_COSTS="0",
        EXTRA="cpu_batches=[4] cpu_steps=1 cpu_warmup=1 cpu_precisions=[fp32] "
              "channels_last=[false] predict_memory=false",
        VARIANTS="train.nonfinite=off train.consistency_every=3;")), out  # (empty variant: no row)


@pytest.mark.skipif(shutil.which("taskset") is None, reason="needs taskset (util-linux)")
def test_rows_for_this_tree_another_tree_and_a_variant(this_tree_a_missing_tree_and_a_variant):
    proc, out = this_tree_a_missing_tree_and_a_variant
    # The missing tree's run fails: the others still run, and the script exits 1 naming it.
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "failed: tree2_1" in proc.stdout.splitlines()[-1]
    lines = (out / "summary.txt").read_text().splitlines()
    assert [line.split()[0] for line in lines] == ["this_1", "tree1_1", "tree2_1", "variant1_1"]
    for line in (lines[0], lines[1], lines[3]):
        assert "loop/bare" in line and "of median steps" in line, line
    assert "no result" in lines[2] and "tree2_1: FAILED" in proc.stdout
    assert not (out / "tree2_1.jsonl").exists()
    row = json.loads((out / "variant1_1.jsonl").read_text())
    assert row["ratio_paired"] == pytest.approx(row["ratio"])
    # the variant's overrides reached the ddp_lab loop's config; this tree's run has the defaults
    for name, expected in (("variant1_1", ("off", 3)), ("this_1", ("skip", 100))):
        [info] = (out / "runs" / name / "ddp_lab").glob("*/run_info.json")
        train = json.loads(info.read_text())["config"]["train"]
        assert (train["nonfinite"], train["consistency_every"]) == expected
