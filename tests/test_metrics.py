"""The step timer's breakdown: phases are contiguous, so each step's parts add up to the step and
the steps add up to the wall clock; warm-up steps are left out; windows report each step once."""

import time

import pytest
import torch

from ddp_lab.metrics import StepTimer, with_exposed_comm


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
    assert set(first) == {"forward", "step"}
    assert timer.window() == {}  # nothing new
    run_steps(timer, 1, {"forward": 0.02})
    assert timer.window()["forward"] >= 20  # only the new, slower step


def test_sampled_phases_every_step_timed_and_phase_medians_over_the_marked_steps_only():
    """phase_every=3: every step has its total, only every third its phases (not the first after
    restart(): its sample moves to the next); a phase's median is over the steps that marked it
    (not diluted by the others), and the totals still tile the wall clock."""
    timer = StepTimer(torch.device("cpu"), warmup=1, phase_every=3)
    sleeps = {"forward": 0.003, "backward": 0.002}
    timer.restart()
    run_steps(timer, 1, sleeps)  # warm-up (step 0: after the restart, not marked)
    t1 = time.perf_counter()
    run_steps(timer, 8, sleeps)  # steps 1..8: phases on 1 (step 0's sample), 3 and 6
    t2 = time.perf_counter()
    summary = timer.summary()
    marked = ["backward", "forward", "step"]
    assert [sorted(s) for s in timer.steps] == [
        marked, ["step"], marked, ["step"], ["step"], marked, ["step"], ["step"]]
    assert summary["timed_steps"] == 8 and summary["phase_timed_steps"] == 3
    assert 3 <= summary["forward_ms"] < 3 + 50 and 2 <= summary["backward_ms"] < 2 + 50
    for step in timer.steps:  # an unmarked step's total is its whole time, sleeps and all
        assert step["step"] >= 5
    assert summary["timed_total_s"] == pytest.approx(t2 - t1, abs=1e-2)


def test_the_step_after_a_host_pause_is_never_sampled():
    """The loop reads a window every log_every steps right after a sync (a pause of the host),
    and that time lands in the next step's first phase. With log_every=10 and phase_every=5 a
    fixed sample would hit every step after a log; it moves to the step after instead, so the
    phases stay what the steps take and every window still gets its samples."""
    timer = StepTimer(torch.device("cpu"), warmup=0, phase_every=5)
    timer.restart()
    windows = []
    for i in range(1, 41):
        time.sleep(0.001)
        timer.mark("data")
        time.sleep(0.002)
        timer.mark("forward")
        timer.end_step()
        if i % 10 == 0:
            time.sleep(0.03)  # the log step's sync and writes
            windows.append(timer.window())
    marked = [s for s in timer.steps if "data" in s]
    assert len(marked) == 8 and all(s["data"] < 20 for s in marked)
    assert all(1 <= w["data"] < 20 for w in windows)
    assert max(s["step"] for s in timer.steps) >= 30  # the pause is in the step totals still


def test_with_a_pause_before_every_step_phases_are_still_sampled():
    """train.log_every=1: every step follows a window read; a due sample moves once, then is
    taken."""
    timer = StepTimer(torch.device("cpu"), warmup=0, phase_every=5)
    timer.restart()
    for _ in range(20):
        timer.mark("data")
        timer.end_step()
        timer.window()
    assert [i for i, s in enumerate(timer.steps) if "data" in s] == [1, 6, 11, 16]


def test_a_step_without_marks_keeps_its_own_time():
    timer = StepTimer(torch.device("cpu"), warmup=0)
    timer.restart()
    time.sleep(0.01)
    timer.end_step()  # no mark at all: its time is still its own, not the next step's
    timer.mark("data")
    timer.end_step()
    assert timer.steps[0]["step"] >= 10 > timer.steps[1]["step"]


def test_with_phase_every_1_every_step_is_marked_pauses_or_not():
    timer = StepTimer(torch.device("cpu"), warmup=0, phase_every=1)
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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_unmarked_steps_time_their_own_gpu_work():
    """phase_every=3 on CUDA: steps alternate long/short GPU work, queued ahead of the GPU; every
    step's total (one event at its end) must be its own, marked or not."""
    long_cycles, short_cycles, steps = 2_000_000, 100_000, 30
    timer = StepTimer(torch.device("cuda"), warmup=0, phase_every=3)
    timer.restart()
    for i in range(steps):
        torch.cuda._sleep(long_cycles if i % 2 == 0 else short_cycles)
        timer.mark("a")
        timer.end_step()
        if i % 8 == 7:
            torch.cuda.synchronize()
    summary = timer.summary()
    assert summary["timed_steps"] == steps and summary["phase_timed_steps"] == 1 + (steps - 1) // 3
    for i, step in enumerate(timer.steps):
        other = timer.steps[i + 1 if i % 2 == 0 else i - 1]
        assert (step["step"] > 5 * other["step"]) == (i % 2 == 0), (i, step, other)
        assert ("a" in step) == (i == 1 or (i > 0 and i % 3 == 0))  # not right after restart()
