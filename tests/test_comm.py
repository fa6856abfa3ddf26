"""Our all-reduce (ddp_lab.comm) against torch's own dist.all_reduce, on real gloo process groups.

References: `dist.all_reduce` (bitwise, on integer-valued data, which every summation order adds
exactly); a float64 sum of the same inputs (on random real data, where we must not lose more than
a small multiple of what the native all-reduce loses); the message schedules and byte counts
written out below from the documentation, independently of the implementation; `cost()`.
The ring is checked twice: as it runs by default (one slice per chunk at these sizes) and cut
into slices of a few elements (`ring.SLICE_BYTES` lowered in the child processes), so the
pipelined path runs with many slices, uneven ones and empty ones.

Every world size runs all its cases inside one process group: starting groups is the slow part.
"""

from __future__ import annotations

import contextlib
import math
import time

import pytest
import torch
import torch.distributed as dist

from ddp_lab import comm
from launchers import spawn

ALGOS = ("naive", "ring", "tree")
# The ring's slicing (SLICE_BYTES, MIN_SLICE_BYTES) for a case; None: as it runs by default.
SMALL_SLICES = (64, 32)  # many slices of 16 fp32 elements, uneven and sometimes empty
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
EPS = {torch.float32: 2.0 ** -24, torch.float64: 2.0 ** -53, torch.float16: 2.0 ** -11,
       torch.bfloat16: 2.0 ** -8}  # unit roundoff
BITS = {torch.float32: torch.int32, torch.float64: torch.int64, torch.float16: torch.int16,
        torch.bfloat16: torch.int16}


def shapes(n: int) -> list[tuple[int, ...]]:
    """numel 0, 1, < N, N, N+1, primes, multi-dimensional, and a few thousand elements."""
    out = [(0,), (1,), (max(n - 1, 1),), (n,), (n + 1,), (2,), (7,), (13,), (97,), (3, 5),
           (2, 3, 7), (1031,), (4099,), (0, 3)]
    if n > 3:  # 4-7 ranks on 2 cores are slow: the awkward sizes only (1-3 ranks take them all)
        out = [(0,), (1,), (n - 1,), (n + 1,), (13,), (2, 3, 7), (1031,)]
    return list(dict.fromkeys(out))


def _gen(*key: int) -> torch.Generator:
    return torch.Generator().manual_seed(hash(key) % (2 ** 31))


@contextlib.contextmanager
def ring_slices(slicing: tuple[int, int] | None):
    """The ring sliced with (SLICE_BYTES, MIN_SLICE_BYTES) = `slicing` inside the block."""
    from ddp_lab.comm import ring

    default = ring.SLICE_BYTES, ring.MIN_SLICE_BYTES
    ring.SLICE_BYTES, ring.MIN_SLICE_BYTES = slicing or default
    try:
        yield
    finally:
        ring.SLICE_BYTES, ring.MIN_SLICE_BYTES = default


# (algorithm, ring slicing): every algorithm as it runs, and the ring in small slices too
CASES = [(a, None) for a in ALGOS] + [("ring", SMALL_SLICES)]


def _numerics_group(rank: int, n: int) -> dict:
    """Every algorithm x dtype x shape on this group; returns the worst errors for the parent."""
    worst = {}
    for ai, (algo, slicing) in enumerate(CASES):
        for di, dtype in enumerate(DTYPES):
            for si, shape in enumerate(shapes(n)):
                key = (algo, slicing, str(dtype), shape)
                # Integer-valued data: exact in any summation order, so bitwise equal to native.
                x = torch.randint(-8, 9, shape, generator=_gen(rank, ai, di, si)).to(dtype)
                # Real data, against a float64 sum of the same (rounded) inputs.
                real = (torch.randn(shape, generator=_gen(rank, ai, di, si, 1),
                                    dtype=torch.float64) * 3).to(dtype)
                # The references in one native all-reduce (a group of 7 on 2 cores pays per call):
                # the integer sum (exact in float64 and in `dtype`), the real sum, the abs sum.
                refs = torch.stack([x.double(), real.double(), real.double().abs()])
                dist.all_reduce(refs)
                ref, exact, abs_sum = refs.to(dtype)[0], refs[1], refs[2]
                got = x.clone()
                with ring_slices(slicing):
                    ret = comm.all_reduce(got, algo)
                assert ret is got, "all_reduce must work in place and return its argument"
                assert got.dtype == dtype and got.shape == shape
                assert torch.equal(got.view(BITS[dtype]), ref.view(BITS[dtype])), \
                    f"{key}: not bitwise equal to dist.all_reduce on integer data"

                with ring_slices(slicing):
                    ours = comm.all_reduce(real.clone(), algo)
                if real.numel() == 0:
                    continue
                err_ours = (ours.double() - exact).abs().max().item()
                # Summing N terms: at most N-1 roundings of partial sums bounded by the abs sum.
                bound = max(n - 1, 1) * EPS[dtype] * abs_sum.max().item()
                assert err_ours <= bound + 1e-300, f"{key}: error {err_ours} > bound {bound}"
                # The worst element of a few thousand is a stable statistic; of 7 it is noise.
                # (float64: the reference is native float64 itself, so only the bound applies.)
                err_native = float("nan")
                if real.numel() >= 1000 and dtype != torch.float64:
                    native = real.clone()
                    dist.all_reduce(native)
                    err_native = (native.double() - exact).abs().max().item()
                    assert err_ours <= 2 * err_native + EPS[dtype] * exact.abs().max().item(), \
                        f"{key}: error {err_ours} vs native's {err_native}"
                worst[key] = (err_ours, err_native)
    return worst


