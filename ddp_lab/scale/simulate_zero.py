"""The simulation's ZeRO section: at which model size and GPU count each stage is needed, and
what it costs in step time (docs/zero.md).

Memory is the training state per GPU (ddp_lab.cost.memory.zero_bytes: mixed precision and
Adam, 16 bytes a parameter unsharded; activations come on top). Time is the network model's
(ddp_lab.cost.network.predict_step with `zero`): stage 1 adds an all-gather of the 16-bit
weights after the optimizer; stage 2 reduce-scatters the gradients instead of all-reducing them
(half the bytes) and then all-gathers the same weights. On the ring family a reduce-scatter or
an all-gather is half an all-reduce, so stage 2 sends what stage 0 sends, but its all-gather
comes after backward, where nothing hides it; stage 1 sends 1.5x.
"""

from __future__ import annotations

import math

from ddp_lab.bench.common import write_rows
from ddp_lab.config import ConfigError
from ddp_lab.cost import memory as mem
from ddp_lab.cost import network as net

BF16 = 2  # bytes of a 16-bit gradient or weight


def check(sim) -> None:
    """sim's ZeRO keys, before any work."""
    bad = [s for s in sim.zero_stages if s not in net.ZERO_OPS]
    if bad:
        raise ConfigError(f"sim.zero_stages: {bad} not among the simulated stages "
                          f"{sorted(net.ZERO_OPS)}")
    if float(sim.gpu_gb) <= 0 or any(float(b) <= 0 for b in sim.zero_params_b):
        raise ConfigError("sim.gpu_gb and every sim.zero_params_b must be > 0")


def _pow2_at_least(n: int) -> int:
    return 1 << max(1, math.ceil(math.log2(max(n, 2))))


def comm_ms(network: net.Network, algo: str, params: float, stage: int, n: int) -> dict:
    """One step's collectives for `params` 16-bit gradients and weights as whole messages
    (bandwidth-bound: buckets only add latency): the gradients' op and the weights'
    all-gathers (stage 3, on paper: before forward and again before backward)."""
    reduce, gather = net.ZERO_OPS[min(stage, 2)]
    one = lambda op: 1e3 * network.collective_s(op, algo, params * BF16, n) if op else 0.0
    return {"reduce_ms": one(reduce), "gather_ms": (2 if stage == 3 else 1) * one(gather)}


def memory_rows(network: net.Network, algo: str, sim) -> list[dict]:
    """Per model size: the fewest GPUs of sim.gpu_gb that hold its training state at each stage
    (3 on paper: ddp_lab trains 0-2), and the communication per step on N GPUs, N the power of
    two at or above both that and one node of 8."""
    rows = []
    for billions in sim.zero_params_b:
        p = billions * 1e9
        state = mem.zero_bytes(p, 0, 1)["total"] / mem.GB
        row = {"params": f"{billions:g} B", "state": f"{state:,.0f} GB"}
        for stage in mem.ZERO_STAGES:
            need = mem.gpus_for_zero(p, stage, sim.gpu_gb)
            if need is None:
                row[f"zero={stage}"] = "never"
                continue
            n = _pow2_at_least(max(need, 8))
            c = comm_ms(network, algo, p, stage, n)
            row[f"zero={stage}"] = (f"{need}; at {n}: {c['reduce_ms']:,.0f} + "
                                    f"{c['gather_ms']:,.0f} ms")
        rows.append(row)
    return rows


def step_rows(network: net.Network, algo: str, times: dict, sim, interference) -> list[dict]:
    """Each simulated model at each stage and N on `network` (bf16 gradients and weights,
    sim.bucket_mb buckets, overlap as configured): efficiency, step, what is exposed, the
    training state per GPU (simulation_zero.csv)."""
    out = []
    for m, compute_s in times.items():
        profile = net.profile_model(m)
        for stage in sim.zero_stages:
            for n in sim.world_sizes:
                p = net.predict_step(profile, network, algo, n, forward_s=compute_s / 3,
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


def efficiency_table(rows: list[dict]) -> list[dict]:
    """step_rows as a table: a row per model and stage, a column per N."""
    table: dict[tuple, dict] = {}
    for r in rows:
        row = table.setdefault((r["model"], r["zero"]), {"model": r["model"], "zero": r["zero"]})
        row[str(r["world_size"])] = f"{100 * r['efficiency']:.0f}%"
    return list(table.values())


def add_section(out, network: net.Network, algo: str, times: dict, sim, interference,
                out_dir: str) -> None:
    """The two ZeRO tables into the simulation's Sections `out`, the rows to
    simulation_zero.csv."""
    rows = step_rows(network, algo, times, sim, interference)
    write_rows(rows, out_dir, "simulation_zero")
    out.table(f"ZeRO: the fewest GPUs of {sim.gpu_gb:g} GB that hold the training state "
              "(mixed precision + Adam; activations on top; stage 3 on paper), and at N GPUs "
              "(a power of two, at least 8) the gradients' reduction + the weights' "
              f"all-gather(s) per step on {network.name} ({algo}, 16-bit)",
              memory_rows(network, algo, sim))
    out.table(f"ZeRO: efficiency per stage on {network.name} ({algo}, bf16, {sim.bucket_mb:g} MB "
              "buckets; the all-gather exposed after the optimizer)", efficiency_table(rows))
