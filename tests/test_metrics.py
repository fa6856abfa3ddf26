"""The step timer's breakdown: phases are contiguous, so each step's parts add up to the step and
the steps add up to the wall clock; warm-up steps are left out; windows report each step once."""

import time
from types import SimpleNamespace

import pytest
import torch

from ddp_lab.metrics import StepTimer, medians, with_exposed_comm


def run_steps(timer, n, sleeps):
    for _ in range(n):
        for phase, s in sleeps.items():
            time.sleep(s)
            timer.mark(phase)
        timer.end_step()


def test_parts_add_up_to_the_step_and_steps_to_the_wall_clock():
    timer = StepTimer(torch.device("cpu"), warmup=2)
    sleeps = {"data": 0.002, "forward": 0.004, "backward": 0.006, "comm": 0.001, "optim": 0.003}
    t0 = time.perf_counter()
    timer.restart()
    run_steps(timer, 2, sleeps)  # warm-up: not timed
    t1 = time.perf_counter()
    run_steps(timer, 5, sleeps)
    t2 = time.perf_counter()
    assert len(timer.steps) == 5
    for step in timer.steps:
        assert step["step"] == pytest.approx(sum(step[p] for p in sleeps), rel=1e-12)
        for phase, s in sleeps.items():
            assert s * 1e3 <= step[phase] < s * 1e3 + 50  # a sleep never returns early (nor, on a
            # shared machine, always on time)
    summary = timer.summary()
    # contiguous marks: the timed steps cover the wall clock from the end of warm-up, no gaps
    assert summary["timed_total_s"] == pytest.approx(t2 - t1, abs=1e-2)
    assert summary["timed_total_s"] < t2 - t0
    assert summary["timed_steps"] == 5


def test_window_reports_each_timed_step_once():
    timer = StepTimer(torch.device("cpu"), warmup=1)
    timer.restart()
    run_steps(timer, 3, {"forward": 0.001})
    first = timer.window()
    assert len(first) == 2 and set(medians(first)) == {"forward", "step"}
    assert timer.window() == []  # nothing new
    run_steps(timer, 1, {"forward": 0.02})
    [new] = timer.window()
    assert new["forward"] >= 20  # only the new, slower step


def test_notes_join_their_step_and_a_nan_note_is_left_out():
    """A measurement of the step that is not a phase (the sync's busy time): in the step's
    record and its medians, never in the step's total; NaN (not measured) is left out."""
    timer = StepTimer(torch.device("cpu"), warmup=0)
    timer.restart()
    for busy in (3.0, float("nan"), 5.0):
        timer.mark("data")
        timer.note("comm_busy", busy)
        timer.end_step()
    assert ["comm_busy" in s for s in timer.steps] == [True, False, True]
    assert all(s["step"] == s["data"] for s in timer.steps)
    assert timer.summary()["comm_busy_ms"] == 4.0


def test_a_step_without_marks_keeps_its_own_time():
    timer = StepTimer(torch.device("cpu"), warmup=0)
    timer.restart()
    time.sleep(0.01)
    timer.end_step()  # no mark at all: its time is still its own, not the next step's
    timer.mark("data")
    timer.end_step()
    assert timer.steps[0]["step"] >= 10 > timer.steps[1]["step"]


def test_every_step_is_marked_pauses_or_not():
    timer = StepTimer(torch.device("cpu"), warmup=0)
    timer.restart()
    run_steps(timer, 2, {"data": 0})
    timer.window()
    run_steps(timer, 1, {"data": 0})
    timer.restart()
    run_steps(timer, 1, {"data": 0})
    assert [sorted(s) for s in timer.steps] == [["data", "step"]] * 4


def test_exposed_comm_is_what_backward_and_comm_took_beyond_local_backward():
    phases = {"forward": 2.0, "backward": 5.0, "comm": 1.5, "optim": 0.3}
    out = with_exposed_comm(phases, local_backward_ms=4.0, accum_steps=1)
    assert out["exposed_comm"] == pytest.approx(2.5) and out["compute"] == pytest.approx(6.0)
    assert with_exposed_comm(phases, 7.0, 1)["exposed_comm"] == 0.0  # never negative
    assert with_exposed_comm(phases, 2.0, 3)["backward_local"] == 6.0  # per micro-step x accum
    assert with_exposed_comm(phases, None, 1) == phases


