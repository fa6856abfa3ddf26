"""The compression study's arithmetic (ddp_lab/bench/compression.py, compression_table.py,
ddp_lab/perf/compression.py), in process on hand-made run rows: no launch. The study itself:
docs/results/cpu-compression."""

from __future__ import annotations

import math
import os
from types import SimpleNamespace

import pytest
import torch

from ddp_lab.bench import compression
from ddp_lab.bench.compression import ARMS, check
from ddp_lab.bench.compression_table import arm_rows
from ddp_lab.config import ConfigError
from ddp_lab.dtypes import DTYPES
from ddp_lab.perf.compression import Thread, breakeven_gbps, predict_step_ms, wire_ms
from ddp_lab.perf.step import Bucket

ONE = [Bucket(1000, 1.0)]  # one bucket, ready at backward's end: nothing can hide


def each(buckets, cfg):
    """arm_rows' buckets: the same for every arm of cfg."""
    return dict.fromkeys(cfg.arms, buckets)


def test_the_link_adds_bytes_over_its_speed():
    # 125 MB at 1 Gb/s = 1 s; no link adds nothing
    assert wire_ms(125e6, 1.0) == pytest.approx(1000.0, rel=1e-12)
    assert wire_ms(125e6, 0.0) == 0.0
    # one bucket ready at backward's end: its whole wire time, 12.5 MB at 10 Gb/s = 10 ms
    at_end = Thread(200.0, 50.0, (1.0,), (5.0,))
    assert predict_step_ms(at_end, [12.5e6], 10.0) == pytest.approx(210.0, rel=1e-12)
    assert predict_step_ms(at_end, [12.5e6], 0.0) == 200.0


def test_wire_time_hides_under_the_backward_left_when_its_bucket_is_ready():
    """Backward 40 ms; bucket 0 ready at 10 ms (0.25) with 2 ms of host time, bucket 1 at 40 ms
    with 3 ms. 12.5 MB of bucket 0 at 10 Gb/s (10 ms) ends at 10 + 2 + 10 = 22 ms, inside
    backward: it adds 0; bucket 1's 1.25 MB (1 ms) comes after backward: it adds 1 ms. Without
    the overlap (everything after backward) it would add 11 ms."""
    early = Thread(100.0, 40.0, (0.25, 1.0), (2.0, 3.0))
    assert predict_step_ms(early, [12.5e6, 0.0], 10.0) == pytest.approx(100.0, rel=1e-12)
    assert predict_step_ms(early, [12.5e6, 1.25e6], 10.0) == pytest.approx(101.0, rel=1e-12)


def test_wire_time_past_backward_delays_the_buckets_behind_it():
    """Bucket 0 ready at 20 ms of 40 with 25 ms of wire (31.25 MB at 10 Gb/s) and 2 of host ends
    at 47 ms; bucket 1 (ready at 40, 3 ms) then runs 47-50 instead of 40-43: the step loses
    10 ms beyond backward instead of 3, 7 ms more. A compressor's time in a bucket queues the
    same way (`compute_ms`): 5 ms more in bucket 0 ends it at 52, bucket 1 at 55: 12 ms more."""
    half = Thread(100.0, 40.0, (0.5, 1.0), (2.0, 3.0))
    assert predict_step_ms(half, [31.25e6, 0.0], 10.0) == pytest.approx(107.0, rel=1e-12)
    assert predict_step_ms(half, [31.25e6, 0.0], 10.0, [5.0, 0.0]) == pytest.approx(
        112.0, rel=1e-12)


