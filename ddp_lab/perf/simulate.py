"""The simulation past the hardware we have: the step model (ddp_lab/perf/step.py) for 8 ...
1,024 GPUs per all-reduce algorithm, model, gradient dtype, network and bucket size, as rows of
numbers; ddp_lab/scale/sim_report.py prints and writes them (simulation.csv, .md, .png).

Its inputs, all in conf/scale.yaml's `sim` block (the `sim` argument below):
- single-GPU compute per step = batch_per_gpu / one GPU's img/s, of which backward is 2/3, each
  model's from the first of: the sweep's own N=1 GPU point; `sim.img_per_s` where given on the
  command line; a measured results file of `sim.compute_from` (by default the 224 px AlexNet row
  of docs/results/h200-loop-vs-bare); `sim.img_per_s`'s default, assumed. Each says which
  (`compute_source`). The optimizer step and data loading are left out.
- networks: PRESETS in ddp_lab/perf/params.py (NVLink ~370 GB/s busbw inside a node of 8;
  400/100 Gb/s InfiniBand or 25 Gb/s Ethernet per node between nodes), or the alpha-beta fit of
  the sweep's own all-reduce timings (`measured_<backend>`, flat: no node structure).
- algorithms: naive (everything through rank 0), ring (flat, through every rank), hring
  (two-level ring: intra-node reduce-scatter, inter-node ring, intra-node all-gather), tree
  (binomial reduce + broadcast, the whole message every round).
- interference: the sweep's model (ddp_lab/perf/step.py's `schedule`), with GPU slowdowns
  assumed (`sim.interference`: backward x1.05 and all-reduces x1.1 while they overlap, NCCL
  taking SMs and memory bandwidth) until a multi-GPU sweep measures them; every efficiency also
  comes as a band with both slowdowns from `sim.interference_band[0]` to `[1]`
  (efficiency_lo/_hi).
- ZeRO: the training state per GPU (ddp_lab/perf/memory.py's `zero_bytes`: mixed precision and
  Adam, 16 bytes a parameter unsharded; activations on top) and the step with `zero` (stage 1
  adds an all-gather of the 16-bit weights after the optimizer; stage 2 reduce-scatters the
  gradients instead of all-reducing them, then all-gathers the same weights). On the ring family
  a reduce-scatter or an all-gather is half an all-reduce, so stage 2 sends what stage 0 sends,
  but its all-gather comes after backward, where nothing hides it; stage 1 sends 1.5x.
"""

from __future__ import annotations

import math
from typing import Sequence

from ddp_lab.buckets import MiB
from ddp_lab.dtypes import element_size
from ddp_lab.perf import memory as mem
from ddp_lab.perf.compute import profile_model
from ddp_lab.perf.params import (NO_INTERFERENCE, Compute, PRESETS, Interference, Network,
                                 measured_network)
from ddp_lab.perf.step import ZERO_OPS, gathers, predict_step

BF16 = 2  # bytes of a 16-bit gradient or weight (the ZeRO section's)
MSG_SIZES = [2 ** k for k in range(10, 31, 2)]  # 1 KiB ... 1 GiB

# Published sanity cases, with the per-GPU throughput and batch reconstructed for them.
# TensorFlow's benchmarks on a DGX-1 (8x P100, 2017): AlexNet 2,987 -> 17,457 img/s at batch 512
# per GPU (~73%), ResNet-50 219 -> 1,700 at batch 64 (~97-99%), VGG-16 154 -> 1,141 (~93%).
# Horovod (Sergeev & Del Balso 2018): 128 servers x 4 P100, 25 Gb/s RoCE, flat NCCL ring with
# 64 MB tensor fusion: ~68% VGG-16 and ~90% ResNet-101 / Inception V3 at 512 GPUs.
SANITY = [
    # (case, network, N, model, img/s per GPU, batch per GPU, bucket MB, published efficiency)
    ("TF DGX-1, 8x P100", "dgx1_p100", 8, "alexnet", 2987.0, 512, 25.0, 0.73),
    ("TF DGX-1, 8x P100", "dgx1_p100", 8, "resnet50", 219.0, 64, 25.0, 0.99),
    ("TF DGX-1, 8x P100", "dgx1_p100", 8, "vgg16", 154.0, 64, 25.0, 0.93),
    ("Horovod, 512x P100", "horovod_p100", 512, "vgg16", 154.0, 64, 64.0, 0.68),
    ("Horovod, 512x P100", "horovod_p100", 512, "resnet101", 130.0, 64, 64.0, 0.90),
]