def _traces_group(rank: int, n: int) -> dict:
    """The (step, op, peer, chunk) trace and bytes sent of each algorithm for a few sizes; the
    ring also in slices of 2 and 3 fp32 elements (uneven and empty slices), and in two slices
    per chunk from the minimum rule alone."""
    out = {}
    more = [("ring", (8, 8)), ("ring", (12, 12)), ("ring", (1 << 20, 4))]
    for algo, slicing in CASES[:-1] + more:
        for numel in sorted({1, max(n - 1, 1), 2 * n, 2 * n + 1, 1000}):
            x = torch.ones(numel)
            with comm.recording(trace=True) as rec, ring_slices(slicing):
                comm.all_reduce(x, algo)
            assert torch.equal(x, torch.full((numel,), float(n)))
            out[(algo, slicing, numel)] = (rec.events, rec.bytes_sent, rec.bytes_received)
    return out


def _errors_and_groups(rank: int, n: int) -> dict:
    """Bad input is a ValueError before any communication; subgroups map group ranks correctly."""
    msgs = {}
    bad = {
        "non_contiguous": torch.zeros(4, 6).t(),
        "wrong_device": torch.zeros(4, device="meta"),  # not CPU: gloo cannot send it
        "bool": torch.zeros(4, dtype=torch.bool),
    }
    for algo in comm.ALGOS:
        for name, t in bad.items():
            with pytest.raises(ValueError) as e:
                comm.all_reduce(t, algo)
            msgs[(algo, name)] = str(e.value)
        with pytest.raises(ValueError, match="unknown all-reduce algorithm"):
            comm.all_reduce(torch.zeros(3), algo + "x")
    # The group is still in step after the refusals: nothing was sent.
    x = torch.full((5,), float(rank))
    comm.all_reduce(x, "ring")
    assert torch.equal(x, torch.full((5,), float(sum(range(n)))))
    # Subgroups: odd and even ranks, with group ranks != global ranks.
    groups = [dist.new_group(list(range(p, n, 2))) for p in (0, 1)]
    mine = groups[rank % 2]
    members = list(range(rank % 2, n, 2))
    for algo, slicing in CASES:
        for numel in (1, 5, 33):
            x = torch.arange(numel, dtype=torch.float32) * (rank + 1)
            with comm.recording(trace=True) as rec, ring_slices(slicing):
                comm.all_reduce(x, algo, group=mine)
            want = torch.arange(numel, dtype=torch.float32) * sum(m + 1 for m in members)
            assert torch.equal(x, want), (algo, numel, rank)
            assert all(0 <= peer < len(members) for _, _, peer, _ in rec.events), \
                "traces name group ranks"
    # Integer tensors reduce too (exactly).
    x = torch.full((3, 3), rank, dtype=torch.int64)
    comm.all_reduce(x, "tree")
    assert torch.equal(x, torch.full((3, 3), sum(range(n)), dtype=torch.int64))
    return msgs


# ---- expected schedules, written from the documentation (not from the implementation) ----------

