"""Where an all-reduce's time goes on gloo: per thread (ours vs gloo's), page faults, and our ring's
calling thread split into posting, waiting and adding.

    torchrun --standalone --nproc_per_node=2 scripts/ring_profile.py [MiB=64] [calls=20]

For `native` (dist.all_reduce) and each of our algorithms on the same fp32 tensor: the median
wall time of a call (slowest rank), the CPU time per call of each thread of rank 0's process,
summed by thread name (from /proc/self/task; `main` is the calling thread), and its minor page
faults per call. For our algorithms also: time per call inside Channel.post (posting) and
Pending.wait (waiting for transfers), and for the ring the adds. Rank 0 prints one markdown table.
"""

from __future__ import annotations

import os
import resource
import statistics
import sys
import time

import torch
import torch.distributed as dist

from ddp_lab import comm
from ddp_lab.comm import p2p, ring


def thread_cpu() -> dict[str, float]:
    """CPU seconds (user + sys) of this process's threads, summed by thread name."""
    out, hz, me = {}, os.sysconf("SC_CLK_TCK"), str(os.getpid())
    for tid in os.listdir("/proc/self/task"):
        try:
            name = "main" if tid == me else open(f"/proc/self/task/{tid}/comm").read().strip()
            fields = open(f"/proc/self/task/{tid}/stat").read().rsplit(")", 1)[1].split()
        except FileNotFoundError:  # the thread ended
            continue
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / hz
    return out


class Split:
    """Time spent in the ring's posting, waiting and adding, by wrapping those three calls."""

    def __init__(self):
        self.post = self.wait = self.land = 0.0

    def install(self):
        post, wait, land = p2p.Channel.post, p2p.Pending.wait, ring._land

        def timed(fn, attr):
            def wrapper(*args, **kwargs):
                t0 = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    setattr(self, attr, getattr(self, attr) + time.perf_counter() - t0)
            return wrapper

        p2p.Channel.post = timed(post, "post")
        p2p.Pending.wait = timed(wait, "wait")
        ring._land = timed(land, "land")  # wait + add; add = land - (waits inside land)


def profile(algo: str, x: torch.Tensor, calls: int, split: Split) -> dict:
    call = (lambda: dist.all_reduce(x)) if algo == "native" else (lambda: comm.all_reduce(x, algo))
    for _ in range(2):  # warm-up: connections, the ring's kept scratch
        call()
    split.__init__()
    dist.barrier()
    cpu0, faults0, walls = thread_cpu(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt, []
    for _ in range(calls):
        t0 = time.perf_counter()
        call()
        walls.append(time.perf_counter() - t0)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults0
    cpu = {k: v - cpu0.get(k, 0.0) for k, v in thread_cpu().items()}
    wall = torch.tensor([statistics.median(walls)])
    dist.all_reduce(wall, op=dist.ReduceOp.MAX)  # a collective is done when its last rank is
    return {"wall": wall.item(), "cpu": {k: v / calls for k, v in cpu.items() if v > 0},
            "faults": faults / calls,
            "split": (split.post / calls, split.wait / calls, split.land / calls)}


def table(results: dict, mib: float, calls: int) -> str:
    threads = sorted({t for r in results.values() for t in r["cpu"]},
                     key=lambda t: (t != "main", t))
    head = (["algo", "wall ms", "CPU ms (all threads)"] + [f"`{t}` ms" for t in threads]
            + ["page faults", "post ms", "wait ms", "add ms"])
    lines = [f"N={dist.get_world_size()}, {mib:g} MiB fp32, {calls} calls, torch "
             f"{torch.__version__}, rank 0, load {os.getloadavg()[0]:.2f}", "",
             "| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for algo, r in results.items():
        post, wait, land = r["split"]
        # the ring waits only inside _land, so its adds took land - wait
        ring_cols = [f"{post * 1e3:.2f}" if post else "", f"{wait * 1e3:.2f}" if post else "",
                     f"{(land - wait) * 1e3:.2f}" if land else ""]
        cells = ([algo, f"{r['wall'] * 1e3:.1f}", f"{sum(r['cpu'].values()) * 1e3:.1f}"]
                 + [f"{r['cpu'].get(t, 0.0) * 1e3:.1f}" for t in threads]
                 + [f"{r['faults']:.0f}"] + ring_cols)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    mib = float(sys.argv[1]) if len(sys.argv) > 1 else 64
    calls = int(sys.argv[2]) if len(sys.argv) > 2 else 20
    algos = sys.argv[3].split(",") if len(sys.argv) > 3 else ["native", "ring", "naive"]
    dist.init_process_group("gloo")
    x = torch.zeros(int(mib * 2**20) // 4)
    split = Split()
    split.install()
    results = {algo: profile(algo, x, calls, split) for algo in algos}
    if dist.get_rank() == 0:
        print(table(results, mib, calls), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
