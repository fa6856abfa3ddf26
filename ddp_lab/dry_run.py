"""The dry run: one training step's communication at any world size, counted on one CPU.

    python -m ddp_lab.dry_run world_size=1024 sync=ring [model=...] [sync.zero=1|2|3]
    python -m ddp_lab.dry_run world_size=1024 sync=tree dry_run.ranks=[0,1,1023]
    python -m ddp_lab.dry_run world_size=1024 sync=hring dist.node_size=8

It runs the training code itself, not a second implementation of it (torchtitan's rule), on
torch's `fake` process-group backend, where every send and receive completes at once and moves
nothing. One process takes each rank in turn (or the ranks of `dry_run.ranks`): it becomes that
rank of a fake group of `world_size`, builds the sync the config names (`build_sync`: its real
bucket plan, ZeRO's shards, its subgroups), and runs one step's syncs: `finish()` reduces every
bucket as a training step does, and at ZeRO-1/2 `gather_params()` all-gathers the parameters as
the optimizer's hook does after its step. ZeRO-3 gathers each unit in its forward and backward
hooks instead, so there the rank runs a forward and backward of one sample first (a model of its
own: prepare frees the units' storage). Our point-to-point layer (ddp_lab/comm/p2p.py) counts
each message it posts, so bytes and messages are counted, not computed.

Tensor values mean nothing here: a fake receive leaves its buffer as it was, so every sum is
garbage. Only counts are checked, each beside the performance model's figure:
    bytes sent     comm.cost() per bucket and collective: summed over the ranks it is exact; each
                   rank's (dry_run_report.rank_sends: comm.cost()'s terms for that rank) differs
                   by chunk rounding only (the ring: under 2 elements a collective,
                   ddp_lab/comm/ring.py; hring: that on each of its two levels);
                   perf.step.bytes_per_step is the simulation's figure (the whole gradient as
                   one message)
    messages       each rank's sends, against its schedule's (rank_sends: a ring's, a slice each)
    scratch        the receive buffers p2p keeps, against comm.scratch_numel. Each rank runs on
                   threads of its own, so the buffers it counts are its own. On meta tensors p2p
                   keeps none: not counted (null, and dry_run.json's scratch_not_counted says
                   "meta").
    memory         perf.memory.predict_held: what the rank would hold on its device (training
                   state, buckets, scratch; activations come on top)

Because values mean nothing, the dry run skips two things a rank would do for them (`shortcuts`):
torch's batch_isend_irecv per message (p2p posts through a transport that counts and moves
nothing: ddp_lab/comm/p2p.py) and fresh bucket buffers per rank (every rank gets the same ones).
The counts stay the training code's: a test checks them rank by rank against a run without the
shortcuts (`dry_run(..., fast=False)`).

Refused before any rank runs, in one line (ConfigError): a layout that cannot exist (ranks that
are not there; a world size that is not a whole number of nodes of dist.node_size; an emulated
link, which would delay nothing), a rank predicted to hold more than `dry_run.device_gb`,
naive's N-1 whole-bucket receive buffers on rank 0 over it, or a rank this host cannot hold (on
the CPU the dry run allocates one rank's buffers at a time, for real).

Output: a table on stdout; dry_run.json (the counts, the model's figures, a row per rank) and
dry_run_info.json (the resolved config, versions, host) in the run dir,
outputs/dry_run/<overrides>/.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import sys
import threading
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf
# Imported for its side effect too: it registers the "fake" backend with torch.distributed.
from torch.testing._internal.distributed.fake_pg import FakeStore

from ddp_lab import buckets, comm, provenance
from ddp_lab.comm import p2p
from ddp_lab.config import Config, validate
from ddp_lab.dist import DistInfo, destroy_group, launched_as, node_layout, nodes_as, set_nodes
from ddp_lab.dry_run_report import report, summarize
from ddp_lab.dtypes import element_size
from ddp_lab.errors import ConfigError
from ddp_lab.keys import check_keys, key, text
from ddp_lab.models import build_model
from ddp_lab.optim import state_tensors
from ddp_lab.perf.memory import GB, predict_held
from ddp_lab.perf.step import ZERO_OPS, gathers
from ddp_lab.sync import build_sync
from ddp_lab.sync.bucketed import new_buffers
from ddp_lab.sync.config import wire_dtype
from ddp_lab.sync.zero_checkpoint import shard_ranges
from ddp_lab.sync.zero3 import unit_numels

PROGRESS_S = 5.0  # seconds between progress lines on stderr


@dataclass
class DryRunKeys:
    # the ranks to step through; []: every rank of world_size
    ranks: list[int] = key(factory=list)
    # GB (1e9 B) of device memory a rank may hold: a config predicted to need more is refused
    device_gb: float = key(80.0, positive=True)
    # where the ranks' tensors live: cpu (real buffers, receive scratch counted) | meta (nothing
    # allocated, no arithmetic) | auto: meta for naive and tree, cpu for the others (device_of)
    device: str = key("auto", choices=("auto", "cpu", "meta"))


@dataclass
class DryRunConfig(Config):
    """The training config (every group, checked as ddp_lab.train checks it) and the dry run's."""
    world_size: int = 8
    dry_run: DryRunKeys = field(default_factory=DryRunKeys)