def split_sizes(numel: int, n: int) -> list[int]:
    """torch.tensor_split's chunk sizes: the first numel % n chunks get one element more."""
    return [numel // n + (1 if i < numel % n else 0) for i in range(n)]


def ring_slice_sizes(numel: int, n: int, slicing: tuple[int, int] | None,
                     elem: int = 4) -> list[list[int]]:
    """Each chunk's slice sizes, from ring.py's docstring: every chunk is cut into the same number
    m = ceil(|chunk 0| / SLICE_BYTES) of slices (at least 2 once |chunk 0| >= 2 MIN_SLICE_BYTES;
    sizes in bytes), as tensor_split cuts."""
    from ddp_lab.comm import ring

    slice_bytes, min_bytes = slicing or (ring.SLICE_BYTES, ring.MIN_SLICE_BYTES)
    sizes = split_sizes(numel, n)
    m = math.ceil(sizes[0] * elem / slice_bytes)
    if sizes[0] * elem >= 2 * min_bytes:
        m = max(m, 2)
    return [split_sizes(size, max(m, 1)) for size in sizes]


def expected_naive(rank: int, n: int, numel: int):
    if rank == 0:
        return ([(0, "recv", p, None) for p in range(1, n)] +
                [(1, "send", p, None) for p in range(1, n)])
    return [(0, "send", 0, None), (1, "recv", 0, None)]


def expected_ring(rank: int, n: int, numel: int, slicing: tuple[int, int] | None = None):
    """Simulated as a relay: at step 0 every rank sends its own chunk; from then on a rank sends
    on the chunk it received in the previous step; the chunk it received last in the
    reduce-scatter is the one it owns fully, and starts the all-gather. Every chunk goes as its
    slices (chunk, k), k = 0 .. m-1, in order."""
    slices = ring_slice_sizes(numel, n, slicing)
    sent = {r: r for r in range(n)}  # chunk each rank sends at the current step
    events = {r: [] for r in range(n)}
    for step in range(2 * (n - 1)):
        received = {r: sent[(r - 1) % n] for r in range(n)}  # from the left neighbour
        for r in range(n):
            for k in range(len(slices[0])):
                events[r].append((step, "send", (r + 1) % n, (sent[r], k)))
                events[r].append((step, "recv", (r - 1) % n, (received[r], k)))
        sent = received
    # Empty slices (of chunks of fewer elements than slices, or numel < N) are not transferred.
    return [e for e in events[rank] if slices[e[3][0]][e[3][1]] > 0]


def expected_tree(rank: int, n: int, numel: int):
    """Binomial tree as parent/children: parent(r) = r - lowbit(r); r's children are r + 2^k for
    every k below r's lowest set bit (below L for the root) that lands inside the group. A child
    at distance 2^k meets its parent at reduce step k and at broadcast step L + (L-1-k)."""
    L = math.ceil(math.log2(n)) if n > 1 else 0
    low = (rank & -rank).bit_length() - 1 if rank else L  # exponent of the lowest set bit
    events = []
    children = [(k, rank + 2 ** k) for k in range(low) if rank + 2 ** k < n]
    for k, c in children:
        events.append((k, "recv", c, None))
    if rank:
        events.append((low, "send", rank - 2 ** low, None))
        events.append((L + (L - 1 - low), "recv", rank - 2 ** low, None))
    for k, c in children:
        events.append((L + (L - 1 - k), "send", c, None))
    return events


EXPECTED = {"naive": expected_naive, "ring": expected_ring, "tree": expected_tree}


def expected_bytes_sent(algo: str, rank: int, n: int, numel: int, elem: int = 4) -> int:
    s = numel * elem
    if n == 1:
        return 0
    if algo == "naive":
        return (n - 1) * s if rank == 0 else s
    if algo == "tree":  # S up to the parent (not the root), S down to each child
        L = math.ceil(math.log2(n))
        low = (rank & -rank).bit_length() - 1 if rank else L
        children = sum(rank + 2 ** k < n for k in range(low))
        return (children + (rank > 0)) * s
    sizes = split_sizes(numel, n)  # ring: every chunk but r+1, then every chunk but r+2
    return 2 * s - (sizes[(rank + 1) % n] + sizes[(rank + 2) % n]) * elem


def _key(e):
    """Sortable events: chunk labels None, c and (c, k) all as tuples."""
    label = e[3]
    if not isinstance(label, tuple):
        label = (-1,) if label is None else (label,)
    return (e[0], e[1], e[2], label)


def check_traces(traces: list[dict], n: int) -> None:
    for (algo, slicing, numel), _ in traces[0].items():
        c = comm.cost(algo, numel * 4, n)
        sent = []
        steps_used = set()
        for rank in range(n):
            events, bytes_sent, bytes_received = traces[rank][(algo, slicing, numel)]
            assert [e[0] for e in events] == sorted(e[0] for e in events), \
                f"{algo} rank {rank}: steps out of order: {events}"
            if algo == "ring":  # within a step, slice by slice: (send k, recv k), then k + 1
                for step in {e[0] for e in events}:
                    ks = [e[3][1] for e in events if e[0] == step]
                    assert ks == sorted(ks), f"ring step {step}: slices out of order: {events}"
            if n == 1:
                want = []
            elif algo == "ring":
                want = sorted(expected_ring(rank, n, numel, slicing), key=_key)
            else:
                want = sorted(EXPECTED[algo](rank, n, numel), key=_key)
            assert sorted(events, key=_key) == want, (f"{algo} slicing={slicing} N={n} "
                                                      f"numel={numel} rank {rank}:\n got  {events}"
                                                      f"\n want {want}")
            assert bytes_sent == expected_bytes_sent(algo, rank, n, numel), (algo, numel, rank)
            sent.append(bytes_sent)
            steps_used |= {e[0] for e in events}
        assert sum(sent) == c.total_bytes, f"{algo} N={n} numel={numel}: {sent} vs {c}"
        assert sum(t[(algo, slicing, numel)][2] for t in traces) == c.total_bytes  # recv = sent
        assert len(steps_used) == c.steps and (not steps_used or max(steps_used) == c.steps - 1)
        if algo == "ring" and numel % n:
            assert max(sent) <= c.bytes_per_rank + 2 * 4  # uneven chunks: within two elements
        else:
            assert max(sent) == c.bytes_per_rank, f"{algo} N={n} numel={numel}: {sent} vs {c}"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [1, 2, 3, 4, *(  # 5: the full suite only (6 and 7 cost
    pytest.param(n, marks=pytest.mark.slow) for n in (5,))])  # 18 s more, what 3 and 5 test)
