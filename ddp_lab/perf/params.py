"""The model's inputs about the machine: links, networks and interference, each with where it came
from.

A `Link` is one kind of wire priced by two numbers, alpha (seconds per message round) and beta
(seconds per byte on the critical path: 1/beta is the bus bandwidth for the ring). A `Network` is
where the collectives run:

- given: `intra` links inside a node of `gpus_per_node` ranks (NVLink) and `inter` links between
  nodes (beta: the node's network bandwidth); the PRESETS below, each link with its `source`;
  and the emulated link between nodes on one host (`emulated_network`: dist.link's numbers);
- measured: the alpha-beta fits of one backend (ddp_lab/perf/fit.py), flat over the ranks they
  were measured on (`measured_network`).

`Network.allreduce_s` / `collective_s` price one collective on it: with a fit, the fit's alpha
and beta over the algorithm's rounds and bytes; on given links, the formulas of
ddp_lab/perf/collectives.py.

`Interference`: how much backward and communication slow each other while both run. Measured by
the interference probe (ddp_lab/perf/probe.py reads its result); assumed for GPUs in the
simulation (conf/scale.yaml's `sim.interference`).

`Compute`: one GPU's training throughput for a model, what the simulation's communication has to
hide behind; `measured_compute` reads it from a results file (a throughput benchmark's table or a
training run's summary.json), each with the file and row it came from.
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ddp_lab.dist import seconds_per_byte
from ddp_lab.perf.collectives import allreduce_on_links

if TYPE_CHECKING:
    from ddp_lab.perf.fit import Fit


@dataclass(frozen=True)
class Link:
    alpha_s: float  # latency of one message round
    beta_s_per_byte: float  # 1 / bandwidth of the critical path
    source: str = ""  # where the two numbers come from: "given: ..." or "measured: ..."

    @classmethod
    def of(cls, alpha_us: float, GBps: float, source: str = "") -> "Link":
        return cls(alpha_us * 1e-6, 1.0 / (GBps * 1e9), source)


@dataclass(frozen=True)
class Network:
    """Where the all-reduces run: given links with a node structure, or measured fits (flat)."""
    name: str
    intra: Link | None = None
    inter: Link | None = None
    gpus_per_node: int = 8
    fits: dict[str, "Fit"] = field(default_factory=dict)
    note: str = ""

    @property
    def source(self) -> str:
        """Where this network's numbers come from: its links' sources, or its fits'."""
        if self.fits:
            return "; ".join(f"{algo}: measured: alpha-beta fit of {f.points} {f.backend} "
                             f"timings at N={','.join(map(str, f.world_sizes))}"
                             for algo, f in self.fits.items())
        return "; ".join(f"{where}: {link.source}" for where, link in
                         (("intra", self.intra), ("inter", self.inter)) if link is not None)

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
        return allreduce_on_links(algo, nbytes, n, self.intra, self.inter, self.gpus_per_node)

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


# Given interconnects. The latencies (alpha) are assumptions of the usual order for each kind of
# link: NVLink lowest, then RDMA, then TCP.
NVLINK = Link.of(alpha_us=3.0, GBps=370.0,
                 source="given: NVLink ~370 GB/s NCCL ring busbw, 8 H100/H200 via NVSwitch; "
                        "alpha assumed")


def _per_node(alpha_us: float, gbit: float, what: str) -> Link:
    return Link.of(alpha_us, gbit / 8, source=f"given: {gbit:g} Gb/s {what}, one link per node "
                                              "(line rate); alpha assumed")


PRESETS = {
    "nvlink": Network("nvlink", NVLINK, None, 8, note="one NVLink domain (no network)"),
    "ib400": Network("ib400", NVLINK, _per_node(5.0, 400, "InfiniBand"), 8,
                     note="8 GPUs/node on NVLink, 400 Gb/s InfiniBand per node"),
    "ib100": Network("ib100", NVLINK, _per_node(8.0, 100, "InfiniBand"), 8,
                     note="8 GPUs/node on NVLink, 100 Gb/s InfiniBand per node"),
    "eth25": Network("eth25", NVLINK, _per_node(25.0, 25, "Ethernet (TCP)"), 8,
                     note="8 GPUs/node on NVLink, 25 Gb/s Ethernet (TCP) per node"),
    # Reconstructions of the published sanity cases (rough; for the qualitative comparison only):
    "dgx1_p100": Network("dgx1_p100", Link.of(10.0, 18.0, source="reconstructed: DGX-1, "
                                              "first-generation NVLink, ring busbw assumed"),
                         None, 8,
                         note="8x P100, first-generation NVLink, ~18 GB/s ring busbw (assumed)"),
    "horovod_p100": Network("horovod_p100",
                            Link.of(10.0, 10.0, source="reconstructed: PCIe inside a server "
                                                       "(Sergeev & Del Balso 2018), assumed"),
                            _per_node(20.0, 25, "RoCE (Sergeev & Del Balso 2018)"), 4,
                            note="4x P100 per server over PCIe (~10 GB/s), 25 Gb/s RoCE between"),
}


