"""A timeline of a few training steps on every rank: when each bucket's gradients were ready, when
its all-reduce ran, and what the optimizer waited for (`train.trace=true`).

Each rank records stamps during the traced steps (`train.trace_steps` consecutive steps after
the timing warm-up) and turns them into times once tracing is over, so tracing adds no host sync
inside a step:
  * lane `compute` (the training thread): the step timer's own marks, as spans `data`,
    `forward`, `backward`, `wait` (the sync's finish(): waiting for the last all-reduces),
    `guard` (the non-finite check), `optimizer`; and an instant `bucket_ready` when backward has
    produced the last gradient of a bucket;
  * lane `comm`: one `allreduce` span per bucket (args: bucket, bytes, algo, step), stamped by the
    sync where it times its communication (ours: around `comm.all_reduce` on the communication
    thread; DDP: a comm hook, from launching the bucket's all-reduce to its future's callback).
A stamp is a host clock reading (`time.perf_counter`) or, on CUDA, an event on the stream doing
the work; events are put on the host clock through an anchor event recorded on an idle GPU.

Clocks across ranks: ranks on rank 0's host share its monotonic clock (offset 0); a rank on
another host is shifted by the median, over a few barriers, of (rank 0's clock - its clock) read
just after each barrier, which is exact to within the barrier's exit skew.

`write()` merges every rank's spans into `trace.json` (Chrome trace format: open it in
https://ui.perfetto.dev or chrome://tracing; `pid` is the rank, times in microseconds), draws
`timeline.png`, and returns the `overlap` block of summary.json.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

LANES = {"compute": 0, "comm": 1}
PHASE_SPANS = {"data": "data", "forward": "forward", "backward": "backward", "comm": "wait",
               "guard": "guard", "optim": "optimizer", "graph": "step (CUDA graph)"}


@dataclass
class Tracer:
    """One rank's stamps for steps `first` .. `last` (1-based, inclusive)."""
    device: torch.device
    first: int = 0
    last: int = -1
    step: int | None = None  # the traced step in progress, None outside the traced steps
    spans: list = field(default_factory=list)  # (lane, name, start stamp, end stamp, args)
    instants: list = field(default_factory=list)  # (lane, name, stamp, args)
    _anchor: tuple | None = None  # CUDA: (anchor event, its host time in us)

    def begin_step(self, step: int) -> bool:
        """Called by the loop before each step; True while `step` is traced."""
        self.step = step if self.first <= step <= self.last else None
        if self.step == self.first and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # once: events' clock meets the host's here
            anchor = torch.cuda.Event(enable_timing=True)
            anchor.record()
            anchor.synchronize()
            self._anchor = (anchor, time.perf_counter() * 1e6)
        return self.step is not None

    def stamp(self):
        """Now, on the current stream (CUDA) or the host clock."""
        if self.device.type != "cuda":
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def span(self, lane: str, name: str, start, end, **args) -> None:
        self.spans.append((lane, name, start, end, dict(args, step=self.step)))

    def instant(self, lane: str, name: str, stamp, **args) -> None:
        self.instants.append((lane, name, stamp, dict(args, step=self.step)))

    def marks(self, marks: list) -> None:
        """The step timer's marks of this step, [(phase, stamp)], as contiguous compute spans."""
        for (_, start), (phase, end) in zip(marks, marks[1:]):
            self.span("compute", PHASE_SPANS.get(phase, phase), start, end)

    def _us(self, stamp) -> float:
        if isinstance(stamp, float):
            return stamp * 1e6
        anchor, host_us = self._anchor
        return host_us + anchor.elapsed_time(stamp) * 1e3

    def events(self) -> list[dict]:
        """This rank's spans and instants as Chrome trace events, on its host clock (us)."""
        if self.device.type == "cuda" and self._anchor is not None:
            torch.cuda.synchronize(self.device)
        out = []
        for lane, name, start, end, args in self.spans:
            t0 = self._us(start)
            out.append({"name": name, "ph": "X", "ts": t0, "dur": max(0.0, self._us(end) - t0),
                        "tid": LANES[lane], "args": args})
        for lane, name, stamp, args in self.instants:
            out.append({"name": name, "ph": "i", "s": "t", "ts": self._us(stamp),
                        "tid": LANES[lane], "args": args})
        return out


def clock_offsets_us(rounds: int = 5) -> list[float]:
    """Collective: per rank, what to add to its clock to read rank 0's (see the module)."""
    hosts = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, socket.gethostname())
    readings = []
    for _ in range(rounds):
        dist.barrier()
        now = [None] * dist.get_world_size()
        dist.all_gather_object(now, time.perf_counter() * 1e6)
        readings.append(now)
    return [0.0 if hosts[r] == hosts[0] else
            statistics.median(now[0] - now[r] for now in readings) for r in range(len(hosts))]


