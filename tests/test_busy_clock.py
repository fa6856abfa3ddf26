"""The sync's clock of its collectives on the CPU: each call's host time, summed over a step and
known at its end; NaN before any step ends. A fake host clock makes it exact."""

import math

import pytest

from ddp_lab.sync import busy_clock
from ddp_lab.sync.busy_clock import BusyClock


def test_a_steps_calls_are_summed_and_known_when_it_ends(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(busy_clock.time, "perf_counter", lambda: now[0])

    def call(seconds):
        def run():
            now[0] += seconds
        return run

    clock = BusyClock(cuda=False)
    assert math.isnan(clock.last_ms())
    assert clock.timed(call(0.002)) == (0.0, 0.002)
    now[0] += 1.0  # time between the calls (backward, packing) is not the collectives'
    clock.timed(call(0.003))
    assert math.isnan(clock.last_ms())  # the step has not ended
    clock.end_step()
    assert clock.last_ms() == pytest.approx(5.0, abs=1e-9)  # 2 + 3 ms
    clock.timed(call(0.004))
    clock.end_step()
    assert clock.last_ms() == pytest.approx(4.0, abs=1e-9)  # each step on its own
