"""The network side of the scaling model: alpha-beta fits, the step's overlap schedule with
interference, and simulation past the hardware we have.

An all-reduce of S bytes on N ranks costs (ddp_lab.comm.cost)

    t = steps(algo, N) * alpha + critical_bytes(algo, S, N) * beta

alpha is one message round's latency, beta the inverse bandwidth of the link the critical path
crosses (for the ring, critical_bytes = 2(N-1)/N * S, so 1/beta is exactly nccl-tests' bus
bandwidth). `fit_alpha_beta` finds alpha, beta >= 0 per (algo, backend) by least squares on
relative errors over the benchmark's message sizes, with one line per message-size regime where
the backend changes protocol with the size, and one fit per world size where pooling them does
not fit; it keeps the fewest of those the table needs (BIC, `_fit_group`).

One training step, as the model sees it (`predict_step`; per phase for a sweep's points in
ddp_lab/scale/predict.py):

    data + forward + backward + exposed communication + optimizer

The gradients are cut into buckets in the order backward produces them (`bucket_layout`: DDP's
rule or ours; a parameter is never split). Bucket b is *ready* when backward has produced the
last of its gradients: at the fraction of backward the interference probe measured
(ddp_lab/scale/interfere.py), else walked layer by layer, each layer taking its share of the
forward FLOPs. All-reduces run one at a time, in bucket order, on one channel (`schedule`): each
starts when its bucket is ready and the previous one is done. While an all-reduce runs beside
backward, backward advances at 1/Interference.compute of its speed and the all-reduce at
1/Interference.comm (they share cores and memory bandwidth on a CPU, SMs and memory bandwidth on
a GPU); after backward it runs at full speed. Exposed communication = (slowed backward - backward)
+ (end of the last all-reduce - end of backward, >= 0). With Interference(1, 1) that is
start_b = max(ready_b, end_{b-1}), end_b = start_b + t(bucket_b): the model before interference.
Without overlap every bucket starts when backward ends. Not modelled here: DDP's re-ordering of
buckets after the first step; contention between ranks and stragglers are the sweep's
(ddp_lab/scale/predict.py).
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

from ddp_lab import buckets
from ddp_lab.comm.cost import cost, hierarchical_cost
from ddp_lab.dtypes import element_size

MB = 1 << 20


# ---- the all-reduce table and the alpha-beta fit ---------------------------------------------

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
        bytes (ddp_lab.comm.cost): for the ring, exactly half of the all-reduce."""
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
    return f"{nbytes / MB:g} MiB" if nbytes >= MB else f"{nbytes / 1024:g} KiB"


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


def _fit_group(algo: str, backend: str, rs: list[dict], max_regimes: int) -> Fit:
    """Pooled regimes, or one fit per world size where that scores better (BIC)."""
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
    use_per_n = len(ns) > 1 and _bic(resid_n, params_n) < _bic(resid, 3 * len(regimes) - 1)
    fit = dataclasses.replace(pooled, by_world_size=tuple(per_n) if use_per_n else ())
    r2, worst = _quality(fit, rs)
    r2_line, worst_line = _quality(line, rs)
    return dataclasses.replace(fit, r2=r2, max_rel_err=worst, r2_one_line=r2_line,
                               max_rel_err_one_line=worst_line)


def _quality_of(algo, backend, regimes, rows) -> tuple:
    fit = Fit(algo, backend, regimes, 0.0, 0.0, len(rows),
              tuple(sorted({int(r["world_size"]) for r in rows})))
    return (*_quality(fit, rows), len(rows), fit.world_sizes)


