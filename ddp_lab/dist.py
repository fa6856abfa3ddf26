"""The process group: made from torchrun's environment (the only module that reads it), torn down
whatever happens, and the ranks laid out on nodes.

One process without torchrun is the same code with world size 1: it still gets a (single-member)
process group, so collectives, samplers and syncs never need an `if distributed` branch. Its group
meets in an in-process store, so a lone run (or many side by side) needs no TCP port.

Nodes. Consecutive ranks share a node (`dist.node_size`; 0: torchrun's): sync=hring's two levels
(`node_groups`) and the emulated link between nodes (`dist.link`, applied in ddp_lab/comm/p2p.py)
see them. `set_nodes` fixes the layout once the group exists; `nodes()` reads it.

Hangs and failed collectives: ddp_lab/hangs.py.

In this module `dist` is torch.distributed; other modules import what they need from here by
name (`from ddp_lab.dist import init_group`), so the two never share a name.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import importlib
import math
import os
import tempfile
import uuid
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ddp_lab.errors import ConfigError
from ddp_lab.keys import key


@dataclass
class LinkConfig:
    """An emulated link between nodes (ddp_lab/comm/p2p.py); both 0: off. Checked by check_dist:
    the key rules reach one level of groups only."""
    latency_us: float = 0.0  # alpha: each message, once
    gbps: float = 0.0  # beta = 8 / (gbps * 1e9) s per byte, Gb/s; 0: no bandwidth limit
    # One link per node, shared by its ranks: messages leaving a node queue on it (the model's
    # assumption, ddp_lab/perf/collectives.py). false: a link per rank
    shared: bool = False


@dataclass
class DistConfig:
    backend: str = key("auto", choices=("auto", "gloo", "nccl"))
    # A collective that waits longer than this fails instead of hanging; at least 1
    timeout_s: float = key(300.0, positive=True)
    # Ranks per node, consecutive ranks together (sync=hring's levels, dist.link's nodes); 0:
    # torchrun's (LOCAL_WORLD_SIZE), the real nodes
    node_size: int = key(0, at_least=0)
    link: LinkConfig = key(factory=LinkConfig)


def check_dist(cfg) -> None:
    d = cfg.dist
    if d.timeout_s < 1:
        raise ConfigError(f"dist.timeout_s={d.timeout_s:g} is too short for ranks to meet "
                          "(connecting to the rendezvous store alone can take longer); use >= 1")
    _, _, world_size, local_world_size = env_ranks()
    layout = node_layout(d.node_size, d.link, world_size, local_world_size)
    if layout.emulated and cfg.sync.name == "ddp":
        raise ConfigError("dist.link delays the messages of our collectives (ddp_lab/comm/p2p.py); "
                          "sync=ddp's all-reduce is torch's own and would not wait for it: use one "
                          "of ours (sync=ring, say), or leave dist.link off")


@dataclass(frozen=True)
class Nodes:
    """The world's ranks on nodes, `size` consecutive ranks to a node, and the emulated link
    between nodes (latency and bandwidth 0: none)."""
    size: int
    count: int
    latency_s: float = 0.0
    s_per_byte: float = 0.0
    shared: bool = False
    clock_fd: int = -1  # shared link: a file the node's ranks share (set_nodes; p2p.py reads it)
    # dist.timeout_s: a message the link would hold longer fails at once, as a wait that long
    # would; every rank holds before it posts, so no pending receive would ever time out
    max_hold_s: float = math.inf

    def node(self, rank: int) -> int:
        return rank // self.size

    @property
    def emulated(self) -> bool:
        return self.latency_s > 0 or self.s_per_byte > 0

    def busiest_link_bytes(self, rank_bytes: list[float]) -> float:
        """What the busiest link between nodes carries, from each rank's bytes sent to other
        nodes (by rank): a shared link carries its node's ranks' bytes together, a link per rank
        its own rank's."""
        if not self.shared:
            return max(rank_bytes)
        return max(sum(rank_bytes[k * self.size:(k + 1) * self.size]) for k in range(self.count))


def seconds_per_byte(gbps: float) -> float:
    """A link of `gbps` Gb/s: the beta of alpha-beta, s per byte; 0 Gb/s: no bandwidth limit, 0."""
    return 8 / (gbps * 1e9) if gbps else 0.0


