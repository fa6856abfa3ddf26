"""train.trace=true: the timeline of a few steps on every rank (trace.json, timeline.png) and
summary.json's overlap block. Two real ranks over gloo: our ring with overlap and small buckets
(several per step), and torch's DDP through its comm hook; the overlap block is recomputed from
trace.json and checked against the step breakdown, and the order of events against what the
sync promises. The ring's run is as test_sync_train.py's ring-overlap one (helpers.SMALL: 2 ranks
x 16, 3 steps, no timing warm-up, all traced; 2 MB buckets, 9 per step); DDP's is NO_DROPOUT's."""

import json
import os

import pytest

from ddp_lab.trace import overlap
from background import background
from helpers import SMALL, SMALL_BUCKETS, check, summary
from launchers import ranks
from reliab_helpers import NO_DROPOUT

# sync -> (its traced run's overrides, its traced steps: every timed one). DDP: 2 ranks x 8
# samples, 6 steps; the timing warm-up is 1, so steps 2..6 are timed, all traced.
SYNCS = {"ring": (SMALL + SMALL_BUCKETS + ["sync=ring", "sync.overlap=true", "train.trace=true",
                                           "train.batch_size=16"], {1, 2, 3}),
         "ddp": (NO_DROPOUT + ["sync=ddp", "train.max_steps=6", "train.timing_warmup=1",
                               "train.trace=true", "train.trace_steps=5", "sync.bucket_mb=4"],
                 {2, 3, 4, 5, 6})}


@background(cost=lambda sync: 25 if sync == "ddp" else 12, keys=SYNCS)
def traced_run(sync, run_dir):
    check(ranks(SYNCS[sync][0] + [f"hydra.run.dir={run_dir}"], timeout=240))
    return run_dir


def traced(traced_run, name):
    run = traced_run[name]
    with open(os.path.join(run, "trace.json")) as f:
        events = json.load(f)["traceEvents"]
    return summary(run), events, run


def by_rank_and_step(events):
    out = {}
    for e in events:
        if e["ph"] in ("X", "i"):
            out.setdefault((e["pid"], e["args"]["step"]), []).append(e)
    return out


@pytest.mark.parametrize("name", list(SYNCS))
def test_every_rank_has_every_bucket_in_every_traced_step(traced_run, name):
    s, events, run = traced(traced_run, name)
    steps = by_rank_and_step(events)
    assert {rank for rank, _ in steps} == {0, 1}
    assert {step for _, step in steps} == SYNCS[name][1] == set(s["overlap"]["steps"])
    names = {e["name"] for e in events if e["ph"] == "M"}
    assert {"process_name", "thread_name"} <= names
    for (rank, step), evs in steps.items():
        ready = sorted(e["args"]["bucket"] for e in evs if e["name"] == "bucket_ready")
        reduces = sorted(e["args"]["bucket"] for e in evs if e["name"] == "allreduce")
        assert ready == reduces and len(reduces) >= 3, (rank, step, ready, reduces)
        assert all(e["args"]["bytes"] > 0 and e["tid"] == 1 for e in evs
                   if e["name"] == "allreduce")
        assert {"forward", "backward", "wait", "guard", "optimizer"} <= {e["name"] for e in evs}
    assert os.path.getsize(os.path.join(run, "timeline.png")) > 10_000


def test_the_ring_keeps_the_order_the_sync_promises(traced_run):
    """Each bucket's all-reduce starts at or after its bucket_ready and after the previous
    bucket's all-reduce started; the wait ends after the last all-reduce ends; the optimizer
    starts after the wait."""
    _, events, _ = traced(traced_run, "ring")
    for (rank, step), evs in by_rank_and_step(events).items():
        ready = {e["args"]["bucket"]: e["ts"] for e in evs if e["name"] == "bucket_ready"}
        reduces = sorted((e for e in evs if e["name"] == "allreduce"),
                         key=lambda e: e["args"]["bucket"])
        for prev, cur in zip(reduces, reduces[1:]):
            assert cur["ts"] >= prev["ts"], (rank, step, cur["args"]["bucket"])
        for e in reduces:
            assert e["ts"] >= ready[e["args"]["bucket"]], (rank, step, e["args"])
        [wait] = [e for e in evs if e["name"] == "wait"]
        [optimizer] = [e for e in evs if e["name"] == "optimizer"]
        last_end = max(e["ts"] + e["dur"] for e in reduces)
        assert wait["ts"] + wait["dur"] >= last_end
        assert optimizer["ts"] >= wait["ts"] + wait["dur"]


@pytest.mark.parametrize("name", list(SYNCS))
def test_the_overlap_block_is_what_the_trace_says(traced_run, name):
    s, events, _ = traced(traced_run, name)
    block, recomputed = s["overlap"], overlap(events)
    assert block.keys() == recomputed.keys()
    for key, value in recomputed.items():
        assert block[key] == pytest.approx(value, rel=1e-9), key
    assert block["comm_busy_ms"] > 0 and 0 <= block["exposed_comm_ms"]
    assert len(block["rank_exposed_comm_ms"]) == 2


def test_the_overlap_block_agrees_with_the_step_breakdown(traced_run):
    """Every timed step is traced, and both come from the same stamps: the wait is the step
    timer's `comm` phase and the all-reduce spans are the sync's busy time, step by step."""
    s, _, _ = traced(traced_run, "ring")
    # The two sums round differently: stamps are perf_counter seconds (float64, so ~1e-12 s per
    # stamp on a host up for hours), the trace keeps spans as microseconds. 1 ns is far below
    # any stamp missed or counted twice.
    same = lambda x: pytest.approx(x, rel=1e-9, abs=1e-6)
    assert s["overlap"]["wait_ms"] == same(s["time_ms"]["comm"])
    assert s["overlap"]["comm_busy_ms"] == same(s["time_ms"]["comm_busy"])


def test_overlap_of_a_hand_made_step():
    """Two buckets on one rank: ready at 0 and 40 us; all-reduces 10-60 and 60-100 us; backward
    ends at 45, the wait runs 45-110: busy 90 us, exposed from the last ready (40) to the end of
    the wait (110): 70 us."""
    def span(name, ts, dur, **args):
        return {"name": name, "ph": "X", "ts": ts, "dur": dur, "pid": 0, "tid": 0,
                "args": {"step": 1, **args}}
    events = [
        {"name": "bucket_ready", "ph": "i", "ts": 0, "pid": 0, "tid": 0,
         "args": {"step": 1, "bucket": 0}},
        {"name": "bucket_ready", "ph": "i", "ts": 40, "pid": 0, "tid": 0,
         "args": {"step": 1, "bucket": 1}},
        span("allreduce", 10, 50, bucket=0), span("allreduce", 60, 40, bucket=1),
        span("backward", 0, 45), span("wait", 45, 65)]
    block = overlap(events)
    assert block["comm_busy_ms"] == pytest.approx(0.090)
    assert block["wait_ms"] == pytest.approx(0.065)
    assert block["exposed_comm_ms"] == pytest.approx(0.070)
    assert block["overlap_fraction"] == pytest.approx(1 - 70 / 90)
    assert block["bucket_ready_to_start_ms"] == pytest.approx([0.010, 0.020])


def test_no_trace_when_off(small_references):
    s = summary(small_references["ddp"])
    assert "overlap" not in s
    assert not os.path.exists(os.path.join(small_references["ddp"], "trace.json"))