# ---- inputs: compute per model, networks, buckets, interference ------------------------------

def compute_times(sim, swept: dict[str, float], measured: dict[str, Compute],
                  defaults: dict[str, float]) -> tuple[dict[str, float], dict[str, str]]:
    """model -> single-GPU compute seconds per step at sim.batch_per_gpu, and where it comes
    from, the first of: this sweep's own N=1 GPU point (`swept`, sim.use_measured); a rate given
    in sim.img_per_s (one that differs from `defaults`, the schema's); a results file of
    sim.compute_from (`measured`); sim.img_per_s's default, assumed. A rate measured at another
    batch is taken as the same per image."""
    times, source = {}, {}
    for m in sim.models:
        given = m in sim.img_per_s and float(sim.img_per_s[m]) != defaults.get(m)
        if sim.use_measured and m in swept:
            times[m], source[m] = swept[m], "measured: this sweep's N=1 point"
        elif given:
            times[m] = sim.batch_per_gpu / float(sim.img_per_s[m])
            source[m] = f"given: sim.img_per_s.{m}={float(sim.img_per_s[m]):g}"
        elif m in measured:
            times[m], source[m] = sim.batch_per_gpu / measured[m].img_per_s, measured[m].source
        elif m in sim.img_per_s:
            times[m] = sim.batch_per_gpu / float(sim.img_per_s[m])
            source[m] = (f"assumed: sim.img_per_s's default, {float(sim.img_per_s[m]):g} img/s, "
                         "never measured")
        else:
            raise ValueError(f"sim.img_per_s has no throughput for model {m!r}, and no file of "
                             "sim.compute_from measured one")
    return times, source


def networks(sim, fits: dict) -> list[Network]:
    """sim.networks: presets by name, and `measured`: one network per backend of `fits`."""
    out = []
    for name in sim.networks:
        if name == "measured":
            for backend in sorted({b for _, b in fits}):
                m = measured_network(fits, backend)
                if m is not None:
                    out.append(m)
        elif name in PRESETS:
            out.append(PRESETS[name])
        else:
            raise ValueError(f"sim.networks: unknown network {name!r}; presets: "
                             f"{', '.join(PRESETS)}, measured")
    return out


def bucket_sizes(sim) -> list[float]:
    """sim.bucket_sweep and sim.bucket_mb, smallest first, 0 (one bucket) last."""
    return sorted(set(list(sim.bucket_sweep) + [sim.bucket_mb]), key=lambda b: b or math.inf)


def assumed_interference(sim) -> Interference:
    return Interference(float(sim.interference["compute"]), float(sim.interference["comm"]))


# ---- efficiency and throughput ---------------------------------------------------------------

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
                                "grad_MB": profile.parameters * elem / MiB,
                                "compute_source": (compute_source or {}).get(name, "assumed"),
                            })
    return rows


def simulate_with_band(sim, times: dict, nets: list, buckets: list, source: dict) -> list[dict]:
    """The simulation with the assumed interference; each row also with the band's ends."""
    run = lambda inter: simulate(times, nets, list(sim.world_sizes), list(sim.grad_dtypes),
                                 buckets, batch_per_gpu=sim.batch_per_gpu,
                                 overlap=sim.overlap, compute_source=source,
                                 interference=inter)
    rows = run(assumed_interference(sim))
    lo, hi = (run(Interference(float(x), float(x))) for x in sim.interference_band)
    for r, a, b in zip(rows, lo, hi):
        r["efficiency_lo"], r["efficiency_hi"] = b["efficiency"], a["efficiency"]  # hi: least
    return rows