def node_layout(node_size: int, link, world_size: int, local_world_size: int) -> Nodes:
    """dist.node_size and dist.link (a LinkConfig, or None) on `world_size` ranks, checked."""
    size = node_size or local_world_size
    if world_size % size:
        raise ConfigError(f"dist.node_size={size} does not divide the world size {world_size}: "
                          f"nodes hold consecutive ranks, the same number each")
    latency_us, gbps = (link.latency_us, link.gbps) if link is not None else (0.0, 0.0)
    for name, value in (("latency_us", latency_us), ("gbps", gbps)):
        if not (math.isfinite(value) and value >= 0):
            raise ConfigError(f"dist.link.{name}={value:g} must be finite and >= 0 (0: off)")
    layout = Nodes(size, world_size // size, latency_us * 1e-6, seconds_per_byte(gbps),
                   bool(link.shared) if link is not None else False)
    if layout.emulated and world_size == 1:
        raise ConfigError("dist.link emulates a link between nodes, and one rank is one node: "
                          "launch at least 2 ranks, or leave dist.link off")
    if layout.emulated and layout.count == 1:
        raise ConfigError(f"dist.link emulates a link between nodes, but the {world_size} "
                          f"ranks are one node of dist.node_size={size}: set dist.node_size "
                          f"to a divisor of {world_size} below it")
    if layout.emulated and layout.shared and local_world_size % size:
        raise ConfigError(f"dist.link.shared=true needs each emulated node on one machine (its "
                          f"ranks share a local file): dist.node_size={size} must divide the "
                          f"{local_world_size} rank(s) torchrun starts per machine")
    return layout


_nodes: Nodes | None = None
_node_groups: dict[int, tuple] = {}  # node size -> (this rank's node, its ranks across nodes)


def set_nodes(node_size: int = 0, link=None, max_hold_s: float = math.inf) -> Nodes:
    """Collective, once the group exists (init_group calls it): ranks on nodes of `node_size`
    (0: torchrun's) with `link` (a LinkConfig; None: no emulated link) between them, holding no
    message longer than `max_hold_s` (dist.timeout_s)."""
    layout = dataclasses.replace(node_layout(node_size, link, dist.get_world_size(),
                                             env_ranks()[3]), max_hold_s=max_hold_s)
    if layout.emulated and layout.shared:
        layout = dataclasses.replace(layout, clock_fd=_node_clock(layout))
    _forget_nodes()
    global _nodes
    _nodes = layout
    return layout