ConfigStore.instance().store(name="dry_run_schema", node=DryRunConfig)


# ---- the layout, and what the model predicts, before anything runs ---------------------------

def device_of(cfg) -> str:
    """dry_run.device, auto resolved: the faster of the two for the algorithm. Naive and tree
    send a few whole buckets a step, so real buffers cost their arithmetic and meta tensors
    nothing; the ring sends 2(N-1) small chunks a bucket, where meta's kernels, which run in
    Python, cost more than the CPU's arithmetic."""
    device = cfg.dry_run.device
    return device if device != "auto" else "meta" if cfg.sync.name in ("naive", "tree") else "cpu"


def node_size(cfg) -> int:
    """Ranks per node: dist.node_size; 0 (torchrun's nodes, and there is no torchrun here) the
    whole world one node, as ddp_lab.dist.nodes() takes it outside torchrun."""
    return cfg.dist.node_size or cfg.world_size


def check_layout(cfg) -> list[int]:
    """The ranks to run, after refusing a layout that cannot exist (nodes: node_size)."""
    n, name = cfg.world_size, cfg.sync.name
    if name not in comm.OURS:
        raise ConfigError(f"sync={name}: the dry run counts the messages of our collectives, "
                          f"sync={'|'.join(comm.OURS)}; DDP's go through torch's C++ reducer")
    node_layout(node_size(cfg), None, n, n)  # refuses nodes that do not divide the world
    if cfg.sync.compress in ("powersgd", "topk"):
        raise ConfigError(f"sync.compress={cfg.sync.compress}: the dry run checks bytes against "
                          "comm.cost(), which prices uncompressed collectives; a training run "
                          "counts compressed ones (summary.json's comm.compression)")
    if cfg.dist.link.latency_us or cfg.dist.link.gbps:
        raise ConfigError("dist.link delays messages, and the dry run moves none (the fake "
                          "backend): its counts are the same without it; leave dist.link off")
    ranks = list(cfg.dry_run.ranks) or list(range(n))
    wrong = [r for r in ranks if not 0 <= r < n]
    if wrong or len(set(ranks)) != len(ranks):
        raise ConfigError(f"dry_run.ranks={text(cfg.dry_run.ranks)}: each rank once, from 0 to "
                          f"world_size-1={n - 1}" + (f" ({wrong[0]} is not)" if wrong else ""))
    return sorted(ranks)


