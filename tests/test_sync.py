"""Gradient synchronisers on real gloo process groups (no torchrun), against named references:
each rank's own gradients averaged with torch's dist.all_reduce; rank 0's initial parameters;
the documented per-rank byte counts of each algorithm (tests/test_comm.py)."""

from __future__ import annotations


import pytest
import torch
import torch.distributed as dist
from torch import nn

from launchers import spawn
from test_comm import expected_bytes_sent, split_sizes

TOL = {"fp32": 1e-6, "bf16": 1e-2, "fp16": 2e-3}  # relative to the largest averaged grad


def scfg(name, overlap=True, comm_dtype="fp32", bucket_mb=0.001):
    """The sync group as the schema makes it (every key at its default but these)."""
    from ddp_lab.sync.config import SyncConfig

    return SyncConfig(name=name, overlap=overlap, comm_dtype=comm_dtype, bucket_mb=bucket_mb)


class WithUnused(nn.Module):
    def __init__(self):
        super().__init__()
        self.unused = nn.Linear(5, 5)  # first in parameter order, so in the last bucket
        self.net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(),
                                 nn.Linear(4 * 6 * 6, 10), nn.ReLU(), nn.Linear(10, 3))

    def forward(self, x):
        return self.net(x)  # self.unused is never called: its grad stays None


def make_model(seed: int, unused: bool = False) -> nn.Module:
    torch.manual_seed(seed)
    if unused:
        return WithUnused()
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 10),
                         nn.ReLU(), nn.Linear(10, 3))


def batch(rank: int, step: int, micro: int):
    g = torch.Generator().manual_seed(1000 * rank + 10 * step + micro)
    return torch.randn(8, 3, 8, 8, generator=g), torch.randint(0, 3, (8,), generator=g)


def forward_backward(model, sync, rank, step, accum):
    for micro in range(accum):
        x, y = batch(rank, step, micro)
        ctx = sync.no_sync() if micro < accum - 1 else _null()
        with ctx:
            loss = nn.functional.cross_entropy(model(x), y) / accum
            loss.backward()


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def reference_grads(rank, n, step, accum, unused=False):
    """Every rank's own gradients (no sync) averaged with dist.all_reduce: SUM, then / N."""
    model = make_model(0, unused)
    for micro in range(accum):
        x, y = batch(rank, step, micro)
        (nn.functional.cross_entropy(model(x), y) / accum).backward()
    out = []
    for p in model.parameters():
        g = p.grad.clone() if p.grad is not None else torch.zeros_like(p)
        dist.all_reduce(g)
        out.append(g / n)
    return out


def expected_step_bytes(sync, rank, n) -> int:
    total = 0
    for b in sync.buckets:
        elem = b.buffer.element_size()
        if sync.algo == "hring":
            total += sum(hring_bytes_sent(rank, n, b.buffer.numel(), elem))
        else:
            total += expected_bytes_sent(sync.algo, rank, n, b.buffer.numel(), elem)
    return total