def nodes() -> Nodes:
    """The layout set_nodes fixed; before it, torchrun's nodes (or, outside torchrun, the whole
    group as one node) with no emulated link."""
    if _nodes is not None:
        return _nodes
    world_size = dist.get_world_size() if dist.is_initialized() else env_ranks()[2]
    size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    size = size if size and world_size % size == 0 else world_size
    return Nodes(size, world_size // size)


@contextlib.contextmanager
def nodes_as(layout: Nodes):
    """`layout` as nodes() inside the block, group or none (the dry run prices hring's nodes
    before any rank's group exists)."""
    global _nodes
    saved, _nodes = _nodes, layout
    try:
        yield
    finally:
        _nodes = saved


def link_off():
    """The same nodes without the emulated link inside the block (what the host adds alone)."""
    return nodes_as(dataclasses.replace(nodes(), latency_s=0.0, s_per_byte=0.0))


def node_groups() -> tuple:
    """(this rank's node, the ranks with its local rank: one per node) as process groups, from
    torch.distributed.new_subgroups and new_subgroups_by_enumeration. Collective the first time
    for a node size (every rank must call it at the same point); made once."""
    layout = nodes()
    if layout.size not in _node_groups:
        g, m = layout.size, layout.count
        node, _ = dist.new_subgroups(group_size=g)
        across, _ = dist.new_subgroups_by_enumeration([[k * g + r for k in range(m)]
                                                       for r in range(g)])
        _node_groups[layout.size] = (node, across)
    return _node_groups[layout.size]


def _node_clock(layout: Nodes) -> int:
    """A file the ranks of this rank's node share (the time their link is next free), removed as
    soon as every rank has it open: nothing is left behind once the processes end."""
    token = [uuid.uuid4().hex if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(token, src=0)
    path = os.path.join(tempfile.gettempdir(),
                        f"ddp_lab-link-{token[0]}-node{layout.node(dist.get_rank())}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    dist.barrier()
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    return fd


@dataclass(frozen=True)
class DistInfo:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    backend: str
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def env_ranks() -> tuple[int, int, int, int]:
    """(rank, local_rank, world_size, local_world_size) from torchrun's variables, or a lone process."""
    rank = int(os.environ.get("RANK", 0))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    return rank, local_rank, world_size, local_world_size


@contextlib.contextmanager
def launched_as(world_size: int):
    """torchrun's variables, as on one node of `world_size` ranks, while the block runs: what
    reads the world from them (env_ranks: the training checks) sees that world (the dry run)."""
    saved = {k: os.environ.get(k) for k in ("WORLD_SIZE", "LOCAL_WORLD_SIZE")}
    os.environ.update(WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size))
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k)
            else:
                os.environ[k] = v


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_WORLD_SIZE" in os.environ


def choose_backend(requested: str, local_world_size: int) -> str:
    """auto -> NCCL when every local rank can have a CUDA device of its own, else gloo."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if requested == "auto":
        return "nccl" if gpus >= local_world_size and dist.is_nccl_available() else "gloo"
    if requested == "nccl":
        if gpus < local_world_size:
            raise ConfigError(
                f"dist.backend=nccl needs one CUDA device per local rank: {local_world_size} local "
                f"rank(s) but {gpus} CUDA device(s). Use dist.backend=gloo (CPU) or fewer processes "
                f"per node (--nproc_per_node<={gpus}).")
        if not dist.is_nccl_available():
            raise ConfigError("dist.backend=nccl: this torch build has no NCCL; use dist.backend=gloo")
    return requested


def init_group(backend: str = "auto", timeout_s: float = 300.0, node_size: int = 0,
               link=None) -> DistInfo:
    """Create the default process group (world size 1 without torchrun), pick this rank's device
    and set the nodes (`set_nodes`: dist.node_size, dist.link)."""
    rank, local_rank, world_size, local_world_size = env_ranks()
    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if world_size > 1 and not under_torchrun() and missing:
        raise ConfigError(f"WORLD_SIZE={world_size} without torchrun needs {' and '.join(missing)} "
                          "set on every rank; launch with torchrun instead (README: Launching)")
    backend = choose_backend(backend, local_world_size)
    if backend == "nccl":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    kwargs = {"device_id": device} if backend == "nccl" else {}
    # Imported before the group exists, not after: a first import of torch._dynamo (which
    # torch.optim's first optimizer, DDP's constructor and torch.compile make) keeps ten
    # references to the default group where no destroy_process_group() reaches them. The group
    # then outlives destroy_group(), and its gloo worker threads run into interpreter shutdown, where
    # one releasing a finished collective's tensors takes the GIL and aborts the process
    # ("terminate called without an active exception", SIGABRT after a successful run).
    # Imported first, destroy_group() joins them.
    importlib.import_module("torch._dynamo")
    timeout = datetime.timedelta(seconds=timeout_s)
    store = (dist.HashStore() if world_size == 1 and not under_torchrun()
             else _restart_safe_store(world_size, local_world_size, timeout))
    if store is not None:
        kwargs["store"] = store
    dist.init_process_group(backend=backend, rank=rank, world_size=world_size, timeout=timeout,
                            **kwargs)
    try:
        set_nodes(node_size, link, max_hold_s=timeout_s)
    except BaseException:  # a layout refused: the group goes too, its threads joined
        destroy_group()
        raise
    return DistInfo(rank, local_rank, world_size, local_world_size, backend, device)


def _restart_safe_store(world_size: int, local_world_size: int, timeout):
    """torchrun (torch >= 2.5) shares its rendezvous TCPStore with the workers and keeps it across
    restarts, without a per-attempt prefix: a restarted group can read the previous attempt's
    gloo/NCCL addresses and fail to connect ("Connection refused", pytorch#135712). On one node
    every worker sees the same TORCHELASTIC_RESTART_COUNT, so scope the keys by it there. Across
    nodes the agents' counts can differ; there, launch torchrun with
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (a fresh store per attempt) when using --max-restarts."""
    if (os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
            or int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) == 0
            or world_size != local_world_size):
        return None
    base = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                         is_master=False, timeout=timeout)
    return dist.PrefixStore(f"ddp_lab/attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}",
                            base)


def _forget_nodes() -> None:
    global _nodes
    if _nodes is not None and _nodes.clock_fd >= 0:
        os.close(_nodes.clock_fd)
    _nodes = None


def destroy_group() -> None:
    _forget_nodes()
    _node_groups.clear()
    if dist.is_initialized():
        dist.destroy_process_group()


def print0(*args, **kwargs) -> None:
    """print on global rank 0 only."""
    if int(os.environ.get("RANK", 0)) == 0:
        print(*args, **kwargs, flush=True)
