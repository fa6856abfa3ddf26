"""Gradient compressors (ddp_lab/compress) on real gloo groups through our ring, exact wherever the
arithmetic allows: error feedback telescopes; the cases that must not compress (full rank, k = n)
are the uncompressed all-reduce bitwise; PowerSGD is linear (N ranks = one process on the mean
gradient); what goes on the wire is counted, against (rows + cols) r a matrix and torch's own
powerSGD_hook's statistics; a compressor's state round-trips through a checkpoint."""

from __future__ import annotations

import pytest
import torch

from ddp_lab import comm
from ddp_lab.compress import COMPRESSORS, Ops
from launchers import spawn

# A bucket as the sync packs it: a conv weight, a bias, a fully connected weight, a bias.
SHAPES = [torch.Size([16, 3, 3, 3]), torch.Size([16]), torch.Size([40, 64]), torch.Size([40])]
NUMEL = sum(s.numel() for s in SHAPES)


def ring_ops(n: int, counts: list | None = None) -> Ops:
    """Our ring on the default group; `counts` collects the elements each all-reduce is given."""
    def all_reduce(t):
        if counts is not None:
            counts.append(t.numel())
        return comm.all_reduce(t, "ring")

    return Ops(n, all_reduce, lambda mine, whole: comm.all_gather(mine, whole, "ring"))