def write(tracer: Tracer, run_dir: str, is_main: bool) -> dict | None:
    """Collective: trace.json and timeline.png in `run_dir` (rank 0), and the overlap block."""
    offsets = clock_offsets_us()
    mine = tracer.events()
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    if not is_main:
        return None
    origin = min((e["ts"] + offsets[r] for r, evs in enumerate(every) for e in evs), default=0.0)
    events = []
    for rank, evs in enumerate(every):
        events += _metadata(rank)
        events += [dict(e, pid=rank, ts=e["ts"] + offsets[rank] - origin) for e in evs]
    with open(os.path.join(run_dir, "trace.json"), "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms",
                   "otherData": {"clock": "host monotonic, us; ranks aligned to rank 0",
                                 "offsets_us": offsets}}, f)
    if any(e["ph"] in ("X", "i") for e in events):  # (a run too short to trace has none)
        from ddp_lab.timeline import draw

        draw(events, os.path.join(run_dir, "timeline.png"))
    return overlap(events)


def _metadata(rank: int) -> list[dict]:
    meta = [{"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}},
            {"name": "process_sort_index", "ph": "M", "pid": rank, "args": {"sort_index": rank}}]
    return meta + [{"name": "thread_name", "ph": "M", "pid": rank, "tid": tid,
                    "args": {"name": lane}} for lane, tid in LANES.items()]


def overlap(events: list[dict]) -> dict:
    """summary.json's `overlap` block from trace events (rank 0's medians over the traced steps;
    per rank where noted). Per step:
      comm_busy_ms     time covered by all-reduce spans (busy communicating, hidden or not);
      wait_ms          the `wait` span: the training thread waiting in the sync's finish();
      exposed_comm_ms  from the last bucket_ready to the end of the wait: communication no
                       computation hid (DDP waits inside backward, so there it ends backward);
      overlap_fraction 1 - exposed / busy, at least 0;
    and per bucket the delay from bucket_ready to its all-reduce's start."""
    by_rank: dict[int, dict[int, list]] = {}
    for e in events:
        if e["ph"] in ("X", "i"):
            by_rank.setdefault(e["pid"], {}).setdefault(e["args"]["step"], []).append(e)
    per_rank = {r: [_step_overlap(evs) for _, evs in sorted(steps.items())]
                for r, steps in sorted(by_rank.items())}
    if not per_rank:
        return {}
    rank0 = per_rank[min(per_rank)]
    med = lambda rows, key: statistics.median(row[key] for row in rows)
    block = {"steps": sorted(by_rank[min(by_rank)]),
             **{k: med(rank0, k) for k in ("comm_busy_ms", "wait_ms", "exposed_comm_ms")}}
    busy = block["comm_busy_ms"]
    # (exposed can exceed busy by backward's tail after the last gradient: then nothing was hidden)
    block["overlap_fraction"] = max(0.0, 1 - block["exposed_comm_ms"] / busy) if busy > 0 else None
    delays: dict[int, list[float]] = {}
    for row in rank0:
        for b, d in row["ready_to_start_ms"].items():
            delays.setdefault(b, []).append(d)
    block["bucket_ready_to_start_ms"] = [statistics.median(delays[b]) for b in sorted(delays)]
    block["rank_exposed_comm_ms"] = [med(rows, "exposed_comm_ms") for rows in per_rank.values()]
    return block


def _step_overlap(evs: list[dict]) -> dict:
    """One rank's step: busy, wait and exposed time (ms), and each bucket's ready-to-start."""
    reduces = sorted((e for e in evs if e["name"] == "allreduce"), key=lambda e: e["ts"])
    ready = {e["args"]["bucket"]: e["ts"] for e in evs if e["name"] == "bucket_ready"}
    waits = [e for e in evs if e["name"] == "wait"]
    wait_end = max((w["ts"] + w["dur"] for w in waits), default=None)
    busy, covered_to = 0.0, float("-inf")
    for e in reduces:  # the union of the spans: DDP's all-reduces may run side by side
        start, end = max(e["ts"], covered_to), e["ts"] + e["dur"]
        busy += max(0.0, end - start)
        covered_to = max(covered_to, end)
    exposed = (max(0.0, wait_end - max(ready.values()))
               if ready and wait_end is not None else 0.0)
    return {"comm_busy_ms": busy / 1e3, "wait_ms": sum(w["dur"] for w in waits) / 1e3,
            "exposed_comm_ms": exposed / 1e3,
            "ready_to_start_ms": {e["args"]["bucket"]: (e["ts"] - ready[e["args"]["bucket"]]) / 1e3
                                  for e in reduces if e["args"]["bucket"] in ready}}
