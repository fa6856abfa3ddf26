"""Vector add c = a + b, CPU vs GPU, from 1e3 to 1e9 elements: the seed's "the GPU only pays off
for large vectors, and the host<->device transfer is not negligible for a simple addition",
measured, with the crossover size.

    python -m ddp_lab.bench.vector_add                          # 1e3..1e9 on a GPU machine
    python -m ddp_lab.bench.vector_add device=cpu max_exp=6     # CPU columns only

Columns (float32, times are medians per add):
- cpu: torch.add on all the CPU threads torch uses; cpu1: on one thread (the seed's C loop).
- gpu_kernel: the add kernel alone on data already on the GPU (back-to-back launches, so launch
  overhead is hidden only as far as the GPU queue hides it).
- gpu_total: copy a and b host->device, add, copy c device->host, from ordinary (pageable) host
  memory as the seed's cudaMemcpy does; gpu_pinned: the same from page-locked memory.
Buffers are allocated once, outside the timing. Small vectors stay in the GPU's L2 and the CPU's
caches between repeats, as they would in a loop. GB/s counts 12 bytes per element (2 reads, 1
write). Every row checks that the GPU's c, copied back, equals the CPU's bit for bit (`ok`).
Sizes whose buffers would take more than `mem_fraction` of free host or GPU memory are skipped.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
from hydra.core.config_store import ConfigStore

from ddp_lab.bench.common import (calls_per_sample, entry, plot_lines, report, resolve_device,
                                  write_info)
from ddp_lab.metrics import time_fn
from ddp_lab.config import ConfigError


@dataclass
class VectorAddConfig:
    device: str = "auto"  # auto | cpu | cuda
    sizes: list[int] = field(default_factory=list)  # explicit element counts; empty: the range below
    min_exp: int = 3  # 10^min_exp elements ...
    max_exp: int = 9  # ... to 10^max_exp on a GPU machine
    cpu_max_exp: int = 7  # ... to 10^cpu_max_exp when device resolves to cpu
    points_per_decade: int = 2
    warmup: int = 2
    iters: int = 7
    big_iters: int = 3  # iterations for vectors of >= 1e8 elements (seconds each)
    single_thread: bool = True  # also time the CPU on one thread
    pinned: bool = True  # also time transfers from pinned memory
    mem_fraction: float = 0.5
    plot: bool = False


ConfigStore.instance().store(name="bench_vector_add_schema", node=VectorAddConfig)


def size_list(cfg, device: torch.device) -> list[int]:
    if cfg.sizes:
        return sorted(int(s) for s in cfg.sizes)
    top = cfg.max_exp if device.type == "cuda" else min(cfg.max_exp, cfg.cpu_max_exp)
    steps = (top - cfg.min_exp) * cfg.points_per_decade
    return sorted({int(round(10 ** (cfg.min_exp + i / cfg.points_per_decade))) for i in range(steps + 1)})


def host_available_bytes() -> float:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def crossover(sizes: list[int], slow: list[float], fast: list[float]) -> str:
    """The smallest size from which `fast` beats `slow` at that and every larger measured size."""
    pairs = [(n, s, f) for n, s, f in zip(sizes, slow, fast) if s == s and f == f]
    if not pairs:
        return "n/a"
    best = None
    for n, s, f in reversed(pairs):
        if f < s:
            best = n
        else:
            break
    if best is None:
        return "none"
    return f"{best:.3g}" if best != pairs[0][0] else f"<= {best:.3g}"


def random_vector(n: int, salt: int) -> torch.Tensor:
    """n random, non-zero float32 values, made quickly: a random block of 1M values in [0.5, 1.5)
    tiled to length n (torch.randn of 1e9 values would take longer than the benchmark)."""
    gen = torch.Generator().manual_seed(salt)
    block = torch.rand(min(n, 1 << 20), generator=gen) + 0.5
    reps = -(-n // len(block))
    return block.repeat(reps)[:n] if reps > 1 else block  # a contiguous view: no copy


def timed(fn, dev, warmup: int, iters: int) -> float:
    """time_fn with enough back-to-back calls per sample for a millisecond of work."""
    inner = calls_per_sample(fn, dev, target_s=1e-3, max_calls=1000)
    return time_fn(fn, dev, warmup=warmup, iters=iters, inner=inner)


def pinned_ms(a, b, da, db, dc, expected, device: torch.device, warmup: int,
              iters: int) -> tuple[float, bool]:
    """Milliseconds per add with the copies from and to page-locked host memory, and whether
    the result copied back is `expected`."""
    pa, pb = a.pin_memory(), b.pin_memory()
    pc = torch.empty(len(a), pin_memory=True)

    def total_pinned():
        da.copy_(pa, non_blocking=True)
        db.copy_(pb, non_blocking=True)
        torch.add(da, db, out=dc)
        pc.copy_(dc, non_blocking=True)

    ms = timed(total_pinned, device, warmup, iters) * 1e3
    torch.cuda.synchronize(device)
    return ms, bool(torch.equal(pc, expected))


def gpu_times(row: dict, a, b, expected, device: torch.device, cfg, warmup: int,
              iters: int) -> bool:
    """The GPU columns of `row`: with pageable transfers, the kernel alone, with pinned
    transfers (pinned=true), and the speed-ups; True if every result copied back is `expected`."""
    n = len(a)
    da, db = torch.empty(n, device=device), torch.empty(n, device=device)
    dc = torch.empty(n, device=device)
    back = torch.empty_like(a)

    def total_pageable():
        da.copy_(a)
        db.copy_(b)
        torch.add(da, db, out=dc)
        back.copy_(dc)

    row["gpu_total_ms"] = timed(total_pageable, device, warmup, iters) * 1e3
    ok = bool(torch.equal(back, expected))
    row["gpu_kernel_ms"] = timed(lambda: torch.add(da, db, out=dc), device, warmup, iters) * 1e3
    if cfg.pinned:
        row["gpu_pinned_ms"], same = pinned_ms(a, b, da, db, dc, expected, device, warmup, iters)
        ok &= same
    row["gpu_kernel_gbs"] = 12 * n / (row["gpu_kernel_ms"] / 1e3) / 1e9
    row["speedup_kernel"] = row["cpu_ms"] / row["gpu_kernel_ms"]
    row["speedup_total"] = row["cpu_ms"] / row["gpu_total_ms"]
    if cfg.pinned:
        row["speedup_pinned"] = row["cpu_ms"] / row["gpu_pinned_ms"]
    return ok


def bench_size(n: int, device: torch.device, cfg) -> dict:
    big = n >= 10**8
    iters, warmup = (cfg.big_iters, 1) if big else (cfg.iters, cfg.warmup)
    a, b = random_vector(n, 1), random_vector(n, 2)
    c = torch.empty_like(a)
    row = {"n": n, "mb": 12 * n / 1e6}
    row["cpu_ms"] = timed(lambda: torch.add(a, b, out=c), "cpu", warmup, iters) * 1e3
    if cfg.single_thread:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            row["cpu1_ms"] = timed(lambda: torch.add(a, b, out=c), "cpu", warmup, iters) * 1e3
        finally:
            torch.set_num_threads(threads)
    expected = a + b
    ok = bool(torch.equal(c, expected))
    row["cpu_gbs"] = 12 * n / (row["cpu_ms"] / 1e3) / 1e9
    if device.type == "cuda":
        ok &= gpu_times(row, a, b, expected, device, cfg, warmup, iters)
        torch.cuda.empty_cache()  # gpu_times' buffers died with it: release them
    row["ok"] = ok
    return row


def too_big(n: int, device: torch.device, cfg) -> str | None:
    """Why size n is skipped (its buffers would take over mem_fraction of free memory), or None."""
    host_need = 4 * n * (5 + (3 if cfg.pinned and device.type == "cuda" else 0) + 1)
    gpu_need = 12 * n if device.type == "cuda" else 0
    gpu_free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else float("inf")
    if host_need > cfg.mem_fraction * host_available_bytes() or gpu_need > cfg.mem_fraction * gpu_free:
        return f"{n:.3g} (needs {host_need / 1e9:.1f} GB host, {gpu_need / 1e9:.1f} GB GPU)"
    return None


def crossovers(rows: list[dict], cfg) -> tuple[dict[str, str], list[str]]:
    """Per GPU column and CPU column: the size from which the GPU wins (see `crossover`), and
    the same as notes."""
    ns, col = [r["n"] for r in rows], lambda k: [r.get(k, float("nan")) for r in rows]
    pairs = {"gpu kernel only": "gpu_kernel_ms", "gpu incl. transfer (pageable)": "gpu_total_ms"}
    if cfg.pinned:
        pairs["gpu incl. transfer (pinned)"] = "gpu_pinned_ms"
    cpus = {"cpu (all threads)": "cpu_ms"}
    if cfg.single_thread:
        cpus["cpu (1 thread)"] = "cpu1_ms"
    cross, notes = {}, []
    for cname, ckey in cpus.items():
        for gname, gkey in pairs.items():
            cross[f"{gname} vs {cname}"] = crossover(ns, col(ckey), col(gkey))
            notes.append(f"crossover: {gname} beats {cname} from n = {cross[f'{gname} vs {cname}']}")
    return cross, notes


COLUMNS = ["n", "mb", "cpu_ms", "cpu1_ms", "gpu_kernel_ms", "gpu_total_ms", "gpu_pinned_ms",
           "cpu_gbs", "gpu_kernel_gbs", "speedup_kernel", "speedup_total", "speedup_pinned", "ok"]


def run(cfg, run_dir: str) -> list[dict]:
    device = resolve_device(cfg.device)
    if cfg.iters <= 0 or cfg.big_iters <= 0 or cfg.points_per_decade <= 0:
        raise ConfigError("iters, big_iters and points_per_decade must be > 0")
    if not 0 < cfg.mem_fraction <= 1:
        raise ConfigError(f"mem_fraction={cfg.mem_fraction} must be in (0, 1]")
    sizes = size_list(cfg, device)
    if not sizes or sizes[0] <= 0:
        raise ConfigError("no sizes to run (sizes must be > 0, min_exp <= max_exp)")

    rows, skipped = [], []
    for n in sizes:
        why = too_big(n, device, cfg)
        if why:
            skipped.append(why)
            continue
        rows.append(bench_size(n, device, cfg))
        print(f"  n={n:.3g} done", flush=True)

    notes = [f"{sum(not r['ok'] for r in rows)} row(s) where the GPU's sum differs from the CPU's"]
    if skipped:
        notes.append("skipped for memory: " + ", ".join(skipped))
    cross, more = (crossovers(rows, cfg) if device.type == "cuda"
                   else ({}, ["crossover: n/a without a GPU"]))
    notes += more
    report(rows, run_dir, "vector_add", [c for c in COLUMNS if any(c in r for r in rows)],
           title="vector add c = a + b (float32)", notes=notes)
    if cfg.plot and rows:
        series = {k: ([r["n"] for r in rows], [r.get(k, float("nan")) for r in rows])
                  for k in ("cpu_ms", "cpu1_ms", "gpu_kernel_ms", "gpu_total_ms", "gpu_pinned_ms")
                  if k in rows[0]}
        plot_lines(series, os.path.join(run_dir, "vector_add.png"), xlabel="elements",
                   ylabel="ms per add", title="vector add: CPU vs GPU", logx=True, logy=True)
    write_info(run_dir, "vector_add", cfg, device, crossover=cross, skipped=skipped)
    return rows


main = entry(run, "bench/vector_add")


if __name__ == "__main__":
    main()
