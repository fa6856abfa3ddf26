"""The network side of the scaling model: alpha-beta fits, per-step predictions, and simulation
past the hardware we have.

An all-reduce of S bytes on N ranks costs (ddp_lab.comm.cost)

    t = steps(algo, N) * alpha + critical_bytes(algo, S, N) * beta

alpha is one message round's latency, beta the inverse bandwidth of the link the critical path
crosses (for the ring, critical_bytes = 2(N-1)/N * S, so 1/beta is exactly nccl-tests' bus
bandwidth). `fit_alpha_beta` finds alpha, beta >= 0 per (algo, backend) by least squares over
the benchmark's message sizes.

One training step, as the model sees it (`step_time`):

    data + forward + backward + exposed communication + optimizer

The gradients are cut into buckets (reverse parameter order, a parameter never split, a bucket
closed once it reaches the cap, as DDP does). Bucket b is *ready* when backward has produced the
last of its gradients. Backward is walked layer by layer in reverse forward order, each layer
taking a share of the backward time equal to its share of the forward FLOPs, so a bucket of
AlexNet's fully connected layers (most of the bytes, few of the FLOPs) is ready early and can hide
behind the long convolution backward that follows. All-reduces run one at a time, in bucket order,
on one channel: start_b = max(ready_b, end_{b-1}), end_b = start_b + t(bucket_b), every bucket
paying its own latency. Exposed communication = end of the last all-reduce - end of backward
(>= 0). Without overlap every bucket starts when backward ends. Not modelled: the slowdown of
compute by concurrent communication (SMs, memory bandwidth, CPU threads on gloo), stragglers,
DDP's re-ordering of buckets after the first step, and the optimizer step (a constant per step).
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

from ddp_lab.comm.cost import cost, hierarchical_cost

GRAD_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
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
class Fit:
    """alpha (s per message round) and beta (s per critical-path byte) for one (algo, backend)."""
    algo: str
    backend: str
    alpha_s: float
    beta_s_per_byte: float
    r2: float  # coefficient of determination of the times
    max_rel_err: float  # the worst |predicted - measured| / measured over the rows fitted
    points: int
    world_sizes: tuple[int, ...]

    def time_s(self, nbytes: float, world_size: int) -> float:
        return cost(self.algo, nbytes, world_size).time(self.alpha_s, self.beta_s_per_byte)

    @property
    def bandwidth_GBps(self) -> float:
        """1/beta in GB/s: the bus bandwidth for ring/native, rank 0's link for naive/tree."""
        return 1e-9 / self.beta_s_per_byte if self.beta_s_per_byte > 0 else float("inf")

    def as_row(self) -> dict:
        return {"algo": self.algo, "backend": self.backend, "alpha_us": self.alpha_s * 1e6,
                "bandwidth_GBps": self.bandwidth_GBps, "r2": self.r2,
                "max_rel_err_pct": 100 * self.max_rel_err, "points": self.points,
                "world_sizes": " ".join(map(str, self.world_sizes))}


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