@dataclass(frozen=True)
class Plan:
    """What the model says before the run: the buckets, each collective, each rank's memory."""
    bucket_numels: list[int]  # elements per bucket, in bucket order
    comm_elem: int  # bytes of an element as the gradients travel
    calls: list[tuple[str, int, int]]  # one step's collectives: (op, numel, elem) each
    held: list[dict]  # predict_held of every rank of the world

    def memory(self, rank: int) -> int:
        return int(sum(v for v in self.held[rank].values() if v is not None))


def make_plan(cfg) -> Plan:
    s = cfg.sync
    with torch.device("meta"):  # the parameter counts only: nothing allocated
        model = _model(cfg)
    numels, units = [p.numel() for p in model.parameters()], unit_numels(model)
    comm_elem = element_size(wire_dtype(s))  # (sync.compress=bf16|fp16 too)
    sizes = numels[::-1]  # backward's order, as the sync cuts them (ZeRO-3: a bucket a unit)
    groups = buckets.plan([k * comm_elem for k in sizes], s.bucket_mb, "ours")
    bucket_numels = units[::-1] if s.zero == 3 else [sum(sizes[i] for i in g) for g in groups]
    reduce, gather = ZERO_OPS[s.zero]
    calls = [(reduce, k, comm_elem) for k in bucket_numels]
    # fp32 parameters, gathered after the step (ZeRO-1/2), or in forward and in backward (3)
    calls += [(gather, k, 4) for k in bucket_numels] * gathers(s.zero, s.reshard_after_forward)
    states = state_tensors(cfg.optim)
    held = [predict_held(numels, cfg.world_size, r, s.name, s.zero, states, s.bucket_mb,
                         comm_elem, s.overlap, comm.scratch_numel, units=units,
                         reshard_after_forward=s.reshard_after_forward)
            for r in range(cfg.world_size)]
    return Plan(bucket_numels, comm_elem, calls, held)


def check_memory(cfg, plan: Plan) -> None:
    """Refuse what no rank's device (or this host, which holds one rank at a time) could hold."""
    n, limit = cfg.world_size, cfg.dry_run.device_gb
    if cfg.sync.name == "naive" and n > 1:
        s = max(plan.bucket_numels) * plan.comm_elem
        if (n - 1) * s > limit * GB:
            raise ConfigError(
                f"sync=naive at world_size={n}: rank 0 receives every rank's copy of a bucket at "
                f"once, into N-1 buffers of the largest ({s} B): {n - 1} x {s} B = "
                f"{(n - 1) * s / GB:.1f} GB > dry_run.device_gb={limit:g}; use sync=ring or "
                f"sync=tree, or a smaller sync.bucket_mb")
    worst = max(range(n), key=plan.memory)
    need, held = plan.memory(worst), plan.held[worst]
    parts = " + ".join(f"{k.removesuffix('_bytes').replace('_', ' ')} {v / GB:.2f}"
                       for k, v in held.items() if v)
    if need > limit * GB:
        raise ConfigError(f"rank {worst} would hold {need / GB:.2f} GB > dry_run.device_gb="
                          f"{limit:g}: {parts} GB (activations on top); shard it with "
                          f"sync.zero=1|2|3, or use a smaller model")
    from ddp_lab.bench.vector_add import host_available_bytes

    if device_of(cfg) == "cpu" and need > host_available_bytes():
        raise ConfigError(f"the dry run holds one rank's buffers at a time, for real: rank "
                          f"{worst}'s {need / GB:.2f} GB ({parts} GB) is more than the "
                          f"{host_available_bytes() / GB:.1f} GB this host has available")


# ---- the run: every rank in turn, on the fake backend -----------------------------------------