def emulated_network(node_size: int, latency_us: float, gbps: float, intra: Link) -> Network:
    """The emulated link of `dist.link` (ddp_lab/comm/p2p.py) between nodes of `node_size` ranks,
    as a Network: alpha = latency_us, beta = 8 / gbps ns per byte (gbps 0: no bandwidth limit),
    one link per node (what dist.link.shared=true emulates, and what the formulas assume);
    `intra`: the host's own links between ranks."""
    inter = Link(latency_us * 1e-6, seconds_per_byte(gbps),
                 source=f"given: the emulated link, dist.link.latency_us={latency_us:g} "
                        f"dist.link.gbps={gbps:g} dist.link.shared=true")
    return Network(f"emulated_{gbps:g}gbps", intra, inter, node_size,
                   note=f"nodes of {node_size} ranks on one host, {gbps:g} Gb/s emulated "
                        f"between them")


def measured_network(fits: dict[tuple[str, str], "Fit"], backend: str) -> Network | None:
    """The network of `backend`'s fits (ddp_lab/perf/fit.py), flat; None without any."""
    mine = {algo: f for (algo, b), f in fits.items() if b == backend}
    if not mine:
        return None
    return Network(f"measured_{backend}", fits=mine,
                   note=f"alpha-beta fitted on {backend}, flat over all ranks")


@dataclass(frozen=True)
class Interference:
    """How much backward and communication slow each other while both run (1.0: not at all):
    `compute` = backward time with all-reduces running / without, `comm` = all-reduce time with
    backward running / without. Measured by the interference probe (ddp_lab/perf/probe.py);
    assumed for GPUs (sim.interference)."""
    compute: float = 1.0
    comm: float = 1.0


NO_INTERFERENCE = Interference()


@dataclass(frozen=True)
class Compute:
    """One GPU's training throughput for a model (img/s at `batch`), and where it comes from."""
    img_per_s: float
    batch: int
    source: str


def measured_compute(path: str, label: str | None = None) -> dict[str, Compute]:
    """model -> its measured throughput, from one results file: a `bench.train_throughput` table
    (train_throughput.jsonl / .csv: the ddp_lab loop's `ddp_img_s`) or a training run's
    summary.json (`train_img_per_s`, one process). A model must have one row: which of several
    rows is meant is not the model's to guess. `label`: how the source names the file."""
    if path.endswith("summary.json"):
        with open(path) as f:
            s = json.load(f)
        if s.get("world_size") != 1:
            raise ValueError(f"{path}: a compute rate is one GPU's; this run had "
                             f"{s.get('world_size')} ranks")
        rows = [{"model": s["model"], "img_per_s": s["train_img_per_s"],
                 "batch": s["per_rank_batch"], "what": s["precision"]}]
    else:
        with open(path, newline="") as f:
            raw = ([json.loads(line) for line in f if line.strip()] if path.endswith(".jsonl")
                   else list(csv.DictReader(f)))
        rows = [{"model": r["model"], "img_per_s": r["ddp_img_s"], "batch": r["batch"],
                 "what": f"{r['precision']}, channels_last={r['channels_last']}, "
                         f"compile={r['compile']}"} for r in raw]
    out = {}
    for r in rows:
        if r["model"] in out:
            raise ValueError(f"{path}: more than one row of model {r['model']!r}: name a file "
                             "with one row per model")
        out[r["model"]] = Compute(float(r["img_per_s"]), int(r["batch"]),
                                  f"measured: {label or path} ({r['what']}, batch {r['batch']})")
    return out