def test_the_calibrations_peak_is_read_then_reset(monkeypatch):
    """On CUDA the peak up to the calibration's end is read, then the peak statistics are reset,
    in that order: summary.json's max_memory_allocated_GiB is then the training's alone, without
    the calibration's transient. Nothing on the CPU, nor without a calibration."""
    from ddp_lab.step import calibrate, peak_and_reset

    calls = []
    monkeypatch.setattr(torch.cuda, "max_memory_allocated",
                        lambda device: calls.append(("peak", device)) or 123)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats",
                        lambda device: calls.append(("reset", device)))
    cuda = torch.device("cuda", 0)
    assert peak_and_reset(cuda) == 123 and calls == [("peak", cuda), ("reset", cuda)]
    calls.clear()
    assert peak_and_reset(torch.device("cpu")) is None and calls == []
    assert calibrate(None, None, passes=0) == (None, None) and calls == []

    # calibrate: the backward first, then the peak read and reset; its batch from epoch 0 alone
    import ddp_lab.step

    monkeypatch.setattr(ddp_lab.step, "time_local_backward",
                        lambda parts, batch, passes: calls.append(("backward", batch)) or 5.0)
    param = SimpleNamespace(device=cuda)
    parts = SimpleNamespace(model=SimpleNamespace(parameters=lambda: iter([param])))
    stream = SimpleNamespace(epoch=lambda e, last_epoch=None: iter([(e, last_epoch)]))
    assert calibrate(parts, stream, passes=2) == (5.0, 123)
    assert calls == [("backward", (0, 0)), ("peak", cuda), ("reset", cuda)]


def test_a_calibration_on_the_cpu_times_backward_and_reads_no_peak():
    from omegaconf import OmegaConf

    from ddp_lab.data import build_data
    from ddp_lab.dist import DistInfo
    from ddp_lab.step import build_parts, calibrate
    from helpers import SMALL, compose_config

    cfg = OmegaConf.to_object(compose_config(SMALL + ["sync=none", "train.batch_size=4"]))
    cpu = torch.device("cpu")
    flags = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
             torch.backends.cudnn.benchmark)
    try:
        with torch.random.fork_rng():  # (build_parts seeds the global generator)
            parts = build_parts(cfg, DistInfo(0, 0, 1, 1, "none", cpu), 10)
            ms, peak = calibrate(parts, build_data(cfg, 0, 1, cpu).train, passes=1)
    finally:  # build_parts sets process-wide flags: as they were, for the other tests
        (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
         torch.backends.cudnn.benchmark) = flags
    assert ms > 0 and peak is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_marks_time_the_gpu_work_of_each_phase_and_recycle_their_events(monkeypatch):
    """Phases whose GPU work alternates long/short from step to step, queued ahead of the GPU in
    blocks of 8 steps: every step must see its own long phase (an event recycled while still
    needed, such as the one that starts the next step, would give it another mark's time), and the
    timer must reuse its events."""
    made = []

    class CountedEvent(torch.cuda.Event):
        def __new__(cls, *args, **kwargs):
            made.append(1)
            return super().__new__(cls, *args, **kwargs)

    monkeypatch.setattr(torch.cuda, "Event", CountedEvent)
    long_cycles, short_cycles, steps = 2_000_000, 100_000, 40
    timer = StepTimer(torch.device("cuda"), warmup=0)
    timer.restart()
    for i in range(steps):
        for phase in ("a", "b"):
            torch.cuda._sleep(long_cycles if (phase == "a") == (i % 2 == 0) else short_cycles)
            timer.mark(phase)
        timer.end_step()
        if i % 8 == 7:  # the GPU catches up: the next end_step reads these, frees their events
            torch.cuda.synchronize()
    summary = timer.summary()
    assert summary["timed_steps"] == steps
    for i, step in enumerate(timer.steps):
        long_, short = ("a", "b") if i % 2 == 0 else ("b", "a")
        assert step[long_] > 5 * step[short], (i, step)
    assert len(made) < steps  # 2 marks a step: without recycling, 2 * steps + 1 events
