"""The simulation's report: ddp_lab/perf/simulate.py's rows printed as tables and written to
simulation.csv, simulation_allreduce.csv, simulation_zero.csv, simulation.md and simulation.png
(sim_plot.py). What the simulation assumes is in ddp_lab/perf/simulate.py's docstring; the ZeRO
tables are explained in docs/zero.md.
"""

from __future__ import annotations

import os

from ddp_lab.cli import CONF_DIR
from ddp_lab.errors import ConfigError
from ddp_lab.perf import simulate
from ddp_lab.perf.compute import profile_model
from ddp_lab.perf.memory import ZERO_STAGES
from ddp_lab.perf.params import PRESETS, Compute, Network, measured_compute
from ddp_lab.scale.config import SimConfig
from ddp_lab.scale.report import md_table
from ddp_lab.scale.sim_plot import plot
from ddp_lab.tables import format_table, write_rows


def _pct(x: float) -> str:
    return "" if x != x else f"{100 * x:.0f}%"


def _columns(table: list[dict]) -> list[str]:
    return list(dict.fromkeys(k for r in table for k in r))


def _bucket(mb: float) -> str:
    return f"{mb:g} MB" if mb else "one bucket"


def _human(nbytes: float) -> str:
    for unit, div in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if nbytes >= div:
            return f"{nbytes / div:.3g} {unit}"
    return f"{nbytes:.0f} B"


def pick(rows: list[dict], **kw) -> list[dict]:
    return [r for r in rows if all(r[k] == v for k, v in kw.items())]


def _best_algo(network: Network) -> str:
    """The algorithm a network's tables lead with: the two-level ring, else the last one (a fit)."""
    return "hring" if "hring" in network.algos() else network.algos()[-1]


class Sections:
    """The simulation's tables twice over: console text and the markdown of simulation.md."""

    def __init__(self, md: list[str]):
        self.text: list[str] = []
        self.md = md

    def table(self, title: str, table: list[dict], md_after: tuple[str, ...] = ()) -> None:
        self.text += [title, format_table(table), ""]
        self.md += [f"### {title}", "", md_table(table, _columns(table)), "", *md_after]

    def bullets(self, title: str, items: list[str]) -> None:
        self.text += [f"{title}:"] + [f"- {f}" for f in items] + [""]
        self.md += [f"### {title}", ""] + [f"- {f}" for f in items] + [""]


def model_efficiency(rows, main: Network, m: str, sim) -> list[dict]:
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


def network_efficiency(rows, nets: list[Network], times: dict, sim) -> list[dict]:
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


def fastest_allreduce(ar: list[dict], main: Network, sim) -> list[dict]:
    """Which algorithm is fastest per message size and N, and where tree stops winning."""
    table = []
    for n in sim.world_sizes:
        row = {"N": n}
        for s in (2 ** 12, 2 ** 16, 2 ** 20, 2 ** 24, 2 ** 26, 2 ** 28):
            r = [x for x in ar if x["world_size"] == n and x["bytes"] == s]
            row[_human(s)] = r[0]["fastest"] if r else ""
        if "ring" in main.algos():
            row["tree < ring below"] = _human(simulate.tree_crossover(main, n, "ring"))
        if "hring" in main.algos():
            row["tree < hring below"] = _human(simulate.tree_crossover(main, n, "hring"))
        table.append(row)
    return table


def findings(rows, main: Network, times: dict, sim) -> list[str]:
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
    """The published cases against this model, with and without overlap."""
    return [{"case": r["case"], "model": r["model"], "N": r["world_size"],
             "params_M": f"{r['parameters'] / 1e6:.1f}", "published": _pct(r["published"]),
             "model, overlap": _pct(r["efficiency"]),
             "model, no overlap": _pct(r["efficiency_no_overlap"])} for r in simulate.sanity()]


def compute_files(sim) -> dict[str, Compute]:
    """The measured rates of sim.compute_from's files (paths from the repository's root)."""
    out = {}
    for path in sim.compute_from:
        full = path if os.path.isabs(path) else os.path.join(os.path.dirname(CONF_DIR), path)
        if not os.path.exists(full):
            raise ConfigError(f"sim.compute_from: {path} does not exist")
        try:
            out.update(measured_compute(full, label=path))
        except (KeyError, ValueError) as e:
            raise ConfigError(f"sim.compute_from: {path}: {e}") from None
    return out


