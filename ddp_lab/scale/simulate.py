"""Simulation past the hardware: efficiency and throughput for 8 ... 1,024 GPUs per all-reduce
algorithm, model, gradient dtype, interconnect and bucket size (`ddp_lab.cost.network`), printed
as tables and written to simulation.csv, simulation_allreduce.csv, simulation.png, simulation.md.

Assumptions (all in conf/scale.yaml's `sim` block, changeable on the command line):
- single-GPU compute per step = batch_per_gpu / sim.img_per_s[model] (H100/H200-class, bf16
  autocast), of which backward is 2/3; replaced by the sweep's own N=1 GPU measurement for a
  model it ran (`compute_source=measured`). The optimizer step and data loading are left out.
- networks: PRESETS in ddp_lab/cost/network.py (NVLink ~370 GB/s busbw inside a node of 8;
  400/100 Gb/s InfiniBand or 25 Gb/s Ethernet per node between nodes), or the alpha-beta fit of
  the sweep's own all-reduce timings (`measured_<backend>`, flat: no node structure).
- algorithms: naive (everything through rank 0), ring (flat, through every rank), hring
  (two-level ring: intra-node reduce-scatter, inter-node ring, intra-node all-gather), tree
  (binomial reduce + broadcast, the whole message every round).
- interference: the sweep's model (ddp_lab.cost.network.schedule), with GPU slowdowns assumed
  (`sim.interference`: backward x1.05 and all-reduces x1.1 while they overlap, NCCL taking SMs
  and memory bandwidth) until a multi-GPU sweep measures them; every efficiency also comes as a
  band with both slowdowns from `sim.interference_band[0]` to `[1]` (efficiency_lo/_hi).
"""

from __future__ import annotations

import math
import os

from ddp_lab.bench.common import format_table, write_rows
from ddp_lab.cost import network as net
from ddp_lab.scale import simulate_zero

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
MSG_SIZES = [2 ** k for k in range(10, 31, 2)]  # 1 KiB ... 1 GiB


def _pct(x: float) -> str:
    return "" if x != x else f"{100 * x:.0f}%"


def compute_times(sim, measured: dict[str, float]) -> tuple[dict[str, float], dict[str, str]]:
    times, source = {}, {}
    for m in sim.models:
        if sim.use_measured and m in measured:
            times[m], source[m] = measured[m], "measured"
        else:
            if m not in sim.img_per_s:
                raise ValueError(f"sim.img_per_s has no throughput for model {m!r}")
            times[m], source[m] = sim.batch_per_gpu / float(sim.img_per_s[m]), "assumed"
    return times, source


def networks(sim, fits: dict) -> list[net.Network]:
    out = []
    for name in sim.networks:
        if name == "measured":
            for backend in sorted({b for _, b in fits}):
                m = net.measured_network(fits, backend)
                if m is not None:
                    out.append(m)
        elif name in net.PRESETS:
            out.append(net.PRESETS[name])
        else:
            raise ValueError(f"sim.networks: unknown network {name!r}; presets: "
                             f"{', '.join(net.PRESETS)}, measured")
    return out


def allreduce_rows(network: net.Network, sizes_n) -> list[dict]:
    rows = []
    for n in sizes_n:
        for s in MSG_SIZES:
            t = {a: network.allreduce_s(a, s, n) for a in network.algos()}
            rows.append({"network": network.name, "world_size": n, "bytes": s,
                         **{f"{a}_us": v * 1e6 for a, v in t.items()},
                         "fastest": min(t, key=t.get)})
    return rows


def tree_crossover(network: net.Network, n: int, against: str) -> float:
    """The largest message (bytes, on a fine grid) for which tree is faster than `against`."""
    best = 0.0
    for k in range(0, 241):
        s = 2 ** (k / 8)
        if network.allreduce_s("tree", s, n) < network.allreduce_s(against, s, n):
            best = s
    return best


def _bucket(mb: float) -> str:
    return f"{mb:g} MB" if mb else "one bucket"


def _human(nbytes: float) -> str:
    for unit, div in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if nbytes >= div:
            return f"{nbytes / div:.3g} {unit}"
    return f"{nbytes:.0f} B"


def pick(rows: list[dict], **kw) -> list[dict]:
    return [r for r in rows if all(r[k] == v for k, v in kw.items())]


def _best_algo(network: net.Network) -> str:
    """The algorithm a network's tables lead with: the two-level ring, else the last one (a fit)."""
    return "hring" if "hring" in network.algos() else network.algos()[-1]


