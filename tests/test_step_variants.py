"""scripts/step_variants.py on the CPU (--smoke): the ablation table and the host cost of each of
the loop's pieces run end to end and write what they print."""

import json
import os
import sys

from background import background
from helpers import check
from launchers import REPO, run_cmd

SCRIPT = os.path.join(REPO, "scripts", "step_variants.py")


def _run(args, out):
    return run_cmd([sys.executable, SCRIPT, "--smoke", "--out", str(out), *args], 240), out


@background(cost=15)
def host_costs(out):
    return _run(["--host-costs"], out)


@background(cost=20)
def two_variants(out):
    return _run(["--only", "eager bf16 cl,+loop all"], out)


def test_host_costs_name_every_piece_of_the_loop(host_costs):
    proc, out = host_costs
    check(proc)
    costs = json.load(open(out / "host_costs.json"))["us_per_call"]
    assert set(costs) == {"data", "events", "sched", "guard", "loss", "one tiny op"}
    assert all(us > 0 for us in costs.values())
    assert "host cost of the loop's pieces" in proc.stdout


def test_exact_names_select_variants_timed_over_rounds(two_variants):
    proc, out = two_variants
    check(proc)
    rows = json.load(open(out / "step_variants.json"))["rows"]
    assert [r["variant"] for r in rows] == ["eager bf16 cl", "+loop all"]  # not "... s2d" too
    assert all(r["rounds"] == 2 and r["img_s"] > 0 for r in rows)
    assert "median of 2 rounds" in proc.stdout