def test_compression_pays_below_the_breakeven_speed():
    # 10 ms more compute to save 12.5 MB, one bucket at backward's end: the link saves 10 ms
    # at 10 Gb/s exactly. The bisection halves 1 / gbps 100 times: rel 1e-9 is far from its
    # 2^-100 and from the ~1e-16 rounding of the step times it compares.
    arm = lambda g: predict_step_ms(Thread(110.0, 50.0, (1.0,), (0.0,)), [0.0], g)
    fp32 = lambda g: predict_step_ms(Thread(100.0, 50.0, (1.0,), (0.0,)), [12.5e6], g)
    g = breakeven_gbps(arm, fp32, 12.5e6)
    assert g == pytest.approx(10.0, rel=1e-9)
    for gbps, pays in ((g / 2, True), (g * 2, False)):
        assert (arm(gbps) < fp32(gbps)) == pays
    assert breakeven_gbps(lambda g: 90.0, fp32, 1.0) == math.inf  # faster even without a link
    assert breakeven_gbps(arm, fp32, 0.0) == 0.0  # saves no bytes
    assert math.isnan(breakeven_gbps(lambda g: math.nan, fp32, 1.0))  # (sync=ddp: no host time)
    assert breakeven_gbps(lambda g: 110.0, lambda g: 100.0, 1.0) == 0.0  # no link slow enough


def test_the_breakeven_speed_counts_the_wire_that_hides():
    """fp32 sends 12.5 MB in each of two buckets (100 / g ms each at g Gb/s), ready at 20 and
    40 ms of backward, no host time; the arm sends nothing but takes 10 ms longer. fp32's link
    adds max(0, w0 - 20) + w1: bucket 0's wire hides while w0 <= 20 (g >= 5), and w1 = 10 at
    g = 10. The sum of both wires (the upper bound) would put it at 25 MB x 8 / 10 ms = 20."""
    fp32 = Thread(100.0, 40.0, (0.5, 1.0), (0.0, 0.0))
    arm = Thread(110.0, 40.0, (0.5, 1.0), (0.0, 0.0))
    g = breakeven_gbps(lambda g: predict_step_ms(arm, [0.0, 0.0], g),
                       lambda g: predict_step_ms(fp32, [12.5e6, 12.5e6], g), 25e6)
    assert g == pytest.approx(10.0, rel=1e-9)


def _run(arm, gbps, step_ms, seed=0, acc=0.8, nbytes=1000, elements=250, link_bytes=None,
         **more):
    return {"phase": "accuracy" if gbps == 0 else "link", "nproc": 2, "arm": arm, "seed": seed,
            "gbps": gbps, "status": "ok", "val_accuracy": acc, "step_ms": step_ms,
            "bytes_per_step": nbytes,
            "link_bytes_per_step": nbytes if link_bytes is None else link_bytes,
            "elements_per_step": elements, "gradient_elements": 250, "compress_ms": 0.0,
            "steps_to_target": 10, "backward_ms": 50.0, "comm_busy_ms": 5.0,
            "bucket_bytes_sent": [nbytes], "bucket_compress_ms": [], **more}


def test_arm_rows_compare_each_arm_with_fp32_at_its_link():
    cfg = SimpleNamespace(nproc=[2], gbps=[0.0, 1.0], arms=["fp32", "powersgd-r2"])
    runs = [_run("fp32", 0.0, ms, seed=s, acc=a) for s, (ms, a) in enumerate(
        [(100.0, 0.8), (102.0, 0.9), (98.0, 0.7)])]
    runs += [_run("powersgd-r2", 0.0, 110.0, seed=s, acc=0.8, nbytes=10, elements=5)
             for s in range(3)]
    runs += [_run("fp32", 1.0, 110.0), _run("powersgd-r2", 1.0, 111.0, nbytes=10, elements=5)]
    rows = {(r["gbps"], r["arm"]): r for r in arm_rows(runs, cfg, each(ONE, cfg))}
    fp32, psgd = rows[0.0, "fp32"], rows[0.0, "powersgd-r2"]
    assert (fp32["step_ms"], fp32["step_ms_min"], fp32["step_ms_max"]) == (100.0, 98.0, 102.0)
    assert fp32["acc_mean"] == pytest.approx(0.8) and fp32["acc_sd"] == pytest.approx(0.1)
    assert psgd["x_fewer_elements"] == 50 and psgd["acc_vs_fp32_pts"] == pytest.approx(0.0)
    # 990 bytes saved x 8 over 10 ms more: 792 kb/s
    assert psgd["breakeven_gbps"] == pytest.approx(990 * 8 / 10e-3 / 1e9)
    linked = rows[1.0, "powersgd-r2"]  # 110 + 10 B over 1 Gb/s; fp32: 100 + 1000 B
    assert linked["predicted_step_ms"] == pytest.approx(110.0 + 8e-5)
    assert linked["predicted_change_ms"] == pytest.approx(10.0 + 8e-5 - 8e-3)
    assert linked["step_change_ms"] == pytest.approx(1.0)


