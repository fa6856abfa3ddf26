"""The emulated link between nodes (dist.node_size, dist.link: ddp_lab/comm/p2p.py's `Link`):
counted, not timed. What each node sends to the others against the formulas
(ddp_lab/perf/collectives.py's node_link_bytes); every message to another node held exactly
once (the link's own count against the messages the recorder counted); the shared link queueing
messages one after another, booked on a given clock; and the layouts a config may not ask for,
each refused in one line.
"""

from __future__ import annotations

import os

import pytest
import torch

from ddp_lab.config import validate
from ddp_lab.errors import ConfigError
from helpers import compose_config
from launchers import spawn

NUMEL = 1680  # divisible by every rank count here: the formulas' N | S
ALGOS = ("naive", "ring", "tree", "hring")


def _held_and_counted(rank: int, n: int) -> dict:
    from ddp_lab import comm
    from ddp_lab.comm import p2p
    from ddp_lab.dist import LinkConfig, set_nodes

    out = {}
    for shared in (True, False):
        layout = set_nodes(2, LinkConfig(latency_us=1.0, gbps=1000.0, shared=shared))
        link = p2p.link(layout)
        for algo in ALGOS:
            held = link.held
            with comm.recording() as rec:
                comm.all_reduce(torch.ones(NUMEL), algo)
            out[shared, algo] = (rec.cross_node_bytes, rec.cross_node_messages, link.held - held)
    set_nodes(2)  # the same nodes, no link: still counted, nothing held
    held = link.held
    with comm.recording() as rec:
        comm.all_reduce(torch.ones(NUMEL), "ring")
    out["no link"] = (rec.cross_node_bytes, link.held - held)
    return out


