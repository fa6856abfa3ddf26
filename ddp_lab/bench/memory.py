"""Memory bandwidth: host memory copy vs device memory copy, and host<->device transfers. The seed's
table claims DDR4 ~50 GB/s vs HBM2 ~1.5 TB/s ("30x"); this measures what a copy reaches here.

    python -m ddp_lab.bench.memory                       # host, device, H2D/D2H pinned and pageable
    python -m ddp_lab.bench.memory device=cpu sizes_mb=[64]

Definitions (nccl-tests style: say what is counted):
- host_copy / device_copy: dst.copy_(src) of S bytes; bandwidth = 2 S / t (S read + S written).
  A CPU's DRAM may also read dst before writing it (write-allocate), so its real traffic can be
  3 S; a GPU copy streams. host_copy_1t is the same on one CPU thread.
- h2d / d2h: S bytes across the host link (PCIe/NVLink-C2C) in one direction; bandwidth = S / t,
  from page-locked (pinned) or ordinary pageable host memory.
Copies smaller than the GPU's L2 (50 MB on H100/H200) or the CPU's last-level cache measure the
cache, not the memory: the `in_cache` column says which rows those are, and the summary uses the
largest size. Every row checks that the destination equals the source (`ok`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
from hydra.core.config_store import ConfigStore

from ddp_lab.bench.common import (entry, plot_lines, report, resolve_device, series_of,
                                  write_info)
from ddp_lab.metrics import time_fn
from ddp_lab.bench.vector_add import random_vector
from ddp_lab.config import ConfigError


@dataclass
class MemoryConfig:
    device: str = "auto"  # auto | cpu | cuda
    sizes_mb: list[int] = field(default_factory=lambda: [16, 256, 1024, 4096])  # GPU machine
    cpu_sizes_mb: list[int] = field(default_factory=lambda: [4, 64, 256])  # device resolves to cpu
    warmup: int = 2
    iters: int = 10
    big_iters: int = 3  # iterations for copies of >= 1 GB
    single_thread: bool = True
    pageable: bool = True
    plot: bool = False


ConfigStore.instance().store(name="bench_memory_schema", node=MemoryConfig)


def cpu_cache_bytes() -> int:
    """The largest CPU cache level's size (Linux sysfs), 0 if unknown."""
    best = 0
    base = "/sys/devices/system/cpu/cpu0/cache"
    try:
        for d in os.listdir(base):
            try:
                with open(os.path.join(base, d, "size")) as f:
                    s = f.read().strip()
                mult = {"K": 1024, "M": 1024**2}.get(s[-1], 1)
                best = max(best, int(s.rstrip("KM")) * mult)
            except (OSError, ValueError):
                continue
    except OSError:
        pass
    return best


def _row(kind: str, nbytes: int, t: float, counted: int, ok: bool, in_cache: bool) -> dict:
    return {"kind": kind, "size_mb": nbytes / 1e6, "time_ms": t * 1e3, "bytes_counted": counted,
            "gbs": counted / t / 1e9, "in_cache": in_cache, "ok": ok}


def host_rows(src: torch.Tensor, dst: torch.Tensor, cfg, warmup: int, iters: int,
              llc: int) -> list[dict]:
    """dst.copy_(src) in host memory, on all threads and (single_thread=true) on one."""
    nbytes = src.numel() * 4
    t = time_fn(lambda: dst.copy_(src), "cpu", warmup=warmup, iters=iters)
    rows = [_row("host_copy", nbytes, t, 2 * nbytes, bool(torch.equal(dst, src)),
                 2 * nbytes <= llc)]
    if cfg.single_thread:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            dst.zero_()
            t = time_fn(lambda: dst.copy_(src), "cpu", warmup=warmup, iters=iters)
        finally:
            torch.set_num_threads(threads)
        rows.append(_row("host_copy_1t", nbytes, t, 2 * nbytes, bool(torch.equal(dst, src)),
                         2 * nbytes <= llc))
    return rows


