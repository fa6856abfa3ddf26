"""The formulas: what one collective costs, per algorithm, in the alpha-beta model.

    t = steps * alpha + critical_bytes * beta

alpha is one message round's latency, beta the inverse bandwidth of the link the critical path
crosses (for the ring, critical_bytes = 2(N-1)/N * S, so 1/beta is exactly nccl-tests' bus
bandwidth). `cost` gives the exact rounds and bytes of our algorithms on one level of links;
`hierarchical_cost` the two-level ring (hring), `node_link_bytes` what one node sends to the others;
`allreduce_on_links` prices every algorithm on a node structure of two links (inside a node,
between nodes), as the simulation's given networks and the emulated link have.
alpha and beta come from ddp_lab/perf/params.py (given) or ddp_lab/perf/fit.py (measured).

For a message of S bytes on N ranks each algorithm is described by
  steps           message rounds on the critical path (each costs one latency alpha)
  critical_bytes  bytes serialised on the critical path (time ~ steps*alpha + critical_bytes*beta)
  bytes_per_rank  the most bytes any one rank sends
  total_bytes     bytes sent by all ranks together

  naive  every rank sends S to rank 0 (all at once), rank 0 sums, sends S back to each:
         2 rounds, but (N-1)S in and (N-1)S out through rank 0's link.
  ring   S cut into N chunks; reduce-scatter (N-1 steps) then all-gather (N-1 steps), one chunk of
         S/N per step to the right-hand neighbour: bandwidth-optimal, latency grows with N.
  tree   binomial tree: reduce to rank 0 in ceil(log2 N) rounds, broadcast back in as many; every
         round carries the whole S: few rounds, but log2 N full messages on the critical path.

All three move the same total, 2(N-1)S; they differ in how it is spread over ranks and rounds.

op="reduce_scatter" | "all_gather": each half on its own, S still the whole tensor's bytes (as
nccl-tests count them), with N | S assumed (uneven shards move up to a few elements more):
  ring   N-1 steps of S/N: (N-1)S/N per rank, (N-1)S in total: half the all-reduce
  naive  2 rounds through rank 0: the whole tensor one way ((N-1)S), one chunk per rank the
         other ((N-1)S/N): (N - 1/N)S in total, all of it through rank 0's link
  tree   2 ceil(log2 N) rounds: the whole tensor up (reduce-scatter) or down (all-gather) the
         tree, (N-1)S, and the chunks of each subtree the other way, chunk c over popcount(c)
         levels
critical_bytes: per round, the most bytes through one rank's link, summed over the rounds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Cost:
    steps: int
    critical_bytes: float
    bytes_per_rank: float
    total_bytes: float

    def time(self, alpha_s: float, beta_s_per_byte: float) -> float:
        """The latency-bandwidth (alpha-beta) estimate of one all-reduce, in seconds."""
        return self.steps * alpha_s + self.critical_bytes * beta_s_per_byte


OPS = ("all_reduce", "reduce_scatter", "all_gather")


def cost(algo: str, nbytes: float, world_size: int, op: str = "all_reduce",
         node_size: int | None = None) -> Cost:
    """`algo`'s `op` of `nbytes` on `world_size` ranks; hring's nodes hold `node_size` ranks
    (None: one node, the flat ring)."""
    n, s = world_size, float(nbytes)
    if n < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if op not in OPS:
        raise ValueError(f"unknown collective {op!r}: expected one of {', '.join(OPS)}")
    if n == 1 or s == 0:
        return Cost(0, 0.0, 0.0, 0.0)
    if algo not in ("naive", "ring", "native", "tree", "hring"):
        raise ValueError(f"unknown all-reduce algorithm {algo!r}: expected naive, ring, tree, "
                         "hring or native")
    if algo == "hring":
        return _hring_cost(s, n, node_size or n, op)
    if op != "all_reduce":
        return _half_cost(algo, s, n, scatter=op == "reduce_scatter")
    total = 2 * (n - 1) * s
    if algo == "naive":
        return Cost(2, 2 * (n - 1) * s, (n - 1) * s, total)
    if algo in ("ring", "native"):  # native: NCCL/gloo use a ring for large messages
        return Cost(2 * (n - 1), 2 * (n - 1) * s / n, 2 * (n - 1) * s / n, total)
    rounds = math.ceil(math.log2(n))  # tree
    return Cost(2 * rounds, 2 * rounds * s, rounds * s, total)


def _half_cost(algo: str, s: float, n: int, scatter: bool) -> Cost:
    """A reduce-scatter (scatter=True) or an all-gather: the same rounds and totals (one is the
    other reversed); who sends the most differs."""
    c = s / n  # one chunk
    if algo in ("ring", "native"):
        return Cost(n - 1, (n - 1) * c, (n - 1) * c, (n - 1) * s)
    if algo == "naive":  # the whole tensor to rank 0 then a chunk back, or a chunk in, all out
        return Cost(2, (n - 1) * (s + c), s if scatter else (n - 1) * s, (n - 1) * (s + c))
    levels = math.ceil(math.log2(n))
    # The whole tensor over one level a round; subtree pieces of min(2^k, N - 2^k) chunks at
    # level k. Reduce-scatter: a rank sends S up and its children their subtrees' chunks;
    # all-gather: its own subtree's chunks up and S to each child.
    pieces = sum(min(1 << k, n - (1 << k)) for k in range(levels)) * c
    op = "reduce_scatter" if scatter else "all_gather"
    sent = max(tree_rank_sent(s, n, r, op) for r in range(n))
    chunked = sum(bin(p).count("1") for p in range(1, n)) * c
    return Cost(2 * levels, levels * s + pieces, sent, (n - 1) * s + chunked)


def tree_rank_sent(s: float, n: int, r: int, op: str) -> float:
    """The bytes rank r of the tree (ddp_lab/comm/tree.py) sends in `op` of `s` bytes on `n`
    ranks: once up to its parent, once down to each child. The all-reduce sends the whole
    tensor each way; a reduce-scatter sends S up and each child its subtree's chunks; an
    all-gather its own subtree's chunks up and S to each child."""
    c = s / n
    up = (r > 0) * (_subtree(r, n) * c if op == "all_gather" else s)
    return up + sum(_subtree(k, n) * c if op == "reduce_scatter" else s
                    for k in tree_children(r, n))


