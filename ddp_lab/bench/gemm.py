"""GEMM throughput, CPU vs GPU, per size and dtype: the seeds' "a 4096^2 GEMM is two to three
orders of magnitude faster on the GPU" and "Tensor Cores with FP16/BF16 run an order of magnitude
above FP32", measured.

    python -m ddp_lab.bench.gemm                                  # GPU sizes x dtypes + CPU, speed-ups
    python -m ddp_lab.bench.gemm device=cpu cpu_sizes=[256,512]  # CPU only
    python -m ddp_lab.bench.gemm numpy_compare=true               # the seed's 10000^2 NumPy dot vs GPU

TFLOP/s = 2 n^3 / t (n^3 multiply-adds). Every row checks its own result: `check_rows` random rows
of C are recomputed in float64 from the same (already rounded) inputs and the relative Frobenius
error must be under the dtype's tolerance, so a wrong or silently-TF32 kernel cannot look fast:
fp32's tolerance (5e-5) is an order of magnitude below what TF32's 10-bit mantissa gives (~5e-4).
fp32 means TF32 off (`torch.backends.cuda.matmul.allow_tf32=False`), tf32 the same fp32 tensors
with it on. TF32 is a CUDA math mode; on the CPU it is skipped.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
from hydra.core.config_store import ConfigStore

from ddp_lab.bench.common import (calls_per_sample, entry, plot_lines, report, resolve_device,
                                  sync, write_info)
from ddp_lab.metrics import time_fn
from ddp_lab.config import ConfigError

DTYPES = {"fp64": torch.float64, "fp32": torch.float32, "tf32": torch.float32,
          "fp16": torch.float16, "bf16": torch.bfloat16}
# Relative Frobenius error allowed against the float64 product of the same inputs.
TOLERANCE = {"fp64": 1e-12, "fp32": 5e-5, "tf32": 5e-3, "fp16": 5e-3, "bf16": 2e-2}


@dataclass
class GemmConfig:
    device: str = "auto"  # auto | cpu | cuda (cuda also measures the CPU, for the speed-up)
    sizes: list[int] = field(default_factory=lambda: [1024, 2048, 4096, 8192])  # n on the GPU
    dtypes: list[str] = field(default_factory=lambda: ["fp32", "tf32", "fp16", "bf16"])
    cpu_sizes: list[int] = field(default_factory=lambda: [256, 512, 1024])
    cpu_dtypes: list[str] = field(default_factory=lambda: ["fp32", "bf16"])
    warmup: int = 5
    iters: int = 20
    cpu_warmup: int = 1
    cpu_iters: int = 3
    cpu_budget_s: float = 30.0  # skip a CPU size whose predicted time (from the last) is above this
    check_rows: int = 64  # rows of C recomputed in float64
    numpy_compare: bool = False  # the seed's NumPy float64 dot vs the GPU
    numpy_n: int = 2048  # the seed uses 10000
    numpy_single_thread_n: int = 1024  # also time NumPy on one thread at this n (0: skip)
    seed: int = 0
    plot: bool = False


ConfigStore.instance().store(name="bench_gemm_schema", node=GemmConfig)


class _MathMode:
    """TF32 on or off for the duration of a block (restored after)."""

    def __init__(self, tf32: bool):
        self.tf32 = tf32

    def __enter__(self):
        self.saved = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = self.tf32

    def __exit__(self, *exc):
        torch.backends.cuda.matmul.allow_tf32 = self.saved


def relative_error(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, rows: int,
                   gen: torch.Generator) -> float:
    """||C[r] - (A[r] @ B)_float64|| / ||(A[r] @ B)_float64|| over `rows` random rows r."""
    n = a.shape[0]
    r = torch.randperm(n, generator=gen)[:min(rows, n)].to(a.device)
    ref = a[r].double() @ b.double()
    return ((c[r].double() - ref).norm() / ref.norm()).item()


def bench_one(n: int, dtype: str, device: torch.device, warmup: int, iters: int,
              check_rows: int, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed + n)
    # Random normal, non-zero inputs made on the CPU (same values on every device), then moved.
    a = torch.randn(n, n, generator=gen).to(device=device, dtype=DTYPES[dtype])
    b = torch.randn(n, n, generator=gen).to(device=device, dtype=DTYPES[dtype])
    c = torch.empty(n, n, device=device, dtype=DTYPES[dtype])
    with _MathMode(tf32=dtype == "tf32"):
        fn = lambda: torch.matmul(a, b, out=c)
        fn()  # library initialisation and kernel selection happen here, not in the estimate below
        inner = calls_per_sample(fn, device, target_s=2e-3, max_calls=50)
        t = time_fn(fn, device, warmup=warmup, iters=iters, inner=inner)
        sync(device)
    err = relative_error(a, b, c, check_rows, gen)
    flops = 2 * n**3
    return {"device": device.type, "dtype": dtype, "n": n, "time_ms": t * 1e3,
            "tflops": flops / t / 1e12, "rel_err": err, "tol": TOLERANCE[dtype],
            "ok": bool(err <= TOLERANCE[dtype])}


def gpu_dot(ha: torch.Tensor, hb: torch.Tensor, ref, device: torch.device, dtype: str) -> dict:
    """NumPy's float64 `a @ b` (pinned `ha`, `hb`) on the GPU in `dtype`: kernel only, and with
    the copies in and out; `rel_err` of the first 64 rows against NumPy's `ref`."""
    import numpy as np

    n = ha.shape[0]
    da, db = ha.to(device, DTYPES[dtype]), hb.to(device, DTYPES[dtype])
    with _MathMode(tf32=dtype == "tf32"):
        t = time_fn(lambda: da @ db, device, warmup=2, iters=5)
        hc = torch.empty(n, n, dtype=DTYPES[dtype]).pin_memory()

        def with_transfer():
            xa = ha.to(device, non_blocking=True).to(DTYPES[dtype])
            xb = hb.to(device, non_blocking=True).to(DTYPES[dtype])
            hc.copy_(xa @ xb, non_blocking=True)

        tt = time_fn(with_transfer, device, warmup=1, iters=3)
        c = (da[:64] @ db).double().cpu().numpy()
    err = float(np.linalg.norm(c - ref) / np.linalg.norm(ref))
    return {"what": f"torch {device.type} {dtype}", "dtype": dtype, "n": n, "time_s": t,
            "tflops": 2 * n**3 / t / 1e12, "rel_err": err, "with_transfer_s": tt}