def grads(rank: int, step: int, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(NUMEL, generator=g, dtype=torch.float64).to(dtype)


def make(name: str, **kw):
    return COMPRESSORS[name](**kw)


def _telescoping(rank, n, name, kw):
    """T steps in float64. What a rank sent for its x = g + kept: PowerSGD, the average it
    applied (torch's hook keeps x - average); top-k, its own k entries, and the average applied
    is the mean of every rank's. Over the steps, what was sent plus what is still kept equals the
    sum of the rank's gradients. Returns the relative gap."""
    import torch.distributed as dist

    c, sent_sum, total = make(name, **kw), torch.zeros(NUMEL, dtype=torch.float64), 0
    for step in range(5):
        g = grads(rank, step, torch.float64)
        x = g + c.feedback.kept.get(0, torch.zeros_like(g))
        flat = g.clone()
        c.reduce(0, flat, SHAPES, ring_ops(n))
        kept = c.feedback.kept[0]
        if name == "powersgd":
            sent = flat
            torch.testing.assert_close(sent + kept, x, rtol=1e-12, atol=0)
        else:
            sent = x - kept
            k = -(-NUMEL * kw["fraction"] // 1)
            assert int((sent != 0).sum()) == k and torch.equal(sent[sent != 0], x[sent != 0])
            every = [torch.empty_like(sent) for _ in range(n)]
            dist.all_gather(every, sent)
            torch.testing.assert_close(flat, sum(every) / n, rtol=1e-12, atol=1e-15)
        sent_sum += sent
        total = total + g
    return ((sent_sum + c.feedback.kept[0] - total).norm() / total.norm()).item()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name, kw", [("powersgd", {"rank": 1}), ("topk", {"fraction": 0.05})])
def test_error_feedback_telescopes(name, kw):
    """sum(sent) + kept_T == sum(g) in float64: relative error below 1e-12 (5 steps of a few
    thousand elements: each step's subtraction and addition round once, ~1e-16 each)."""
    assert max(spawn(_telescoping, 2, name, kw, timeout=50)) < 1e-12


def _identity_cases(rank, n):
    """What must not compress is the ring's all-reduce and divide, bitwise: PowerSGD where no
    matrix is worth it (full rank), top-k at k = n."""
    out = []
    for name, kw in (("powersgd", {"rank": 64}), ("topk", {"fraction": 1.0})):
        g = grads(rank, 0)
        flat = g.clone()
        make(name, **kw).reduce(0, flat, SHAPES, ring_ops(n))
        ref = comm.all_reduce(g.clone(), "ring").div_(n)
        out.append(torch.equal(flat, ref))
    return out


@pytest.mark.timeout(60)
def test_what_would_not_pay_is_the_uncompressed_ring_bitwise():
    assert spawn(_identity_cases, 3, timeout=50) == [[True, True]] * 3


def _linearity(rank, n, steps):
    c = make("powersgd", rank=2, seed=7)
    for step in range(steps):
        flat = grads(rank, step)
        c.reduce(0, flat, SHAPES, ring_ops(n))
    return flat.tolist()  # (a tensor would travel by a file descriptor the rank closes on exit)


@pytest.mark.timeout(60)
def test_powersgd_on_n_ranks_is_one_process_on_the_mean_gradient():
    """Linear: 4 ranks (P and Q all-reduced) against one process given the mean of the four
    gradients, 3 steps with error feedback (the mean of the ranks' kept errors is what one
    process keeps). fp32: relative L2 under 1e-5 (sums in other orders, a few ulp a step)."""
    n, steps = 4, 3
    got = spawn(_linearity, n, steps, timeout=50)
    c = make("powersgd", rank=2, seed=7)
    one = Ops(1, lambda t: t, None)
    for step in range(steps):
        flat = torch.stack([grads(r, step) for r in range(n)]).mean(0)
        c.reduce(0, flat, SHAPES, one)
    for g in map(torch.tensor, got):
        assert ((g - flat).norm() / flat.norm()).item() < 1e-5


def _counted(rank, n, rank_r):
    c, counts = make("powersgd", rank=rank_r, min_compression_rate=1.0), []
    with comm.recording() as rec:
        c.reduce(0, grads(rank, 0), SHAPES, ring_ops(n, counts))
    return counts, rec.bytes_sent, (c.numel_before, c.numel_after)


@pytest.mark.timeout(60)
def test_powersgd_sends_rows_plus_cols_times_r_per_matrix():
    """Per compressed matrix (the conv weight as 16 x 27, the FC weight as 40 x 64) P and Q of
    (rows + cols) r elements; the biases uncompressed, in one all-reduce first. The Recorder's
    count at N = 2 (a ring all-reduce sends its payload once per rank) is those elements' bytes."""
    r = 2
    matrices = [(16, 27), (40, 64)]
    for counts, sent, (before, after) in spawn(_counted, 2, r, timeout=50):
        assert counts == [16 + 40, sum(a * r for a, _ in matrices),
                          sum(b * r for _, b in matrices)]
        assert after == 16 + 40 + sum((a + b) * r for a, b in matrices) and before == NUMEL
        assert sent == 4 * after


def _torch_stats(rank, n, r, start, min_rate, steps):
    """torch's powerSGD_hook on DDP over a model of SHAPES, its compression_stats after `steps`."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps
    from torch.nn.parallel import DistributedDataParallel

    class Bucket(torch.nn.Module):  # parameters of SHAPES; its "loss" makes their gradients x
        def __init__(self):
            super().__init__()
            self.ps = torch.nn.ParameterList(torch.zeros(shape) for shape in SHAPES)

        def forward(self, x):
            return sum((p * x[:p.numel()].view_as(p)).sum() for p in self.ps)

    ddp = DistributedDataParallel(Bucket(), bucket_cap_mb=1000)
    state = ps.PowerSGDState(None, matrix_approximation_rank=r, start_powerSGD_iter=start,
                             min_compression_rate=min_rate, random_seed=0)
    ddp.register_comm_hook(state, ps.powerSGD_hook)
    for step in range(steps):
        ddp(grads(rank, step)).backward()
        ddp.zero_grad()
    return list(state.compression_stats()[1:])


@pytest.mark.timeout(60)
def test_statistics_match_torchs_powersgd_hook():
    """The same rank, start and minimum rate: torch's hook counts elements before and after
    compression once a step from `start` on; ours, given the same bucket as many times, the same."""
    r, start, min_rate, steps = 1, 2, 2.0, 4
    theirs = spawn(_torch_stats, 2, r, start, min_rate, steps, timeout=50)[0]
    c = make("powersgd", rank=r, min_compression_rate=min_rate)
    for _ in range(steps - start):
        c.split(torch.zeros(NUMEL), SHAPES)
    assert (c.numel_before, c.numel_after) == tuple(theirs)


def _round_trip(rank, n):
    """Two steps, a state_dict saved (through torch.save, weights_only) and loaded into a fresh
    compressor, then two more steps each: the same results, bitwise."""
    import io

    a = make("powersgd", rank=2, seed=3)
    for step in range(2):
        a.reduce(0, grads(rank, step), SHAPES, ring_ops(n))
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    b = make("powersgd", rank=2, seed=99)
    b.load_state_dict(torch.load(io.BytesIO(buf.getvalue()), weights_only=True))
    same = []
    for step in (2, 3):
        fa, fb = grads(rank, step), grads(rank, step)
        a.reduce(0, fa, SHAPES, ring_ops(n))
        b.reduce(0, fb, SHAPES, ring_ops(n))
        same.append(torch.equal(fa, fb))
    return same


@pytest.mark.timeout(60)
def test_state_round_trips_through_a_weights_only_checkpoint():
    assert spawn(_round_trip, 2, timeout=50) == [[True, True]] * 2


def _ddp_takes_torchs_hooks(rank, n):
    """sync=ddp sync.compress=... against torch's DDP with torch's hook registered by hand, over
    three steps (PowerSGD compressing from the third): the same gradients, bitwise, and the bytes
    it counts are what the hook hands over (bf16: 2 bytes an element; PowerSGD: 4 bytes an
    element torch's state counts after compression)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps
    from torch.nn.parallel import DistributedDataParallel

    from ddp_lab.sync.config import SyncConfig
    from ddp_lab.sync.ddp import DDPSync

    def bucket():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(64, 40), torch.nn.Linear(40, 8))

    out = []
    for compress in ("bf16", "powersgd"):
        ours = DDPSync(SyncConfig(name="ddp", compress=compress, compress_start=2,
                                  compress_rank=1, bucket_mb=1000), torch.device("cpu"), n)
        model, ref = bucket(), DistributedDataParallel(bucket(), bucket_cap_mb=1000)
        if compress == "bf16":
            ref.register_comm_hook(None, default_hooks.bf16_compress_hook)
        else:
            state = ps.PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=2,
                                     random_seed=0)
            ref.register_comm_hook(state, ps.powerSGD_hook)
        wrapped, same, counted = ours.prepare(model), [], []
        for step in range(3):
            x = torch.randn(4, 64, generator=torch.Generator().manual_seed(10 * step + rank))
            for m in (wrapped, ref):
                m(x).square().sum().backward()
            ours.finish()
            same.append(all(torch.equal(a.grad, b.grad) for a, b in
                            zip(model.parameters(), ref.module.parameters())))
            counted.append(ours.comm_stats()["allreduce_payload_bytes"])
            model.zero_grad(), ref.zero_grad()
        expected = ([2 * 2928] * 3 if compress == "bf16" else
                    [4 * 2928, 4 * 2928, 4 * (40 + 8 + (40 + 64) + (8 + 40))])
        out.append((all(same), counted == expected, counted))
    return out


@pytest.mark.timeout(60)
def test_ddp_compress_is_torchs_own_hooks():
    for ranks_out in spawn(_ddp_takes_torchs_hooks, 2, timeout=50):
        for same, counted_right, counted in ranks_out:
            assert same and counted_right, counted


@pytest.mark.parametrize("overrides, message", [
    (["sync=ddp", "sync.compress=powersgd", "sync.compress_start=2", "sync.compress_rank=0"],
     "sync.compress_rank=0 must be >= 1"),
    (["sync=ddp", "sync.compress=powersgd", "sync.compress_start=2",
      "sync.min_compression_rate=0"], "sync.min_compression_rate=0.0 must be > 0"),
    (["sync=ddp", "sync.compress=topk"], "sync.compress=topk with sync=ddp: torch has no top-k"),
    # the syncs that do not all-gather: ddp above; fsdp and none do not read sync.compress
    (["sync=fsdp", "sync.compress=topk"], "sync.compress=topk has no effect with sync=fsdp"),
    (["sync=ring", "sync.zero=1", "sync.compress=topk"],
     "sync.compress=topk with sync.zero=1: compression of reduce-scattered shards is not built"),
    (["sync=ddp", "sync.compress=powersgd"], "sync.compress_start=0 with sync=ddp"),
    # warm start needs it too, and sync=ddp always warm-starts
    (["sync=ddp", "sync.compress=powersgd", "sync.error_feedback=false", "sync.compress_start=1"],
     "sync.compress_start=1 with sync=ddp"),
    (["sync=ddp", "sync.compress=bf16", "sync.comm_dtype=fp16"],
     "sync.compress=bf16 with sync.comm_dtype=fp16"),
    (["sync=ddp", "sync.compress_rank=4"], "sync.compress_rank=4 has no effect with "
                                           "sync.compress=none"),
])
def test_bad_compression_settings_are_one_line(overrides, message):
    from ddp_lab.config import validate
    from ddp_lab.errors import ConfigError
    from helpers import compose_config

    with pytest.raises(ConfigError) as e:
        validate(compose_config(overrides))
    assert message in str(e.value) and "\n" not in str(e.value)


def test_a_topk_fraction_outside_0_1_is_refused():
    """The range is checked before whether a sync reads the key (ours take top-k once wired)."""
    from ddp_lab.config import Config
    from ddp_lab.errors import ConfigError
    from ddp_lab.keys import check_keys
    from helpers import compose_config

    cfg = compose_config(["sync=ddp"])
    for bad, message in ((0.0, "must be > 0"), (1.5, "must be <= 1")):
        cfg.sync.topk_fraction = bad
        with pytest.raises(ConfigError, match=f"sync.topk_fraction={bad} {message}"):
            check_keys(cfg, Config)


def test_powersgd_draws_its_first_q_without_touching_the_global_generators(monkeypatch):
    """torch.manual_seed would seed every CUDA generator too, alike on every rank (dropout's
    masks would then agree between ranks): the first Q comes from a generator of its own. The
    CPU generator's stream and CUDA's seeding are both left as they were."""
    seeded = []
    monkeypatch.setattr(torch.cuda, "manual_seed_all", lambda seed: seeded.append(seed))
    torch.manual_seed(1)  # (its own call to manual_seed_all counts too: cleared below)
    seeded.clear()
    want = torch.rand(3)
    torch.manual_seed(1)
    seeded.clear()
    make("powersgd", rank=2, seed=7).reduce(0, grads(0, 0), SHAPES, Ops(1, lambda t: t, None))
    assert seeded == [] and torch.equal(torch.rand(3), want)


def test_a_rank_too_high_for_every_matrix_is_said_in_a_warning(caplog):
    """sync.compress_rank=100000 compresses nothing (torch's rule sends every matrix whole): the
    run says so in a warning instead of reporting a rate of 1.0 without a word."""
    from types import SimpleNamespace

    from ddp_lab import step
    from ddp_lab.compress.powersgd import nothing_compressed

    model = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.Linear(8, 4))
    keys = SimpleNamespace(compress_rank=100000, min_compression_rate=2.0)
    with caplog.at_level("WARNING", logger="ddp_lab"):
        step._warn_if_nothing_compressed(keys, model)
    assert [r.getMessage() for r in caplog.records] == [
        "sync.compress_rank=100000: PowerSGD compresses none of the model's 2 matrices ((rows + "
        "cols) x rank x sync.min_compression_rate=2 is not below rows x cols for any): every "
        "gradient is sent whole, as without compression"]
    # (16 + 8) x 1 x 2 = 48 < 128: the first matrix compresses at rank 1; biases never count
    assert nothing_compressed([p.shape for p in model.parameters()], 1, 2.0) is None
    assert nothing_compressed([torch.Size([5])], 100000, 2.0) is None  # no matrix at all