def tree_children(r: int, n: int) -> list[int]:
    levels = math.ceil(math.log2(n)) if n > 1 else 0
    low = (r & -r).bit_length() - 1 if r else levels  # a rank's children sit below its lowest bit
    return [r + (1 << k) for k in range(low) if r + (1 << k) < n]


def _subtree(r: int, n: int) -> int:
    return min(r + (r & -r), n) - r


def bus_bandwidth(nbytes: float, seconds: float, world_size: int) -> tuple[float, float]:
    """(algbw, busbw) in bytes/s with nccl-tests' definitions: algbw = S/t, busbw = algbw*2(N-1)/N."""
    algbw = nbytes / seconds if seconds > 0 else float("nan")
    return algbw, algbw * 2 * (world_size - 1) / world_size


def hierarchical_cost(nbytes: float, gpus_per_node: int, nodes: int,
                      op: str = "all_reduce") -> tuple[Cost, Cost]:
    """The two-level ring (ddp_lab/comm/hring.py) on `nodes` x `gpus_per_node` ranks, as
    (intra-node part, inter-node part), each to be priced with its own link's alpha and beta:

      1. intra-node reduce-scatter: G-1 steps of S/G (each GPU ends with 1/G of its node's sum)
      2. inter-node ring all-reduce of each 1/G shard among the M GPUs with the same local rank
         (the G rings run side by side; together they put S/M per step through each node's
         network link): 2(M-1) steps, 2(M-1)/M*S through the node's link
      3. intra-node all-gather: G-1 steps of S/G
    (op="reduce_scatter" | "all_gather": step 1 then step 2's reduce-scatter, or step 2's
    all-gather then step 3.)

    critical_bytes of the inter part count the bytes through one node's link (all its shards),
    so its beta is the node's network bandwidth, not one GPU's. With one node it is the flat ring.
    """
    g, m, s = gpus_per_node, nodes, float(nbytes)
    if g < 1 or m < 1:
        raise ValueError(f"gpus_per_node and nodes must be >= 1, got {gpus_per_node}, {nodes}")
    inside, across = cost("ring", s, g, op), cost("ring", s / g, m, op)  # one ring of each level
    intra = Cost(inside.steps, inside.critical_bytes, inside.bytes_per_rank,
                 m * inside.total_bytes)
    inter = Cost(across.steps, g * across.critical_bytes, across.bytes_per_rank,
                 g * across.total_bytes)  # the G rings across nodes share each node's link
    return intra, inter