def fit_alpha_beta(rows: Iterable[dict], max_regimes: int = 3) -> dict[tuple[str, str], Fit]:
    """One Fit per (algo, backend) over every (message size, world size) row with world size > 1
    and no wrong elements, minimising relative errors (so the latency term is not drowned by the
    largest messages). Up to `max_regimes` message-size regimes, and a fit per world size, where
    the table shows they are needed (`_fit_group`); one line otherwise."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        if int(r["world_size"]) > 1 and not int(r.get("wrong") or 0) and float(r["time_us"]) > 0:
            groups.setdefault((r["algo"], r.get("backend", "")), []).append(r)
    return {(algo, backend): _fit_group(algo, backend, rs, max_regimes)
            for (algo, backend), rs in sorted(groups.items())}


# ---- networks --------------------------------------------------------------------------------

@dataclass(frozen=True)
class Link:
    alpha_s: float
    beta_s_per_byte: float

    @classmethod
    def of(cls, alpha_us: float, GBps: float) -> "Link":
        return cls(alpha_us * 1e-6, 1.0 / (GBps * 1e9))


@dataclass(frozen=True)
class Network:
    """Where the all-reduces run. Given: `intra` links inside a node of `gpus_per_node` ranks
    (NVLink), `inter` between nodes (beta: the node's network bandwidth). Measured: the fits of
    one backend, flat (no node structure: the ranks it was measured on)."""
    name: str
    intra: Link | None = None
    inter: Link | None = None
    gpus_per_node: int = 8
    fits: dict[str, Fit] = field(default_factory=dict)
    note: str = ""

    def algos(self) -> list[str]:
        if self.fits:
            have = set(self.fits)
            out = [a for a in ("naive", "ring", "tree") if a in have]
            if "ring" not in have and "native" in have:
                out.append("native")
            return out
        return ["naive", "ring", "hring", "tree"]

    def allreduce_s(self, algo: str, nbytes: float, n: int) -> float:
        """Seconds for one all-reduce of `nbytes` on `n` ranks with `algo`:
        naive, ring (flat), hring (two-level ring), tree (binomial), native (= ring)."""
        if n <= 1 or nbytes == 0:
            return 0.0
        if self.fits:
            fit = self.fits.get(algo) or (self.fits.get("ring") or self.fits.get("native")
                                          if algo in ("hring", "native", "ring") else None)
            if fit is None:
                raise KeyError(f"no measured fit for {algo!r} in {self.name}")
            return fit.time_s(nbytes, n)
        g = self.gpus_per_node
        if algo == "native":
            algo = "hring"
        if n <= g or self.inter is None:  # one node: every algorithm on the intra-node links
            base = "ring" if algo == "hring" else algo
            return cost(base, nbytes, n).time(self.intra.alpha_s, self.intra.beta_s_per_byte)
        if n % g:
            raise ValueError(f"world size {n} is not a whole number of {g}-GPU nodes")
        m, s, i, e = n // g, float(nbytes), self.intra, self.inter
        if algo == "naive":
            # Everyone sends S to rank 0 at once and gets S back: 2 rounds over the network, rank
            # 0's node link carries (N-G)*S each way while its NVLink carries (G-1)*S.
            return 2 * e.alpha_s + 2 * max((n - g) * s * e.beta_s_per_byte,
                                           (g - 1) * s * i.beta_s_per_byte)
        if algo == "ring":
            # One flat ring through every rank: each of its 2(N-1) steps waits for the slowest
            # hop (the one between nodes), and each node link carries one chunk of S/N per step.
            return 2 * (n - 1) * (e.alpha_s + s / n * e.beta_s_per_byte)
        if algo == "hring":
            intra, inter = hierarchical_cost(s, g, m)
            return (intra.time(i.alpha_s, i.beta_s_per_byte)
                    + inter.time(e.alpha_s, e.beta_s_per_byte))
        if algo == "tree":
            # Binomial tree over ranks laid out node by node: the rounds at distance < G stay in
            # the node, the others cross the network (one flow per node link); each carries S.
            rounds = math.ceil(math.log2(n))
            local = math.ceil(math.log2(g)) if g > 1 else 0
            return 2 * (local * (i.alpha_s + s * i.beta_s_per_byte)
                        + (rounds - local) * (e.alpha_s + s * e.beta_s_per_byte))
        raise ValueError(f"unknown algorithm {algo!r}")

    def collective_s(self, op: str, algo: str, nbytes: float, n: int) -> float:
        """Seconds for one `op` (all_reduce | reduce_scatter | all_gather) of `nbytes` (the whole
        tensor's). A measured fit prices each op by its own rounds and bytes; on a given network
        a reduce-scatter or all-gather is half of the ring-family all-reduce (which is one of
        each), and naive and tree are not modelled there."""
        if op == "all_reduce":
            return self.allreduce_s(algo, nbytes, n)
        if n <= 1 or nbytes == 0:
            return 0.0
        if self.fits:
            fit = self.fits.get(algo) or self.fits.get("ring") or self.fits.get("native")
            return fit.time_s(nbytes, n, op)
        if algo not in ("ring", "hring", "native"):
            raise ValueError(f"{op} on {self.name} is modelled for ring and hring, not {algo!r}")
        return self.allreduce_s(algo, nbytes, n) / 2


# Given interconnects. NVLink: ~370 GB/s bus bandwidth for NCCL's ring on 8 H100/H200-class GPUs
# through NVSwitch; between nodes, one network link of the stated speed per node. The latencies
# (alpha) are assumptions of the usual order for each kind of link: NVLink lowest, then RDMA,
# then TCP.
NVLINK = Link.of(alpha_us=3.0, GBps=370.0)
PRESETS = {
    "nvlink": Network("nvlink", NVLINK, None, 8, note="one NVLink domain (no network)"),
    "ib400": Network("ib400", NVLINK, Link.of(5.0, 400 / 8), 8,
                     note="8 GPUs/node on NVLink, 400 Gb/s InfiniBand per node"),
    "ib100": Network("ib100", NVLINK, Link.of(8.0, 100 / 8), 8,
                     note="8 GPUs/node on NVLink, 100 Gb/s InfiniBand per node"),
    "eth25": Network("eth25", NVLINK, Link.of(25.0, 25 / 8), 8,
                     note="8 GPUs/node on NVLink, 25 Gb/s Ethernet (TCP) per node"),
    # Reconstructions of the published sanity cases (rough; for the qualitative comparison only):
    "dgx1_p100": Network("dgx1_p100", Link.of(10.0, 18.0), None, 8,
                         note="8x P100, first-generation NVLink, ~18 GB/s ring busbw (assumed)"),
    "horovod_p100": Network("horovod_p100", Link.of(10.0, 10.0), Link.of(20.0, 25 / 8), 4,
                            note="4x P100 per server over PCIe (~10 GB/s), 25 Gb/s RoCE between"),
}


def measured_network(fits: dict[tuple[str, str], Fit], backend: str) -> Network | None:
    mine = {algo: f for (algo, b), f in fits.items() if b == backend}
    if not mine:
        return None
    return Network(f"measured_{backend}", fits=mine,
                   note=f"alpha-beta fitted on {backend}, flat over all ranks")


# ---- models: per-layer parameters and FLOPs --------------------------------------------------

@dataclass(frozen=True)
class Layer:
    name: str
    params: tuple[int, ...]  # numel of each parameter the layer owns, registration order
    flops: float  # forward FLOPs per image (2 per multiply-add)


@dataclass(frozen=True)
class ModelProfile:
    name: str
    image_size: int
    layers: tuple[Layer, ...]  # in forward (execution) order

    @property
    def parameters(self) -> int:
        return sum(sum(layer.params) for layer in self.layers)

    @property
    def flops_per_image(self) -> float:
        return sum(layer.flops for layer in self.layers)

    def gradients_in_backward_order(self) -> list[tuple[int, float]]:
        """(numel, ready_fraction) per parameter, in the order backward produces them: the
        fraction of the backward time (~ the forward FLOPs) done when its gradient exists."""
        total = self.flops_per_image or 1.0
        done, out = 0.0, []
        for layer in reversed(self.layers):
            done += layer.flops
            out.extend((numel, done / total) for numel in reversed(layer.params))
        return out


MODEL_DEFAULTS = {  # name -> (image size, classes)
    "alexnet": (224, 1000), "alexnet_cifar": (32, 10), "resnet50": (224, 1000),
    "resnet101": (224, 1000), "vgg16": (224, 1000),
}
_PROFILES: dict[tuple, ModelProfile] = {}


def profile_model(name: str, image_size: int | None = None,
                  num_classes: int | None = None, fc_width: int = 4096) -> ModelProfile:
    """Parameters and forward FLOPs of every layer, from one forward pass on the meta device (no
    memory, no compute). Knows the lab's models and torchvision's resnet50/resnet101/vgg16."""
    import torch
    from torch import nn

    size, classes = MODEL_DEFAULTS.get(name, (image_size, num_classes))
    size, classes = image_size or size, num_classes or classes
    key = (name, size, classes, fc_width)
    if key in _PROFILES:
        return _PROFILES[key]
    with torch.device("meta"):
        if name in ("alexnet", "alexnet_cifar"):
            from ddp_lab.models import build_model
            model = build_model(name, classes, 0.0, fc_width=fc_width)
        elif name in ("resnet50", "resnet101", "vgg16"):
            import torchvision
            model = getattr(torchvision.models, name)(weights=None, num_classes=classes)
        else:
            raise ValueError(f"unknown model {name!r}: expected one of {', '.join(MODEL_DEFAULTS)}")
    layers: list[Layer] = []
    seen: set[int] = set()

    def hook(module, inputs, output):
        if id(module) in seen:
            return
        seen.add(id(module))
        if isinstance(module, nn.Conv2d):
            k = module.in_channels // module.groups * module.kernel_size[0] * module.kernel_size[1]
            flops = 2.0 * output.numel() * k
        elif isinstance(module, nn.Linear):
            flops = 2.0 * output.numel() * module.in_features
        else:
            flops = 0.0
        params = tuple(p.numel() for p in module.parameters(recurse=False) if p.requires_grad)
        if flops or params:
            layers.append(Layer(module_names[id(module)], params, flops))

    module_names = {id(m): n for n, m in model.named_modules()}
    handles = [m.register_forward_hook(hook) for m in model.modules()
               if not list(m.children())]
    with torch.no_grad():
        model(torch.empty(1, 3, size, size, device="meta"))
    for h in handles:
        h.remove()
    profile = ModelProfile(name, size, tuple(layers))
    assert profile.parameters == sum(p.numel() for p in model.parameters() if p.requires_grad)
    _PROFILES[key] = profile
    return profile


# ---- buckets, overlap and one step -----------------------------------------------------------

@dataclass(frozen=True)
class Bucket:
    nbytes: int
    ready: float  # fraction of backward done when its last gradient is produced


def bucket_layout(numels: Sequence[int], elem_bytes: int, bucket_mb: float, rule: str,
                  first_bucket_mb: float | None = None) -> list[int]:
    """Bytes per bucket of gradients of `numels` (in the order backward produces them), as a sync
    cuts them (ddp_lab/buckets.py: `ours` or `ddp`'s rule)."""
    groups = buckets.plan([n * elem_bytes for n in numels], bucket_mb, rule, first_bucket_mb)
    return [sum(numels[i] for i in g) * elem_bytes for g in groups]


def buckets_of(grads: Sequence[tuple[int, float]], elem_bytes: int, bucket_mb: float,
               rule: str = "ddp", first_bucket_mb: float | None = None) -> list[Bucket]:
    """Buckets of gradients given as (numel, ready fraction) in backward order: each is ready
    when the last of its gradients is (the latest of them, should measured ones cross)."""
    groups = buckets.plan([n * elem_bytes for n, _ in grads], bucket_mb, rule, first_bucket_mb)
    return [Bucket(sum(grads[i][0] for i in g) * elem_bytes, max(grads[i][1] for i in g))
            for g in groups]


def make_buckets(profile: ModelProfile, bucket_mb: float, elem_bytes: int,
                 first_bucket_mb: float | None = None, rule: str = "ddp") -> list[Bucket]:
    """Buckets of `profile`'s gradients in the order backward fills them, ready by FLOPs
    (bucket_layout has the rules). bucket_mb <= 0 means one bucket for everything."""
    return buckets_of(profile.gradients_in_backward_order(), elem_bytes, bucket_mb, rule,
                      first_bucket_mb)


@dataclass(frozen=True)
class Interference:
    """How much backward and communication slow each other while both run (1.0: not at all):
    `compute` = backward time with all-reduces running / without, `comm` = all-reduce time with
    backward running / without. Measured by ddp_lab/scale/interfere.py; assumed for GPUs."""
    compute: float = 1.0
    comm: float = 1.0


NO_INTERFERENCE = Interference()


@dataclass(frozen=True)
class Schedule:
    """One step's backward and bucket all-reduces, as `schedule` plays them."""
    backward_s: float  # backward alone
    backward_end_s: float  # backward as slowed by the communication running beside it
    comm_end_s: float  # end of the last all-reduce (0 without buckets)
    busy_s: float  # the all-reduces' times at full speed, summed
    comm_wall_s: float  # time the channel was busy (slower where it ran beside backward)

    @property
    def slowdown_s(self) -> float:
        """Backward time lost to the communication it overlapped."""
        return self.backward_end_s - self.backward_s

    @property
    def wait_s(self) -> float:
        """What is left of the communication after backward ends."""
        return max(0.0, self.comm_end_s - self.backward_end_s)

    @property
    def exposed_s(self) -> float:
        """Time the step loses to communication beyond backward alone: slowdown + wait (the
        training loop's `exposed_comm` = backward + comm - backward without communication)."""
        return self.slowdown_s + self.wait_s


def schedule(buckets: Sequence[Bucket], backward_s: float, allreduce_s: Callable[[float], float],
             overlap: bool = True, interference: Interference = NO_INTERFERENCE) -> Schedule:
    """Backward and the bucket all-reduces on one channel, in bucket order, each as soon as its
    bucket is ready and the previous one is done. While both run, backward advances at
    1/interference.compute of its speed and the all-reduce at 1/interference.comm; after backward
    the all-reduces run at full speed. Without interference this is start_b = max(ready_b,
    end_{b-1}), end_b = start_b + t_b: the model of the module docstring."""
    ready = [b.ready * backward_s if overlap else backward_s for b in buckets]
    sc, sm = interference.compute, interference.comm
    t = work = busy = wall = end = 0.0
    j, left, began = 0, None, 0.0  # next bucket; work left in the one in flight; its start
    while work < backward_s:
        if left is None and j < len(buckets) and ready[j] <= work:
            left, began = allreduce_s(buckets[j].nbytes), t
            busy += left
        rate = 1.0 / sc if left is not None else 1.0
        dt, event = (backward_s - work) / rate, "backward"
        if left is not None and left * sm < dt:
            dt, event = left * sm, "comm"
        elif left is None and j < len(buckets) and (ready[j] - work) / rate < dt:
            dt, event = (ready[j] - work) / rate, "ready"
        t += dt  # (the event's own target exactly: no rounding can leave it a hair short)
        work = {"backward": backward_s, "ready": ready[j] if j < len(ready) else work}.get(
            event, work + dt * rate)
        if event == "comm":
            end, wall, left, j = t, wall + t - began, None, j + 1
        elif left is not None:
            left -= dt / sm
    backward_end = t if backward_s > 0 else 0.0
    if left is not None:  # the all-reduce in flight finishes at full speed
        end, wall, j = t + left, wall + t + left - began, j + 1
    for b in buckets[j:]:
        tb = allreduce_s(b.nbytes)
        start = max(end, backward_end)
        end, busy, wall = start + tb, busy + tb, wall + tb
    return Schedule(backward_s, backward_end, end, busy, wall)


def exposed_comm_s(buckets: Sequence[Bucket], backward_s: float,
                   allreduce_s: Callable[[float], float], overlap: bool = True,
                   interference: Interference = NO_INTERFERENCE) -> tuple[float, float]:
    """(exposed, busy) seconds of one step's gradient all-reduces: busy = the sum of the bucket
    all-reduce times, exposed = what the step loses to them beyond backward alone."""
    s = schedule(buckets, backward_s, allreduce_s, overlap, interference)
    return s.exposed_s, s.busy_s


ZERO_OPS = {0: ("all_reduce", None), 1: ("all_reduce", "all_gather"),
            2: ("reduce_scatter", "all_gather")}  # ZeRO stage -> (gradient op, parameter op)


def bytes_per_step(algo: str, grad_bytes: float, world_size: int, zero: int = 0,
                   param_bytes: float | None = None) -> float:
    """Bytes the busiest rank (rank 0 for naive and tree) sends per step for `grad_bytes` of
    gradients; linear in the size, so bucketing does not change it (up to chunk rounding). ZeRO
    adds the all-gather of `param_bytes` (default: as many as the gradients) and, at stage 2,
    reduce-scatters the gradients instead of all-reducing them."""
    algo = "ring" if algo in ("ddp", "native") else algo
    reduce, gather = ZERO_OPS[zero]
    out = cost(algo, grad_bytes, world_size, reduce).bytes_per_rank
    if gather:
        out += cost(algo, grad_bytes if param_bytes is None else param_bytes, world_size,
                    gather).bytes_per_rank
    return out


@dataclass(frozen=True)
class StepPrediction:
    step_s: float
    compute_s: float
    exposed_s: float  # slowdown of backward + the wait after it
    busy_s: float
    buckets: int
    slowdown_s: float = 0.0  # backward lost to communication beside it (interference)
    wait_s: float = 0.0  # communication left after backward
    gather_s: float = 0.0  # ZeRO: the parameters' all-gather after the optimizer (exposed)

    def efficiency(self, step1_s: float, scale: float = 1.0) -> float:
        return step1_s / (scale * self.step_s)


def predict_step(profile: ModelProfile, network: Network, algo: str, world_size: int, *,
                 forward_s: float, backward_s: float, other_s: float = 0.0,
                 bucket_mb: float = buckets.DEFAULT_BUCKET_MB, elem_bytes: int = 4, overlap: bool = True,
                 first_bucket_mb: float | None = None,
                 interference: Interference = NO_INTERFERENCE, zero: int = 0) -> StepPrediction:
    """One step on `world_size` ranks: the single-rank phases plus the modelled exposed
    communication of `algo` on `network`, slowed by `interference` where it overlaps backward.
    ZeRO stage `zero`: the buckets reduce-scattered at 2, and at 1 and 2 each bucket's
    parameters (`elem_bytes` per element, as the gradients) all-gathered after the optimizer,
    exposed (the next forward reads them)."""
    buckets = make_buckets(profile, bucket_mb, elem_bytes, first_bucket_mb)
    reduce, gather = ZERO_OPS[zero]
    s = schedule(buckets, backward_s,
                 lambda nb: network.collective_s(reduce, algo, nb, world_size), overlap,
                 interference)
    gather_s = sum(network.collective_s(gather, algo, b.nbytes, world_size)
                   for b in buckets) if gather else 0.0
    return StepPrediction(forward_s + backward_s + other_s + s.exposed_s + gather_s,
                          forward_s + backward_s, s.exposed_s, s.busy_s + gather_s, len(buckets),
                          s.slowdown_s, s.wait_s, gather_s)


# ---- simulation past the hardware ------------------------------------------------------------

def simulate(models: dict[str, float], networks: Sequence[Network], world_sizes: Sequence[int],
             grad_dtypes: Sequence[str], bucket_sizes_mb: Sequence[float], *,
             batch_per_gpu: int, overlap: bool = True,
             compute_source: dict[str, str] | None = None,
             interference: Interference = NO_INTERFERENCE) -> list[dict]:
    """Rows of (network, model, grad dtype, algo, N, bucket) -> efficiency and throughput.

    `models`: name -> single-GPU compute (forward + backward) seconds per step at `batch_per_gpu`;
    backward is taken as 2/3 of it. Weak scaling: efficiency = step_1 / step_N, with step_1 the
    compute alone (a world size of 1 has nothing to communicate). `interference`: how much
    backward and the all-reduces slow each other where they overlap (the sweep's model)."""
    rows = []
    for net in networks:
        for name, compute_s in models.items():
            profile = profile_model(name)
            fwd, bwd = compute_s / 3, 2 * compute_s / 3
            for dtype in grad_dtypes:
                elem = element_size(dtype)
                for algo in net.algos():
                    for n in world_sizes:
                        if not net.fits and n > net.gpus_per_node and (
                                net.inter is None or n % net.gpus_per_node):
                            continue
                        for bucket_mb in bucket_sizes_mb:
                            p = predict_step(profile, net, algo, n, forward_s=fwd, backward_s=bwd,
                                             bucket_mb=bucket_mb, elem_bytes=elem, overlap=overlap,
                                             interference=interference)
                            rows.append({
                                "network": net.name, "model": name, "grad_dtype": dtype,
                                "algo": algo, "world_size": n, "bucket_mb": bucket_mb,
                                "buckets": p.buckets,
                                "efficiency": compute_s / p.step_s,
                                "img_per_s": n * batch_per_gpu / p.step_s,
                                "step_ms": p.step_s * 1e3, "compute_ms": compute_s * 1e3,
                                "exposed_comm_ms": p.exposed_s * 1e3,
                                "comm_busy_ms": p.busy_s * 1e3,
                                "grad_MB": profile.parameters * elem / MB,
                                "compute_source": (compute_source or {}).get(name, "assumed"),
                            })
    return rows