def run(sim, out_dir: str, fits: dict | None = None,
        measured: dict[str, float] | None = None, say=print) -> str:
    """Run the simulation, print its tables, write its files; returns the markdown section."""
    times, source = simulate.compute_times(sim, measured or {}, compute_files(sim),
                                           dict(SimConfig().img_per_s))
    nets = simulate.networks(sim, fits or {})
    rows = simulate.simulate_with_band(sim, times, nets, simulate.bucket_sizes(sim), source)
    write_rows(rows, out_dir, "simulation")
    main = next((n for n in nets if n.name == sim.network), nets[0])
    out = Sections(["## Simulation", "",
                    f"Weak scaling, {sim.batch_per_gpu} images per GPU, overlap "
                    f"{'on' if sim.overlap else 'off'}, {sim.bucket_mb:g} MB buckets "
                    f"unless said otherwise. Network `{main.name}`: {main.note}. Compute per step "
                    "(forward + backward, ms): "
                    + ", ".join(f"{m} {1e3 * t:.1f} ({source[m]})" for m, t in times.items())
                    + f". {interference_note(sim)}", ""])
    efficiency_sections(out, rows, main, nets, times, source, sim)
    zero_section(out, main, _best_algo(main), times, sim, out_dir)
    ar = simulate.allreduce_rows(main, sim.world_sizes)
    write_rows(ar, out_dir, "simulation_allreduce")
    out.table(f"Fastest all-reduce per message size on {main.name}",
              fastest_allreduce(ar, main, sim))
    out.bullets("Findings", findings(rows, main, times, sim))
    out.table("Sanity: published scaling vs this model (fp32 gradients, flat ring, assumed "
              "per-GPU throughput of the time)", sanity_table(),
              md_after=("Networks: " + "; ".join(f"`{k}`: {v.note}" for k, v in PRESETS.items()
                                                 if k in ("dgx1_p100", "horovod_p100")) + ".", ""))
    with open(os.path.join(out_dir, "simulation.md"), "w") as f:
        f.write("\n".join(out.md))
    plot(rows, main, times, sim, os.path.join(out_dir, "simulation.png"))
    say("\n".join(out.text))
    return "\n".join(out.md)


def efficiency_sections(out: Sections, rows: list[dict], main: Network, nets: list[Network],
                        times: dict, source: dict, sim) -> None:
    """Per model on the main network, per network, and the interference band."""
    for m in times:
        table = model_efficiency(rows, main, m, sim)
        if table:
            out.table(f"{m} ({profile_model(m).parameters / 1e6:.1f} M params, "
                      f"{times[m] * 1e3:.1f} ms compute, {source[m]}), efficiency on {main.name}",
                      table)
    out.table(f"Efficiency by network ({sim.grad_dtypes[-1]} gradients, "
              f"{sim.bucket_mb:g} MB buckets)", network_efficiency(rows, nets, times, sim))
    out.table(f"Interference band on {main.name} ({_best_algo(main)}, "
              f"{sim.grad_dtypes[-1]}, {sim.bucket_mb:g} MB): efficiency with both "
              f"slowdowns at {sim.interference_band[1]:g} / as assumed / "
              f"{sim.interference_band[0]:g}", band_table(rows, main, times, sim))


def interference_note(sim) -> str:
    i = sim.interference
    return (f"Interference assumed for GPUs (no multi-GPU run has measured it here yet): "
            f"backward x{float(i['compute']):g} and all-reduces x{float(i['comm']):g} while they "
            f"overlap; bands: both slowdowns from {sim.interference_band[0]:g} to "
            f"{sim.interference_band[1]:g}.")


def band_table(rows, main: Network, times: dict, sim) -> list[dict]:
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


# ---- ZeRO ------------------------------------------------------------------------------------

def zero_memory_rows(network: Network, algo: str, sim) -> list[dict]:
    """Per model size: the fewest GPUs of sim.gpu_gb that hold its training state at each stage,
    and the communication per step at the N of `simulate.zero_needs`."""
    rows = []
    for billions in sim.zero_params_b:
        needs = simulate.zero_needs(network, algo, billions * 1e9, sim.gpu_gb)
        row = {"params": f"{billions:g} B", "state": f"{needs['state_GB']:,.0f} GB"}
        for stage in ZERO_STAGES:
            s = needs[stage]
            row[f"zero={stage}"] = "never" if s is None else (
                f"{s['gpus']}; at {s['at']}: {s['reduce_ms']:,.0f} + {s['gather_ms']:,.0f} ms")
        rows.append(row)
    return rows


def zero_efficiency_table(rows: list[dict]) -> list[dict]:
    """simulate.zero_step_rows as a table: a row per model and stage, a column per N."""
    table: dict[tuple, dict] = {}
    for r in rows:
        row = table.setdefault((r["model"], r["zero"]), {"model": r["model"], "zero": r["zero"]})
        row[str(r["world_size"])] = f"{100 * r['efficiency']:.0f}%"
    return list(table.values())


def zero_section(out: Sections, network: Network, algo: str, times: dict, sim,
                 out_dir: str) -> None:
    """The two ZeRO tables into `out`, the rows to simulation_zero.csv."""
    rows = simulate.zero_step_rows(network, algo, times, sim, simulate.assumed_interference(sim))
    write_rows(rows, out_dir, "simulation_zero")
    out.table(f"ZeRO: the fewest GPUs of {sim.gpu_gb:g} GB that hold the training state "
              "(mixed precision + Adam; activations on top), and at N GPUs "
              "(a power of two, at least 8) the gradients' reduction + the weights' "
              f"all-gather(s) per step on {network.name} ({algo}, 16-bit)",
              zero_memory_rows(network, algo, sim))
    out.table(f"ZeRO: efficiency per stage on {network.name} ({algo}, bf16, "
              f"{sim.bucket_mb:g} MB buckets; every all-gather exposed: at stage 3 an upper bound)",
              zero_efficiency_table(rows))