def _hring_cost(s: float, n: int, g: int, op: str) -> Cost:
    """hring on one kind of link: a rank's own rounds and bytes at both levels, added."""
    if n % g:
        raise ValueError(f"world size {n} is not a whole number of {g}-rank nodes")
    intra, inter = hierarchical_cost(s, g, n // g, op)
    return Cost(intra.steps + inter.steps, intra.critical_bytes + inter.bytes_per_rank,
                intra.bytes_per_rank + inter.bytes_per_rank, intra.total_bytes + inter.total_bytes)


def node_link_bytes(algo: str, nbytes: float, world_size: int, node_size: int,
                    op: str = "all_reduce") -> float:
    """Bytes each node sends to the other nodes in one `op` of `nbytes`, ranks laid out node by
    node (ddp_lab.dist's nodes): what one shared link per node carries. The flat ring crosses
    from each node once, the last rank to the next node's first: that rank's bytes, 2(N-1)/N * S
    for the all-reduce. hring: the inter part, 2(M-1)/M * S. At 2 nodes of 4: 1.75 S and 1.0 S."""
    n, g = world_size, node_size
    if n % g:
        raise ValueError(f"world size {n} is not a whole number of {g}-rank nodes")
    if n == g:
        return 0.0
    if algo in ("ring", "native"):
        return cost("ring", nbytes, n, op).bytes_per_rank
    if algo == "hring":
        return hierarchical_cost(nbytes, g, n // g, op)[1].critical_bytes
    raise ValueError(f"node_link_bytes: {algo!r} is not modelled (ring, hring)")


def allreduce_on_links(algo: str, nbytes: float, n: int, intra, inter,
                       gpus_per_node: int) -> float:
    """Seconds for one all-reduce of `nbytes` on `n` ranks, `gpus_per_node` to a node, with
    `algo`: naive, ring (flat), hring (two-level ring), tree (binomial), native (= hring).
    `intra` and `inter` are the links inside a node and between nodes (alpha_s and
    beta_s_per_byte each; `inter` None: one node)."""
    g = gpus_per_node
    if algo == "native":
        algo = "hring"
    if n <= g or inter is None:  # one node: every algorithm on the intra-node links
        base = "ring" if algo == "hring" else algo
        return cost(base, nbytes, n).time(intra.alpha_s, intra.beta_s_per_byte)
    if n % g:
        raise ValueError(f"world size {n} is not a whole number of {g}-GPU nodes")
    m, s, i, e = n // g, float(nbytes), intra, inter
    if algo == "naive":
        # Everyone sends S to rank 0 at once and gets S back: 2 rounds over the network, rank
        # 0's node link carries (N-G)*S each way while its NVLink carries (G-1)*S.
        return 2 * e.alpha_s + 2 * max((n - g) * s * e.beta_s_per_byte,
                                       (g - 1) * s * i.beta_s_per_byte)
    if algo == "ring":
        # One flat ring through every rank: each of its 2(N-1) steps waits for the slowest
        # hop (the one between nodes), and each node link carries one chunk of S/N per step.
        return 2 * (n - 1) * e.alpha_s + node_link_bytes("ring", s, n, g) * e.beta_s_per_byte
    if algo == "hring":
        intra_cost, inter_cost = hierarchical_cost(s, g, m)
        return (intra_cost.time(i.alpha_s, i.beta_s_per_byte)
                + inter_cost.time(e.alpha_s, e.beta_s_per_byte))
    if algo == "tree":
        # Binomial tree over ranks laid out node by node: the rounds at distance < G stay in
        # the node, the others cross the network (one flow per node link); each carries S.
        rounds = math.ceil(math.log2(n))
        local = math.ceil(math.log2(g)) if g > 1 else 0
        return 2 * (local * (i.alpha_s + s * i.beta_s_per_byte)
                    + (rounds - local) * (e.alpha_s + s * e.beta_s_per_byte))
    raise ValueError(f"unknown algorithm {algo!r}")
