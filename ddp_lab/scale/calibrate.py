"""All-reduce timings for the alpha-beta fit when no `ddp_lab.bench.allreduce` table is given:

    torchrun --standalone --nproc_per_node=N -m ddp_lab.scale.calibrate OUT.jsonl \
        [--algos native,ring] [--sizes 4096,65536,...]

Rows have the benchmark's keys (algo, backend, world_size, dtype, bytes, time_us, algbw_GBps,
busbw_GBps, wrong), so `ddp_lab.cost.network.fit_alpha_beta` reads either. Each time is the
median over iterations after warm-up of the slowest rank (MAX over ranks); `wrong` counts the
elements of a reduction of ones that differ from N.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist

from ddp_lab.dist import destroy_group, init_group
from ddp_lab.bench.common import time_fn
from ddp_lab.comm.cost import bus_bandwidth


def reducer(algo: str):
    if algo == "native":
        return lambda t: dist.all_reduce(t)
    from ddp_lab.comm import all_reduce  # our collectives (issue 3), where they exist
    return lambda t: all_reduce(t, algo)


def _slowest(seconds: float, device) -> float:
    t = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--algos", default="native")
    p.add_argument("--sizes", default=",".join(str(4096 * 4 ** i) for i in range(8)))
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--seconds", type=float, default=0.2,
                   help="timed seconds per size to aim for (more iterations for fast sizes)")
    a = p.parse_args()
    info = init_group("auto", 300.0)
    try:
        rows = []
        warm = torch.zeros(1024, device=info.device)
        for _ in range(5):  # connections and buffers set up before anything is timed
            dist.all_reduce(warm)
        for algo in a.algos.split(","):
            fn = reducer(algo)
            for nbytes in map(int, a.sizes.split(",")):
                numel = max(1, nbytes // 4)
                ones = torch.ones(numel, device=info.device)
                fn(ones)
                wrong = int((ones != info.world_size).sum().item())
                buf = torch.zeros(numel, device=info.device)  # zeros stay zeros: no overflow
                # Every rank must run the same number of collectives: the iteration count comes
                # from one probe's slowest-rank time, agreed on through MAX.
                probe = _slowest(time_fn(lambda: fn(buf), info.device, warmup=a.warmup, iters=1),
                                 info.device)
                iters = int(min(200, max(a.iters, a.seconds / max(probe, 1e-6))))
                sec = _slowest(time_fn(lambda: fn(buf), info.device, warmup=0, iters=iters),
                               info.device)
                algbw, busbw = bus_bandwidth(numel * 4, sec, info.world_size)
                rows.append({"algo": algo, "backend": info.backend, "world_size": info.world_size,
                             "dtype": "float32", "bytes": numel * 4, "time_us": sec * 1e6,
                             "algbw_GBps": algbw / 1e9, "busbw_GBps": busbw / 1e9,
                             "wrong": wrong})
        if info.is_main:
            os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
            with open(a.out, "w") as f:
                for r in rows:
                    f.write(json.dumps(r) + "\n")
    finally:
        destroy_group()


if __name__ == "__main__":
    main()