def test_the_prediction_prices_what_the_busiest_link_carries():
    # Two ranks share each node's link: it carries 2000 B a step while rank 0 sends 1000 B;
    # pricing rank 0's bytes would predict 100 + 0.008 ms instead of 100 + 0.016.
    cfg = SimpleNamespace(nproc=[2], gbps=[0.0, 1.0], arms=["fp32"])
    runs = [_run("fp32", 0.0, 100.0, link_bytes=2000), _run("fp32", 1.0, 100.0, link_bytes=2000)]
    linked = {r["gbps"]: r for r in arm_rows(runs, cfg, each(ONE, cfg))}[1.0]
    assert linked["predicted_step_ms"] == pytest.approx(100.0 + 2000 * 8 / 1e9 * 1e3, rel=1e-12)


def test_a_sync_that_counts_no_link_bytes_is_priced_by_its_own_bytes():
    """sync=ddp (torch's all-reduce) writes link_bytes_per_step null: the study prices rank 0's
    bytes (the same on nodes of one rank) instead of failing on None; a count of 0 stays 0."""
    summary = {"comm_bytes_per_step": 1000, "link_bytes_per_step": None}
    assert compression._link_bytes(summary) == 1000
    assert compression._link_bytes({"comm_bytes_per_step": 1000}) == 1000  # an older study
    assert compression._link_bytes({**summary, "link_bytes_per_step": 0}) == 0


@pytest.mark.parametrize("keys, message", [
    (dict(arms=["fp32", "zip"]), "arms: 'zip' is not one of"),
    (dict(arms=["bf16"]), "must hold fp32"),
    (dict(link_arms=["bf16"]), "must hold fp32"),
    (dict(gbps=[10.0]), "with 0: no link"),
    (dict(gbps=[0.0, -1.0]), "gbps: -1.0 is not a link speed"),
    (dict(gbps=[0.0, math.nan]), "gbps: nan is not a link speed"),
    (dict(target_accuracy=2.0), r"target_accuracy=2.0 must be in \[0, 1\]"),
    (dict(point_timeout_s=0.0), "point_timeout_s=0.0 must be > 0"),
    (dict(threads_per_rank=-1), "threads_per_rank=-1 must be >= 0"),
    (dict(compress_start=-1), "compress_start=-1 must be >= 0"),
])
def test_bad_study_settings_are_one_line(keys, message):
    cfg = SimpleNamespace(**{"arms": list(ARMS), "link_arms": [], "seeds": [0], "nproc": [2],
                             "gbps": [0.0, 1.0], "steps": 3, "timing_steps": 3, "repeats": 1,
                             "timing_warmup": 1, "target_accuracy": 0.7, "point_timeout_s": 600.0,
                             "threads_per_rank": 0, "compress_start": 0, **keys})
    with pytest.raises(ConfigError, match=message):
        check(cfg)


def test_sync_and_training_overrides_go_to_every_run_replacing_the_recipes(monkeypatch):
    """`sync=ddp` (torch's hooks, the reference) and `optim=sgd` reach the runs in place of the
    recipe's `sync=ring` and `optim=adamw`; the study's own keys do not."""
    for arg in ("sync=ddp", "optim=sgd", "sync.compress_start=2", "model.fc_width=512"):
        assert compression.is_training_override(arg), arg
    for arg in ("arms=[fp32]", "steps=132", "syncs=[ring]"):
        assert not compression.is_training_override(arg), arg
    monkeypatch.setattr(compression, "PASSED", ["sync=ddp", "optim=sgd"])
    kept = compression.recipe()
    assert "sync=ring" not in kept and "optim=adamw" not in kept and "train.batch_size=32" in kept


