"""Interleaved A/B, 2 gloo ranks: naive all-reduce allocating its receive buffer per call (old)
vs kept per thread (new), and gloo's own, on one zero-filled fp32 tensor per size."""
import importlib.util, statistics, sys, time
import torch, torch.distributed as dist
from ddp_lab import comm
from ddp_lab.comm.p2p import Channel

spec = importlib.util.spec_from_file_location("naive_old", "/tmp/naive_old.py")
old = importlib.util.module_from_spec(spec); spec.loader.exec_module(old)
dist.init_process_group("gloo")
rank = dist.get_rank()
REPEATS = int(sys.argv[1]) if len(sys.argv) > 1 else 20
for mib in (4, 16, 64):
    x = torch.zeros(mib * (1 << 20) // 4)
    for f in (lambda: old.all_reduce_naive(x, Channel("naive", None)), lambda: comm.all_reduce(x, "naive")):
        f()  # warm-up, and a correctness check below
    y = torch.full((1000,), float(rank + 1)); comm.all_reduce(y, "naive"); assert torch.equal(y, torch.full((1000,), 3.0))
    times = {"old": [], "new": [], "native": []}
    for rep in range(REPEATS):
        order = ["old", "new", "native"] if rep % 2 == 0 else ["native", "new", "old"]
        for name in order:
            dist.barrier()
            t = time.perf_counter()
            if name == "native":
                dist.all_reduce(x)
            elif name == "new":
                comm.all_reduce(x, "naive")
            else:
                old.all_reduce_naive(x, Channel("naive", None))
            dt = torch.tensor([time.perf_counter() - t])
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)
            times[name].append(dt.item() * 1e3)
    if rank == 0:
        med = {k: statistics.median(v) for k, v in times.items()}
        ratio = statistics.median(o / n for o, n in zip(times["old"], times["new"]))
        print(f"{mib:3d} MiB  old {med['old']:7.1f} ms  new {med['new']:7.1f} ms  native {med['native']:7.1f} ms"
              f"  old/new per repeat, median {ratio:.3f}  new/native {med['new'] / med['native']:.3f}", flush=True)
dist.destroy_process_group()
