"""Which GPU kernels a training step runs, and which of them run on tensor cores: a torch.profiler
pass of the bare loop (ddp_lab/bench/bare.py), as the throughput benchmark's `profile=true` uses it.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from ddp_lab.bench.bare import make_bare_step
from ddp_lab.bench.common import sync


# A kernel runs on tensor cores if its name says it issues MMA instructions or takes 16-bit /
# TF32 operands in a library GEMM/conv. The markers, from cuBLAS/cuDNN/CUTLASS naming:
#   hmma (Volta/Turing/Ampere half MMA), wgmma/gmma (Hopper warpgroup MMA), tensorop (CUTLASS),
#   s16816/16816/1688/884 (MMA instruction shapes), xmma (NVIDIA's GEMM/conv template library),
#   cutlass, sm80_/sm90_ (arch-tuned library kernels), nvjet (Hopper cuBLASLt), and operand types
#   bf16 / f16 / tf32 in the name.
# They are trumped by markers of CUDA-core (SIMT) arithmetic, because xmma/sm90/cutlass kernels
# also exist in fp32 SIMT form: ffma (fused multiply-add on CUDA cores), sgemm/dgemm (classic
# SIMT GEMMs, e.g. ampere_sgemm_128x64_nn, implicit_convolve_sgemm), simt, and the operand types
# f32f32_f32f32 (fp32 in, fp32 math). ATen's own kernels (at::native::..., elementwise,
# reductions) and Inductor's pointwise/reduction Triton kernels never use tensor cores. "gemm" alone proves nothing (sgemm is SIMT).
# It is a heuristic on names; the definitive check is Nsight Compute's tensor-pipe counters
# (sm__pipe_tensor_op_hmma_cycles_active).
TC_MARKERS = ("hmma", "wgmma", "gmma", "tensorop", "16816", "1688", "884", "xmma", "cutlass",
              "sm80_", "sm86_", "sm89_", "sm90_", "sm100_", "nvjet", "bf16", "f16", "tf32")
SIMT_MARKERS = ("ffma", "sgemm", "dgemm", "simt", "f32f32_f32f32", "at::native", "triton_poi",
                "triton_red", "triton_per")


def is_tensor_core_kernel(name: str) -> bool:
    n = name.lower()
    if any(m in n for m in SIMT_MARKERS):
        return False
    return any(m in n for m in TC_MARKERS)


def profile_pass(cfg, device: torch.device, steps: int, top_k: int) -> tuple[list[dict], dict]:
    """Profile `steps` eager bare steps; returns (top kernels or CPU ops, summary)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    step, _ = make_bare_step(cfg, device)
    for _ in range(3):
        step()
    sync(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        sync(device)
    totals: dict[str, list] = defaultdict(lambda: [0.0, 0])
    if device.type == "cuda":
        for e in prof.events():
            if e.device_type == DeviceType.CUDA:
                totals[e.name][0] += e.time_range.elapsed_us()
                totals[e.name][1] += 1
        if not totals:  # older/newer profilers: fall back to the averaged table's device times
            print("warning: the profiler listed no CUDA events; kernel times are taken from its "
                  "averaged table (key_averages) instead", flush=True)
            for e in prof.key_averages():
                t = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
                if t and e.device_type == DeviceType.CUDA:
                    totals[e.key] = [t, e.count]
    else:
        for e in prof.key_averages():
            totals[e.key] = [e.self_cpu_time_total, e.count]
    all_us = sum(t for t, _ in totals.values()) or float("nan")
    rows = []
    for name, (us, calls) in sorted(totals.items(), key=lambda kv: -kv[1][0]):
        tc = is_tensor_core_kernel(name) if device.type == "cuda" else None
        rows.append({"precision": cfg.precision.name, "kernel": name[:110],
                     "calls_per_step": calls / steps, "ms_per_step": us / 1e3 / steps,
                     "pct": 100 * us / all_us, "tensor_core": "n/a" if tc is None else ("yes" if tc else "no")})
    tc_us = sum(us for name, (us, _) in totals.items()
                if device.type == "cuda" and is_tensor_core_kernel(name))
    summary = {"precision": cfg.precision.name, "channels_last": cfg.train.channels_last,
               "batch": cfg.train.batch_size,
               "gpu_ms_per_step" if device.type == "cuda" else "cpu_ms_per_step": all_us / 1e3 / steps,
               "kernels": len(totals),
               "tensor_core_pct": 100 * tc_us / all_us if device.type == "cuda" else float("nan"),
               "top_kernel": rows[0]["kernel"][:60] if rows else ""}
    return rows[:top_k], summary
