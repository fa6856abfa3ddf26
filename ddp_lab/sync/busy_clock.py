"""How long a sync's collectives keep it busy in a step (`comm_busy_ms`), on the CPU or a GPU.

On the CPU each collective is timed by the host clock around the call. On a GPU the call returns
before the work is done, so a pair of CUDA events brackets it; a step's events are read only once
its last one has completed, so asking every step never stalls the host: the figure is the latest
finished step's.
"""

from __future__ import annotations

import math
import time

import torch


class BusyClock:
    """A sync's clock of its collectives: `timed` around each, `end_step` after a step."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self._host_s = 0.0  # CPU: host time inside the collectives this step
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []  # CUDA: this step's
        self._pending: list[list] = []  # CUDA: finished steps' events, read lazily
        self._last_ms = math.nan

    def timed(self, call) -> tuple:
        """Run `call()` on the clock; its (start, end) stamps: seconds, or CUDA events."""
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            call()
            end.record()
            self._events.append((start, end))
        else:
            start = time.perf_counter()
            call()
            end = time.perf_counter()
            self._host_s += end - start
        return start, end

    def end_step(self) -> None:
        """Close the step: on the CPU its time is known now; on a GPU once its events are."""
        if self.cuda:
            self._pending.append(self._events)
            self._events = []
            self._resolve()
        else:
            self._last_ms = self._host_s * 1e3
            self._host_s = 0.0

    def last_ms(self) -> float:
        """Milliseconds inside the collectives in the latest step whose time is known (NaN
        before the first)."""
        if self.cuda:
            self._resolve()
        return self._last_ms

    def _resolve(self) -> None:
        """Read every pending step whose last event has completed, oldest first."""
        while self._pending and (not self._pending[0] or self._pending[0][-1][1].query()):
            events = self._pending.pop(0)
            self._last_ms = sum(s.elapsed_time(e) for s, e in events)
