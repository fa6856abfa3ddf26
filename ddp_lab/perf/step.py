"""Composition: one training step from its compute, its gradient buckets, the collectives that
reduce them and how the two slow each other.

One training step, as the model sees it (`predict_step`; per phase for a sweep's points in
ddp_lab/perf/predict.py):

    data + forward + backward + exposed communication + optimizer

The gradients are cut into buckets in the order backward produces them (`bucket_layout`: DDP's
rule or ours, ddp_lab/buckets.py; a parameter is never split). Bucket b is *ready* when backward
has produced the last of its gradients: at the fraction of backward the interference probe
measured (ddp_lab/perf/probe.py), else walked layer by layer, each layer taking its share of the
forward FLOPs (ddp_lab/perf/compute.py's `ModelProfile`). All-reduces run one at a time, in bucket
order, on one channel (`schedule`): each starts when its bucket is ready and the previous one is
done. While an all-reduce runs beside backward, backward advances at 1/Interference.compute of
its speed and the all-reduce at 1/Interference.comm (they share cores and memory bandwidth on a
CPU, SMs and memory bandwidth on a GPU); after backward it runs at full speed. Exposed
communication = (slowed backward - backward) + (end of the last all-reduce - end of backward,
>= 0). With Interference(1, 1) that is start_b = max(ready_b, end_{b-1}), end_b = start_b +
t(bucket_b): the model before interference. Without overlap every bucket starts when backward
ends. Not modelled here: DDP's re-ordering of buckets after the first step; contention between
ranks and stragglers are the sweep's (ddp_lab/perf/predict.py).

ZeRO (`ZERO_OPS`, `gathers`): stage 1 all-gathers the parameters after the optimizer, stage 2
also reduce-scatters the gradients instead of all-reducing them, stage 3 gathers each unit before
its forward and again before its backward (once with reshard_after_forward=false). Stage 3's
prefetch overlaps those gathers with compute; the model does not: it counts them all exposed, an
upper bound on what they cost.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from ddp_lab import buckets
from ddp_lab.perf.collectives import cost
from ddp_lab.perf.compute import ModelProfile
from ddp_lab.perf.params import NO_INTERFERENCE, Interference, Network


@dataclass(frozen=True)
class Bucket:
    nbytes: int
    ready: float  # fraction of backward done when its last gradient is produced


def bucket_layout(numels: Sequence[int], elem_bytes: int, bucket_mb: float, rule: str,
                  first_bucket_mb: float | None = None) -> list[int]:
    """Bytes per bucket of gradients of `numels` (in the order backward produces them), as a sync
    cuts them (ddp_lab/buckets.py: `ours` or `ddp`'s rule)."""
    groups = buckets.plan([n * elem_bytes for n in numels], bucket_mb, rule, first_bucket_mb)
    return [sum(numels[i] for i in g) * elem_bytes for g in groups]


def buckets_of(grads: Sequence[tuple[int, float]], elem_bytes: int, bucket_mb: float,
               rule: str = "ddp", first_bucket_mb: float | None = None) -> list[Bucket]:
    """Buckets of gradients given as (numel, ready fraction) in backward order: each is ready
    when the last of its gradients is (the latest of them, should measured ones cross)."""
    groups = buckets.plan([n * elem_bytes for n, _ in grads], bucket_mb, rule, first_bucket_mb)
    return [Bucket(sum(grads[i][0] for i in g) * elem_bytes, max(grads[i][1] for i in g))
            for g in groups]


def make_buckets(profile: ModelProfile, bucket_mb: float, elem_bytes: int,
                 first_bucket_mb: float | None = None, rule: str = "ddp") -> list[Bucket]:
    """Buckets of `profile`'s gradients in the order backward fills them, ready by FLOPs
    (bucket_layout has the rules). bucket_mb <= 0 means one bucket for everything."""
    return buckets_of(profile.gradients_in_backward_order(), elem_bytes, bucket_mb, rule,
                      first_bucket_mb)


@dataclass(frozen=True)
class Schedule:
    """One step's backward and bucket all-reduces, as `schedule` plays them."""
    backward_s: float  # backward alone
    backward_end_s: float  # backward as slowed by the communication running beside it
    comm_end_s: float  # end of the last all-reduce (0 without buckets)
    busy_s: float  # the all-reduces' times at full speed, summed
    comm_wall_s: float  # time the channel was busy (slower where it ran beside backward)

    @property
    def slowdown_s(self) -> float:
        """Backward time lost to the communication it overlapped."""
        return self.backward_end_s - self.backward_s

    @property
    def wait_s(self) -> float:
        """What is left of the communication after backward ends."""
        return max(0.0, self.comm_end_s - self.backward_end_s)

    @property
    def exposed_s(self) -> float:
        """Time the step loses to communication beyond backward alone: slowdown + wait (the
        training loop's `exposed_comm` = backward + comm - backward without communication)."""
        return self.slowdown_s + self.wait_s


def schedule(buckets: Sequence[Bucket], backward_s: float, allreduce_s: Callable[[float], float],
             overlap: bool = True, interference: Interference = NO_INTERFERENCE) -> Schedule:
    """Backward and the bucket all-reduces on one channel, in bucket order, each as soon as its
    bucket is ready and the previous one is done. While both run, backward advances at
    1/interference.compute of its speed and the all-reduce at 1/interference.comm; after backward
    the all-reduces run at full speed. Without interference this is start_b = max(ready_b,
    end_{b-1}), end_b = start_b + t_b: the model of the module docstring."""
    return schedule_times([b.ready for b in buckets], backward_s,
                          [allreduce_s(b.nbytes) for b in buckets], overlap, interference)


def schedule_times(ready_fractions: Sequence[float], backward_s: float,
                   times_s: Sequence[float], overlap: bool = True,
                   interference: Interference = NO_INTERFERENCE) -> Schedule:
    """`schedule` given each bucket's time on the channel rather than a price of its bytes: for
    work whose time is not one function of the size (a compressor's, an emulated link's)."""
    ready = [r * backward_s if overlap else backward_s for r in ready_fractions]
    sc, sm = interference.compute, interference.comm
    t = work = busy = wall = end = 0.0
    j, left, began = 0, None, 0.0  # next bucket; work left in the one in flight; its start
    while work < backward_s:
        if left is None and j < len(times_s) and ready[j] <= work:
            left, began = times_s[j], t
            busy += left
        rate = 1.0 / sc if left is not None else 1.0
        dt, event = (backward_s - work) / rate, "backward"
        if left is not None and left * sm < dt:
            dt, event = left * sm, "comm"
        elif left is None and j < len(times_s) and (ready[j] - work) / rate < dt:
            dt, event = (ready[j] - work) / rate, "ready"
        t += dt  # (the event's own target exactly: no rounding can leave it a hair short)
        work = {"backward": backward_s, "ready": ready[j] if j < len(ready) else work}.get(
            event, work + dt * rate)
        if event == "comm":
            end, wall, left, j = t, wall + t - began, None, j + 1
        elif left is not None:
            left -= dt / sm
    backward_end = t if backward_s > 0 else 0.0
    if left is not None:  # the all-reduce in flight finishes at full speed
        end, wall, j = t + left, wall + t + left - began, j + 1
    for tb in times_s[j:]:
        start = max(end, backward_end)
        end, busy, wall = start + tb, busy + tb, wall + tb
    return Schedule(backward_s, backward_end, end, busy, wall)


def exposed_comm_s(buckets: Sequence[Bucket], backward_s: float,
                   allreduce_s: Callable[[float], float], overlap: bool = True,
                   interference: Interference = NO_INTERFERENCE) -> tuple[float, float]:
    """(exposed, busy) seconds of one step's gradient all-reduces: busy = the sum of the bucket
    all-reduce times, exposed = what the step loses to them beyond backward alone."""
    s = schedule(buckets, backward_s, allreduce_s, overlap, interference)
    return s.exposed_s, s.busy_s


ZERO_OPS = {0: ("all_reduce", None), 1: ("all_reduce", "all_gather"),
            2: ("reduce_scatter", "all_gather"),
            3: ("reduce_scatter", "all_gather")}  # ZeRO stage -> (gradient op, parameter op)


def gathers(zero: int, reshard_after_forward: bool = True) -> int:
    """How often a step all-gathers the parameters at ZeRO stage `zero`."""
    return 2 if zero == 3 and reshard_after_forward else int(zero > 0)


def bytes_per_step(algo: str, grad_bytes: float, world_size: int, zero: int = 0,
                   param_bytes: float | None = None, reshard_after_forward: bool = True,
                   node_size: int | None = None) -> float:
    """Bytes the busiest rank (rank 0 for naive and tree) sends per step for `grad_bytes` of
    gradients; linear in the size, so bucketing does not change it (up to chunk rounding). ZeRO
    adds the all-gathers (`gathers`) of `param_bytes` (default: as many as the gradients) and,
    from stage 2, reduce-scatters the gradients instead of all-reducing them. hring: on nodes of
    `node_size` ranks (None: one node)."""
    algo = "ring" if algo in ("ddp", "native") else algo
    reduce, gather = ZERO_OPS[zero]
    out = cost(algo, grad_bytes, world_size, reduce, node_size).bytes_per_rank
    if gather:
        out += gathers(zero, reshard_after_forward) * cost(
            algo, grad_bytes if param_bytes is None else param_bytes, world_size,
            gather, node_size).bytes_per_rank
    return out


@dataclass(frozen=True)
class StepPrediction:
    step_s: float
    compute_s: float
    exposed_s: float  # slowdown of backward + the wait after it
    busy_s: float
    buckets: int
    slowdown_s: float = 0.0  # backward lost to communication beside it (interference)
    wait_s: float = 0.0  # communication left after backward
    gather_s: float = 0.0  # ZeRO: the parameters' all-gathers (exposed: `gathers` of them)

    def efficiency(self, step1_s: float, scale: float = 1.0) -> float:
        return step1_s / (scale * self.step_s)


def predict_step(profile: ModelProfile, network: Network, algo: str, world_size: int, *,
                 forward_s: float, backward_s: float, other_s: float = 0.0,
                 bucket_mb: float = buckets.DEFAULT_BUCKET_MB, elem_bytes: int = 4, overlap: bool = True,
                 first_bucket_mb: float | None = None,
                 interference: Interference = NO_INTERFERENCE, zero: int = 0) -> StepPrediction:
    """One step on `world_size` ranks: the single-rank phases plus the modelled exposed
    communication of `algo` on `network`, slowed by `interference` where it overlaps backward.
    ZeRO stage `zero`: the buckets reduce-scattered from 2, and each bucket's parameters
    (`elem_bytes` per element, as the gradients) all-gathered `gathers(zero)` times, exposed (at
    1 and 2 after the optimizer, the next forward reads them; at 3 see the module)."""
    buckets = make_buckets(profile, bucket_mb, elem_bytes, first_bucket_mb)
    reduce, gather = ZERO_OPS[zero]
    s = schedule(buckets, backward_s,
                 lambda nb: network.collective_s(reduce, algo, nb, world_size), overlap,
                 interference)
    gather_s = gathers(zero) * sum(network.collective_s(gather, algo, b.nbytes, world_size)
                                   for b in buckets) if gather else 0.0
    return StepPrediction(forward_s + backward_s + other_s + s.exposed_s + gather_s,
                          forward_s + backward_s, s.exposed_s, s.busy_s + gather_s, len(buckets),
                          s.slowdown_s, s.wait_s, gather_s)