def test_runs_with_and_without_a_link_share_one_node_layout(tmp_path):
    """The prediction prices the link bytes counted by the runs without a link: they must be laid
    out on the linked runs' nodes (one rank each), else one node counts no crossing at all; a
    layout on the command line (sync=hring dist.node_size=2) reaches both alike."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.structured(compression.CompressionConfig(
        arms=["fp32"], seeds=[0], nproc=[4], gbps=[0.0, 10.0], repeats=1))
    for passed, size in (([], "1"), (["dist.node_size=2"], "2")):
        compression.PASSED[:] = passed
        try:
            layouts = {what["phase"]: [a for a in point.args if a.startswith("dist.node_size=")]
                       for point, what in compression.plan(cfg, str(tmp_path))}
        finally:
            compression.PASSED[:] = []
        assert {phase: sizes[-1] if sizes else None for phase, sizes in layouts.items()} == {
            "accuracy": f"dist.node_size={size}", "link": f"dist.node_size={size}"}


def test_the_arms_take_turns_so_a_drift_in_load_falls_on_each_alike(tmp_path):
    """Each seed, then each repeat on a link, runs every arm before the next one: fp32 and
    PowerSGD alternate rather than run in two blocks minutes apart."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.structured(compression.CompressionConfig(
        arms=["fp32", "powersgd-r2"], seeds=[0, 1], nproc=[2], gbps=[0.0, 1.0], repeats=2))
    order = [(what["phase"], what["arm"]) for _, what in compression.plan(cfg, str(tmp_path))]
    assert order == [(phase, arm) for phase in ("accuracy", "link") for _ in range(2)
                     for arm in ("fp32", "powersgd-r2")]


def test_tabulate_only_reads_what_a_cut_study_left_and_launches_nothing(tmp_path, monkeypatch):
    """A study cut short by a time limit: its finished runs are tabulated from their
    summary.json; the run it never reached is listed as missing, and nothing is launched."""
    import json

    from omegaconf import OmegaConf

    import ddp_lab.scale.launch

    cfg = OmegaConf.structured(compression.CompressionConfig(
        arms=["fp32"], seeds=[0], nproc=[2], gbps=[0.0, 10.0], repeats=2, plot=False,
        tabulate_only=True))
    points = compression.plan(cfg, str(tmp_path))
    for (point, _), step_ms in zip(points[:2], (100.0, 120.0)):  # the accuracy run, link r0
        os.makedirs(point.run_dir)
        with open(os.path.join(point.run_dir, "summary.json"), "w") as f:
            json.dump({"val_accuracy": 0.5, "comm_bytes_per_step": 12_500_000,
                       "time_ms": {"step": step_ms, "backward": 40.0, "comm_busy": 5.0},
                       "comm": {"bucket_bytes": [12_500_000]}, "parameters": 1000}, f)
        with open(os.path.join(point.run_dir, "metrics.jsonl"), "w") as f:
            f.write(json.dumps({"step": 3, "val/accuracy": 0.5}) + "\n")
    monkeypatch.setattr(ddp_lab.scale.launch, "launch", lambda *a, **k: pytest.fail("launched"))
    # one bucket at backward's end (sync_buckets' own test is below)
    monkeypatch.setattr(compression, "sync_buckets", lambda cfg, arm: [Bucket(12_500_000, 1.0)])
    rows = compression.run(cfg, str(tmp_path))
    with open(tmp_path / "runs.jsonl") as f:
        statuses = [json.loads(line)["status"] for line in f]
    assert statuses == ["ok", "ok", "missing"]
    linked = next(r for r in rows if r["gbps"] == 10.0)
    # 12.5 MB over 10 Gb/s is 10 ms on top of the 100 ms step without a link
    assert linked["runs"] == 1 and linked["predicted_step_ms"] == pytest.approx(110.0)


