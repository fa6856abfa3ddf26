"""hring, the two-level all-reduce (ddp_lab/comm/hring.py), on real gloo groups laid out as nodes
(`ddp_lab.dist.set_nodes`), against named references: torch's dist.all_reduce (bitwise on
integer-valued data, which every summation order adds exactly), our flat ring (on real data
within rounding; where one level is left, G=1 or one node, the same schedule and bits) and the
formulas (ddp_lab/perf/collectives.py: what each node sends to the others). Then training:
sync=hring on 2 nodes of 2 against the shared references (DDP on 2 ranks; one process on the
whole batch), held to the ring's tolerance, and ZeRO stages 2 and 3 on hring against the flat
ring and one process. (Its sync's contract, as the other syncs': buckets,
overlap on and off, no_sync and bf16/fp16 on the wire at 2x2: tests/test_sync.py.)

Each world size runs all its layouts in one process group: starting groups is the slow part.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist

from background import background
from ddp_lab.perf.collectives import node_link_bytes
from helpers import SMALL, SMALL_BUCKETS, check, final_params, max_abs_diff
from launchers import ranks, spawn

# world size -> node sizes G to lay it out in: 2x2, G=1 and one node at 4; 3x2 and 2x3 at 6; 4x2
# and 2x4 at 8 (nodes x ranks per node)
LAYOUTS = {4: (2, 1, 4), 6: (2, 3), 8: (2, 4)}
# none; fewer than N (empty chunks and pieces); uneven; divisible by every N here (the counts)
SIZES = (0, 1, 5, 1031, 1680)
COUNTED = 1680
# Two float32 sums of 8 terms in different orders: each element within (N-1)u sum|x| of the
# other (u = 6e-8), about 1e-7 relative on random normal data; a lost or doubled piece is O(1).
REL_L2 = 1e-6


def _layouts(rank: int, n: int) -> dict:
    from ddp_lab import comm
    from ddp_lab.dist import set_nodes

    out = {}
    for g in LAYOUTS[n]:
        set_nodes(g)
        for numel in SIZES:
            gen = torch.Generator().manual_seed(1000 * numel + rank)
            whole = torch.randint(-40, 41, (numel,), generator=gen).float()
            native = whole.clone()
            dist.all_reduce(native)
            mine = comm.shard(native, rank, n)
            hring = comm.all_reduce(whole.clone(), "hring")
            shard = comm.reduce_scatter(whole.clone(), torch.empty_like(mine), "hring")
            gathered = comm.all_gather(mine.clone(), torch.empty_like(native), "hring")
            real = torch.randn(numel, generator=gen)
            with comm.recording(trace=True) as by_ring:
                ring = comm.all_reduce(real.clone(), "ring")
            with comm.recording(trace=True) as by_hring:
                ours = comm.all_reduce(real.clone(), "hring")
            out[(g, numel)] = {
                "native": [torch.equal(hring, native), torch.equal(shard, mine),
                           torch.equal(gathered, native)],
                "rel_l2": ((ours - ring).norm() / ring.norm().clamp(min=1e-30)).item(),
                "as_ring": torch.equal(ours, ring) and by_ring.events == by_hring.events}
        out[(g, "counts")] = _counts(COUNTED)
    return out


def _counts(numel: int) -> dict:
    """What this rank sent to other nodes in one all-reduce of each algorithm."""
    from ddp_lab import comm

    counts = {}
    for algo in ("ring", "hring"):
        with comm.recording() as rec:
            comm.all_reduce(torch.ones(numel), algo)
        counts[algo] = (rec.cross_node_bytes, rec.cross_node_messages, rec.bytes_sent)
    return counts


@pytest.mark.timeout(150)
@pytest.mark.parametrize("n", list(LAYOUTS))
def test_hring_sums_like_native_and_the_ring_on_every_layout(n):
    from ddp_lab.perf.collectives import cost, node_link_bytes

    results = spawn(_layouts, n, timeout=130)
    for g in LAYOUTS[n]:
        one_level = g in (1, n)
        for numel in SIZES:
            for rank, r in enumerate(results):
                got = r[(g, numel)]
                assert got["native"] == [True] * 3, (n, g, numel, rank)  # all-reduce, RS, AG
                assert got["rel_l2"] < REL_L2, (n, g, numel, rank, got["rel_l2"])
                if one_level:  # G=1 or one node: the flat ring itself
                    assert got["as_ring"], (n, g, numel, rank)
        # Bytes and messages each node sent to the others, summed over its ranks. One slice per
        # chunk at this size: the flat ring's one crossing rank sends 2(N-1) messages, hring's
        # G ranks 2(M-1) each.
        m, s = n // g, 4 * COUNTED
        for node in range(m):
            on_node = [r[(g, "counts")] for r in results[node * g:(node + 1) * g]]
            for algo, messages in (("ring", 2 * (n - 1)), ("hring", g * 2 * (m - 1))):
                sent = sum(c[algo][0] for c in on_node)
                assert sent == node_link_bytes(algo, s, n, g), (n, g, algo, node)
                assert sum(c[algo][1] for c in on_node) == (messages if m > 1 else 0)
                # every rank sends 2(N-1)/N S in both: hring's two levels add up to the ring's
                per_rank = cost(algo, s, n, node_size=g).bytes_per_rank
                assert all(c[algo][2] == per_rank for c in on_node), (n, g, algo, per_rank)
    if n == 8:  # 2 nodes of 4, one link each: 1.0 S against the flat ring's 1.75 S
        ours, flat = (sum(r[(4, "counts")][a][0] for r in results[:4]) for a in ("hring", "ring"))
        assert (ours / (4 * COUNTED), flat / (4 * COUNTED)) == (1.0, 1.75)


# Training: 4 ranks as 2 nodes of 2, the same 32 samples a step as the references (4 x 4, two
# micro-steps: no_sync too), overlapped, with an emulated link (a small latency: what matters is
# that every message goes through it) and a timeline.
HRING_RUN = SMALL + SMALL_BUCKETS + [
    "sync=hring", "dist.node_size=2", "dist.link.latency_us=20", "dist.link.shared=true",
    "train.batch_size=4", "train.accum_steps=2", "train.trace=true"]
TOLERANCE = 1e-6  # test_sync_train.py's, for the ring


@background(cost=12)
def hring_run(run_dir):
    check(ranks(HRING_RUN + [f"hydra.run.dir={run_dir}"], nproc=4, timeout=240))
    return run_dir


@pytest.mark.timeout(280)
def test_hring_trains_like_ddp_and_one_process(hring_run, small_references):
    got = final_params(hring_run)
    for ref in ("ddp", "single"):
        diff = max_abs_diff(final_params(small_references[ref]), got)
        assert diff < TOLERANCE, f"hring: max |ours - {ref}| = {diff}"
    with open(hring_run / "summary.json") as f:
        s = json.load(f)
    assert s["world_size"] == 4 and s["global_batch"] == 32 and s["sync"] == "hring"
    assert len(set(s["rank_param_digests"])) == 1, "replicas differ"
    # Each node's shared link carries 2(M-1)/M = 1x every bucket, counted over both its ranks
    # (the formula's count, exact: the node's two pieces of a bucket add up to the bucket).
    assert s["link_bytes_per_step"] == sum(node_link_bytes("hring", b, 4, 2)
                                           for b in s["comm"]["bucket_bytes"])
    assert s["comm"]["cross_node_bytes_per_step"] > 0
    with open(hring_run / "run_info.json") as f:
        dist_cfg = json.load(f)["config"]["dist"]
    assert dist_cfg["node_size"] == 2 and dist_cfg["link"] == {
        "latency_us": 20.0, "gbps": 0.0, "shared": True}
    with open(hring_run / "trace.json") as f:
        spans = [e for e in json.load(f)["traceEvents"] if e.get("name") == "allreduce"]
    # Every rank sends across nodes in hring's middle level, in every bucket's all-reduce.
    assert spans and all(e["args"]["cross_node_bytes"] > 0 for e in spans)
    assert {e["pid"] for e in spans} == {0, 1, 2, 3}


# ZeRO on hring: 4 ranks as 2 nodes of 2, stages 2 and 3 (the reduce-scatter and all-gather of
# hring's three levels) against the flat ring at zero=0 and one process, with SGD (test_zero.py's
# small CNN and batches; stages 0-3 on the other algorithms are tested there).
def _zero_on_hring(rank: int, n: int) -> dict:
    from ddp_lab.dist import set_nodes
    from test_zero import packed, scfg, train

    set_nodes(2)
    out = {}
    for algo, zero in (("ring", 0), ("hring", 2), ("hring", 3)):
        params, sync, *_ = train(rank, n, scfg(algo, zero), "sgd")
        out[(algo, zero)] = (params, sync.comm_stats() if zero == 3 else None)
        sync.close()
    return packed(out)


@pytest.mark.timeout(120)
def test_hring_at_zero_2_and_3_trains_like_the_ring_and_one_process():
    """SGD within 1e-6 (TOLERANCE: the order of a 4-term float32 sum moves the last bits of each
    gradient, LR x steps keeps that far below it); every rank the same."""
    from test_zero import max_diff, one_process, unpacked

    results = [unpacked(r) for r in spawn(_zero_on_hring, 4, timeout=110)]
    ring, single = results[0][("ring", 0)][0], one_process(4, "sgd")
    for zero in (2, 3):
        ours, stats = results[0][("hring", zero)]
        assert all(max_diff(r[("hring", zero)][0], ours) == 0 for r in results[1:]), zero
        for ref in (ring, single):
            assert max_diff(ours, ref) < TOLERANCE, (zero, max_diff(ours, ref))
    assert stats["units"] == 3 and stats["collectives_per_step"]["reduce_scatter"] == 3
