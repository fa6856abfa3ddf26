"""Analytic cost of our all-reduce algorithms, as data for the scaling model.

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


def cost(algo: str, nbytes: float, world_size: int) -> Cost:
    n, s = world_size, float(nbytes)
    if n < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if n == 1 or s == 0:
        return Cost(0, 0.0, 0.0, 0.0)
    total = 2 * (n - 1) * s
    if algo == "naive":
        return Cost(2, 2 * (n - 1) * s, (n - 1) * s, total)
    if algo in ("ring", "native"):  # native: NCCL/gloo use a ring for large messages
        return Cost(2 * (n - 1), 2 * (n - 1) * s / n, 2 * (n - 1) * s / n, total)
    if algo == "tree":
        rounds = math.ceil(math.log2(n))
        return Cost(2 * rounds, 2 * rounds * s, rounds * s, total)
    raise ValueError(f"unknown all-reduce algorithm {algo!r}: expected naive, ring, tree or native")


def bus_bandwidth(nbytes: float, seconds: float, world_size: int) -> tuple[float, float]:
    """(algbw, busbw) in bytes/s with nccl-tests' definitions: algbw = S/t, busbw = algbw*2(N-1)/N."""
    algbw = nbytes / seconds if seconds > 0 else float("nan")
    return algbw, algbw * 2 * (world_size - 1) / world_size


def hierarchical_cost(nbytes: float, gpus_per_node: int, nodes: int) -> tuple[Cost, Cost]:
    """The two-level ring on `nodes` x `gpus_per_node` ranks, as (intra-node part, inter-node part),
    each to be priced with its own link's alpha and beta:

      1. intra-node reduce-scatter: G-1 steps of S/G (each GPU ends with 1/G of its node's sum)
      2. inter-node ring all-reduce of each 1/G shard among the M GPUs with the same local rank
         (the G rings run side by side; together they put S/M per step through each node's
         network link): 2(M-1) steps, 2(M-1)/M*S through the node's link
      3. intra-node all-gather: G-1 steps of S/G

    critical_bytes of the inter part count the bytes through one node's link (all its shards),
    so its beta is the node's network bandwidth, not one GPU's. With one node it is the flat ring.
    """
    g, m, s = gpus_per_node, nodes, float(nbytes)
    if g < 1 or m < 1:
        raise ValueError(f"gpus_per_node and nodes must be >= 1, got {gpus_per_node}, {nodes}")
    if s == 0:
        return Cost(0, 0.0, 0.0, 0.0), Cost(0, 0.0, 0.0, 0.0)
    intra = (Cost(2 * (g - 1), 2 * (g - 1) * s / g, 2 * (g - 1) * s / g, m * 2 * (g - 1) * s)
             if g > 1 else Cost(0, 0.0, 0.0, 0.0))
    inter = (Cost(2 * (m - 1), 2 * (m - 1) * s / m, 2 * (m - 1) * s / (m * g),
                  g * m * 2 * (m - 1) * s / (m * g))
             if m > 1 else Cost(0, 0.0, 0.0, 0.0))
    return intra, inter