def test_the_compute_term_predicts_an_arm_from_fp32_and_its_compressor_alone():
    """predicted_from_fp32 = fp32's step without a link + the compressor alone + its link bytes
    over the link; the break-even speed from the same (no run of the arm is an input)."""
    cfg = SimpleNamespace(nproc=[2], gbps=[0.0, 1.0], arms=["fp32", "powersgd-r2"])
    runs = [_run("fp32", 0.0, 100.0), _run("powersgd-r2", 0.0, 130.0, nbytes=10),
            _run("fp32", 1.0, 108.0), _run("powersgd-r2", 1.0, 126.0, nbytes=10)]
    alone = {(2, "fp32"): 0.0, (2, "powersgd-r2"): 25.0}
    rows = {(r["gbps"], r["arm"]): r for r in arm_rows(runs, cfg, each(ONE, cfg), alone)}
    assert rows[0.0, "powersgd-r2"]["predicted_from_fp32_ms"] == pytest.approx(125.0)
    assert rows[0.0, "powersgd-r2"]["from_fp32_err_pct"] == pytest.approx(100 * (125 / 130 - 1))
    # 10 B over 1 Gb/s is 8e-5 ms; fp32's 1000 B 8e-3 ms
    assert rows[1.0, "powersgd-r2"]["predicted_from_fp32_ms"] == pytest.approx(125.0 + 8e-5,
                                                                                abs=1e-9)
    assert rows[1.0, "fp32"]["predicted_from_fp32_ms"] == pytest.approx(100.0 + 8e-3, abs=1e-9)
    # 990 B saved x 8 over 25 ms more: 316.8 kb/s
    assert rows[0.0, "powersgd-r2"]["predicted_breakeven_gbps"] == pytest.approx(
        990 * 8 / 25e-3 / 1e9)
    # no calibration: no term
    assert "predicted_from_fp32_ms" not in arm_rows(runs, cfg, each(ONE, cfg))[0]


def test_the_table_hides_an_early_buckets_wire_and_queues_the_compressor():
    """Two buckets of 500 B, ready at 0.2 and 1.0 of a 50 ms backward. fp32's own runs: 5 ms
    of host time (2.5 a bucket); at 1 Gb/s its 1000 link bytes (4e-3 ms a bucket) hide in
    bucket 0 (done at 12.5 ms) and add 4e-3 ms in bucket 1. PowerSGD's runs without a link
    (130 ms) sent 90 + 10 B (its 5 ms of host time split 4.5 + 0.5 as those bytes) and spent
    36 + 4 ms compressing: bucket 0 ends at 10 + 4.5 + 36 = 50.5 ms, past backward, so its
    100 B at 1 Gb/s (7.2e-4 and 8e-5 ms) add 8e-4 ms. (Without the compressor's time, or with
    the host time split evenly, bucket 0 would end inside backward: 8e-5 ms.) From fp32 with
    its compressor alone (24 ms, 12 a bucket): bucket 0 ends at 10 + 2.5 + 12 + 7.2e-4 =
    24.5007 ms, inside backward; bucket 1 adds its 12 ms and 8e-5 ms."""
    two = [Bucket(500, 0.2), Bucket(500, 1.0)]
    cfg = SimpleNamespace(nproc=[2], gbps=[0.0, 1.0], arms=["fp32", "powersgd-r2"])
    fp32 = dict(bucket_bytes_sent=[500, 500])
    psgd = dict(nbytes=100, bucket_bytes_sent=[90, 10], bucket_compress_ms=[36.0, 4.0])
    runs = [_run("fp32", 0.0, 100.0, **fp32), _run("powersgd-r2", 0.0, 130.0, **psgd),
            _run("fp32", 1.0, 101.0, **fp32), _run("powersgd-r2", 1.0, 131.0, **psgd)]
    alone = {(2, "fp32"): 0.0, (2, "powersgd-r2"): 24.0}
    rows = {(r["gbps"], r["arm"]): r for r in arm_rows(runs, cfg, each(two, cfg), alone)}
    assert rows[1.0, "fp32"]["predicted_step_ms"] == pytest.approx(100.0 + 4e-3, abs=1e-9)
    assert rows[1.0, "powersgd-r2"]["predicted_step_ms"] == pytest.approx(130.0 + 8e-4, abs=1e-9)
    assert rows[1.0, "powersgd-r2"]["predicted_from_fp32_ms"] == pytest.approx(
        100.0 + 12.0 + 8e-5, abs=1e-9)
    assert rows[0.0, "powersgd-r2"]["predicted_from_fp32_ms"] == pytest.approx(112.0, abs=1e-9)