def hring_bytes_sent(rank, n, numel, elem) -> tuple[int, int]:
    """(inside the node, across nodes): what rank r = m*G + l sends in hring's all-reduce
    (comm/hring.py) on M = N/G nodes of G. In the node a ring reduce-scatter and all-gather of
    the whole tensor (every chunk of G but l, then every one but l+1: comm/ring.py), across the
    nodes the ring all-reduce of piece l (chunk l of G) among the M ranks with local rank l."""
    from ddp_lab.dist import nodes

    g = nodes().size
    if g in (1, n):  # one level: the flat ring
        return expected_bytes_sent("ring", rank, n, numel, elem), 0
    m, l = divmod(rank, g)
    sizes = split_sizes(numel, g)
    inside = elem * (2 * numel - sizes[l] - sizes[(l + 1) % g])
    return inside, expected_bytes_sent("ring", m, n // g, sizes[l], elem)


# hring on 2 nodes of 2 (test_hring_sync_...), per element. With a = sum_i g_i / N the exact
# average: every element of a bucket goes through two additions, one per level (two ranks' sum in
# the node, two nodes' sum across). fp32 sums, then divides by N = 4 (exact); bf16/fp16 divide
# first (exact) and round each g_i / N into the wire dtype (one rounding more). With u the wire
# dtype's unit roundoff (2^-24 fp32, 2^-8 bf16, 2^-11 fp16), to first order
#     |ours - a| <= (2 + c) u * sum_i |g_i| / N + (2 + c) eta,   c = 0 at fp32, 1 below,
# eta the absolute error of a rounding below the dtype's normal range (fp16: half its smallest
# subnormal, 2^-25; bf16 and fp32 share fp32's range: 2^-150). The reference (gloo's fp32 sum of
# N, then / N) is itself within (N - 1) u32 * sum_i |g_i| / N of a. One percent more covers the
# second-order (u^2) terms. A lost or doubled node's share is O(|g|): far outside.
UNIT_ROUNDOFF = {"fp32": 2.0 ** -24, "bf16": 2.0 ** -8, "fp16": 2.0 ** -11}
SUBNORMAL_HALF_STEP = {"fp32": 2.0 ** -150, "bf16": 2.0 ** -150, "fp16": 2.0 ** -25}


def hring_bound(abs_avg: torch.Tensor, comm_dtype: str, n: int) -> torch.Tensor:
    """The bound above, per element, from sum_i |g_i| / N."""
    roundings = 2 + (comm_dtype != "fp32")
    u, eta = UNIT_ROUNDOFF[comm_dtype], SUBNORMAL_HALF_STEP[comm_dtype]
    return 1.01 * ((roundings * u + (n - 1) * UNIT_ROUNDOFF["fp32"]) * abs_avg + roundings * eta)


def reference_abs(rank, n, step, accum):
    """sum_i |g_i| / N, every rank's own gradients (no sync) in fp32."""
    model = make_model(0)
    for micro in range(accum):
        x, y = batch(rank, step, micro)
        (nn.functional.cross_entropy(model(x), y) / accum).backward()
    out = []
    for p in model.parameters():
        g = p.grad.abs()
        dist.all_reduce(g)
        out.append(g / n)
    return out


WIRE = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _bucketed_cases(rank, n, algos=("naive", "ring", "tree")):
    from ddp_lab.sync.bucketed import BucketedSync

    report = {}
    for algo in algos:
        for overlap in (True, False):
            for comm_dtype in ("fp32", "bf16", "fp16"):
                model = make_model(seed=rank)  # different on every rank until prepare()
                sync = BucketedSync(scfg(algo, overlap, comm_dtype), torch.device("cpu"), n)
                assert sync.prepare(model) is model
                want = make_model(seed=0)  # rank 0's initial parameters
                for p, q in zip(model.parameters(), want.parameters()):
                    assert torch.equal(p, q), "prepare() must broadcast rank 0's parameters"
                assert len(sync.buckets) >= 3, "the test wants several buckets"
                # reverse parameter order, and every parameter in exactly one bucket
                order = [id(p) for b in sync.buckets for p in b.params]
                assert order == [id(p) for p in reversed(list(model.parameters()))]
                for step, accum in ((0, 1), (1, 3)):
                    forward_backward(model, sync, rank, step, accum)
                    sync.finish()
                    ref = reference_grads(rank, n, step, accum)
                    scale = max(r.abs().max().item() for r in ref)
                    err = max((p.grad - r).abs().max().item()
                              for p, r in zip(model.parameters(), ref))
                    key = (algo, overlap, comm_dtype, step)
                    assert err <= TOL[comm_dtype] * scale, f"{key}: |grad - ref| {err} (scale {scale})"
                    assert all(b.buffer.dtype == WIRE[comm_dtype] for b in sync.buckets), key
                    if algo == "hring":
                        _check_hring_step(model, sync, ref, rank, n, step, accum, comm_dtype, key)
                    stats = sync.comm_stats()
                    # Counted bytes: exactly one step's all-reduces, accumulation or not.
                    assert sync.bytes_per_step() == expected_step_bytes(sync, rank, n), (key, stats)
                    if n > 1:
                        assert stats["comm_busy_ms"] > 0, stats
                    launched = stats["buckets_launched_in_backward"]
                    if overlap:  # the first buckets started during backward, not in finish()
                        assert launched >= len(sync.buckets) - 1, (key, stats)
                    else:
                        assert launched == 0, (key, stats)
                    model.zero_grad(set_to_none=True)
                report[(algo, overlap, comm_dtype)] = sync.comm_stats()
                sync.close()
    return report


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_bucketed_sync_averages_like_dist_all_reduce(world_size):
    """naive/ring/tree x overlap on/off x fp32/bf16/fp16, with and without accumulation: grads equal
    the dist.all_reduce average; bytes counted = one step's documented bytes; overlap launches
    buckets during backward."""
    spawn(_bucketed_cases, world_size, timeout=110)


def _check_hring_step(model, sync, ref, rank, n, step, accum, comm_dtype, key):
    """Every element within hring_bound of the dist.all_reduce average; below fp32 some element
    not equal to it (the sums really travelled in the low dtype); what crossed to the other node
    is exactly the across-node level's ring all-reduces."""
    abs_avg = reference_abs(rank, n, step, accum)
    for i, (p, r, a) in enumerate(zip(model.parameters(), ref, abs_avg)):
        excess = ((p.grad - r).abs() - hring_bound(a, comm_dtype, n)).max().item()
        assert excess <= 0, f"{key}: parameter {i} past the bound by {excess}"
    if comm_dtype != "fp32":
        assert any(not torch.equal(p.grad, r) for p, r in zip(model.parameters(), ref)), key
    across = sum(hring_bytes_sent(rank, n, b.buffer.numel(), b.buffer.element_size())[1]
                 for b in sync.buckets)
    assert sync.comm_stats()["cross_node_bytes_per_step"] == across > 0, key


def _hring_cases(rank, n):
    from ddp_lab.dist import set_nodes

    set_nodes(2)  # 2 nodes of 2 ranks: both of hring's levels run
    return _bucketed_cases(rank, n, ("hring",))


@pytest.mark.timeout(60)
def test_hring_sync_averages_on_two_nodes_of_two_like_dist_all_reduce():
    """sync=hring's contract, as the other syncs': buckets, overlap on/off, no_sync (accumulation)
    and fp32/bf16/fp16 on the wire, on 4 ranks as 2 nodes of 2; every element within
    hring_bound's stated arithmetic; bytes counted, inside and across nodes, as documented."""
    spawn(_hring_cases, 4, timeout=50)


def _unused_parameter(rank, n):
    from ddp_lab.sync.bucketed import BucketedSync

    model = make_model(rank, unused=True)
    sync = BucketedSync(scfg("ring", True), torch.device("cpu"), n)
    sync.prepare(model)
    forward_backward(model, sync, rank, 0, 1)
    sync.finish()
    ref = reference_grads(rank, n, 0, 1, unused=True)
    for p, r in zip(model.parameters(), ref):
        assert p.grad is not None and torch.allclose(p.grad, r, atol=1e-7, rtol=1e-6)
    assert torch.equal(model.unused.weight.grad, torch.zeros(5, 5))
    # Every bucket but the last (which holds the unused parameter) started during backward.
    return sync.comm_stats()["buckets_launched_in_backward"] == len(sync.buckets) - 1


@pytest.mark.timeout(60)
def test_a_parameter_without_gradient_counts_as_zeros():
    """Its bucket cannot fill during backward; finish() sends it (and all later ones) anyway."""
    assert all(spawn(_unused_parameter, 2, timeout=50))


def _fp16_overflow(rank, n):
    """Gradients of 49152 and 71680 (exact in fp16 once halved): the average 60416 fits fp16, the
    sum 120832 does not, and neither does 71680 cast to fp16 before dividing."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel

    from ddp_lab.sync.bucketed import BucketedSync
    from ddp_lab.sync.ddp import DDPSync

    def run(make_sync):
        model = nn.Linear(4, 1, bias=False)
        sync = make_sync()
        wrapped = sync.prepare(model)
        c = 49152.0 if rank == 0 else 71680.0
        (wrapped(torch.ones(1, 4)) * c).sum().backward()
        sync.finish()
        return model.weight.grad.clone()

    def torch_hook_grad():  # torch's own DDP with torch's fp16 hook, our sync nowhere
        model = nn.Linear(4, 1, bias=False)
        wrapped = DistributedDataParallel(model)
        wrapped.register_comm_hook(None, default_hooks.fp16_compress_hook)
        (wrapped(torch.ones(1, 4)) * (49152.0 if rank == 0 else 71680.0)).sum().backward()
        return model.weight.grad.clone()

    out = {}
    for algo in ("naive", "ring", "tree"):
        out[algo] = run(lambda: BucketedSync(scfg(algo, True, "fp16"), torch.device("cpu"), n))
    out["ddp"] = run(lambda: DDPSync(scfg("ddp", comm_dtype="fp16"), torch.device("cpu"), n))
    torch_hook = torch_hook_grad()
    for name, g in out.items():
        assert torch.equal(g, torch.full((1, 4), 60416.0)), (name, g)
    return bool(torch.isinf(torch_hook).all())


@pytest.mark.timeout(60)
def test_fp16_compression_divides_before_casting_for_every_sync():
    """Ours and DDP's (through our comm hook) stay finite; torch's fp16_compress_hook, which casts
    before dividing, turns the same step into inf (why ddp uses our hook)."""
    assert spawn(_fp16_overflow, 2, timeout=50) == [True, True]


def _ddp_compressed(rank, n):
    from ddp_lab.sync.ddp import DDPSync

    for comm_dtype in ("bf16", "fp16"):
        model = make_model(rank)
        sync = DDPSync(scfg("ddp", comm_dtype=comm_dtype, bucket_mb=25), torch.device("cpu"), n)
        wrapped = sync.prepare(model)
        for step, accum in ((0, 1), (1, 2)):
            forward_backward(wrapped, sync, rank, step, accum)
            sync.finish()
            ref = reference_grads(rank, n, step, accum)
            scale = max(r.abs().max().item() for r in ref)
            err = max((p.grad - r).abs().max().item() for p, r in zip(model.parameters(), ref))
            assert 0 < err <= TOL[comm_dtype] * scale, (comm_dtype, step, err, scale)
            model.zero_grad(set_to_none=True)


@pytest.mark.timeout(60)
def test_ddp_comm_dtype_averages_within_the_dtype_tolerance():
    """sync=ddp sync.comm_dtype=bf16|fp16 against the fp32 dist.all_reduce average (and not
    bitwise equal to it: the gradients really travelled in the low dtype)."""
    spawn(_ddp_compressed, 2, timeout=50)


def _comm_thread_error(rank, n):
    from ddp_lab.sync import bucketed

    model = make_model(0)
    sync = bucketed.BucketedSync(scfg("ring", True), torch.device("cpu"), n)
    sync.prepare(model)
    real = bucketed.comm.all_reduce

    def broken(tensor, algo, group=None):
        raise bucketed.comm.CommError("ring all-reduce failed at step 0 (injected)")

    bucketed.comm.all_reduce = broken
    forward_backward(model, sync, rank, 0, 1)  # the failure happens in the thread, quietly...
    with pytest.raises(bucketed.comm.CommError, match="injected"):
        sync.finish()  # ... and surfaces here, on the training thread
    bucketed.comm.all_reduce = real
    model.zero_grad(set_to_none=True)
    forward_backward(model, sync, rank, 1, 1)
    sync.finish()  # the thread lives on for the next step
    return True


@pytest.mark.timeout(30)
def test_a_failure_in_the_comm_thread_is_raised_by_finish():
    assert spawn(_comm_thread_error, 1, timeout=25) == [True]


def _threads_seen_by_the_comm_thread() -> tuple[int, int]:
    from ddp_lab.sync.comm_thread import CommThread

    seen = []
    worker = CommThread(torch.device("cpu"))
    worker.submit(lambda: seen.append(torch.get_num_threads()))
    worker.flush()
    worker.close()
    return seen[0], torch.get_num_threads()


def test_the_comm_thread_adds_on_one_core_and_leaves_training_its_threads():
    """CPU: the communication thread's copies and adds run on one intra-op thread (beside
    backward's own team), while the training thread keeps the threads it had."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert _threads_seen_by_the_comm_thread() == (1, 2)
    finally:
        torch.set_num_threads(before)


def test_sync_configs_compose():
    from helpers import compose_config

    from ddp_lab.config import validate

    for name in ("naive", "ring", "tree", "hring"):
        cfg = compose_config([f"sync={name}", "sync.overlap=false", "sync.comm_dtype=bf16"])
        validate(cfg)
        assert cfg.sync.name == name and cfg.sync.overlap is False and cfg.sync.bucket_mb == 25
