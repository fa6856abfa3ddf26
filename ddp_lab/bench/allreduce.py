"""All-reduce benchmark, nccl-tests style: our naive/ring/tree/hring against the backend's own.

    torchrun --standalone --nproc_per_node=2 -m ddp_lab.bench.allreduce            # 2 CPU ranks, gloo
    torchrun --standalone --nproc_per_node=8 -m ddp_lab.bench.allreduce            # 8 GPUs, NCCL
    python -m ddp_lab.bench.allreduce algos=[ring,native] dtypes=[float32] max_bytes=67108864
    torchrun --standalone --nproc_per_node=8 -m ddp_lab.bench.allreduce algos=[ring,hring,native] \
        dist.node_size=4 dist.link.gbps=1 dist.link.shared=true      # 2 emulated nodes of 4, 1 Gb/s

For every dtype, message size S (min_bytes, x factor, ..., max_bytes) and algorithm: warm-up, then
timed calls (median; the slowest rank's median, since a collective is done when its last rank is);
one row with
    algo, backend, world_size, dtype, bytes (S), time_us,
    algbw_GBps = S / t, busbw_GBps = algbw * 2(N-1)/N (nccl-tests' definitions, GB = 1e9 bytes),
    wrong = elements, summed over ranks, that differ beyond tolerance from the native all-reduce's
            result on the same input (for `native` itself: from the exact sum, which is known
            because the input is integer-valued: rank r holds (r+1) * p for a random p in
            {-1, 0, 1}, so the sum is p * N(N+1)/2, exact in every dtype for N <= 22).
Timed calls run on a separate zero-filled buffer (in place, repeated: zeros stay zeros, so no
overflow or denormals skew the timing); the check runs once, untimed, on fresh inputs.
Rank 0 prints the table and writes allreduce.jsonl, allreduce.csv (and allreduce_busbw.png) into
outputs/bench/allreduce/<overrides>/. It then prints, for every size >= 1 MiB, each algorithm's time
over native's in this run (a ratio from one run, so both saw the same machine), and whether the
target holds: ring busbw >= 0.95x native's at >= 64 MiB, fp32 (issue 20).

With more than one node (dist.node_size), the checked call of each of ours is counted too: the
bytes each node sent to the others, against the formula where there is one (`node_link_bytes`:
ring, hring), printed for the largest size and written to allreduce_nodes.jsonl and .csv with
the layout and the link.
The emulated link (dist.link) holds our collectives' messages only: `native` rows stay the
host's own all-reduce, without it.
"""

from __future__ import annotations

import functools
import os
import sys
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from hydra.core.config_store import ConfigStore

from ddp_lab import comm
from ddp_lab.dist import DistConfig, Nodes, destroy_group, init_group, link_off, nodes, print0
from ddp_lab.perf.collectives import node_link_bytes
from ddp_lab.perf.params import Link, emulated_network
from ddp_lab.bench.common import entry, format_table, plot_lines, write_rows
from ddp_lab.metrics import time_fn
from ddp_lab.errors import ConfigError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "float64": torch.float64}
COLUMNS = ["algo", "backend", "world_size", "dtype", "bytes", "time_us", "algbw_GBps",
           "busbw_GBps", "wrong"]
TARGET_RATIO, TARGET_BYTES = 0.95, 64 << 20  # issue 20: ring busbw / native's, fp32, large messages


@dataclass
class AllreduceBenchConfig:
    algos: list[str] = field(default_factory=lambda: list(comm.ALGOS))  # ours, then the reference
    dtypes: list[str] = field(default_factory=lambda: ["float32", "bfloat16"])
    min_bytes: int = 8
    max_bytes: int = 1 << 30
    factor: int = 2
    cpu_max_bytes: int = 128 << 20
    warmup: int = 5
    iters: int = 20
    min_iters: int = 3
    case_seconds: float = 1.0
    plot: bool = True
    dist: DistConfig = field(default_factory=DistConfig)


ConfigStore.instance().store(name="bench_allreduce_schema", node=AllreduceBenchConfig)


def sizes(cfg, backend: str) -> list[int]:
    top = min(cfg.max_bytes, cfg.cpu_max_bytes) if backend == "gloo" else cfg.max_bytes
    out, s = [], cfg.min_bytes
    while s <= top:
        out.append(s)
        s *= cfg.factor
    return out


def validate(cfg) -> None:
    for a in cfg.algos:
        if a not in comm.ALGOS:
            raise ConfigError(f"algos: {a!r} is not one of {', '.join(comm.ALGOS)}")
    for d in cfg.dtypes:
        if d not in DTYPES:
            raise ConfigError(f"dtypes: {d!r} is not one of {', '.join(DTYPES)}")
    if not cfg.algos or not cfg.dtypes:
        raise ConfigError("algos and dtypes must not be empty")
    if cfg.min_bytes < 1 or cfg.max_bytes < cfg.min_bytes:
        raise ConfigError(f"need 1 <= min_bytes <= max_bytes, got {cfg.min_bytes} and {cfg.max_bytes}")
    if cfg.factor < 2:
        raise ConfigError(f"factor={cfg.factor} must be >= 2")
    if cfg.warmup < 0 or cfg.min_iters < 1 or cfg.iters < 1:
        raise ConfigError(f"need warmup >= 0, iters >= 1 and min_iters >= 1, got {cfg.warmup}, "
                          f"{cfg.iters} and {cfg.min_iters}")