def test_every_algorithm_matches_dist_all_reduce(world_size):
    """numel 0, 1, < N, prime, multi-dim; four float dtypes; bitwise on integer data, within the
    native all-reduce's own error on real data; schedules and bytes as documented."""
    results = spawn(_numerics_and_traces, world_size, timeout=110)
    check_traces([r["traces"] for r in results], world_size)
    if world_size == 4:
        msgs = results[0]["errors"]
        for algo in comm.ALGOS:
            assert "contiguous" in msgs[(algo, "non_contiguous")]
            assert "gloo" in msgs[(algo, "wrong_device")] and "CPU" in msgs[(algo, "wrong_device")]
            assert "not supported" in msgs[(algo, "bool")]


def _numerics_and_traces(rank, n):
    out = {"worst": _numerics_group(rank, n), "traces": _traces_group(rank, n)}
    if n == 4:
        out["errors"] = _errors_and_groups(rank, n)
    return out


def test_expected_schedules_are_all_reduces():
    """The schedules written above, replayed on sets of contributors, do sum every rank's data
    into every rank: the expectations themselves are right."""
    for n in range(1, 9):
        for numel, slicing in ((1, None), (n, None), (2 * n + 1, None), (7 * n + 3, (8, 8)),
                               (3 * n, (1 << 20, 4))):
            # ring: slice-wise contributor sets
            slices = ring_slice_sizes(numel, n, slicing)
            hold = {r: {(c, k): {r} for c in range(n) for k in range(len(slices[0]))}
                    for r in range(n)}
            for step in range(2 * (n - 1)):
                msgs = []
                for r in range(n):
                    for e in expected_ring(r, n, numel, slicing):
                        if e[0] == step and e[1] == "send":
                            msgs.append((r, e[2], e[3], set(hold[r][e[3]])))
                for src, dst, piece, payload in msgs:
                    if step < n - 1:
                        hold[dst][piece] |= payload
                    else:
                        hold[dst][piece] = payload
            for r in range(n):
                for (c, k), who in hold[r].items():
                    if slices[c][k]:
                        assert who == set(range(n)), (n, numel, r, c, k, who)
            # naive and tree: whole tensors; reduce steps add, broadcast steps overwrite
            L = math.ceil(math.log2(n)) if n > 1 else 0
            for algo, reduce_steps, steps in (("naive", 1, 2 if n > 1 else 0),
                                              ("tree", L, 2 * L)):
                val = {r: {r} for r in range(n)}
                for step in range(steps):
                    msgs = [(e[2], set(val[r])) for r in range(n)
                            for e in EXPECTED[algo](r, n, numel)
                            if e[0] == step and e[1] == "send"]
                    for dst, payload in msgs:
                        val[dst] = val[dst] | payload if step < reduce_steps else payload
                assert all(val[r] == set(range(n)) for r in range(n)), (algo, n, val)
            # every send has its matching receive
            for algo, fn in EXPECTED.items():
                if n == 1:
                    continue
                ev = {r: fn(r, n, numel) for r in range(n)}
                sends = sorted((e[0], r, e[2], _key(e)[3]) for r in range(n) for e in ev[r]
                               if e[1] == "send")
                recvs = sorted((e[0], e[2], r, _key(e)[3]) for r in range(n) for e in ev[r]
                               if e[1] == "recv")
                assert sends == recvs, (algo, n, numel)