@pytest.mark.timeout(60)
def test_each_message_to_another_node_is_counted_and_held_once():
    """2 nodes of 2, a link per node and a link per rank: held == counted on every rank for every
    algorithm; what each node sent against the formulas."""
    from ddp_lab.perf.collectives import node_link_bytes

    n, g, s = 4, 2, 4 * NUMEL
    results = spawn(_held_and_counted, n, timeout=50)
    for rank, r in enumerate(results):
        for key in [(shared, algo) for shared in (True, False) for algo in ALGOS]:
            sent, messages, held = r[key]
            assert held == messages, (rank, key, r[key])  # once each: not per batch, not twice
        assert r["no link"][1] == 0
    on_node = [results[k * g:(k + 1) * g] for k in range(n // g)]
    for rs in on_node:
        for shared in (True, False):
            for algo, messages in (("ring", 2 * (n - 1)), ("hring", g * 2 * (n // g - 1))):
                assert sum(r[shared, algo][0] for r in rs) == node_link_bytes(algo, s, n, g)
                assert sum(r[shared, algo][1] for r in rs) == messages, (shared, algo)
        assert sum(r["no link"][0] for r in rs) == node_link_bytes("ring", s, n, g)
    # naive at 2x2: node 1's two ranks each send S to rank 0, rank 0 sends S to each of them
    assert [sum(r[True, "naive"][0] for r in rs) for rs in on_node] == [2 * s] * 2


def test_a_shared_link_queues_messages_of_the_whole_node(tmp_path):
    """Two ranks of a node book their one link (a file both have open, as set_nodes makes it):
    the second message leaves when the first is through; on links of their own, at once."""
    from ddp_lab.comm.p2p import Link
    from ddp_lab.dist import Nodes

    alpha, beta, now = 50e-6, 8e-9, 100.0  # 50 us, 1 Gb/s; a fixed clock reading
    path = tmp_path / "clock"
    fds = [os.open(path, os.O_RDWR | os.O_CREAT) for _ in range(2)]
    try:
        a, b = (Link(Nodes(2, 2, alpha, beta, shared=True, clock_fd=fd)) for fd in fds)
        assert a.arrival([1000], now) == pytest.approx(now + 1000 * beta + alpha, rel=1e-15)
        assert b.arrival([1000], now) == pytest.approx(now + 2000 * beta + alpha, rel=1e-15)
        assert a.arrival([500, 500], now) == pytest.approx(now + 3000 * beta + alpha, rel=1e-15)
        later = now + 1.0  # the link has been idle since: no queue
        assert b.arrival([1000], later) == pytest.approx(later + 1000 * beta + alpha, rel=1e-15)
        assert (a.held, b.held) == (3, 2)
    finally:
        for fd in fds:
            os.close(fd)
    a, b = (Link(Nodes(2, 2, alpha, beta)) for _ in range(2))  # a link per rank
    assert a.arrival([1000], now) == b.arrival([1000], now) == now + 1000 * beta + alpha


def test_a_link_too_slow_for_the_timeout_fails_at_once_naming_the_keys(monkeypatch):
    """Every rank holds its messages before it posts them, so nothing pending would ever time out:
    a hold past dist.timeout_s (max_hold_s) is refused in one line, before any sleep."""
    from ddp_lab.comm import p2p
    from ddp_lab.dist import Nodes

    monkeypatch.setattr(p2p.time, "sleep", lambda s: pytest.fail(f"slept {s} s"))
    link = p2p.Link(Nodes(1, 2, 0.0, 8 / (1e-4 * 1e9), max_hold_s=20.0))  # 0.0001 Gb/s
    with pytest.raises(ConfigError) as e:
        link.hold([1 << 20])  # 1 MiB: 84 s at 100 kb/s
    assert str(e.value) == ("the emulated link (dist.link.gbps=0.0001, dist.link.latency_us=0) "
                            "would hold 1,048,576 bytes 84 s, past dist.timeout_s=20: raise "
                            "dist.link.gbps (or dist.timeout_s)")


def test_the_emulated_link_is_a_network_the_formulas_price():
    """perf.params.emulated_network: the flat ring pays every step's latency and 2(N-1)/N S
    through each node's link, hring two latencies and 2(M-1)/M S there (plus its levels inside
    the nodes, free here): at 2x4, 1.75 S against 1.0 S."""
    from ddp_lab.perf.params import Link, emulated_network

    s, alpha, beta = 64 << 20, 25e-6, 8e-9  # 25 us, 1 Gb/s
    net = emulated_network(4, 25.0, 1.0, Link(0.0, 0.0))
    assert (net.inter.alpha_s, net.inter.beta_s_per_byte) == pytest.approx((alpha, beta))
    assert net.allreduce_s("ring", s, 8) == pytest.approx(14 * alpha + 1.75 * s * beta)
    assert net.allreduce_s("hring", s, 8) == pytest.approx(2 * alpha + 1.0 * s * beta)
    assert net.allreduce_s("ring", s, 4) == 0.0  # one node: the host's links only (free here)


def test_the_busiest_link_carries_a_nodes_ranks_together_when_shared():
    """summary.json's link_bytes_per_step: ranks 0-1 and 2-3 on two nodes. Shared, a node's link
    carries both ranks' crossings (20 + 30); a link per rank, the largest rank's (30)."""
    from ddp_lab.dist import Nodes

    crossed = [5.0, 10.0, 20.0, 30.0]
    assert Nodes(2, 2, shared=True).busiest_link_bytes(crossed) == 50.0
    assert Nodes(2, 2).busiest_link_bytes(crossed) == 30.0


@pytest.mark.parametrize("overrides, world, message", [
    (["dist.node_size=4"], 6, "dist.node_size=4 does not divide the world size 6"),
    (["dist.link.gbps=1"], 2, "dist.link emulates a link between nodes, but the 2 ranks are "
                              "one node of dist.node_size=2"),
    (["sync=ring", "dist.link.gbps=1"], 1, "one rank is one node: launch at least 2 ranks"),
    (["sync=ring", "dist.node_size=1", "dist.link.gbps=inf"], 2,
     "dist.link.gbps=inf must be finite and >= 0 (0: off)"),
    (["dist.node_size=1", "dist.link.latency_us=50"], 2,
     "sync=ddp's all-reduce is torch's own and would not wait for it"),
    (["sync=ring", "dist.node_size=1", "dist.link.gbps=-1"], 2,
     "dist.link.gbps=-1 must be finite and >= 0 (0: off)"),
])
def test_a_layout_that_cannot_exist_is_refused_in_one_line(overrides, world, message,
                                                         monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(world))
    with pytest.raises(ConfigError) as e:
        validate(compose_config(overrides))
    assert message in str(e.value) and "\n" not in str(e.value)


def test_a_shared_link_refuses_a_node_across_machines(monkeypatch):
    """Four machines of 4 ranks, emulated nodes of 8: a node's ranks could not share the file
    that holds its link's clock, so each machine would book its own link without a word."""
    monkeypatch.setenv("WORLD_SIZE", "16")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    base = ["sync=ring", "dist.link.gbps=1"]
    validate(compose_config(base + ["dist.node_size=2", "dist.link.shared=true"]))
    validate(compose_config(base + ["dist.node_size=8", "dist.link.shared=false"]))
    with pytest.raises(ConfigError) as e:
        validate(compose_config(base + ["dist.node_size=8", "dist.link.shared=true"]))
    assert "dist.node_size=8 must divide the 4 rank(s) torchrun starts per machine" in str(e.value)