class Sections:
    """The simulation's tables twice over: console text and the markdown of simulation.md."""

    def __init__(self, md: list[str]):
        self.text: list[str] = []
        self.md = md

    def table(self, title: str, table: list[dict], md_after: tuple[str, ...] = ()) -> None:
        self.text += [title, format_table(table), ""]
        self.md += [f"### {title}", "", _md(table), "", *md_after]

    def bullets(self, title: str, items: list[str]) -> None:
        self.text += [f"{title}:"] + [f"- {f}" for f in items] + [""]
        self.md += [f"### {title}", ""] + [f"- {f}" for f in items] + [""]


def model_efficiency(rows, main: net.Network, m: str, sim) -> list[dict]:
    """One model on the main network: efficiency per N, algorithm and gradient dtype, the best
    bucket size of its best algorithm and the img/s at the configured bucket."""
    table = []
    for n in sim.world_sizes:
        row = {"N": n}
        for dtype in sim.grad_dtypes:
            for algo in main.algos():
                r = pick(rows, network=main.name, model=m, grad_dtype=dtype, algo=algo,
                         world_size=n, bucket_mb=sim.bucket_mb)
                if r:
                    row[f"{algo}/{dtype}"] = _pct(r[0]["efficiency"])
        best_algo, dtype = _best_algo(main), sim.grad_dtypes[-1]
        cands = pick(rows, network=main.name, model=m, grad_dtype=dtype, algo=best_algo,
                     world_size=n)
        if cands:
            best = max(cands, key=lambda r: r["efficiency"])
            row[f"best bucket ({best_algo}/{dtype})"] = \
                f"{_bucket(best['bucket_mb'])} {_pct(best['efficiency'])}"
            at = pick(rows, network=main.name, model=m, grad_dtype=dtype, algo=best_algo,
                      world_size=n, bucket_mb=sim.bucket_mb)
            if at:
                row["img/s"] = f"{at[0]['img_per_s']:,.0f}"
        if len(row) > 1:
            table.append(row)
    return table


def network_efficiency(rows, nets: list[net.Network], times: dict, sim) -> list[dict]:
    """Every network's best algorithm, per model and N, with the last gradient dtype."""
    table = []
    for network in nets:
        algo = _best_algo(network)
        for m in times:
            row = {"network": network.name, "model": m, "algo": algo}
            for n in sim.world_sizes:
                r = pick(rows, network=network.name, model=m, grad_dtype=sim.grad_dtypes[-1],
                         algo=algo, world_size=n, bucket_mb=sim.bucket_mb)
                row[str(n)] = _pct(r[0]["efficiency"]) if r else ""
            table.append(row)
    return table


def fastest_allreduce(ar: list[dict], main: net.Network, sim) -> list[dict]:
    """Which algorithm is fastest per message size and N, and where tree stops winning."""
    table = []
    for n in sim.world_sizes:
        row = {"N": n}
        for s in (2 ** 12, 2 ** 16, 2 ** 20, 2 ** 24, 2 ** 26, 2 ** 28):
            r = [x for x in ar if x["world_size"] == n and x["bytes"] == s]
            row[_human(s)] = r[0]["fastest"] if r else ""
        if "ring" in main.algos():
            row["tree < ring below"] = _human(tree_crossover(main, n, "ring"))
        if "hring" in main.algos():
            row["tree < hring below"] = _human(tree_crossover(main, n, "hring"))
        table.append(row)
    return table


def findings(rows, main: net.Network, times: dict, sim) -> list[str]:
    """The tables' lessons in words: where naive collapses, where tree beats the flat ring, and
    how much the bucket size matters at the largest N."""
    out, n_top, dtype = [], max(sim.world_sizes), sim.grad_dtypes[-1]
    for m in times:
        for dt in sim.grad_dtypes:
            r = [x for x in pick(rows, network=main.name, model=m, grad_dtype=dt, algo="naive",
                                 bucket_mb=sim.bucket_mb) if x["efficiency"] < 0.5]
            if r:
                out.append(f"naive falls below 50% at {min(x['world_size'] for x in r)} GPUs "
                           f"for {m} with {dt} gradients on {main.name}")
    for m in times:
        for b in (1.0, sim.bucket_mb):
            at = dict(network=main.name, model=m, grad_dtype=dtype, world_size=n_top, bucket_mb=b)
            t, g = pick(rows, algo="tree", **at), pick(rows, algo="ring", **at)
            if t and g and t[0]["efficiency"] > g[0]["efficiency"]:
                out.append(f"tree beats the flat ring for {m} at {n_top} GPUs with {b:g} MB "
                           f"buckets ({_pct(t[0]['efficiency'])} vs {_pct(g[0]['efficiency'])})")
    for m in times:
        algo = _best_algo(main)
        cands = pick(rows, network=main.name, model=m, grad_dtype=dtype, algo=algo,
                     world_size=n_top)
        if cands:
            best = max(cands, key=lambda r: r["efficiency"])
            worst = min(cands, key=lambda r: r["efficiency"])
            out.append(f"best bucket for {m} ({algo}, {n_top} GPUs): {_bucket(best['bucket_mb'])} "
                       f"-> {_pct(best['efficiency'])} (worst {_bucket(worst['bucket_mb'])} -> "
                       f"{_pct(worst['efficiency'])})")
    return out