# ---- a dead peer ------------------------------------------------------------------------------

KILL_AT = {"naive": 0, "ring": 1, "tree": 0}  # the victim (rank 1) dies entering this step
PG_TIMEOUT_S = 10


def _dead_peer(rank, n, algo):
    import os

    from ddp_lab.comm import p2p

    post, armed = p2p.Channel.post, []

    def dying_post(self, step, sends=(), recvs=()):
        if armed and rank == 1 and step >= KILL_AT[algo]:
            os._exit(17)  # mid-collective: after its earlier steps, before this one
        return post(self, step, sends, recvs)

    p2p.Channel.post = dying_post
    comm.all_reduce(torch.ones(1000), algo)  # every connection up, all alive
    armed.append(True)
    if rank == 1:
        time.sleep(0.2)  # the others are inside the collective when rank 1 dies
    t0 = time.monotonic()
    try:
        comm.all_reduce(torch.ones(1 << 16), algo)
    except comm.CommError as e:
        return {"error": str(e), "seconds": time.monotonic() - t0}
    return {"error": None, "seconds": time.monotonic() - t0}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("algo", ALGOS)
def test_a_dead_peer_is_a_clear_error_not_a_hang(algo):
    """Rank 1 of 3 exits mid-collective: the others raise CommError naming the algorithm, the
    step and the peer, within the process group's timeout."""
    results = spawn(_dead_peer, 3, algo, timeout=PG_TIMEOUT_S + 30, pg_timeout_s=PG_TIMEOUT_S,
                    final_barrier=False)
    assert results[1] is None  # the victim never returned
    survivors = [results[0], results[2]]
    for r in survivors:
        assert r is not None and r["error"], f"a survivor finished without an error: {results}"
        assert r["seconds"] < PG_TIMEOUT_S + 5, r
        assert r["error"].startswith(f"{algo} all-reduce failed at step "), r["error"]
        assert "rank" in r["error"]
    assert any("from rank 1 " in r["error"] or "to rank 1 " in r["error"] for r in survivors), \
        survivors


def _silent_peer(rank, n, timeout_s):
    comm.all_reduce(torch.ones(10), "ring")
    if rank == 1:
        time.sleep(timeout_s + 2)  # alive, but never joins the second all-reduce in time
        return None
    t0 = time.monotonic()
    try:
        comm.all_reduce(torch.ones(1 << 16), "ring")
    except comm.CommError as e:
        return {"error": str(e), "seconds": time.monotonic() - t0}
    return {"error": None, "seconds": time.monotonic() - t0}


@pytest.mark.timeout(60)
def test_a_silent_peer_fails_at_the_group_timeout():
    """Rank 1 is alive but never sends: the others fail after the group's timeout (2 s here)."""
    results = spawn(_silent_peer, 3, 2.0, timeout=30, pg_timeout_s=2.0, final_barrier=False)
    for r in (results[0], results[2]):
        assert r["error"] and "ring all-reduce failed at step 0" in r["error"], r
        assert "rank 1" in r["error"] and "Timed out" in r["error"], r
        waited = r["seconds"]  # about the 2 s group timeout: not at once, and not a hang
        assert waited > 1.5 and waited < 10, r