def _agree(value: float, op, device) -> float:
    """The same number on every rank (MAX or SUM), so all ranks take the same decisions."""
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=op)
    return t.item()


def _wrong(result: torch.Tensor, reference: torch.Tensor, n: int, chunk: int = 1 << 24) -> int:
    """Elements of `result` further than n roundings (relative, at least absolute 1 ulp of 1)
    from `reference`; in chunks, so a 1 GB check needs no 8 GB of float64 temporaries."""
    eps, bad = torch.finfo(result.dtype).eps, 0
    for a, b in zip(result.view(-1).split(chunk), reference.view(-1).split(chunk)):
        ref = b.double()
        bad += int(((a.double() - ref).abs() > eps * n * ref.abs().clamp(min=1)).sum().item())
    return bad


def bench(cfg, run_dir: str) -> list[dict]:
    validate(cfg)
    info = init_group(cfg.dist.backend, cfg.dist.timeout_s, cfg.dist.node_size, cfg.dist.link)
    try:
        return _bench(cfg, run_dir, info)
    finally:
        destroy_group()


def _bench(cfg, run_dir, info) -> list[dict]:
    device, n, rank = info.device, info.world_size, info.rank
    layout = nodes()
    dist.barrier()
    rows, crossings = [], []
    todo = sizes(cfg, info.backend)
    if info.backend == "gloo" and cfg.max_bytes > cfg.cpu_max_bytes:
        print0(f"gloo on CPU: sizes above cpu_max_bytes={cfg.cpu_max_bytes} left out")
    gen = torch.Generator(device=device)
    for dname in cfg.dtypes:
        dtype = DTYPES[dname]
        elem = torch.empty((), dtype=dtype).element_size()
        for nbytes in todo:
            numel = nbytes // elem
            if numel == 0:
                continue
            gen.manual_seed(numel)  # the same pattern on every rank
            pattern = torch.randint(-1, 2, (numel,), device=device, generator=gen, dtype=torch.int8)
            x = (pattern.to(dtype) * (rank + 1))
            exact = pattern.to(torch.float64) * (n * (n + 1) // 2)
            del pattern
            native = comm.all_reduce(x.clone(), "native")
            for algo in cfg.algos:
                with comm.recording() as counted:
                    out = native if algo == "native" else comm.all_reduce(x.clone(), algo)
                if layout.count > 1 and algo != "native":
                    crossings.append(_crossing(algo, dname, numel * elem, counted, layout, device))
                wrong = _wrong(out, exact if algo == "native" else native, n)
                del out
                work = torch.zeros_like(x)
                call = functools.partial(comm.all_reduce, work, algo)
                t = _timed(cfg, call, device)
                if layout.emulated and algo != "native":
                    with link_off():  # the same nodes, nothing held: what the host adds
                        crossings[-1].update(_link_model(cfg.dist, algo, numel * elem, n, t,
                                                         _timed(cfg, call, device)))
                algbw, busbw = comm.bus_bandwidth(numel * elem, t, n)
                row = {"algo": algo, "backend": info.backend, "world_size": n, "dtype": dname,
                       "bytes": numel * elem, "time_us": t * 1e6, "algbw_GBps": algbw / 1e9,
                       "busbw_GBps": busbw / 1e9,
                       "wrong": int(_agree(wrong, dist.ReduceOp.SUM, device))}
                rows.append(row)
                if info.is_main:
                    print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                   for k, v in row.items()), file=sys.stderr, flush=True)
                del work
            del x, native, exact
    if info.is_main:
        _report(cfg, rows, run_dir)
        if crossings:
            _report_nodes(cfg.dist, crossings, run_dir)
    return rows


def _timed(cfg, call, device) -> float:
    """The slowest rank's median seconds per call. A first call (warm-up) and a probe, agreed
    across ranks, decide how many calls fit case_seconds: every rank must make the same calls.
    Warm-up never takes longer than the timed part."""
    probe = _agree(time_fn(call, device, warmup=min(cfg.warmup, 1), iters=1),
                   dist.ReduceOp.MAX, device)
    iters = max(min(cfg.min_iters, cfg.iters),
                min(cfg.iters, int(cfg.case_seconds / max(probe, 1e-9))))
    warmup = min(max(cfg.warmup - 2, 0), iters)
    dist.barrier()
    return _agree(time_fn(call, device, warmup=warmup, iters=iters), dist.ReduceOp.MAX, device)