def sanity() -> list[dict]:
    """The published cases (SANITY) against this model (fp32 gradients, the flat ring), with and
    without overlap."""
    out = []
    for case, net_name, n, m, ips, batch, bucket, published in SANITY:
        profile = profile_model(m)
        compute = batch / ips
        eff = {}
        for overlap in (True, False):
            p = predict_step(profile, PRESETS[net_name], "ring", n, forward_s=compute / 3,
                             backward_s=2 * compute / 3, bucket_mb=bucket, elem_bytes=4,
                             overlap=overlap)
            eff[overlap] = compute / p.step_s
        out.append({"case": case, "model": m, "world_size": n, "parameters": profile.parameters,
                    "published": published, "efficiency": eff[True],
                    "efficiency_no_overlap": eff[False]})
    return out


# ---- all-reduce alone ------------------------------------------------------------------------

def allreduce_rows(network: Network, sizes_n) -> list[dict]:
    """Each algorithm's all-reduce time per message size and N, and the fastest."""
    rows = []
    for n in sizes_n:
        for s in MSG_SIZES:
            t = {a: network.allreduce_s(a, s, n) for a in network.algos()}
            rows.append({"network": network.name, "world_size": n, "bytes": s,
                         **{f"{a}_us": v * 1e6 for a, v in t.items()},
                         "fastest": min(t, key=t.get)})
    return rows


def tree_crossover(network: Network, n: int, against: str) -> float:
    """The largest message (bytes, on a fine grid) for which tree is faster than `against`."""
    best = 0.0
    for k in range(0, 241):
        s = 2 ** (k / 8)
        if network.allreduce_s("tree", s, n) < network.allreduce_s(against, s, n):
            best = s
    return best


# ---- ZeRO: which stage a model size needs, and what it costs --------------------------------

def _pow2_at_least(n: int) -> int:
    return 1 << max(1, math.ceil(math.log2(max(n, 2))))


def zero_comm_ms(network: Network, algo: str, params: float, stage: int, n: int) -> dict:
    """One step's collectives for `params` 16-bit gradients and weights as whole messages
    (bandwidth-bound: buckets only add latency): the gradients' op and the weights'
    all-gathers (`gathers`: at stage 3 before forward and again before backward)."""
    reduce, gather = ZERO_OPS[stage]
    one = lambda op: 1e3 * network.collective_s(op, algo, params * BF16, n) if op else 0.0
    return {"reduce_ms": one(reduce), "gather_ms": gathers(stage) * one(gather)}


def zero_needs(network: Network, algo: str, params: float, gpu_gb: float) -> dict:
    """For a model of `params` parameters: its unsharded training state (GB), and per ZeRO stage
    None where no GPU count of `gpu_gb` GB holds it, else the
    fewest that do (`gpus`) and the communication per step (`zero_comm_ms`) on N GPUs (`at`), N
    the power of two at or above both that and one node of 8."""
    out = {"state_GB": mem.zero_bytes(params, 0, 1)["total"] / mem.GB}
    for stage in mem.ZERO_STAGES:
        need = mem.gpus_for_zero(params, stage, gpu_gb)
        if need is None:
            out[stage] = None
            continue
        n = _pow2_at_least(max(need, 8))
        out[stage] = {"gpus": need, "at": n, **zero_comm_ms(network, algo, params, stage, n)}
    return out


def zero_step_rows(network: Network, algo: str, times: dict, sim,
                   interference: Interference) -> list[dict]:
    """Each simulated model at each stage and N on `network` (bf16 gradients and weights,
    sim.bucket_mb buckets, overlap as configured): efficiency, step, what is exposed, the
    training state per GPU (simulation_zero.csv)."""
    out = []
    for m, compute_s in times.items():
        profile = profile_model(m)
        for stage in sim.zero_stages:
            for n in sim.world_sizes:
                p = predict_step(profile, network, algo, n, forward_s=compute_s / 3,
                                 backward_s=2 * compute_s / 3, bucket_mb=sim.bucket_mb,
                                 elem_bytes=BF16, overlap=sim.overlap,
                                 interference=interference, zero=stage)
                out.append({"network": network.name, "algo": algo, "model": m, "zero": stage,
                            "world_size": n, "efficiency": compute_s / p.step_s,
                            "step_ms": p.step_s * 1e3, "exposed_comm_ms": p.exposed_s * 1e3,
                            "gather_ms": p.gather_s * 1e3,
                            "state_GB_per_gpu": mem.zero_bytes(profile.parameters, stage,
                                                               n)["total"] / mem.GB})
    return out