def fit_alpha_beta(rows: Iterable[dict], relative: bool = True) -> dict[tuple[str, str], Fit]:
    """One Fit per (algo, backend) over every (message size, world size) row with world size > 1
    and no wrong elements. `relative=True` weights each row by 1/time, i.e. minimises relative
    errors, so the latency term is not drowned by the largest messages."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        if int(r["world_size"]) > 1 and not int(r.get("wrong") or 0) and float(r["time_us"]) > 0:
            groups.setdefault((r["algo"], r.get("backend", "")), []).append(r)
    fits = {}
    for (algo, backend), rs in sorted(groups.items()):
        a, y, w = [], [], []
        for r in rs:
            c = cost(algo, r["bytes"], int(r["world_size"]))
            t = float(r["time_us"]) * 1e-6
            wt = 1.0 / t if relative else 1.0
            a.append((c.steps * wt, c.critical_bytes * wt))
            y.append(t * wt)
            w.append((c, t))
        alpha, beta = _nnls2(a, y)
        times = [t for _, t in w]
        pred = [c.time(alpha, beta) for c, _ in w]
        mean = sum(times) / len(times)
        ss_tot = sum((t - mean) ** 2 for t in times)
        ss_res = sum((p - t) ** 2 for p, t in zip(pred, times))
        fits[(algo, backend)] = Fit(
            algo, backend, alpha, beta, 1 - ss_res / ss_tot if ss_tot > 0 else float("nan"),
            max(abs(p - t) / t for p, t in zip(pred, times)), len(rs),
            tuple(sorted({int(r["world_size"]) for r in rs})))
    return fits


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
            return cost(fit.algo, nbytes, n).time(fit.alpha_s, fit.beta_s_per_byte)
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
                  num_classes: int | None = None) -> ModelProfile:
    """Parameters and forward FLOPs of every layer, from one forward pass on the meta device (no
    memory, no compute). Knows the lab's models and torchvision's resnet50/resnet101/vgg16."""
    import torch
    from torch import nn

    size, classes = MODEL_DEFAULTS.get(name, (image_size, num_classes))
    size, classes = image_size or size, num_classes or classes
    key = (name, size, classes)
    if key in _PROFILES:
        return _PROFILES[key]
    with torch.device("meta"):
        if name in ("alexnet", "alexnet_cifar"):
            from ddp_lab.models import build_model
            model = build_model(name, classes, 0.0)
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


def make_buckets(profile: ModelProfile, bucket_mb: float, elem_bytes: int,
                 first_bucket_mb: float | None = None) -> list[Bucket]:
    """Buckets in the order backward fills them: a bucket closes once it holds >= the cap (a
    parameter is never split). `first_bucket_mb`: DDP's smaller first bucket (1 MiB), or None.
    bucket_mb <= 0 means one bucket for everything."""
    cap = bucket_mb * MB if bucket_mb > 0 else float("inf")
    first = first_bucket_mb * MB if first_bucket_mb else cap
    buckets, size, ready = [], 0, 0.0
    for numel, frac in profile.gradients_in_backward_order():
        size += numel * elem_bytes
        ready = frac
        if size >= (first if not buckets else cap):
            buckets.append(Bucket(size, ready))
            size = 0
    if size:
        buckets.append(Bucket(size, ready))
    return buckets


def exposed_comm_s(buckets: Sequence[Bucket], backward_s: float,
                   allreduce_s: Callable[[float], float], overlap: bool = True) -> tuple[float, float]:
    """(exposed, busy) seconds of one step's gradient all-reduces: busy = the sum of the bucket
    all-reduce times, exposed = what is left after backward ends (the model in the module doc)."""
    end, busy = 0.0, 0.0
    for b in buckets:
        t = allreduce_s(b.nbytes)
        start = max(end, b.ready * backward_s if overlap else backward_s)
        end = start + t
        busy += t
    return max(0.0, end - backward_s), busy


def bytes_per_step(algo: str, grad_bytes: float, world_size: int) -> float:
    """Bytes the busiest rank (rank 0 for naive and tree) sends per step for `grad_bytes` of
    gradients; linear in the size, so bucketing does not change it (up to chunk rounding)."""
    return cost("ring" if algo in ("ddp", "native") else algo, grad_bytes, world_size).bytes_per_rank


@dataclass(frozen=True)
class StepPrediction:
    step_s: float
    compute_s: float
    exposed_s: float
    busy_s: float
    buckets: int

    def efficiency(self, step1_s: float, scale: float = 1.0) -> float:
        return step1_s / (scale * self.step_s)


def predict_step(profile: ModelProfile, network: Network, algo: str, world_size: int, *,
                 forward_s: float, backward_s: float, other_s: float = 0.0,
                 bucket_mb: float = 25.0, elem_bytes: int = 4, overlap: bool = True,
                 first_bucket_mb: float | None = None) -> StepPrediction:
    """One step on `world_size` ranks: the measured single-rank phases plus the modelled exposed
    communication of `algo` on `network`."""
    buckets = make_buckets(profile, bucket_mb, elem_bytes, first_bucket_mb)
    exposed, busy = exposed_comm_s(buckets, backward_s,
                                   lambda nb: network.allreduce_s(algo, nb, world_size), overlap)
    return StepPrediction(forward_s + backward_s + other_s + exposed, forward_s + backward_s,
                          exposed, busy, len(buckets))


# ---- simulation past the hardware ------------------------------------------------------------

def simulate(models: dict[str, float], networks: Sequence[Network], world_sizes: Sequence[int],
             grad_dtypes: Sequence[str], bucket_sizes_mb: Sequence[float], *,
             batch_per_gpu: int, overlap: bool = True,
             compute_source: dict[str, str] | None = None) -> list[dict]:
    """Rows of (network, model, grad dtype, algo, N, bucket) -> efficiency and throughput.

    `models`: name -> single-GPU compute (forward + backward) seconds per step at `batch_per_gpu`;
    backward is taken as 2/3 of it. Weak scaling: efficiency = step_1 / step_N, with step_1 the
    compute alone (a world size of 1 has nothing to communicate)."""
    rows = []
    for net in networks:
        for name, compute_s in models.items():
            profile = profile_model(name)
            fwd, bwd = compute_s / 3, 2 * compute_s / 3
            for dtype in grad_dtypes:
                elem = GRAD_BYTES[dtype]
                for algo in net.algos():
                    for n in world_sizes:
                        if not net.fits and n > net.gpus_per_node and (
                                net.inter is None or n % net.gpus_per_node):
                            continue
                        for bucket_mb in bucket_sizes_mb:
                            p = predict_step(profile, net, algo, n, forward_s=fwd, backward_s=bwd,
                                             bucket_mb=bucket_mb, elem_bytes=elem, overlap=overlap)
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