def _link_model(dcfg, algo: str, nbytes: int, n: int, t: float, host: float) -> dict:
    """The emulated link's time by the model (emulated_network, the host's own links free) beside
    the measured time and the host's alone: the link holds a rank in series with its own work, so
    the measured time should lie between the larger of the two parts and their sum."""
    free = Link(0.0, 0.0, source="the host's own links, left out")
    net = emulated_network(nodes().size, dcfg.link.latency_us, dcfg.link.gbps, free)
    model = net.allreduce_s(algo, nbytes, n)
    return {"time_us": t * 1e6, "host_us": host * 1e6, "link_model_us": model * 1e6,
            "model_err_pct": 100 * (t / (host + model) - 1)}


def _crossing(algo: str, dtype: str, nbytes: int, counted, layout: Nodes, device) -> dict:
    """Bytes each node sent to the others in one all-reduce (counted on every rank, summed), and
    the formula's (None where there is none)."""
    total = _agree(counted.cross_node_bytes, dist.ReduceOp.SUM, device)
    try:
        formula = node_link_bytes(algo, nbytes, layout.size * layout.count, layout.size)
    except ValueError:
        formula = None
    return {"algo": algo, "dtype": dtype, "bytes": nbytes, "node_size": layout.size,
            "nodes": layout.count, "cross_node_bytes_per_node": total / layout.count,
            "formula": formula}


def _report_nodes(dcfg, crossings: list[dict], run_dir: str) -> None:
    """A line per algorithm at the largest size; every row, with the link's keys, in
    allreduce_nodes.jsonl and .csv."""
    top = max(c["bytes"] for c in crossings)
    for c in crossings:
        if c["bytes"] == top:
            formula = "" if c["formula"] is None else f" (formula {c['formula'] / top:.4g} S)"
            print(f"{c['algo']}, {c['dtype']} {_size(top)}: each node sent "
                  f"{c['cross_node_bytes_per_node'] / top:.4g} S to the others{formula}",
                  flush=True)
    link = {f"link_{k}": dcfg.link[k] for k in ("latency_us", "gbps", "shared")}
    write_rows([{**c, **link} for c in crossings], run_dir, "allreduce_nodes")


def _report(cfg, rows, run_dir) -> None:
    os.makedirs(run_dir, exist_ok=True)
    print(format_table(rows, COLUMNS), flush=True)
    jsonl, csv_path = write_rows(rows, run_dir, "allreduce")
    for line in [*ratio_lines(rows), target_line(rows)]:
        print(line, flush=True)
    bad = sum(r["wrong"] for r in rows)
    print(f"{'all results correct' if bad == 0 else f'{bad} WRONG elements'}; rows in {jsonl} "
          f"and {csv_path}", flush=True)
    if cfg.plot and rows:
        series = {}
        for r in rows:
            xs, ys = series.setdefault(f"{r['algo']} {r['dtype']}", ([], []))
            xs.append(r["bytes"])
            ys.append(r["busbw_GBps"])
        path = plot_lines(series, os.path.join(run_dir, "allreduce_busbw.png"), xlabel="bytes",
                          ylabel="busbw (GB/s)", logx=True,
                          title=f"all-reduce, {rows[0]['backend']}, {rows[0]['world_size']} ranks")
        print(f"plot: {path}", flush=True)


def ratio_lines(rows, min_bytes: int = 1 << 20) -> list[str]:
    """Each algorithm's time over native's (measured in this one run) at every size >= min_bytes."""
    native = {(r["dtype"], r["bytes"]): r for r in rows if r["algo"] == "native"}
    out = []
    for r in rows:
        ref = native.get((r["dtype"], r["bytes"]))
        if r["algo"] != "native" and ref is not None and r["bytes"] >= min_bytes:
            out.append(f"{r['algo']} / native, {r['dtype']} {_size(r['bytes'])}: time "
                       f"{r['time_us'] / ref['time_us']:.3f} (busbw {r['busbw_GBps']:.3g} vs "
                       f"{ref['busbw_GBps']:.3g} GB/s)")
    return out


def target_line(rows) -> str:
    """Whether this run meets issue 20's target for our ring against the backend's all-reduce."""
    want = f"target: ring busbw >= {TARGET_RATIO}x native at >= {_size(TARGET_BYTES)}, fp32"
    native = {r["bytes"]: r for r in rows if r["algo"] == "native" and r["dtype"] == "float32"}
    got = [(r["bytes"], native[r["bytes"]]["time_us"] / r["time_us"]) for r in rows
           if r["algo"] == "ring" and r["dtype"] == "float32" and r["bytes"] >= TARGET_BYTES
           and r["bytes"] in native]
    if not got:
        return f"{want}: not measured in this run (no fp32 ring and native rows that large)"
    verdict = "holds" if all(x >= TARGET_RATIO for _, x in got) else "does NOT hold"
    return f"{want}: {verdict} ({', '.join(f'{x:.3f}x at {_size(b)}' for b, x in got)})"


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**20:g} MiB" if nbytes >= 1 << 20 else f"{nbytes} B"


main = entry(bench, "bench/allreduce")


if __name__ == "__main__":
    main()