def numpy_vs_gpu(cfg, device: torch.device) -> list[dict]:
    """The seed's comparison: np.dot of two n x n float64 matrices (np.random.rand, as in the
    article) against the same product on the GPU (float64, as CuPy would do with those arrays), and
    the GPU in the dtypes deep learning uses. GPU times are kernel-only like the seed's %timeit of
    cp.dot; `with_transfer_s` adds copying A and B in and C out (pinned memory)."""
    import numpy as np

    n = cfg.numpy_n
    rng = np.random.default_rng(cfg.seed)
    a, b = rng.random((n, n)), rng.random((n, n))
    rows = []
    t = time_fn(lambda: np.dot(a, b), "cpu", warmup=1, iters=2)
    ref = np.dot(a[:64], b)
    rows.append({"what": "numpy np.dot (all threads)", "dtype": "fp64", "n": n, "time_s": t,
                 "tflops": 2 * n**3 / t / 1e12, "rel_err": 0.0})
    t_numpy = t
    if cfg.numpy_single_thread_n > 0:
        m = cfg.numpy_single_thread_n
        a1, b1 = rng.random((m, m)), rng.random((m, m))
        try:
            from threadpoolctl import threadpool_limits

            with threadpool_limits(limits=1, user_api="blas"):
                t1 = time_fn(lambda: np.dot(a1, b1), "cpu", warmup=1, iters=2)
            rows.append({"what": f"numpy np.dot, 1 thread, n={m} scaled by (n/{m})^3",
                         "dtype": "fp64", "n": n, "time_s": t1 * (n / m) ** 3,
                         "tflops": 2 * m**3 / t1 / 1e12, "rel_err": 0.0})
        except ImportError:
            print("  (threadpoolctl not installed: no single-thread NumPy row)")
    if device.type == "cuda":
        ha, hb = torch.from_numpy(a).pin_memory(), torch.from_numpy(b).pin_memory()
        rows += [gpu_dot(ha, hb, ref, device, dtype) for dtype in ("fp64", "fp32", "tf32", "bf16")]
    for r in rows:
        r["speedup_vs_numpy"] = t_numpy / r["time_s"]
    return rows


def check_config(cfg) -> None:
    for d in (*cfg.dtypes, *cfg.cpu_dtypes):
        if d not in DTYPES:
            raise ConfigError(f"dtype {d!r} is not one of {', '.join(DTYPES)}")
    if min((*cfg.sizes, *cfg.cpu_sizes), default=1) <= 0 or cfg.iters <= 0 or cfg.cpu_iters <= 0:
        raise ConfigError("sizes, cpu_sizes, iters and cpu_iters must be > 0")


def gpu_rows(cfg, device: torch.device) -> list[dict]:
    rows = []
    for dtype in cfg.dtypes:
        for n in cfg.sizes:
            rows.append(bench_one(n, dtype, device, cfg.warmup, cfg.iters, cfg.check_rows, cfg.seed))
            torch.cuda.empty_cache()
    return rows