def dry_run(cfg, progress: bool = False, fast: bool = True) -> dict:
    """Check `cfg` (composed from conf/dry_run.yaml), run its ranks, return dry_run.json's dict.
    fast=False: each rank through torch's batch_isend_irecv, with bucket buffers of its own: the
    path the fast one (`shortcuts`) is checked against, rank by rank (tests/test_dry_run.py)."""
    if cfg.world_size < 1:
        raise ConfigError(f"world_size={cfg.world_size} must be >= 1")
    with launched_as(cfg.world_size):
        validate(cfg)  # the training keys, as ddp_lab.train checks them on world_size ranks
    check_keys(cfg, DryRunConfig)
    cfg = OmegaConf.to_object(cfg)  # plain dataclasses: read per rank, a DictConfig costs ~1 ms
    ranks = check_layout(cfg)
    with nodes_as(node_layout(node_size(cfg), None, cfg.world_size, cfg.world_size)):
        plan = make_plan(cfg)  # (hring's scratch depends on its nodes)
    check_memory(cfg, plan)
    device = torch.device(device_of(cfg))
    model_for_rank = _models(cfg, device)
    transport, buffers = shortcuts() if fast else (p2p.torch_transport, new_buffers)
    start, rows, said = time.perf_counter(), [], time.perf_counter()
    with p2p.transport(transport):
        for i, rank in enumerate(ranks):
            rows.append({**_in_own_thread(lambda: _one_rank(cfg, model_for_rank(), rank, device,
                                                            buffers)),
                         "predicted_scratch_bytes": plan.held[rank]["comm_scratch_bytes"],
                         "predicted_memory_bytes": plan.memory(rank)})
            if progress and time.perf_counter() - said > PROGRESS_S:
                said, spent = time.perf_counter(), time.perf_counter() - start
                print(f"dry run: {i + 1}/{len(ranks)} ranks, {spent:.0f} s, about "
                      f"{spent * (len(ranks) / (i + 1) - 1):.0f} s left", file=sys.stderr,
                      flush=True)
    return summarize(cfg, plan, rows, time.perf_counter() - start, device_of(cfg),
                     node_size(cfg))


def shortcuts():
    """What the dry run may skip because values mean nothing, counts unchanged: torch's batch
    per message (p2p's counting_transport: the counts are p2p's own, made before), and a fresh
    set of bucket buffers per rank, whose first touch cost about 60 ms a rank of
    AlexNet-CIFAR's 93 MB. Ranks asking for the same sizes get the same buffers; within a
    rank each bucket still has its own."""
    made = {}

    def buffers(sizes: list[tuple]) -> list[torch.Tensor]:
        if tuple(sizes) not in made:
            made[tuple(sizes)] = new_buffers(sizes)
        return made[tuple(sizes)]

    return p2p.counting_transport, buffers


def _models(cfg, device: torch.device):
    """Each rank's model, from a call: one for every rank, which a sync's prepare leaves whole
    (ZeRO-1/2 make its parameters views of flat buffers), but a copy a rank at ZeRO-3, whose
    prepare frees the parameters' storage (a copy: building one, its initialization, took 80 ms
    a rank on one core; values mean nothing here)."""
    with device:
        model = _model(cfg)
    return (lambda: copy.deepcopy(model)) if cfg.sync.zero == 3 else (lambda: model)


def _model(cfg):
    """The config's model; the dry run loads no data, so its classes are data.num_classes."""
    m = cfg.model
    return build_model(m.name, cfg.data.num_classes, m.dropout, m.stem, m.fc_width)


@contextlib.contextmanager
def fake_group(rank: int, world_size: int):
    """The default process group as rank `rank` of `world_size`, on the fake backend (for CPU
    and meta tensors alike)."""
    dist.init_process_group("cpu:fake,meta:fake", rank=rank, world_size=world_size,
                            store=FakeStore())
    try:
        yield
    finally:
        destroy_group()  # (with the node groups ddp_lab.dist made on it)


