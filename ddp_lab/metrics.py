"""Measurement and logging: a step timer with a per-phase breakdown, and a rank-0 logger that
writes TensorBoard events and metrics.jsonl (a null object on every other rank).

Metric names follow `group/name_unit` (`time/backward_ms`, `throughput/img_per_s`).
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections import defaultdict

import torch

class StepTimer:
    """Contiguous marks: each `mark(phase)` ends `phase` where the previous mark ended, so the
    phases of a step add up to its total by construction, and time the GPU sat idle waiting for the
    host (a slow loader) lands in the phase that waited.

    Every step's total is timed: one mark at each step boundary. Its phases are marked on every
    `phase_every`-th step only (1: every step), never on the first step after a pause of the host
    (a restart, a window read): that step's first phase holds the pause, and the loop pauses every
    `log_every` steps, so a fixed sample could land there every time. On CUDA each mark is an
    event on the current stream, read back lazily (no sync per step) and recycled once read; five
    phase marks a step and reading them back cost ~40 us of host time, 1-2% of a small model's
    host-bound step, so the loop samples them there. On CPU marks are `time.perf_counter()`
    readings."""

    def __init__(self, device: torch.device, warmup: int, phase_every: int = 1):
        self.cuda = device.type == "cuda"
        self.warmup = warmup
        self.phase_every = phase_every
        self.steps: list[dict[str, float]] = []  # resolved, timed steps only
        self._pending: list[list[tuple[str | None, object]]] = []
        self._marks: list[tuple[str | None, object]] = []
        self._seen = 0
        self._phases: bool | None = None  # whether this step's phases are marked (None: undecided)
        self._after_pause = True  # this step follows a restart or a window read
        self._owed = False  # a sample moved off a step that followed a pause
        self._free: list = []  # read events, to record again
        self._stream = None  # the stream marks are recorded on
        self._window_start = 0  # first step of self.steps not yet reported by window()

    def _now(self):
        if self.cuda:
            ev = self._free.pop() if self._free else torch.cuda.Event(enable_timing=True)
            ev.record(self._stream)
            return ev
        return time.perf_counter()

    def restart(self) -> None:
        """Begin a new step here (after eval or a checkpoint: their time is not a step's)."""
        # Looked up once here: Event.record() would look it up at every mark (~5 us each).
        self._stream = torch.cuda.current_stream() if self.cuda else None
        self._marks = [("start", self._now())]
        self._phases, self._after_pause = None, True

    def _decide(self) -> bool:
        """Whether this step's phases are marked: every phase_every-th step's, but a sample due on
        the first step after a pause moves to the next step (once: with a pause before every
        step, as with train.log_every=1, that one is taken)."""
        due = self._owed or self._seen % self.phase_every == 0
        moved = due and self._after_pause and self.phase_every > 1 and not self._owed
        self._phases, self._owed, self._after_pause = due and not moved, moved, False
        return self._phases

    def mark(self, phase: str) -> None:
        if self._phases or (self._phases is None and self._decide()):
            self._marks.append((phase, self._now()))

    def end_step(self) -> None:
        phases = self._decide() if self._phases is None else self._phases
        marks, self._seen, self._phases = self._marks, self._seen + 1, None
        if not phases or len(marks) == 1:
            marks.append((None, self._now()))  # the step's end only
        if self._seen > self.warmup:
            self._pending.append(marks)
        self._marks = [("start", marks[-1][1])]  # the next step starts where this one ended
        self._resolve(block=False)

    def _resolve(self, block: bool) -> None:
        while self._pending:
            marks = self._pending[0]
            if self.cuda:
                if block:
                    marks[-1][1].synchronize()
                elif not marks[-1][1].query():
                    return
                ms = lambda a, b: a.elapsed_time(b)
            else:
                ms = lambda a, b: (b - a) * 1e3
            if marks[-1][0] is None:  # a step whose phases were not marked
                parts = {"step": ms(marks[0][1], marks[-1][1])}
            else:
                parts = defaultdict(float)
                for (_, t0), (phase, t1) in zip(marks, marks[1:]):
                    parts[phase] += ms(t0, t1)
                parts["step"] = sum(parts.values())
            self.steps.append(dict(parts))
            self._pending.pop(0)
            if self.cuda:  # all but the last, which starts the next step
                self._free.extend(ev for _, ev in marks[:-1])

    def window(self) -> dict[str, float]:
        """Median of each phase (ms) over the timed steps finished since the last call that
        marked it (`step`: over all of them); never waits for the GPU (steps still in flight are
        reported next time). Read where the host pauses (the loop's log step, after its sync):
        the next step's phases are not sampled."""
        self._after_pause = True
        self._resolve(block=False)
        new, self._window_start = self.steps[self._window_start:], len(self.steps)
        return _medians(new)

    def summary(self) -> dict[str, float]:
        """Median of each phase over the timed steps that marked it, plus the number of those,
        the number of timed steps and their total wall time."""
        self._resolve(block=True)
        if not self.steps:
            return {}
        out = {f"{k}_ms": v for k, v in _medians(self.steps).items()}
        out["timed_steps"] = len(self.steps)
        out["phase_timed_steps"] = sum(len(s) > 1 for s in self.steps)
        out["timed_total_s"] = sum(s["step"] for s in self.steps) / 1e3
        return out


def _medians(steps: list[dict[str, float]]) -> dict[str, float]:
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