def test_an_arm_cut_in_fewer_buckets_is_predicted_from_fp32_on_its_own():
    """bf16 travels in 2 bytes: one bucket of 500 B where fp32 (5 ms of host time) has two, the
    first ready at 0.2 of backward. From fp32, bf16's step is fp32's thread on bf16's one bucket
    at backward's end: fp32's 5 ms of host time in it, the 500 link bytes at 1 Gb/s (4e-3 ms)
    all added: 100 + 4e-3 ms. On fp32's two buckets half would hide (100 + 2e-3)."""
    cfg = SimpleNamespace(nproc=[2], gbps=[0.0, 1.0], arms=["fp32", "bf16"])
    fp32 = dict(bucket_bytes_sent=[500, 500])
    runs = [_run("fp32", 0.0, 100.0, **fp32), _run("bf16", 0.0, 101.0, nbytes=500),
            _run("fp32", 1.0, 101.0, **fp32), _run("bf16", 1.0, 102.0, nbytes=500)]
    buckets = {"fp32": [Bucket(500, 0.2), Bucket(500, 1.0)], "bf16": [Bucket(500, 1.0)]}
    alone = {(2, "fp32"): 0.0, (2, "bf16"): 0.0}
    rows = {(r["gbps"], r["arm"]): r for r in arm_rows(runs, cfg, buckets, alone)}
    assert rows[1.0, "bf16"]["predicted_from_fp32_ms"] == pytest.approx(100.0 + 4e-3, abs=1e-9)


def test_ddps_untimed_buckets_are_all_taken_at_backwards_end():
    """sync=ddp records no host time in its collectives (nan): nothing is taken to hide, so
    the link adds its whole wire time, though the buckets' own ready times say otherwise:
    1000 B over 1 Gb/s, 8e-3 ms (half of it would hide under backward at 0.2)."""
    cfg = SimpleNamespace(nproc=[2], gbps=[0.0, 1.0], arms=["fp32"])
    ddp = dict(comm_busy_ms=math.nan, bucket_bytes_sent=[500, 500])
    runs = [_run("fp32", 0.0, 100.0, **ddp), _run("fp32", 1.0, 101.0, **ddp)]
    two = [Bucket(500, 0.2), Bucket(500, 1.0)]
    linked = {r["gbps"]: r for r in arm_rows(runs, cfg, each(two, cfg), {(2, "fp32"): 0.0})}
    assert linked[1.0]["predicted_step_ms"] == pytest.approx(100.0 + 8e-3, abs=1e-9)
    assert linked[1.0]["predicted_from_fp32_ms"] == pytest.approx(100.0 + 8e-3, abs=1e-9)


def test_runs_cut_otherwise_than_the_models_buckets_are_refused():
    cfg = SimpleNamespace(nproc=[2], gbps=[0.0], arms=["fp32"])
    runs = [_run("fp32", 0.0, 100.0, bucket_bytes_sent=[500, 500])]
    with pytest.raises(ConfigError, match="fp32: its runs were cut in other buckets than the 1 "
                                          "this command's model and sync.bucket_mb make"):
        arm_rows(runs, cfg, each(ONE, cfg))