def _one_rank(cfg, model, rank: int, device: torch.device, buffers) -> dict:
    """Rank `rank`'s step: its sync built (its bucket buffers from `buffers`) and prepared,
    ZeRO-3's forward and backward, every bucket reduced, ZeRO-1/2's gather. Receive scratch is
    kept, so counted, on the CPU only (ddp_lab/comm/p2p.py's `scratch`)."""
    g = node_size(cfg)
    info = DistInfo(rank, rank % g, cfg.world_size, g, "fake", device)
    with fake_group(rank, cfg.world_size):
        set_nodes(g)  # sync=hring's levels: nodes of g ranks, no link (nothing moves to delay)
        sync = build_sync(cfg.sync, info)
        sync.make_buffers = buffers
        try:
            sync.prepare(model)
            if sync.forward_communicates:  # ZeRO-3: its hooks gather each unit, twice
                _forward_backward(model, cfg.model.image_size, device)
            sync.finish()  # (with overlap, on the sync's own communication thread)
            with comm.recording() as gathered:
                if cfg.sync.zero in (1, 2):
                    sync.gather_params()  # the optimizer's post-step hook, on this thread
            stats = sync.comm_stats()
            row = {"rank": rank, "bytes_sent": stats["bytes_per_step"] + gathered.bytes_sent,
                   "messages": stats["messages_per_step"] + gathered.messages,
                   "scratch_bytes": None if device.type == "meta" else
                   sum(t.numel() * t.element_size() for t in comm.kept_scratch())}
            if cfg.sync.zero:
                row["shards"] = _shard_ranges(sync, rank, cfg.world_size)
            return row
        finally:
            sync.close()


def _forward_backward(model, image_size: int, device: torch.device) -> None:
    """One sample through the model and back: the hooks' communication (values mean nothing)."""
    x = torch.zeros(1, 3, image_size, image_size, device=device)
    F.cross_entropy(model(x), torch.zeros(1, dtype=torch.long, device=device)).backward()


def _shard_ranges(sync, rank: int, world_size: int) -> list[list[int]]:
    """Each bucket's shard on this rank: [start, stop) of its flat parameters. ZeRO-1/2's shard
    is a view, whose offset says where it lies; ZeRO-3's is a copy (its flat is freed outside a
    step), placed where comm.shard cuts, for as long as the copy is: at stage 3 the cover check
    tests the shards' lengths, not where the sync placed them."""
    out = []
    for s, f in zip(sync.shards, sync.flats):
        if sync.stage < 3:
            start = s.storage_offset() - f.storage_offset()
        else:
            start = shard_ranges(f.numel(), world_size)[rank][0]
        out.append([start, start + s.numel()])
    return out


def _in_own_thread(fn):
    """fn() on a fresh thread: p2p keeps receive buffers per thread, so a rank run on threads of
    its own counts its own buffers, and they are freed with the thread when it ends."""
    out = {}

    def body():
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
            out["error"] = e

    thread = threading.Thread(target=body, name="ddp_lab-dry-run-rank")
    thread.start()
    thread.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


def run(cfg, run_dir: str) -> None:
    """The command: dry_run.json and dry_run_info.json (how it was made) in `run_dir`, the table
    on stdout."""
    torch.set_num_threads(1)  # one core: the ranks take turns anyway
    out = dry_run(cfg, progress=True)
    head = json.dumps({k: v for k, v in out.items() if k != "per_rank"}, indent=1)
    rows = ",\n  ".join(json.dumps(r) for r in out["per_rank"])  # a rank a line: 1,024 lines
    with open(os.path.join(run_dir, "dry_run.json"), "w") as f:
        f.write(f'{head[:-2]},\n "per_rank": [\n  {rows}\n ]\n}}\n')
    provenance.write(os.path.join(run_dir, "dry_run_info.json"),
                     OmegaConf.to_container(cfg, resolve=True), device="cpu")
    print(report(out), flush=True)
    print(f"-> {os.path.join(run_dir, 'dry_run.json')}", flush=True)


def main() -> None:
    from ddp_lab.cli import run_hydra_app

    run_hydra_app(run, "dry_run")


if __name__ == "__main__":
    main()
