"""sync.compress inside our syncs (ddp_lab/sync/compressed.py behind sync/bucketed.py), on real
gloo groups, against named references: the uncompressed sync=ring (what must not compress, and
every step before sync.compress_start, equals it bitwise); (rows + cols) r elements per compressed
matrix and 2k per top-k bucket, counted, and the bytes the Recorder counts, sync=ddp's through
torch's hooks the same; a step holding an inf or NaN leaves the error buffers and Q as they were,
decided without reading anything back to the host (counted at the dispatcher; on CUDA, torch's
sync debug mode); stop-and-resume with compression on equals the run straight through, bitwise,
sync=ddp's (torch's PowerSGDState, across DDP's bucket layouts) too; a compressor defined here,
the identity, plugged into the sync, is sync=ring bitwise with its error buffers exactly zero.
(The compressors alone: tests/test_compress.py.)"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from background import background
from ddp_lab.compress import Compressor, Ops
from ddp_lab.compress.feedback import Feedback
from helpers import check, summary
from launchers import ranks, spawn
from reliab_helpers import RESUME, assert_same_training_state, train_log
from test_sync import batch, make_model
from test_zero import make_sync, train

# Buckets of at most 0.001 MiB (262 floats): the small CNN's 1440-element FC weight alone, the rest
# in a few buckets, so several buckets a step and matrices of three shapes.
RING = dict(name="ring", bucket_mb=0.001)


def scfg(**keys):
    """The sync group as the schema makes it (every key at its default but these)."""
    from ddp_lab.sync.config import SyncConfig

    return SyncConfig(**{**RING, **keys})


def expected_elements(model: nn.Module, r: int, min_rate: float) -> int:
    """PowerSGD's elements a step: (rows + cols) r per matrix worth compressing, every other
    parameter whole (torch's rule, written out here rather than taken from ddp_lab)."""
    total = 0
    for p in model.parameters():
        rows, cols = p.shape[0], p.numel() // p.shape[0]
        rank = min(rows, cols, r)
        worth = p.dim() > 1 and (rows + cols) * rank * min_rate < rows * cols
        total += (rows + cols) * rank if worth else p.numel()
    return total


def _through_the_sync(rank, n):
    """Four SGD steps of the small CNN (tests/test_zero.py's `train`) per case; what each case's
    parameters and last step's counts are, as plain data."""
    ring = train(rank, n, scfg(), "sgd")[0]
    out, ring_topk = {}, None
    for case, keys in {
        "powersgd full rank": dict(compress="powersgd", compress_rank=64, error_feedback=False),
        "topk k=n": dict(compress="topk", topk_fraction=1.0),
        "powersgd before start": dict(compress="powersgd", compress_rank=1, compress_start=4),
        "topk before start": dict(compress="topk", topk_fraction=0.1, compress_start=4),
        "powersgd r=1": dict(compress="powersgd", compress_rank=1, min_compression_rate=1.0),
        "topk 10%": dict(compress="topk", topk_fraction=0.1),
        "topk 10% tree": dict(compress="topk", topk_fraction=0.1, name="tree"),
    }.items():
        params, sync, _, model = train(rank, n, scfg(**keys), "sgd")
        stats = sync.comm_stats()
        ring_topk = params if case == "topk 10%" else ring_topk
        out[case] = {"same_as_ring": _bitwise(params, ring),
                     "same_as_ring_topk": _bitwise(params, ring_topk),
                     "stats": stats["compression"], "bytes_per_step": stats["bytes_per_step"],
                     "bucket_numels": [b.numel for b in sync.buckets],
                     "kept": _kept(sync, scfg(**keys)),
                     "expected_elements": expected_elements(model, 1, 1.0),
                     "numel": sum(p.numel() for p in model.parameters())}
        sync.close()
    return out


def _counted_each_step(rank, n):
    """Four SGD steps of the small CNN per case, PowerSGD compressing from the third
    (compress_start=2, r = 1, minimum rate 1): sync=ring through our compressor, sync=ddp through
    torch's hooks. Each step's counted elements and the payload bytes handed to collectives."""
    powersgd = dict(compress="powersgd", compress_rank=1, compress_start=2,
                    min_compression_rate=1.0)
    out = {}
    ddp = dict(name="ddp", bucket_mb=1000)  # one bucket, as the ring's count is per step
    for case, keys in {"ring powersgd": powersgd, "ddp powersgd": dict(ddp, **powersgd),
                       "ddp bf16": dict(ddp, compress="bf16"),
                       "ddp fp16": dict(ddp, compress="fp16")}.items():
        model = make_model(0)
        sync = make_sync(scfg(**keys), n)
        wrapped = sync.prepare(model)
        opt = sync.build_optimizer(model, torch.optim.SGD, dict(lr=0.1))
        out[case] = []
        for step in range(4):
            x, y = batch(rank, step, 0)
            nn.functional.cross_entropy(wrapped(x), y).backward()
            sync.finish()
            stats = sync.comm_stats()  # (ring at N = 2: its bytes are the payload, sent once)
            out[case].append((stats["compression"]["elements_per_step"],
                              stats.get("allreduce_payload_bytes", stats["bytes_per_step"])))
            opt.step()
            opt.zero_grad(set_to_none=True)
        sync.close()
    return out, expected_elements(model, 1, 1.0), sum(p.numel() for p in model.parameters())


@pytest.mark.timeout(60)
def test_ddp_counts_the_elements_torchs_hooks_send():
    """elements_per_step is counted where the elements are handed to the all-reduce: under
    torch's powerSGD_hook (P and Q all-reduced in its futures' callbacks) the whole gradient
    before compress_start, then (rows + cols) r per compressed matrix and the biases whole,
    step by step what our ring's PowerSGD counts; bf16 and fp16 send every element, 2 bytes each."""
    for got, compressed, numel in spawn(_counted_each_step, 2, timeout=50):
        want = [(numel, 4 * numel)] * 2 + [(compressed, 4 * compressed)] * 2
        assert compressed < numel and got["ddp powersgd"] == got["ring powersgd"] == want
        assert got["ddp bf16"] == got["ddp fp16"] == [(numel, 2 * numel)] * 4


def _powersgd_in_small_buckets(rank, n):
    """sync=ddp's PowerSGD (torch's hook) over buckets of 1 KiB at most (two, as DDP rebuilds
    them after the first step), compressing from step 2: on gloo, without one_bucket_at_a_time,
    the two buckets wait in the hook's callbacks on both of gloo's worker threads and step 2
    never ends. Returns the buckets (DDP's own count) and the averaged gradients."""
    keys = dict(name="ddp", bucket_mb=0.001, compress="powersgd", compress_rank=1,
                compress_start=2, min_compression_rate=1.0)
    model = make_model(0)
    sync = make_sync(scfg(**keys), n)
    wrapped = sync.prepare(model)
    for step in range(4):
        x, y = batch(rank, step, 0)
        nn.functional.cross_entropy(wrapped(x), y).backward()
        sync.finish()
    buckets = sync.ddp._get_ddp_logging_data()["rebuilt_bucket_sizes"].count(",") + 1
    sync.close()
    return buckets, torch.cat([p.grad.view(-1) for p in model.parameters()]).tolist()


@pytest.mark.timeout(60)
def test_torchs_powersgd_in_many_buckets_on_gloo_does_not_deadlock():
    (buckets, grads0), (_, grads1) = spawn(_powersgd_in_small_buckets, 2, timeout=30)
    assert buckets >= 2, buckets  # as many as gloo has worker threads: enough to deadlock
    assert grads0 == grads1  # the same average on every rank


def _powersgd_on_the_cpu_of_a_gpu_machine(rank, n):
    """torch's powerSGD_hook synchronizes CUDA with the bucket's device whenever CUDA is
    available: with CPU buckets (gloo on a GPU machine) that raised inside the hook."""
    torch.cuda.is_available = lambda: True  # this process only: a machine with a GPU
    return _powersgd_in_small_buckets(rank, n)[1]


@pytest.mark.timeout(60)
def test_torchs_powersgd_trains_on_cpu_where_cuda_is_available():
    grads0, grads1 = spawn(_powersgd_on_the_cpu_of_a_gpu_machine, 2, timeout=30)
    assert grads0 == grads1 and any(grads0)


def _kept(sync, s) -> tuple[int, int]:
    """(bytes of what the compressor keeps, counted from storages as summary.json's memory block
    counts them; perf.memory's prediction of them)."""
    from ddp_lab.held_memory import _storage_bytes
    from ddp_lab.perf.memory import compress_state_numel

    shapes = [[p.shape for p in b.params] for b in sync.buckets]
    return (_storage_bytes(sync.compress_state(), set()),
            4 * compress_state_numel(shapes, s.compress, s.compress_rank, s.min_compression_rate,
                                     s.error_feedback) if s.compress != "none" else 0)


def _bitwise(a, b) -> bool:
    return b is not None and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def through_the_sync():
    return spawn(_through_the_sync, 2, timeout=80)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("case", ["powersgd full rank", "topk k=n", "powersgd before start",
                                  "topk before start"])
def test_what_does_not_compress_is_sync_ring_bitwise(case, through_the_sync):
    """Full-rank PowerSGD (no matrix worth it; error feedback off, since torch's keeps x - average,
    a rank's own deviation, even then), top-k at k = n, and every step before compress_start:
    sync=ring's parameters after four steps, bitwise, on every rank."""
    for got in through_the_sync:
        c = got[case]
        assert c["same_as_ring"], case
        assert c["stats"]["steps"] == 4
        assert c["stats"]["compressing"] == (not case.endswith("before start"))
        # what went on the wire is the whole gradient
        assert c["stats"]["elements_per_step"] == c["stats"]["gradient_elements"] == c["numel"]


@pytest.mark.timeout(90)
def test_powersgd_through_the_sync_sends_rows_plus_cols_times_r(through_the_sync):
    """r = 1, minimum rate 1: (rows + cols) per weight matrix, the biases whole; the Recorder's
    bytes are 4 per element (fp32 P, Q and biases; a ring all-reduce at N = 2 sends its payload
    once), bucket by bucket summing to the sync's bytes_per_step."""
    for got in through_the_sync:
        c = got["powersgd r=1"]
        s = c["stats"]
        assert not c["same_as_ring"] and s["compressing"]
        assert s["elements_per_step"] == sum(s["bucket_elements"]) == c["expected_elements"]
        assert s["bucket_bytes_sent"] == [4 * e for e in s["bucket_elements"]]
        assert sum(s["bucket_bytes_sent"]) == c["bytes_per_step"]
        assert s["gradient_elements"] == c["numel"] and len(s["bucket_compress_ms"]) == len(
            c["bucket_numels"])
        # torch's compression_stats, over the four steps
        assert (s["numel_before"], s["numel_after"]) == (4 * c["numel"], 4 * c["expected_elements"])


def test_what_compression_keeps_is_counted_as_perf_memory_predicts(through_the_sync):
    """summary.json's compress_state_bytes: error feedback keeps every bucket whole (4 B an
    element), PowerSGD each compressed matrix's Q as well; nothing kept before compress_start."""
    for got in through_the_sync:
        for case in ("powersgd r=1", "topk 10%", "topk 10% tree"):
            counted, predicted = got[case]["kept"]
            assert counted == predicted > 0, case
        # rank 64, no error feedback: no matrix worth compressing, so no Q either
        assert got["powersgd full rank"]["kept"] == (0, 0)
        assert got["topk 10%"]["kept"][0] == 4 * got["topk 10%"]["numel"]  # the buckets, whole
        assert got["powersgd r=1"]["kept"][0] > 4 * got["powersgd r=1"]["numel"]  # + the Qs
        assert got["powersgd before start"]["kept"][0] == got["topk before start"]["kept"][0] == 0


@pytest.mark.timeout(90)
@pytest.mark.parametrize("case", ["topk 10%", "topk 10% tree"])
def test_topk_through_the_sync_sends_2k_per_bucket(case, through_the_sync):
    """k = ceil(n / 10) values and k int32 indices per bucket where 2k < n, else the bucket whole;
    4 bytes each. At N = 2 the ring's all-gather sends this rank's piece once; the tree's sends
    rank 1's piece to rank 0, which sends the whole (both pieces) back: 8 bytes an element there."""
    for rank, got in enumerate(through_the_sync):
        c = got[case]
        s = c["stats"]
        want = [2 * math.ceil(n / 10) if 2 * math.ceil(n / 10) < n else n
                for n in c["bucket_numels"]]
        assert s["bucket_elements"] == want and s["elements_per_step"] == sum(want)
        per_element = 8 if case.endswith("tree") and rank == 0 else 4
        assert s["bucket_bytes_sent"] == [per_element * e for e in want]
        assert sum(s["bucket_bytes_sent"]) == c["bytes_per_step"]
        if case.endswith("tree"):  # an all-gather moves values, adding none; at N = 2 the
            assert c["same_as_ring_topk"]  # dense buckets' a + b is b + a: ring's, bitwise


def _state(sync) -> dict:
    """The sync's compression state, flattened to {"feedback.3": tensor, ...}, copied."""
    c = sync.state_dict()["compressor"]
    return {f"{part}.{b}": t.clone() for part in ("feedback", "qs")
            for b, t in c.get(part, {}).items()}


def _planted(rank, n, keys, bad):
    """Two steps with a GradScaler (init scale 1024, as fp16 runs it) and compression on (`keys`);
    in the second, rank 0 plants `bad` in one gradient element before the sync. Returns whether
    this rank's averaged gradients hold a non-finite value, the scale after, whether the
    parameters moved, and whether the poisoned bucket's error buffer and Q are as they were and
    every kept tensor finite."""
    model = make_model(0)
    sync = make_sync(scfg(overlap=False, **keys), n)  # (no hooks: the plant lands before the sync)
    sync.prepare(model)
    opt = sync.build_optimizer(model, torch.optim.SGD, dict(lr=0.1, momentum=0.9))
    scaler = sync.grad_scaler(torch.amp.GradScaler("cpu", init_scale=1024.0))
    poisoned = model[0].weight  # the first parameter: in the (reversed) buckets' last
    for step in (1, 2):
        if step == 2:
            kept_before = _state(sync)
            before = [p.detach().clone() for p in model.parameters()]
        x, y = batch(rank, step, 0)
        scaler.scale(nn.functional.cross_entropy(model(x), y)).backward()
        if step == 2 and rank == 0:
            poisoned.grad.view(-1)[-1] = bad
        sync.finish()
        nonfinite = any(not torch.isfinite(p.grad).all() for p in model.parameters())
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
    kept = _state(sync)
    bucket = [k for k in kept if k.endswith(f".{sync._bucket_of[poisoned]}")]
    sync.close()
    return {"nonfinite": nonfinite, "scale": scaler.get_scale(),
            "moved": not _bitwise(before, [p.detach() for p in model.parameters()]),
            "bucket_kept_as_was": bool(bucket) and all(torch.equal(kept[k], kept_before[k])
                                                        for k in bucket),
            "all_finite": all(bool(torch.isfinite(t).all()) for t in kept.values())}


@pytest.mark.timeout(60)
def test_a_nonfinite_step_is_skipped_everywhere_and_keeps_the_error_buffers():
    """An inf, and a NaN, in one element of rank 0's gradient: after PowerSGD (it reaches P = M Q
    and so every rank's average) and after top-k (the largest |value|: always among what rank 0
    sends) every rank holds it, so the GradScaler skips the step on every rank and halves its
    scale; the poisoned bucket's error buffer and Q are last step's, and nothing kept is
    non-finite."""
    for got in spawn(_planted_cases, 2, timeout=50):
        for case, r in got.items():
            assert r == {"nonfinite": True, "scale": 512.0, "moved": False,
                         "bucket_kept_as_was": True, "all_finite": True}, case


def _planted_cases(rank, n):
    return {f"{keys['compress']} {bad}": _planted(rank, n, keys, bad)
            for keys in (dict(compress="powersgd", compress_rank=1),
                         dict(compress="topk", topk_fraction=0.1))
            for bad in (float("inf"), float("nan"))}


def _torchs_powersgd_planted(rank, n, plant_at):
    """sync=ddp's PowerSGD (torch's hook, compressing from the third step), five steps under a
    GradScaler; at step `plant_at` rank 0's first parameter gets an inf in its gradient as
    backward makes it (a tensor hook: before DDP's buckets). Returns, per step, whether this
    rank's averaged gradients were all finite."""
    keys = dict(name="ddp", bucket_mb=0.001, compress="powersgd", compress_rank=1,
                compress_start=2, min_compression_rate=1.0)
    model = make_model(0)
    sync = make_sync(scfg(**keys), n)
    wrapped = sync.prepare(model)
    opt = sync.build_optimizer(model, torch.optim.SGD, dict(lr=0.1, momentum=0.9))
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    step_now = [0]
    poison = lambda g: g.index_fill(0, torch.tensor([0]), float("inf")) \
        if rank == 0 and step_now[0] == plant_at else g
    next(model.parameters()).register_hook(poison)
    finite = []
    for step in range(1, 6):
        step_now[0] = step
        x, y = batch(rank, step, 0)
        scaler.scale(nn.functional.cross_entropy(wrapped(x), y)).backward()
        sync.finish()
        finite.append(all(bool(torch.isfinite(p.grad).all()) for p in model.parameters()))
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
    sync.close()
    return finite


@pytest.mark.timeout(90)
@pytest.mark.parametrize("plant_at", [3, 4])  # the first compressed step, and a later one
def test_torchs_powersgd_keeps_its_state_through_a_nonfinite_step(plant_at):
    """Without state_kept_when_nonfinite, torch's hook keeps the poisoned error buffer and Q,
    and every step after the planted one is non-finite too."""
    want = [step != plant_at for step in range(1, 6)]
    assert spawn(_torchs_powersgd_planted, 2, plant_at, timeout=60) == [want, want]


class _HostReads(TorchDispatchMode):
    """The ops run inside it that hand a tensor's values to Python, which on CUDA waits for the
    device: _local_scalar_dense (under every .item(), bool(), int(), float()), nonzero (its size
    is in the data: boolean indexing too) and equal."""

    READS = ("_local_scalar_dense", "nonzero", "equal")

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in self.READS:
            self.seen.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def _one_rank(device: torch.device, compress: str):
    """sync/compressed.py's CompressedBuckets on one rank (its collectives the identity) over the
    small CNN's parameters in two buckets; returns it and `step(seed, bad=None)`, one step of
    gradients drawn on `device`, `bad` planted in the second bucket."""
    from ddp_lab.sync.compressed import CompressedBuckets

    shapes = [p.shape for p in make_model(0).parameters()]
    buckets = [SimpleNamespace(params=[SimpleNamespace(shape=s) for s in half],
                               numel=sum(s.numel() for s in half))
               for half in (shapes[:2], shapes[2:])]
    compressed = CompressedBuckets(scfg(compress=compress, compress_rank=1, topk_fraction=0.1),
                                   device)
    ops = Ops(1, lambda t: t, lambda mine, whole: whole.copy_(mine))

    def step(seed: int, bad: float | None = None) -> None:
        gen = torch.Generator(device).manual_seed(seed)
        for b, bucket in enumerate(buckets):
            bucket.buffer = torch.randn(bucket.numel, generator=gen, device=device)
            if bad is not None and b == 1:  # fill_: a Python float assigned would be a host copy
                bucket.buffer[:1].fill_(bad)
            compressed.reduce(b, bucket, ops, last=b == 1)

    return compressed, step


def _bad_steps_keep_the_second_buckets_state(compressed, step) -> None:
    """An inf step, then a NaN step: the second bucket's kept tensors as they were, the first's
    replaced (as tests above check through the sync on two ranks)."""
    for bad in (float("inf"), float("nan")):
        before = _state(compressed)
        step(10, bad)
        after = _state(compressed)
        for k in before:
            assert torch.equal(after[k], before[k]) == k.endswith(".1"), (bad, k)
            assert torch.isfinite(after[k]).all(), (bad, k)


@pytest.mark.parametrize("compress", ["powersgd", "topk"])
def test_the_compressed_bucket_path_reads_nothing_back_to_the_host(compress):
    """Per bucket nothing is read back to Python, a non-finite bucket included (on CUDA each read
    would wait for the device, every bucket): the finiteness check stays on the device."""
    compressed, step = _one_rank(torch.device("cpu"), compress)
    step(0)  # (the first: PowerSGD draws each bucket's first Q, once a run)
    with _HostReads() as reads:
        step(1)
        step(2, float("inf"))
        step(3, float("nan"))
    assert reads.seen == []
    _bad_steps_keep_the_second_buckets_state(compressed, step)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("compress", ["powersgd", "topk"])
def test_on_cuda_the_compressed_bucket_path_never_synchronizes(compress):
    """The same on a GPU, where torch itself refuses every synchronizing call."""
    compressed, step = _one_rank(torch.device("cuda"), compress)
    step(0)  # (PowerSGD's first Q is drawn on the host and copied over: once a run)
    torch.cuda.set_sync_debug_mode("error")
    try:
        step(1)
        step(2, float("inf"))
        step(3, float("nan"))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    _bad_steps_keep_the_second_buckets_state(compressed, step)


# ---- stop and resume, launched: rank 0's checkpoint.pt holds every rank's compression state ----

# PowerSGD from step 2 of 6 (3 per epoch), with error feedback: the stop at step 4 falls mid-epoch
# and mid-compression, with error buffers, Q and the seeds' position all in use.
COMPRESSED = RESUME + ["sync=ring", "sync.compress=powersgd", "sync.compress_rank=1",
                       "sync.compress_start=2"]


@background(cost=lambda run: 6 if run == "straight" else 12, keys=("straight", "resumed"))
def compressed_runs(run, run_dir):
    """"straight": the 6 steps through; "resumed": stopped at step 4, checkpointing every 2 steps,
    then the same command again. The run dir, and the stopped run's checkpoint."""
    every = ["train.checkpoint_every=6"] if run == "straight" else ["train.checkpoint_every=2"]
    stopped = None
    if run == "resumed":
        check(ranks(COMPRESSED + every + ["train.stop_at_step=4", f"hydra.run.dir={run_dir}"]))
        stopped = torch.load(run_dir / "checkpoint.pt", map_location="cpu", weights_only=True)
    check(ranks(COMPRESSED + every + [f"hydra.run.dir={run_dir}"]))
    return run_dir, stopped


@pytest.mark.timeout(300)
def test_stop_and_resume_with_compression_equals_the_run_straight_through(compressed_runs):
    straight, _ = compressed_runs["straight"]
    resumed, stopped = compressed_runs["resumed"]
    assert [s["steps"] for s in stopped["sync"]] == [4, 4]  # every rank's, rank order
    feedback = [s["compressor"]["feedback"] for s in stopped["sync"]]
    assert feedback[0].keys() == feedback[1].keys() and feedback[0]  # one per bucket
    assert not all(torch.equal(feedback[0][b], feedback[1][b]) for b in feedback[0])  # per rank
    assert f"resumed from {resumed}/checkpoint.pt at step 4" in train_log(resumed)
    assert summary(resumed)["comm"]["compression"]["compressing"]
    # the memory block: the resumed run's first step compressed (its state held and predicted),
    # the straight run's did not yet (compress_start=2: nothing at its counted points)
    for run_dir, held in ((resumed, True), (straight, False)):
        memory = summary(run_dir)["memory"]
        counted, predicted = memory["compress_state_bytes"], memory["predicted"]["compress_state_bytes"]
        assert counted == predicted and (counted[0] > 0) == held, (run_dir, counted, predicted)
    assert_same_training_state(resumed, straight)


# ---- a compressor from outside the package: the identity ----

class Identity(Compressor):
    """Sends the bucket as it is, error feedback on: what a rank sent is all of x = g + e, so what
    it keeps, x - sent, is exactly zero, and the average is the sync's own all-reduce, divided."""

    def __init__(self):
        self.feedback = Feedback(True)
        self.numel_before = self.numel_after = 0  # (CompressedBuckets.stats reads them)

    def reduce(self, key, flat, shapes, ops) -> None:
        x = self.feedback.add(key, flat)
        ops.all_reduce(flat)
        flat.div_(ops.world_size)
        self.feedback.keep(key, x, x, torch.isfinite(flat).all())


def _built(model: nn.Module, n: int, **keys) -> SimpleNamespace:
    """A model behind a sync of `keys` (scfg's), its wrapper and an SGD with momentum."""
    sync = make_sync(scfg(**keys), n)
    wrapped = sync.prepare(model)
    opt = sync.build_optimizer(model, torch.optim.SGD, dict(lr=0.1, momentum=0.9))
    return SimpleNamespace(model=model, sync=sync, wrapped=wrapped, opt=opt)


def _steps(run: SimpleNamespace, rank: int, steps) -> None:
    for step in steps:
        x, y = batch(rank, step, 0)
        nn.functional.cross_entropy(run.wrapped(x), y).backward()
        run.sync.finish()
        run.opt.step()
        run.opt.zero_grad(set_to_none=True)


def _identity_through_the_sync(rank, n):
    """Four steps of sync=ring, and of sync=ring with the identity compressor where the sync keeps
    the one it built from sync.compress (sync/compressed.py's CompressedBuckets.compressor: every
    bucket goes through its reduce, with the sync's collectives). Returns whether the parameters
    are bitwise the same, and how many error buffers are kept and how many of them are zero."""
    ring = _built(make_model(0), n, **RING)
    _steps(ring, rank, range(4))
    ours = _built(make_model(0), n, **RING, compress="topk")
    ours.sync.compression.compressor = Identity()
    _steps(ours, rank, range(4))
    kept = list(ours.sync.compression.compressor.feedback.kept.values())
    for run in (ring, ours):
        run.sync.close()
    return {"same": _bitwise(list(ours.model.parameters()), list(ring.model.parameters())),
            "buckets": len(ours.sync.buckets), "kept": len(kept),
            "kept_zero": sum(not t.any() for t in kept)}


@pytest.mark.timeout(60)
def test_the_identity_compressor_is_sync_ring_bitwise():
    """Error feedback on, each bucket through a compressor that sends it unchanged: sync=ring's
    parameters after four steps, bitwise, on both ranks, and every error buffer exactly zero."""
    for r in spawn(_identity_through_the_sync, 2, timeout=50):
        assert r["same"]
        assert r["buckets"] >= 2 and r["kept"] == r["kept_zero"] == r["buckets"], r


# ---- sync=ddp's PowerSGD (torch's hook and state), stopped and resumed ----

# Buckets of 1 KiB at most: a new DDP's first step holds every parameter in one bucket, and after
# it DDP cuts three in the order the gradients became ready, so the resumed run's first step has
# another layout than the one the state was saved under, and its second another again. PowerSGD
# from step 2.
DDP_POWERSGD = dict(name="ddp", bucket_mb=0.001, compress="powersgd", compress_rank=1,
                    compress_start=2, min_compression_rate=1.0)


def _shapes_repeating() -> nn.Module:
    """The small CNN with three more layers: 10 x 10 matrices on both sides of others in one
    bucket, whose P and Q torch lays out grouped by shape, not in the bucket's order."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(144, 10),
                         nn.ReLU(), nn.Linear(10, 10), nn.ReLU(), nn.Linear(10, 4), nn.ReLU(),
                         nn.Linear(4, 10), nn.ReLU(), nn.Linear(10, 10), nn.ReLU(),
                         nn.Linear(10, 3))


def _ddp_powersgd_resumed(rank, n, path):
    """Four steps, a checkpoint as ddp_lab/resume.py writes one (every rank's sync state gathered
    to rank 0, checkpoint.atomic_save; checkpoint.load: weights_only, its sha256), and on to six:
    the run straight through (saving changes nothing in it). A fresh model, optimizer and DDP
    loaded from the checkpoint, and the last two steps. Returns whether the parameters are
    bitwise the straight run's, what the checkpoint holds, and the bucket layouts the state was
    saved under and the resumed run's first step met."""
    import torch.distributed as dist

    from ddp_lab import checkpoint

    straight = _built(_shapes_repeating(), n, **DDP_POWERSGD)
    _steps(straight, rank, range(4))
    states = checkpoint.gather_sync_states(straight.sync)
    if rank == 0:
        checkpoint.atomic_save({"step": 4, "model": straight.model.state_dict(),
                                "optimizer": straight.opt.state_dict(), "sync": states}, path)
    saved_layout = dict(straight.sync.powersgd.layout)
    _steps(straight, rank, range(4, 6))
    dist.barrier()
    saved = checkpoint.load(path)
    resumed = _built(_shapes_repeating(), n, **DDP_POWERSGD)
    resumed.model.load_state_dict(saved["model"])
    resumed.opt.load_state_dict(saved["optimizer"])
    resumed.sync.load_state_dict(saved["sync"][rank])
    _steps(resumed, rank, [4])
    met_layout = dict(resumed.sync.powersgd.layout)
    _steps(resumed, rank, [5])
    for run in (straight, resumed):
        run.sync.close()
    mine = saved["sync"][rank]["powersgd"]
    return {"same": _bitwise(list(resumed.model.parameters()), list(straight.model.parameters())),
            "iter": mine["iter"], "error": {k: v.tolist() for k, v in mine["error"].items()},
            "q": sorted(k for k, v in mine["q"].items() if v.numel()),
            "saved_layout": saved_layout, "met_layout": met_layout}


@pytest.mark.timeout(60)
def test_ddp_powersgd_stop_and_resume_equals_the_run_straight_through(tmp_path):
    """sync=ddp sync.compress=powersgd stopped at step 4 (two compressed steps in: error buffers,
    warm-start Q and the seeds' position all in use) and resumed from its checkpoint: the last
    two steps give the straight run's parameters, bitwise, on every rank, though the resumed
    DDP's first step lays its buckets out otherwise."""
    got = spawn(_ddp_powersgd_resumed, 2, str(tmp_path / "checkpoint.pt"), timeout=50)
    params = dict(_shapes_repeating().named_parameters())
    for r in got:
        assert r["same"] and r["iter"] == 4
        assert r["error"].keys() == params.keys()  # every parameter's error, by name
        assert r["q"] == sorted(k for k, p in params.items() if p.dim() > 1)  # each matrix's Q
        assert r["met_layout"] != r["saved_layout"]  # the state had to follow the parameters
    assert got[0]["error"] != got[1]["error"]  # each rank's own