def test_the_studys_buckets_are_the_ones_its_sync_cuts(monkeypatch):
    """sync_buckets (the model's profile, by FLOPs) cuts the bytes bucket_shapes reads off the
    built model (the sync's own buckets: test_the_buckets_timed_alone_are_the_syncs), the last
    ready at backward's end; at the studies' 25 MiB the 512-wide model is one bucket."""
    from omegaconf import OmegaConf

    from ddp_lab.models import build_model
    from ddp_lab.perf.compression import bucket_shapes

    cfg = OmegaConf.structured(compression.CompressionConfig(arms=["fp32", "bf16"]))
    model = build_model("alexnet_cifar", 10, 0.0, fc_width=512)
    # bf16's buckets are cut in the 2 bytes an element travels in: 9 at 1 MiB (a study's crash)
    for arm, size, bucket_mb, count in (("fp32", 4, 1.0, 11), ("fp32", 4, 25.0, 1),
                                        ("bf16", 2, 1.0, 9)):
        monkeypatch.setattr(compression, "PASSED", ["model.fc_width=512",
                                                    f"sync.bucket_mb={bucket_mb}"])
        got = compression.sync_buckets(cfg, arm)
        shapes = bucket_shapes(model.to(DTYPES[arm]), bucket_mb)
        assert [b.nbytes for b in got] == [size * sum(math.prod(s) for s in b) for b in shapes]
        assert len(got) == count and got[-1].ready == pytest.approx(1.0, rel=1e-12)


