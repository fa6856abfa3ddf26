"""All-reduce timings for the alpha-beta fit when no `ddp_lab.bench.allreduce` table is given:

    torchrun --standalone --nproc_per_node=N -m ddp_lab.scale.calibrate OUT.jsonl \
        [--algos native,ring] [--sizes 4096,65536,...]

Rows have the benchmark's keys (algo, backend, world_size, dtype, bytes, time_us, algbw_GBps,
busbw_GBps, wrong), so `ddp_lab.perf.fit.fit_alpha_beta` reads either, plus `samples_us`.
Each time is the median over passes (each pass goes through every size in turn) of the slowest
rank's (MAX over ranks) median over a pass's iterations, after warm-up; `wrong` counts the
elements of a reduction of ones that differ from N.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
import torch.distributed as dist

from ddp_lab.dist import destroy_group, init_group
from ddp_lab.metrics import time_fn
from ddp_lab.perf.collectives import bus_bandwidth


def reducer(algo: str):
    if algo == "native":
        return lambda t: dist.all_reduce(t)
    from ddp_lab.comm import all_reduce  # our collectives (issue 3), where they exist
    return lambda t: all_reduce(t, algo)


def _slowest(seconds: float, device) -> float:
    t = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _time_sizes(fn, sizes: list[int], a, info) -> dict[int, list[float]]:
    """Seconds per all-reduce of each size (the slowest rank's), over `a.passes` passes that go
    through every size in turn: a burst of load on a shared machine then hits a few samples of
    many sizes, not all samples of a few, and the median leaves it out."""
    bufs = {n: torch.zeros(max(1, n // 4), device=info.device) for n in sizes}  # zeros stay 0
    iters = {}
    for n in sizes:  # every rank must run as many collectives: agreed on through MAX
        probe = _slowest(time_fn(lambda: fn(bufs[n]), info.device, warmup=a.warmup, iters=1),
                         info.device)
        iters[n] = int(min(200, max(a.iters, a.seconds / max(probe, 1e-6))))
    samples: dict[int, list[float]] = {n: [] for n in sizes}
    for _ in range(a.passes):
        for n in sizes:
            k = max(1, -(-iters[n] // a.passes))
            samples[n].append(_slowest(time_fn(lambda: fn(bufs[n]), info.device, warmup=0,
                                               iters=k), info.device))
    return samples


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--algos", default="native")
    p.add_argument("--sizes", default=",".join(str(4096 * 4 ** i) for i in range(8)))
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=6)
    p.add_argument("--passes", type=int, default=5)
    p.add_argument("--seconds", type=float, default=0.2,
                   help="timed seconds per size to aim for (more iterations for fast sizes)")
    a = p.parse_args()
    info = init_group("auto", 300.0)
    try:
        rows = []
        warm = torch.zeros(1024, device=info.device)
        for _ in range(5):  # connections and buffers set up before anything is timed
            dist.all_reduce(warm)
        sizes = [max(1, int(x) // 4) * 4 for x in a.sizes.split(",")]
        for algo in a.algos.split(","):
            fn = reducer(algo)
            wrong = {n: _wrong(fn, n, info) for n in sizes}
            for n, secs in _time_sizes(fn, sizes, a, info).items():
                sec = statistics.median(secs)
                algbw, busbw = bus_bandwidth(n, sec, info.world_size)
                rows.append({"algo": algo, "backend": info.backend, "world_size": info.world_size,
                             "dtype": "float32", "bytes": n, "time_us": sec * 1e6,
                             "algbw_GBps": algbw / 1e9, "busbw_GBps": busbw / 1e9,
                             "wrong": wrong[n], "samples_us": [x * 1e6 for x in secs]})
        if info.is_main:
            os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
            with open(a.out, "w") as f:
                for r in rows:
                    f.write(json.dumps(r) + "\n")
    finally:
        destroy_group()


def _wrong(fn, nbytes: int, info) -> int:
    """Elements of a reduction of ones that differ from the world size."""
    ones = torch.ones(max(1, nbytes // 4), device=info.device)
    fn(ones)
    return int((ones != info.world_size).sum().item())


if __name__ == "__main__":
    main()
