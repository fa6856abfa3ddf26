"""Measurement and logging: a step timer with a per-phase breakdown, a rank-0 logger that writes
TensorBoard events and metrics.jsonl (a null object on every other rank), and `time_fn`, the
honest timing of a call every benchmark and the sweep's calibration share.

Metric names follow `group/name_unit` (`time/backward_ms`, `throughput/img_per_s`).
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from collections import defaultdict
from typing import Callable

import torch

class StepTimer:
    """The loop's one clock. Contiguous marks: each `mark(phase)` ends `phase` where the previous
    mark ended, so the phases of a step add up to its total by construction, time the GPU sat idle
    waiting for the host (a slow loader) lands in the phase that waited, and the timed steps tile
    the wall clock from the end of warm-up, except where the loop paused it (`restart()`, after
    evaluation and checkpoints). Throughput is counted from the same steps.

    On CUDA each mark is an event on the current stream, read back lazily (no host sync per step)
    and recycled once read; on CPU it is a `time.perf_counter()` reading. `note(key, value)` adds
    a measurement of the current step that is not a phase (the sync's busy time)."""

    def __init__(self, device: torch.device, warmup: int):
        self.cuda = device.type == "cuda"
        self.warmup = warmup
        self.steps: list[dict[str, float]] = []  # resolved, timed steps only
        self._pending: list[tuple[list, dict, bool]] = []  # (marks, notes, kept) not yet read
        self._marks: list[tuple[str, object]] = []
        self._notes: dict[str, float] = {}
        self._seen = 0
        self._free: list = []  # read events, to record again
        self._stream = None  # the stream marks are recorded on
        self._window_start = 0  # first step of self.steps not yet handed out by window()

    def _now(self):
        if self.cuda:
            ev = self._free.pop() if self._free else torch.cuda.Event(enable_timing=True)
            ev.record(self._stream)
            return ev
        return time.perf_counter()

    def restart(self) -> None:
        """Begin a new step here (after eval or a checkpoint: their time is not a step's)."""
        self._stream = torch.cuda.current_stream() if self.cuda else None
        self._marks, self._notes = [("start", self._now())], {}

    def mark(self, phase: str) -> None:
        self._marks.append((phase, self._now()))

    def note(self, key: str, value: float) -> None:
        if not math.isnan(value):
            self._notes[key] = value

    def end_step(self, keep: bool = False) -> list:
        """End the step; returns its marks [(phase, stamp)]. `keep`: the caller keeps them (the
        tracer), so their CUDA events are never recorded again."""
        marks = self._marks
        if len(marks) == 1:
            marks.append(("step", self._now()))  # no phases: the step's total only
        self._seen += 1
        if self._seen > self.warmup:
            self._pending.append((marks, self._notes, keep))
        # The next step starts here: on its own event if this step's are kept (never recycled).
        start = self._now() if keep and self.cuda else marks[-1][1]
        self._marks, self._notes = [("start", start)], {}
        self._resolve(block=False)
        return marks

    def _resolve(self, block: bool) -> None:
        while self._pending:
            marks, notes, kept = self._pending[0]
            if self.cuda:
                if block:
                    marks[-1][1].synchronize()
                elif not marks[-1][1].query():
                    return
                ms = lambda a, b: a.elapsed_time(b)
            else:
                ms = lambda a, b: (b - a) * 1e3
            parts = defaultdict(float)
            for (_, t0), (phase, t1) in zip(marks, marks[1:]):
                parts[phase] += ms(t0, t1)
            parts["step"] = sum(parts.values())
            self.steps.append({**parts, **notes})
            self._pending.pop(0)
            if self.cuda and not kept:  # all but the last, which starts the next step
                self._free.extend(ev for _, ev in marks[:-1])

    def window(self) -> list[dict[str, float]]:
        """The timed steps finished since the last call; never waits for the GPU (steps still in
        flight are handed out next time)."""
        self._resolve(block=False)
        new, self._window_start = self.steps[self._window_start:], len(self.steps)
        return new

    def summary(self) -> dict[str, float]:
        """Median of each phase (ms) over the timed steps, their number and their total time."""
        self._resolve(block=True)
        if not self.steps:
            return {}
        out = {f"{k}_ms": v for k, v in medians(self.steps).items()}
        out["timed_steps"] = len(self.steps)
        out["timed_total_s"] = sum(s["step"] for s in self.steps) / 1e3
        return out


def medians(steps: list[dict[str, float]]) -> dict[str, float]:
    """Each key's median over the steps that have it."""
    keys = sorted({k for s in steps for k in s})
    return {k: statistics.median(s[k] for s in steps if k in s) for k in keys}


def with_exposed_comm(phases: dict[str, float], local_backward_ms: float | None,
                      accum_steps: int) -> dict[str, float]:
    """`phases` (ms) plus compute and exposed communication where backward without communication
    was measured: DDP waits for its all-reduces inside backward, our syncs after it, so the
    exposed part is (backward + comm) - local backward either way."""
    if local_backward_ms is None or "backward" not in phases:
        return dict(phases)
    local = local_backward_ms * accum_steps
    return {**phases, "backward_local": local, "compute": phases["forward"] + local,
            "exposed_comm": max(0.0, phases["backward"] + phases.get("comm", 0.0) - local)}


class NullLogger:
    """What every rank but 0 gets: the same calls, no output."""

    def log(self, step: int, metrics: dict) -> None: ...
    def text(self, tag: str, text: str) -> None: ...
    def hparams(self, hparams: dict, metrics: dict) -> None: ...
    def close(self) -> None: ...


class RunLogger(NullLogger):
    """TensorBoard events and metrics.jsonl in the run directory (rank 0)."""

    def __init__(self, run_dir: str):
        from torch.utils.tensorboard import SummaryWriter

        self.run_dir = run_dir
        self.writer = SummaryWriter(log_dir=run_dir)
        self.jsonl = open(os.path.join(run_dir, "metrics.jsonl"), "a", buffering=1)

    def log(self, step: int, metrics: dict) -> None:
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, step)
        self.jsonl.write(json.dumps({"step": step, "time": time.time(), **metrics}) + "\n")

    def text(self, tag: str, text: str) -> None:
        # TensorBoard renders text as markdown: indent four spaces to keep YAML/JSON verbatim.
        self.writer.add_text(tag, "\n".join("    " + line for line in text.splitlines()))

    def hparams(self, hparams: dict, metrics: dict) -> None:
        self.writer.add_hparams(hparams, metrics, run_name=".")

    def close(self) -> None:
        self.writer.close()
        self.jsonl.close()


def make_logger(run_dir: str, is_main: bool) -> NullLogger:
    return RunLogger(run_dir) if is_main else NullLogger()


def time_fn(fn: Callable[[], object], device: torch.device | str, warmup: int = 3,
            iters: int = 10, min_seconds: float = 0.0, inner: int = 1) -> float:
    """Median seconds per call of fn() after `warmup` calls; at least `iters` timed calls (more
    until `min_seconds` of timed work, for very fast calls).

    `inner` > 1 times that many back-to-back calls per sample and divides: for calls of a few
    microseconds, where one event pair (or clock pair) per call would mostly time launch latency."""
    device = torch.device(device)
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # warm-up work must not leak into the first sample
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < iters or (time.perf_counter() - start < min_seconds and len(times) < 10_000):
        if device.type == "cuda":
            t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0.record()
            for _ in range(inner):
                fn()
            t1.record()
            t1.synchronize()
            times.append(t0.elapsed_time(t1) / 1e3 / inner)
        else:
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            times.append((time.perf_counter() - t0) / inner)
    return statistics.median(times)