class _Clock:
    """A clock that moves only when told (the compressor's 'compute' and 'collectives')."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self):
        return self.now


def test_the_compressor_alone_is_timed_without_its_collectives(monkeypatch):
    """Each step runs every bucket, in order, on gradients of its size, with the study's world
    size; 3 ms of compute a bucket counted, 5 ms in an all-reduce and 7 in an all-gather not."""
    import ddp_lab.perf.compression as term

    clock, seen = _Clock(), []
    monkeypatch.setattr(term, "time", clock)

    class Fake:
        def reduce(self, key, flat, shapes, ops):
            seen.append((key, flat.numel(), len(shapes), ops.world_size))
            clock.now += 3e-3
            ops.all_reduce(flat)
            whole = flat.new_empty(flat.numel() * ops.world_size)
            ops.all_gather(flat, whole)
            assert torch.equal(whole, flat.repeat(ops.world_size))

    def slow(fn, seconds):
        def run(*tensors):
            clock.now += seconds
            return fn(*tensors)
        return run

    monkeypatch.setattr(term, "_sum_of_one", slow(term._sum_of_one, 5e-3))
    monkeypatch.setattr(term, "_pieces_of_all", slow(term._pieces_of_all, 7e-3))
    shapes = [[torch.Size([4, 3]), torch.Size([4])], [torch.Size([10])]]
    ms = term.compress_alone_ms(Fake(), shapes, world_size=4, steps=3, warmup=1)
    assert ms == pytest.approx(2 * 3.0, rel=1e-9)
    assert seen == [(0, 16, 2, 4), (1, 10, 1, 4)] * 4


def _buckets_of_the_sync(rank, n):
    from test_sync import make_model
    from test_zero import make_sync, scfg

    from ddp_lab.perf.compression import bucket_shapes

    model = make_model(0)
    sync = make_sync(scfg("ring", 0, bucket_mb=0.0005), n)
    sync.prepare(model)
    got = [[p.shape for p in b.params] for b in sync.buckets]
    sync.close()
    return got == bucket_shapes(make_model(0), 0.0005) and len(got) > 1


def test_the_buckets_timed_alone_are_the_syncs():
    from launchers import spawn

    assert spawn(_buckets_of_the_sync, 1, timeout=30) == [True]


def _checked(tmp_path, monkeypatch, passed: list[str], **keys) -> None:
    from omegaconf import OmegaConf

    monkeypatch.setattr(compression, "PASSED", passed)
    cfg = OmegaConf.structured(compression.CompressionConfig(**{"seeds": [0], "repeats": 1,
                                                                 **keys}))
    compression.check_points(compression.plan(cfg, str(tmp_path)))


def test_a_run_the_sync_cannot_make_is_refused_before_any_run(tmp_path, monkeypatch):
    """sync=ddp on the command line runs the arms through torch's hooks, which have no top-k and
    do not wait for an emulated link: one line naming the run, before anything launches (not a
    failed run in its log). Each run is checked at its own world size: nodes of 2 on 4 ranks
    (sync=hring) are fine, though this process alone is one rank."""
    with pytest.raises(ConfigError, match="^accuracy-n2-topk-1pct-s0: sync.compress=topk") as e:
        _checked(tmp_path, monkeypatch, ["sync=ddp"], arms=["fp32", "topk-1pct"], nproc=[2],
                 gbps=[0.0])
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="^link-n2-fp32-1gbps-r0: dist.link delays"):
        _checked(tmp_path, monkeypatch, ["sync=ddp"], arms=["fp32"], nproc=[2], gbps=[0.0, 1.0])
    _checked(tmp_path, monkeypatch, [], arms=["fp32", "powersgd-r2", "topk-1pct"], nproc=[2],
             gbps=[0.0, 1.0])
    _checked(tmp_path, monkeypatch, ["sync=hring", "dist.node_size=2", "dist.link.shared=true"],
             arms=["fp32"], nproc=[4], gbps=[0.0, 1.0])


def test_a_study_is_not_launched_over_one_it_would_delete(tmp_path):
    compression.check_fresh(str(tmp_path))  # a fresh run dir
    run = tmp_path / "runs" / "accuracy-n2-fp32-s0"
    run.mkdir(parents=True)
    compression.check_fresh(str(tmp_path))  # a run that never finished is nothing to keep
    (run / "summary.json").write_text("{}")
    with pytest.raises(ConfigError, match="holds a study's runs already: tabulate them"):
        compression.check_fresh(str(tmp_path))


def test_the_study_refuses_before_launching_anything(tmp_path, monkeypatch):
    """run() itself: a run the sync cannot make, and a run dir holding finished runs, are refused
    before any launch (launching fails this test) and before the compressors are timed."""
    from omegaconf import OmegaConf

    import ddp_lab.scale.launch

    monkeypatch.setattr(ddp_lab.scale.launch, "launch", lambda *a, **k: pytest.fail("launched"))
    monkeypatch.setattr(compression, "calibrate", lambda *a, **k: pytest.fail("calibrated"))
    cfg = OmegaConf.structured(compression.CompressionConfig(
        arms=["fp32", "topk-1pct"], seeds=[0], nproc=[2], gbps=[0.0], plot=False))
    monkeypatch.setattr(compression, "PASSED", ["sync=ddp"])
    with pytest.raises(ConfigError, match="^accuracy-n2-topk-1pct-s0: sync.compress=topk"):
        compression.run(cfg, str(tmp_path))
    monkeypatch.setattr(compression, "PASSED", [])
    (tmp_path / "runs" / "accuracy-n2-fp32-s0").mkdir(parents=True)
    (tmp_path / "runs" / "accuracy-n2-fp32-s0" / "summary.json").write_text("{}")
    with pytest.raises(ConfigError, match="holds a study's runs already"):
        compression.run(cfg, str(tmp_path))


def test_tabulating_a_study_reads_the_run_dir_its_command_wrote(monkeypatch):
    """The refusal above says: the same command with tabulate_only=true. Without a
    hydra.run.dir, both name the same default run dir."""
    import sys

    dirs = []
    monkeypatch.setattr(compression, "entry", lambda task, name: lambda: dirs.append(
        [a for a in sys.argv if a.startswith("hydra.run.dir=")]))
    monkeypatch.setattr(sys, "argv", ["compression"])
    compression.main(["nproc=[2]", "steps=3"])
    compression.main(["nproc=[2]", "steps=3", "tabulate_only=true"])
    assert dirs[0] == dirs[1] and len(dirs[0]) == 1, dirs