def sanity_table() -> list[dict]:
    """The published cases (SANITY) against this model, with and without overlap."""
    table = []
    for case, net_name, n, m, ips, batch, bucket, published in SANITY:
        profile = net.profile_model(m)
        compute = batch / ips
        row = {"case": case, "model": m, "N": n, "params_M": f"{profile.parameters / 1e6:.1f}",
               "published": _pct(published)}
        for overlap in (True, False):
            p = net.predict_step(profile, net.PRESETS[net_name], "ring", n,
                                 forward_s=compute / 3, backward_s=2 * compute / 3,
                                 bucket_mb=bucket, elem_bytes=4, overlap=overlap)
            row["model, overlap" if overlap else "model, no overlap"] = _pct(compute / p.step_s)
        table.append(row)
    return table


def run(sim, out_dir: str, fits: dict | None = None, measured: dict[str, float] | None = None,
        say=print) -> str:
    """Run the simulation, print its tables, write its files; returns the markdown section."""
    fits = fits or {}
    times, source = compute_times(sim, measured or {})
    nets = networks(sim, fits)
    buckets = sorted(set(list(sim.bucket_sweep) + [sim.bucket_mb]), key=lambda b: b or math.inf)
    rows = simulate_with_band(sim, times, nets, buckets, source)
    write_rows(rows, out_dir, "simulation")
    main = next((n for n in nets if n.name == sim.network), nets[0])
    out = Sections(["## Simulation", "",
                    f"Weak scaling, {sim.batch_per_gpu} images per GPU, overlap "
                    f"{'on' if sim.overlap else 'off'}, {sim.bucket_mb:g} MB buckets unless said "
                    f"otherwise. Network `{main.name}`: {main.note}. Compute per step (forward + "
                    "backward, ms): "
                    + ", ".join(f"{m} {1e3 * t:.1f} ({source[m]})" for m, t in times.items())
                    + f". {interference_note(sim)}", ""])
    for m in times:
        table = model_efficiency(rows, main, m, sim)
        if table:
            out.table(f"{m} ({net.profile_model(m).parameters / 1e6:.1f} M params, "
                      f"{times[m] * 1e3:.1f} ms compute, {source[m]}), efficiency on {main.name}",
                      table)
    out.table(f"Efficiency by network ({sim.grad_dtypes[-1]} gradients, {sim.bucket_mb:g} MB "
              "buckets)", network_efficiency(rows, nets, times, sim))
    out.table(f"Interference band on {main.name} ({_best_algo(main)}, {sim.grad_dtypes[-1]}, "
              f"{sim.bucket_mb:g} MB): efficiency with both slowdowns at "
              f"{sim.interference_band[1]:g} / as assumed / {sim.interference_band[0]:g}",
              band_table(rows, main, times, sim))
    simulate_zero.add_section(out, main, _best_algo(main), times, sim, assumed_interference(sim),
                              out_dir)
    ar = allreduce_rows(main, sim.world_sizes)
    write_rows(ar, out_dir, "simulation_allreduce")
    out.table(f"Fastest all-reduce per message size on {main.name}",
              fastest_allreduce(ar, main, sim))
    out.bullets("Findings", findings(rows, main, times, sim))
    out.table("Sanity: published scaling vs this model (fp32 gradients, flat ring, assumed "
              "per-GPU throughput of the time)", sanity_table(),
              md_after=("Networks: " + "; ".join(f"`{k}`: {v.note}" for k, v in net.PRESETS.items()
                                                 if k in ("dgx1_p100", "horovod_p100")) + ".", ""))
    with open(os.path.join(out_dir, "simulation.md"), "w") as f:
        f.write("\n".join(out.md))
    plot(rows, main, times, sim, os.path.join(out_dir, "simulation.png"))
    say("\n".join(out.text))
    return "\n".join(out.md)


def interference_note(sim) -> str:
    i = sim.interference
    return (f"Interference assumed for GPUs (no multi-GPU run has measured it here yet): "
            f"backward x{float(i['compute']):g} and all-reduces x{float(i['comm']):g} while they "
            f"overlap; bands: both slowdowns from {sim.interference_band[0]:g} to "
            f"{sim.interference_band[1]:g}.")


def assumed_interference(sim) -> net.Interference:
    return net.Interference(float(sim.interference["compute"]), float(sim.interference["comm"]))


