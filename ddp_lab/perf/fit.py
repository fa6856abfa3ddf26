"""Measured link parameters: alpha and beta fitted to all-reduce timings.

The table is `python -m ddp_lab.bench.allreduce`'s (or the sweep's calibration, which writes the
same rows: ddp_lab/scale/calibrate.py). An all-reduce of S bytes on N ranks costs

    t = steps(algo, N) * alpha + critical_bytes(algo, S, N) * beta   (perf/collectives.py)

`fit_alpha_beta` finds alpha, beta >= 0 per (algo, backend) by least squares on relative errors
over the benchmark's message sizes, with one line per message-size regime where the backend
changes protocol with the size, and one fit per world size where pooling them does not fit; it
keeps the fewest of those the table needs (BIC, `_fit_group`). A `Fit` prices any collective of
its algorithm (`Fit.time_s`); a measured Network (ddp_lab/perf/params.py) is a backend's fits.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Iterable, Sequence

from ddp_lab.buckets import MiB
from ddp_lab.perf.collectives import cost


def read_table(path: str) -> list[dict]:
    """Rows of `python -m ddp_lab.bench.allreduce` (allreduce.jsonl or allreduce.csv), with keys
    algo, backend, world_size, dtype, bytes, time_us, algbw_GBps, busbw_GBps, wrong."""
    if path.endswith(".jsonl"):
        with open(path) as f:
            rows = [json.loads(line) for line in f if line.strip()]
    else:
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
    for r in rows:
        for key in ("world_size", "bytes"):
            r[key] = int(float(r[key]))
        r["time_us"] = float(r["time_us"])
        r["wrong"] = int(float(r.get("wrong") or 0))
    return rows


@dataclass(frozen=True)
class Regime:
    """alpha and beta for messages of at least `lo_bytes` bytes (up to the next regime's)."""
    lo_bytes: float
    alpha_s: float
    beta_s_per_byte: float


@dataclass(frozen=True)
class Fit:
    """An all-reduce's alpha-beta fit for one (algo, backend): one line per message-size regime
    (a backend changes protocol with the size: eager vs rendezvous sends, cache-resident vs
    streaming reductions), and one such fit per world size where the table shows that pooling
    them does not fit (ranks sharing one machine's memory bandwidth, say)."""
    algo: str
    backend: str
    regimes: tuple[Regime, ...]  # by lo_bytes, the first from 0
    r2: float  # coefficient of determination of the times, as fitted (regimes, world sizes)
    max_rel_err: float  # the worst |predicted - measured| / measured over the rows fitted
    points: int
    world_sizes: tuple[int, ...]
    by_world_size: tuple[tuple[int, "Fit"], ...] = ()  # used at those world sizes when present
    r2_one_line: float = float("nan")  # one alpha-beta line over the whole table, to compare
    max_rel_err_one_line: float = float("nan")

    def regime(self, nbytes: float) -> Regime:
        return next((r for r in reversed(self.regimes) if nbytes >= r.lo_bytes), self.regimes[0])

    def time_s(self, nbytes: float, world_size: int, op: str = "all_reduce") -> float:
        """One collective of `nbytes` on `world_size` ranks. A reduce-scatter or all-gather is
        priced with the all-reduce's alpha and beta (the same links) and its own rounds and
        bytes (ddp_lab/perf/collectives.py): for the ring, exactly half of the all-reduce."""
        per_n = dict(self.by_world_size).get(world_size)
        if per_n is not None:
            return per_n.time_s(nbytes, world_size, op)
        r = self.regime(nbytes)
        return cost(self.algo, nbytes, world_size, op).time(r.alpha_s, r.beta_s_per_byte)

    @property
    def alpha_s(self) -> float:
        """The largest messages' regime: what gradients buckets mostly are."""
        return self.regimes[-1].alpha_s

    @property
    def beta_s_per_byte(self) -> float:
        return self.regimes[-1].beta_s_per_byte

    @property
    def bandwidth_GBps(self) -> float:
        """1/beta in GB/s: the bus bandwidth for ring/native, rank 0's link for naive/tree."""
        return 1e-9 / self.beta_s_per_byte if self.beta_s_per_byte > 0 else float("inf")

    def describe(self) -> str:
        """The regimes in words: `<64 KiB: 40 us, 0.9 GB/s; >=64 KiB: 150 us, 2.1 GB/s`."""
        def one(r: Regime, hi: float | None) -> str:
            where = (f">={_kib(r.lo_bytes)}" if hi is None else
                     f"<{_kib(hi)}" if r.lo_bytes == 0 else f"{_kib(r.lo_bytes)}-{_kib(hi)}")
            bw = (f"{1e-9 / r.beta_s_per_byte:.2g} GB/s" if r.beta_s_per_byte > 0
                  else "latency only")
            return f"{where}: {r.alpha_s * 1e6:.0f} us, {bw}"
        if len(self.regimes) == 1:
            return one(self.regimes[0], None).split(": ", 1)[1]
        his = [r.lo_bytes for r in self.regimes[1:]] + [None]
        return "; ".join(one(r, hi) for r, hi in zip(self.regimes, his))

    def as_row(self) -> dict:
        return {"algo": self.algo, "backend": self.backend, "regimes": len(self.regimes),
                "per_world_size": "yes" if self.by_world_size else "no",
                "fit": self.describe() if not self.by_world_size else "; ".join(
                    f"N={n}: {f.describe()}" for n, f in self.by_world_size),
                "alpha_us": self.alpha_s * 1e6, "bandwidth_GBps": self.bandwidth_GBps,
                "r2": self.r2, "max_rel_err_pct": 100 * self.max_rel_err,
                "r2_one_line": self.r2_one_line,
                "max_rel_err_one_line_pct": 100 * self.max_rel_err_one_line,
                "points": self.points, "world_sizes": " ".join(map(str, self.world_sizes))}


def _kib(nbytes: float) -> str:
    return f"{nbytes / MiB:g} MiB" if nbytes >= MiB else f"{nbytes / 1024:g} KiB"


def _nnls2(a: Sequence[tuple[float, float]], y: Sequence[float]) -> tuple[float, float]:
    """argmin ||A x - y||^2 over x >= 0 for two unknowns: the unconstrained solution if it is
    non-negative, else the better of the two one-variable fits (the KKT cases of a 2-D NNLS)."""
    import numpy as np

    A, Y = np.asarray(a, dtype=float), np.asarray(y, dtype=float)
    # Scale the columns (latency rounds vs bytes differ by ~1e8) before solving.
    scale = np.where(np.abs(A).max(axis=0) > 0, np.abs(A).max(axis=0), 1.0)
    As = A / scale
    x, *_ = np.linalg.lstsq(As, Y, rcond=None)
    candidates = []
    if (x >= 0).all():
        candidates.append(x)
    for j in range(2):
        col = As[:, j]
        denom = col @ col
        xj = np.zeros(2)
        xj[j] = max(0.0, (col @ Y) / denom) if denom > 0 else 0.0
        candidates.append(xj)
    best = min(candidates, key=lambda c: float(((As @ c - Y) ** 2).sum()))
    return tuple(float(v) for v in best / scale)


# Relative errors below this (timer resolution, run-to-run noise of a median) buy no extra regime
# and no per-world-size fit: the model selection below counts them as this large.
REL_NOISE_FLOOR = 0.01
MIN_SIZES_PER_REGIME = 3  # two parameters per line: a third size is what checks it


def _line(rows: list[dict], algo: str) -> tuple[float, float, list[float]]:
    """alpha, beta >= 0 minimising relative errors over `rows`; and the relative residuals."""
    a, y, cs = [], [], []
    for r in rows:
        c, t = cost(algo, r["bytes"], int(r["world_size"])), float(r["time_us"]) * 1e-6
        a.append((c.steps / t, c.critical_bytes / t))
        y.append(1.0)
        cs.append((c, t))
    alpha, beta = _nnls2(a, y)
    return alpha, beta, [c.time(alpha, beta) / t - 1 for c, t in cs]


def _segments(sizes: list[int], k: int):
    """Every way to cut the sorted sizes into k runs of at least MIN_SIZES_PER_REGIME sizes."""
    from itertools import combinations

    m = MIN_SIZES_PER_REGIME
    if k == 1:  # one line always fits, however few the sizes
        yield sizes[:1]
        return
    for cuts in combinations(range(m, len(sizes) - m + 1), k - 1):
        bounds = (0, *cuts, len(sizes))
        if all(b - a >= m for a, b in zip(bounds, bounds[1:])):
            yield [sizes[a] for a in bounds[:-1]]


def _fit_regimes(rows: list[dict], algo: str,
                 max_regimes: int) -> tuple[tuple[Regime, ...], list[float]]:
    """The fewest size regimes the rows need (BIC on relative errors, noise floored): regimes
    and the relative residuals."""
    sizes = sorted({int(r["bytes"]) for r in rows})
    best = None
    for k in range(1, max_regimes + 1):
        for los in _segments(sizes, k):
            regimes, resid = [], []
            for lo, hi in zip(los, [*los[1:], math.inf]):
                part = [r for r in rows if lo <= int(r["bytes"]) < hi]
                alpha, beta, res = _line(part, algo)
                regimes.append(Regime(0.0 if not regimes else float(lo), alpha, beta))
                resid += res
            score = _bic(resid, 3 * k - 1)
            if best is None or score < best[0] - 1e-9:
                best = (score, tuple(regimes), resid)
    return best[1], best[2]


def _bic(resid: list[float], params: int) -> float:
    n = len(resid)
    ssr = max(sum(r * r for r in resid), n * REL_NOISE_FLOOR ** 2)
    return n * math.log(ssr / n) + params * math.log(n)


def _quality(fit: Fit, rows: list[dict]) -> tuple[float, float]:
    """(R^2 of the times, worst relative error) of `fit` over `rows`."""
    times = [float(r["time_us"]) * 1e-6 for r in rows]
    pred = [fit.time_s(r["bytes"], int(r["world_size"])) for r in rows]
    mean = sum(times) / len(times)
    ss_tot = sum((t - mean) ** 2 for t in times)
    ss_res = sum((p - t) ** 2 for p, t in zip(pred, times))
    return (1 - ss_res / ss_tot if ss_tot > 0 else float("nan"),
            max(abs(p - t) / t for p, t in zip(pred, times)))


def _fit_group(algo: str, backend: str, rs: list[dict], max_regimes: int,
               per_world_size: bool = True) -> Fit:
    """Pooled regimes, or (`per_world_size`) one fit per world size where that scores better
    (BIC)."""
    ns = tuple(sorted({int(r["world_size"]) for r in rs}))
    regimes, resid = _fit_regimes(rs, algo, max_regimes)
    pooled = Fit(algo, backend, regimes, 0.0, 0.0, len(rs), ns)
    alpha, beta, _ = _line(rs, algo)
    line = Fit(algo, backend, (Regime(0.0, alpha, beta),), 0.0, 0.0, len(rs), ns)
    per_n, resid_n, params_n = [], [], 0
    for n in ns:
        part = [r for r in rs if int(r["world_size"]) == n]
        reg_n, res_n = _fit_regimes(part, algo, max_regimes)
        per_n.append((n, Fit(algo, backend, reg_n, *_quality_of(algo, backend, reg_n, part))))
        resid_n += res_n
        params_n += 3 * len(reg_n) - 1
    use_per_n = (per_world_size and len(ns) > 1
                 and _bic(resid_n, params_n) < _bic(resid, 3 * len(regimes) - 1))
    fit = dataclasses.replace(pooled, by_world_size=tuple(per_n) if use_per_n else ())
    r2, worst = _quality(fit, rs)
    r2_line, worst_line = _quality(line, rs)
    return dataclasses.replace(fit, r2=r2, max_rel_err=worst, r2_one_line=r2_line,
                               max_rel_err_one_line=worst_line)


def _quality_of(algo, backend, regimes, rows) -> tuple:
    fit = Fit(algo, backend, regimes, 0.0, 0.0, len(rows),
              tuple(sorted({int(r["world_size"]) for r in rows})))
    return (*_quality(fit, rows), len(rows), fit.world_sizes)


def fit_alpha_beta(rows: Iterable[dict], max_regimes: int = 3,
                   world_sizes: Sequence[int] = ()) -> dict[tuple[str, str], Fit]:
    """One Fit per (algo, backend) over every (message size, world size) row with world size > 1
    and no wrong elements, minimising relative errors (so the latency term is not drowned by the
    largest messages). Up to `max_regimes` message-size regimes, and a fit per world size, where
    the table shows they are needed (`_fit_group`); one line otherwise. `world_sizes` (the
    scale app's predict.from_nproc): the rows at those world sizes only, always pooled over them,
    since a world size outside them, which this fit is to price, has no fit of its own."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        n = int(r["world_size"])
        if n > 1 and (not world_sizes or n in world_sizes) and not int(r.get("wrong") or 0) \
                and float(r["time_us"]) > 0:
            groups.setdefault((r["algo"], r.get("backend", "")), []).append(r)
    return {(algo, backend): _fit_group(algo, backend, rs, max_regimes, not world_sizes)
            for (algo, backend), rs in sorted(groups.items())}