def cpu_rows(cfg) -> tuple[list[dict], list[str]]:
    """The CPU sizes in increasing order, each skipped once the last one's time, scaled by n^3,
    predicts more than cpu_budget_s; returns (rows, what was skipped)."""
    rows, skipped = [], []
    for dtype in cfg.cpu_dtypes:
        if dtype == "tf32":
            print("  (tf32 skipped on the CPU: TF32 is a CUDA math mode)")
            continue
        last = None
        for n in sorted(cfg.cpu_sizes):
            calls = cfg.cpu_warmup + cfg.cpu_iters + 2
            if last is not None and last[1] * (n / last[0]) ** 3 * calls > cfg.cpu_budget_s:
                skipped.append(f"cpu {dtype} n={n} (predicted {last[1] * (n / last[0]) ** 3 * calls:.0f} s)")
                continue
            row = bench_one(n, dtype, torch.device("cpu"), cfg.cpu_warmup, cfg.cpu_iters,
                            cfg.check_rows, cfg.seed)
            rows.append(row)
            last = (n, row["time_ms"] / 1e3)
    return rows, skipped


def add_speedups(rows: list[dict]) -> None:
    """GPU rows: vs_cpu_fp32 and vs_cpu_same, the CPU's time at the same n over the GPU's."""
    cpu = {(r["dtype"], r["n"]): r["time_ms"] for r in rows if r["device"] == "cpu"}
    for r in rows:
        if r["device"] != "cpu":
            r["vs_cpu_fp32"] = cpu[("fp32", r["n"])] / r["time_ms"] if ("fp32", r["n"]) in cpu else float("nan")
            r["vs_cpu_same"] = cpu[(r["dtype"], r["n"])] / r["time_ms"] if (r["dtype"], r["n"]) in cpu else float("nan")


def gemm_notes(rows: list[dict], skipped: list[str], cfg) -> list[str]:
    notes = [f"{sum(not r['ok'] for r in rows)} row(s) failed the float64 check"]
    if skipped:
        notes.append(f"skipped (over cpu_budget_s={cfg.cpu_budget_s:g}): " + ", ".join(skipped))
    gpu_fp32 = {r["n"]: r["tflops"] for r in rows if r["device"] == "cuda" and r["dtype"] == "fp32"}
    for d in ("tf32", "bf16", "fp16"):
        best = [(r["tflops"] / gpu_fp32[r["n"]], r["n"]) for r in rows
                if r["device"] == "cuda" and r["dtype"] == d and r["n"] in gpu_fp32]
        if best:
            ratio, n = max(best)
            notes.append(f"tensor cores: {d} reaches {ratio:.1f}x the fp32 (TF32 off) TFLOP/s at n={n}")
    speedups = [(r["vs_cpu_fp32"], r["n"], r["dtype"]) for r in rows
                if r["device"] == "cuda" and r.get("vs_cpu_fp32", float("nan")) == r.get("vs_cpu_fp32")]
    if speedups:
        s, n, d = max(speedups)
        notes.append(f"GPU/CPU: up to {s:.0f}x ({d} GPU vs fp32 CPU at n={n}); the seed claims "
                     "100-1000x for 4096^2")
    return notes


def report_numpy(cfg, device: torch.device, run_dir: str) -> int:
    """The seed's NumPy comparison, printed and written; returns its number of rows."""
    np_rows = numpy_vs_gpu(cfg, device)
    report(np_rows, run_dir, "numpy_vs_gpu",
           ["what", "dtype", "n", "time_s", "tflops", "speedup_vs_numpy", "with_transfer_s", "rel_err"],
           title=f"the seed's NumPy dot vs GPU (n={cfg.numpy_n})",
           notes=["the seed: np.dot 10000^2 ~120 s (it says single-threaded) vs CuPy ~0.8 s: 150x",
                  "np.dot is multi-threaded BLAS by default; its 1-thread row is the seed's setting"])
    return len(np_rows)


def plot_gemm(rows: list[dict], run_dir: str) -> None:
    series = {}
    for r in rows:
        series.setdefault(f"{r['device']} {r['dtype']}", ([], []))
        series[f"{r['device']} {r['dtype']}"][0].append(r["n"])
        series[f"{r['device']} {r['dtype']}"][1].append(r["tflops"])
    plot_lines(series, os.path.join(run_dir, "gemm.png"), xlabel="n (n x n @ n x n)",
               ylabel="TFLOP/s", title="GEMM throughput", logx=True, logy=True)


def run(cfg, run_dir: str) -> list[dict]:
    device = resolve_device(cfg.device)
    check_config(cfg)
    rows = gpu_rows(cfg, device) if device.type == "cuda" else []
    more, skipped = cpu_rows(cfg)
    rows += more
    add_speedups(rows)
    cols = ["device", "dtype", "n", "time_ms", "tflops", "vs_cpu_fp32", "vs_cpu_same", "rel_err", "ok"]
    report(rows, run_dir, "gemm", cols, title="GEMM: TFLOP/s = 2n^3/t",
           notes=gemm_notes(rows, skipped, cfg))
    extra = {"numpy_rows": report_numpy(cfg, device, run_dir)} if cfg.numpy_compare else {}
    if cfg.plot and rows:
        plot_gemm(rows, run_dir)
    write_info(run_dir, "gemm", cfg, device, **extra)
    return rows


main = entry(run, "bench/gemm")


if __name__ == "__main__":
    main()