def simulate_with_band(sim, times: dict, nets: list, buckets: list, source: dict) -> list[dict]:
    """The simulation with the assumed interference; each row also with the band's ends."""
    run = lambda inter: net.simulate(times, nets, list(sim.world_sizes), list(sim.grad_dtypes),
                                     buckets, batch_per_gpu=sim.batch_per_gpu,
                                     overlap=sim.overlap, compute_source=source,
                                     interference=inter)
    rows = run(assumed_interference(sim))
    lo, hi = (run(net.Interference(float(x), float(x))) for x in sim.interference_band)
    for r, a, b in zip(rows, lo, hi):
        r["efficiency_lo"], r["efficiency_hi"] = b["efficiency"], a["efficiency"]  # hi: least
    return rows


def band_table(rows, main: net.Network, times: dict, sim) -> list[dict]:
    algo, dtype = _best_algo(main), sim.grad_dtypes[-1]
    table = []
    for m in times:
        row = {"model": m}
        for n in sim.world_sizes:
            r = pick(rows, network=main.name, model=m, grad_dtype=dtype, algo=algo, world_size=n,
                     bucket_mb=sim.bucket_mb)
            if r:
                row[str(n)] = (f"{_pct(r[0]['efficiency_lo'])} / {_pct(r[0]['efficiency'])} / "
                               f"{_pct(r[0]['efficiency_hi'])}")
        table.append(row)
    return table


def _md(table: list[dict]) -> str:
    cols = list(dict.fromkeys(k for r in table for k in r))
    return "\n".join(["| " + " | ".join(cols) + " |", "| " + " | ".join("---" for _ in cols) + " |"]
                     + ["| " + " | ".join(str(r.get(c, "")) for c in cols) + " |" for r in table])


ALGO_COLORS = {"naive": "tab:red", "ring": "tab:blue", "hring": "tab:green", "tree": "tab:orange",
               "native": "tab:purple"}


def _plot_model(ax, rows, main, m: str, sim) -> None:
    """Efficiency vs GPUs of one model, a line per algorithm and gradient dtype."""
    for algo in main.algos():
        for dtype, ls in zip(sim.grad_dtypes[::-1], ("-", "--", ":")):
            rs = sorted((r for r in rows if r["network"] == main.name and r["model"] == m
                         and r["algo"] == algo and r["grad_dtype"] == dtype
                         and r["bucket_mb"] == sim.bucket_mb), key=lambda r: r["world_size"])
            if rs:
                xs = [r["world_size"] for r in rs]
                ax.plot(xs, [r["efficiency"] for r in rs], ls=ls, marker="o", ms=3,
                        color=ALGO_COLORS.get(algo), label=f"{algo} {dtype}")
                if "efficiency_lo" in rs[0]:  # the interference band
                    ax.fill_between(xs, [r["efficiency_lo"] for r in rs],
                                    [r["efficiency_hi"] for r in rs], alpha=0.12,
                                    color=ALGO_COLORS.get(algo), lw=0)
    ax.set_title(f"{m} on {main.name} (bands: interference)", fontsize=9)
    ax.set_xscale("log", base=2)
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("GPUs")
    ax.grid(True, alpha=0.3)


def _plot_buckets(ax, rows, main, models: list[str], sim) -> None:
    """Efficiency vs bucket size at the largest N, hring and tree, a colour per model."""
    n_top = max(sim.world_sizes)
    dtype = sim.grad_dtypes[-1]
    for m, color in zip(models, ("tab:blue", "tab:green", "tab:red", "tab:purple", "tab:brown",
                                 "tab:gray")):
        for algo, ls in (("hring", "-"), ("tree", "--")):
            rs = sorted((r for r in rows if r["network"] == main.name and r["model"] == m
                         and r["algo"] == algo and r["grad_dtype"] == dtype
                         and r["world_size"] == n_top and r["bucket_mb"] > 0),
                        key=lambda r: r["bucket_mb"])
            if rs:
                ax.plot([r["bucket_mb"] for r in rs], [r["efficiency"] for r in rs], ls=ls,
                        marker="o", ms=3, color=color, label=f"{m} {algo}")
    ax.set_xscale("log")
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("bucket MB")
    ax.set_title(f"bucket size at {n_top} GPUs ({dtype})", fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)


def plot(rows, main, times, sim, path: str) -> str:
    """Efficiency vs GPUs per algorithm, one panel per model (solid: bf16, dashed: fp32), and the
    efficiency vs bucket size at the largest world size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(times)
    fig, axes = plt.subplots(1, len(models) + 1, figsize=(4.2 * (len(models) + 1), 4.0),
                             squeeze=False)
    for ax, m in zip(axes[0], models):
        _plot_model(ax, rows, main, m, sim)
    axes[0][0].set_ylabel("efficiency")
    axes[0][0].legend(fontsize=7)
    _plot_buckets(axes[0][-1], rows, main, models, sim)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