def device_rows(src: torch.Tensor, dst: torch.Tensor, cfg, device: torch.device, warmup: int,
                iters: int, l2: int) -> list[dict]:
    """A device copy, then host->device and back from pinned and (pageable=true) pageable memory."""
    nbytes = src.numel() * 4
    dsrc = src.to(device)
    ddst = torch.empty_like(dsrc)
    t = time_fn(lambda: ddst.copy_(dsrc), device, warmup=warmup, iters=iters)
    rows = [_row("device_copy", nbytes, t, 2 * nbytes, bool(torch.equal(ddst, dsrc)),
                 2 * nbytes <= l2)]
    pinned = src.pin_memory()
    pback = torch.empty_like(pinned).pin_memory()
    ddst.zero_()
    t = time_fn(lambda: ddst.copy_(pinned, non_blocking=True), device, warmup, iters)
    rows.append(_row("h2d_pinned", nbytes, t, nbytes, bool(torch.equal(ddst, dsrc)), False))
    t = time_fn(lambda: pback.copy_(dsrc, non_blocking=True), device, warmup, iters)
    torch.cuda.synchronize(device)
    rows.append(_row("d2h_pinned", nbytes, t, nbytes, bool(torch.equal(pback, src)), False))
    if cfg.pageable:
        ddst.zero_()
        t = time_fn(lambda: ddst.copy_(src), device, warmup, iters)
        rows.append(_row("h2d_pageable", nbytes, t, nbytes, bool(torch.equal(ddst, dsrc)), False))
        dst.zero_()
        t = time_fn(lambda: dst.copy_(dsrc), device, warmup, iters)
        rows.append(_row("d2h_pageable", nbytes, t, nbytes, bool(torch.equal(dst, src)), False))
    return rows


def memory_notes(rows: list[dict]) -> list[str]:
    biggest = max(r["size_mb"] for r in rows)
    at_top = {r["kind"]: r["gbs"] for r in rows if r["size_mb"] == biggest}
    notes = [f"{sum(not r['ok'] for r in rows)} row(s) where the copy differs from its source",
             "the seed: DDR4 ~50 GB/s vs HBM2 ~1.5 TB/s (30x); its 'HBM latency ~10 ns vs DDR4 "
             "~100 ns' is wrong: GPU DRAM latency is hundreds of ns, bandwidth is what HBM buys"]
    if "device_copy" in at_top:
        notes.append(f"at {biggest:.0f} MB: device copy {at_top['device_copy']:.0f} GB/s vs host copy "
                     f"{at_top['host_copy']:.1f} GB/s = {at_top['device_copy'] / at_top['host_copy']:.0f}x")
    else:
        notes.append(f"at {biggest:.0f} MB: host copy {at_top['host_copy']:.1f} GB/s")
    return notes


def plot_memory(rows: list[dict], run_dir: str) -> None:
    plot_lines(series_of(rows, "kind", "size_mb", "gbs"), os.path.join(run_dir, "memory.png"), xlabel="MB copied",
               ylabel="GB/s", title="memory bandwidth", logx=True, logy=True)


def run(cfg, run_dir: str) -> list[dict]:
    device = resolve_device(cfg.device)
    sizes = cfg.sizes_mb if device.type == "cuda" else cfg.cpu_sizes_mb
    if not sizes or min(sizes) <= 0 or cfg.iters <= 0:
        raise ConfigError("sizes_mb / cpu_sizes_mb must be non-empty and > 0, iters > 0")
    llc = cpu_cache_bytes()
    l2 = (getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0)
          if device.type == "cuda" else 0)
    rows = []
    for mb in sizes:
        n = mb * 10**6 // 4
        warmup, iters = (1, cfg.big_iters) if mb >= 1024 else (cfg.warmup, cfg.iters)
        src = random_vector(n, salt=mb)  # random, non-zero
        dst = torch.empty_like(src)
        rows += host_rows(src, dst, cfg, warmup, iters, llc)
        if device.type == "cuda":
            rows += device_rows(src, dst, cfg, device, warmup, iters, l2)
            torch.cuda.empty_cache()  # device_rows' buffers died with it: release them
        print(f"  {mb} MB done", flush=True)
    report(rows, run_dir, "memory", ["kind", "size_mb", "time_ms", "gbs", "bytes_counted",
                                     "in_cache", "ok"],
           title="memory bandwidth (GB/s = counted bytes / t)", notes=memory_notes(rows))
    if cfg.plot:
        plot_memory(rows, run_dir)
    write_info(run_dir, "memory", cfg, device, cpu_cache_bytes=llc, gpu_l2_bytes=l2)
    return rows


main = entry(run, "bench/memory")


if __name__ == "__main__":
    main()
