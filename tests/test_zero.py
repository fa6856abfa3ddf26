"""ZeRO (sync.zero=1|2|3, ddp_lab/sync/zero.py, zero3.py) on real gloo process groups, in process
(no torchrun), against named references: the same sync at zero=0; torch DDP, with torch's
ZeroRedundancyOptimizer at zero=1; one process on the whole batch. Several steps of a small CNN
(tests/test_sync.py's), dropout-free, the same on every rank. (Stage 3's own machinery, the bytes
and the memory of every stage: tests/test_zero3.py.)

What is bitwise and why: with optim.impl=foreach (the optimizer's arithmetic does not depend on
where an element sits in its tensor) zero=1 (the very same all-reduce) and zero=2|3 of naive and
tree (their reduce-scatter sums in their all-reduce's order, whatever the buckets: rank order at
the root, a fixed tree) equal zero=0 bitwise, and so does the ring at N=2 (a + b = b + a); the
ring's reduce-scatter from N=3 on adds in another order (comm/ring.py; at zero=3 the buckets are
units, so the chunks fall elsewhere too): SGD within 1e-6. The fused SGD kernel on CPU rounds an
element differently in its vector body and in its scalar tail (FMA), so the same element at
another offset of a shard can differ by an ulp: within 1e-6 (the default optim.impl=fused).
Clipping sums the shards' squared norms over the ranks where torch takes the norm of per-tensor
norms: within 1e-6.
AdamW, summed in another order (the ring from N=3, DDP, one process): its first updates are
lr * g / (|g| + eps). Wherever |g| >> eps that is about lr * sign(g), which rounding cannot move;
but where a gradient cancels across ranks to below eps it is lr * g / eps, so a rounding
difference dg of the sum moves the weight by lr * dg / eps (1e5 dg at lr 1e-3), and a gradient
that is ~0 up to rounding can move its weight by up to 2 lr a step the other way
(`test_adamw_turns_a_rounding_difference_into_lr_over_eps`). Held to: every element within
2 lr x steps, and all but a few within 1e-6.
"""

from __future__ import annotations

import io
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from launchers import spawn
from test_sync import batch, make_model

STEPS, LR, CLIP = 4, 0.05, 0.05
OPTIMS = {"sgd": (torch.optim.SGD, dict(lr=LR, momentum=0.9, weight_decay=5e-4)),
          "adamw": (torch.optim.AdamW, dict(lr=1e-3, weight_decay=5e-4))}


def scfg(name, zero=0, overlap=True, comm_dtype="fp32", bucket_mb=0.001, reshard=True):
    """The sync group as the schema makes it (every key at its default but these)."""
    from ddp_lab.sync.config import SyncConfig

    return SyncConfig(name=name, zero=zero, overlap=overlap, comm_dtype=comm_dtype,
                      bucket_mb=bucket_mb, reshard_after_forward=reshard)


def make_sync(cfg, n):
    from ddp_lab.sync import BucketedSync, DDPSync, FSDPSync, ShardedSync, ZeRO3Sync

    if cfg.name in ("ddp", "fsdp"):  # (fsdp: tests/test_fsdp.py)
        return (DDPSync if cfg.name == "ddp" else FSDPSync)(cfg, torch.device("cpu"), n)
    cls = {0: BucketedSync, 1: ShardedSync, 2: ShardedSync, 3: ZeRO3Sync}[cfg.zero]
    return cls(cfg, torch.device("cpu"), n)


def train(rank, n, cfg, optim, impl="foreach", accum=1, clip=0.0):
    """STEPS steps of the small CNN; returns (parameters, the sync, its optimizer, the model)."""
    model = make_model(seed=rank)  # rank 0's parameters are broadcast by prepare()
    sync = make_sync(cfg, n)
    wrapped = sync.prepare(model)
    cls, kwargs = OPTIMS[optim]
    opt = sync.build_optimizer(model, cls, dict(kwargs, **_impl(impl)))
    for step in range(STEPS):
        for micro in range(accum):
            x, y = batch(rank, step, micro)
            with sync.no_sync() if micro < accum - 1 else _null():
                (nn.functional.cross_entropy(wrapped(x), y) / accum).backward()
        sync.finish()
        if clip:
            sync.clip_grad_norm_(opt, clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
    with sync.unsharded():  # ZeRO-3: gathered (otherwise they hold no memory)
        params = [p.detach().clone() for p in model.parameters()]
    return params, sync, opt, model


def one_process(n, optim, impl="foreach", accum=1, clip=0.0):
    """Every rank's batch at once, in one model (the mean over all samples)."""
    model = make_model(seed=0)
    cls, kwargs = OPTIMS[optim]
    opt = cls(model.parameters(), **dict(kwargs, **_impl(impl)))
    for step in range(STEPS):
        for micro in range(accum):
            xs, ys = zip(*(batch(r, step, micro) for r in range(n)))
            loss = nn.functional.cross_entropy(model(torch.cat(xs)), torch.cat(ys)) / accum
            loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return [p.detach().clone() for p in model.parameters()]


def _impl(impl):
    return {"fused": True} if impl == "fused" else {"foreach": impl == "foreach"}


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def packed(obj) -> bytes:
    """Tensors for the parent as bytes: tensors put on a multiprocessing queue travel as shared
    memory, which a child that exits at once (launchers.spawn) takes with it."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def unpacked(data: bytes):
    return torch.load(io.BytesIO(data), weights_only=True)


def _storage_bytes(tensors) -> int:
    seen = {}
    for t in tensors:
        if torch.is_tensor(t) and t.numel():
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


# ---- equivalence --------------------------------------------------------------------------------

# (algo, zero, optimizer, impl, accum, clip, overlap, reshard_after_forward)
# Accumulation and clipping, every ring/naive x stage x optimizer: at 2, 3 and 4 ranks (alone at
# 4, where the small CNN's 4 steps cost ~0.1-0.2 s a case: the group's start is the larger part)
CORE = [(a, z, o, "foreach", 2, CLIP, True, True) for a in ("ring", "naive") for z in (2, 3)
        for o in ("sgd", "adamw")]
CASES = CORE + [  # at 2 and 3 ranks
    *[(a, z, o, "foreach", 1, 0.0, True, True) for a in ("naive", "ring", "tree") for z in (1, 2)
      for o in ("sgd", "adamw")],
    ("ring", 2, "sgd", "fused", 1, 0.0, True, True),  # the default optim.impl
    ("ring", 2, "adamw", "fused", 1, 0.0, False, True),
    ("ring", 1, "sgd", "foreach", 2, 0.0, False, True),  # accumulation
    ("tree", 2, "sgd", "foreach", 2, CLIP, True, True),  # accumulation and clipping
    ("naive", 2, "adamw", "foreach", 1, CLIP, False, True),
    ("tree", 3, "sgd", "foreach", 1, 0.0, True, True),
    ("ring", 3, "adamw", "foreach", 1, 0.0, True, True),
    ("ring", 3, "sgd", "fused", 2, 0.0, False, True),  # every collective on the training thread
    ("tree", 3, "adamw", "foreach", 1, 0.0, True, False),  # units gathered forward to backward
]


def _equivalence(rank, n):
    out, zero0 = {"cases": {}, "refs": {}}, {}
    for algo, zero, optim, impl, accum, clip, overlap, reshard in CORE if n > 3 else CASES:
        params, sync, opt, model = train(rank, n, scfg(algo, zero, overlap, reshard=reshard),
                                         optim, impl, accum, clip)
        like = (algo, optim, impl, accum, clip, overlap)  # cases alike but for the stage share one
        if like not in zero0:
            zero0[like], *_ = train(rank, n, scfg(algo, 0, overlap), optim, impl, accum, clip)
        base = zero0[like]
        out["cases"][(algo, zero, optim, impl, accum, clip, overlap, reshard)] = {
            "params": params, "zero0": base,
            "state_bytes": _storage_bytes(v for s in opt.state.values() for v in s.values()),
            "grad_bytes": _storage_bytes(sync.grads),
            "numel": sum(p.numel() for p in model.parameters()),
            "buckets": len(sync.buckets), "stats": sync.comm_stats()}
        sync.close()
    for optim in OPTIMS if n < 4 else ():  # torch's: DDP, and DDP with ZeroRedundancyOptimizer
        for zero in (0, 1):
            params, *_ = train(rank, n, scfg("ddp", zero, bucket_mb=25), optim)
            out["refs"][("ddp", zero, optim)] = params
    return packed(out)


def max_diff(a, b) -> float:
    return max((x.double() - y.double()).abs().max().item() for x, y in zip(a, b))


def bitwise(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


def same_order(algo, zero, n) -> bool:
    """The gradients are summed in zero=0's order (module docstring)."""
    return zero == 1 or algo != "ring" or n == 2


def close_adamw(a, b, lr, steps) -> bool:
    """AdamW's tolerance (module docstring): all within 2 lr per step, all but a few within 1e-6."""
    diffs = torch.cat([(x.double() - y.double()).abs().view(-1) for x, y in zip(a, b)])
    return diffs.max().item() <= 2 * lr * steps and int((diffs > 1e-6).sum()) <= 4


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_zero_trains_like_zero0_ddp_and_one_process(world_size):
    """zero=1, 2 and 3 on naive, ring and tree, SGD and AdamW, with and without overlap (and
    resharding), accumulation and clipping (at 4 ranks: CORE alone): equal to zero=0 (bitwise
    where the order is the same and the optimizer's arithmetic does not depend on an element's
    offset; else SGD within 1e-6, AdamW as the module says where the order differs), to DDP and
    to one process; every rank the same."""
    results = [unpacked(r) for r in spawn(_equivalence, world_size, timeout=230)]
    n = world_size
    assert {c[:3] for c in results[0]["cases"]} >= {c[:3] for c in CORE}  # every combination
    singles = {c[2:6]: one_process(n, *c[2:6]) for c in (CORE if n > 3 else CASES)}
    for key, r in results[0]["cases"].items():
        algo, zero, optim, impl, accum, clip, overlap, reshard = key
        for other in results[1:]:
            assert bitwise(other["cases"][key]["params"], r["params"]), f"{key}: ranks differ"
        exact = (same_order(algo, zero, n) and (impl == "foreach" or optim == "adamw")
                 and not clip)
        if exact:
            assert bitwise(r["params"], r["zero0"]), (key, max_diff(r["params"], r["zero0"]))
        elif optim == "sgd" or same_order(algo, zero, n):
            assert max_diff(r["params"], r["zero0"]) < 1e-6, (key, max_diff(r["params"],
                                                                            r["zero0"]))
        else:
            assert close_adamw(r["params"], r["zero0"], 1e-3, STEPS), key
        single = singles[(optim, impl, accum, clip)]
        ddp = results[0]["refs"].get(("ddp", 0, optim)) if accum == 1 and not clip else None
        for ref in [single] + ([ddp] if ddp is not None else []):
            if optim == "sgd":
                assert max_diff(r["params"], ref) < 1e-6, (key, max_diff(r["params"], ref))
            else:
                assert close_adamw(r["params"], ref, 1e-3, STEPS), (key, max_diff(r["params"],
                                                                                   ref))
    for optim in OPTIMS if n < 4 else ():  # torch's ZeRO-1 against torch's DDP: itself sound
        z1, z0 = (results[0]["refs"][("ddp", z, optim)] for z in (1, 0))
        assert max_diff(z1, z0) < 1e-6, (optim, max_diff(z1, z0))


# ---- bytes: state and gradients 1/N, communication as documented --------------------------------

def test_shards_hold_1_over_n_and_zero2_sends_half_the_all_reduce():
    """Per-rank optimizer-state bytes within one element per bucket of 1/N of the unsharded
    state; at zero=2 the shards' gradients likewise; bytes per step: zero=1 = all-reduce +
    all-gather, zero=2 = reduce-scatter + all-gather (the reduce-scatter half the all-reduce)."""
    from test_comm import expected_bytes_sent

    n = 3
    results = spawn(_bytes, n, timeout=120)
    for rank, r in enumerate(results):
        for (optim, zero), got in r.items():
            numel, buckets = got["numel"], got["bucket_numels"]
            states = {"sgd": 1, "adamw": 2}[optim]
            scalars = 4 * len(buckets) if optim == "adamw" else 0  # AdamW's step, per shard
            ideal = states * 4 * numel / n
            per_element = got["unsharded_state_bytes"] - (4 * got["params"] if scalars else 0)
            assert per_element == states * 4 * numel == ideal * n  # the reference is as said
            assert abs(got["state_bytes"] - scalars - ideal) <= states * 4 * len(buckets), got
            assert abs(got["grad_bytes"] - 4 * numel / n) <= 4 * len(buckets), got
            reduce = {1: "all_reduce", 2: "reduce_scatter"}[zero]
            want = sum(_half_or_whole(reduce, rank, n, b) + _half_or_whole("all_gather", rank, n, b)
                       for b in buckets)
            assert got["bytes_per_step"] == want, (optim, zero, got["bytes_per_step"], want)
            if reduce == "all_reduce":
                assert _half_or_whole(reduce, rank, n, 999) == expected_bytes_sent("ring", rank,
                                                                                   n, 999)


def _half_or_whole(op, rank, n, numel):
    """Bytes rank `rank` sends in one ring collective of `numel` fp32 (comm/ring.py)."""
    sizes = [numel // n + (1 if i < numel % n else 0) for i in range(n)]
    if op == "all_reduce":
        return 4 * (numel - sizes[(rank + 1) % n] + numel - sizes[(rank + 2) % n])
    if op == "reduce_scatter":
        return 4 * (numel - sizes[rank])
    return 4 * (numel - sizes[(rank + 1) % n])


def _bytes(rank, n):
    out = {}
    for optim in OPTIMS:
        for zero in (1, 2):
            params, sync, opt, model = train(rank, n, scfg("ring", zero), optim)
            plain = OPTIMS[optim][0]([p.detach().clone() for p in model.parameters()],
                                     **OPTIMS[optim][1])
            for p in plain.param_groups[0]["params"]:
                p.grad = torch.ones_like(p)
            plain.step()
            out[(optim, zero)] = {
                "numel": sum(p.numel() for p in model.parameters()),
                "params": len(params),
                "bucket_numels": [b.buffer.numel() for b in sync.buckets],
                "state_bytes": _storage_bytes(v for s in opt.state.values() for v in s.values()),
                "unsharded_state_bytes": _storage_bytes(
                    v for s in plain.state.values() for v in s.values()),
                "grad_bytes": _storage_bytes(sync.grads),
                "bytes_per_step": sync.bytes_per_step()}
            sync.close()
    return out


# ---- the loss scale, the non-finite guard and clipping agree across shards ----------------------

def _inf_in_one_shard(rank, n):
    """An inf in rank 0's gradient of an element rank 1 owns (the last of the one bucket): after
    the reduce-scatter only rank 1's shard holds it. Every rank must skip the step and halve its
    scale (ShardedScaler); and, in fp32, the guard must flag the step on every rank."""
    from ddp_lab.guard import Guard

    def setup():
        model = make_model(0)
        sync = make_sync(scfg("ring", 2, overlap=False, bucket_mb=25), n)
        sync.prepare(model)
        opt = sync.build_optimizer(model, torch.optim.SGD, dict(lr=0.1, momentum=0.9, fused=True))
        return model, sync, opt

    def poison(model):  # the first parameter is the (reversed) bucket's last
        if rank == 0:
            next(model.parameters()).grad.view(-1)[-1] = float("inf")

    model, sync, opt = setup()
    scaler = sync.grad_scaler(torch.amp.GradScaler("cpu", init_scale=1024.0))
    x, y = batch(rank, 0, 0)
    scaler.scale(nn.functional.cross_entropy(model(x), y)).backward()
    poison(model)
    sync.finish()
    before = [p.detach().clone() for p in model.parameters()]
    scaler.step(opt)
    scaler.update()
    out = {"scale": scaler.get_scale(), "moved": not bitwise(before, list(model.parameters())),
           "inf_here": any(not torch.isfinite(g).all() for g in sync.grads)}
    sync.close()
    model, sync, opt = setup()
    guard = Guard(SimpleNamespace(nonfinite="skip", consistency_every=0),
                  SimpleNamespace(rank=rank, world_size=n), model,
                  torch.amp.GradScaler("cpu", enabled=False), total_steps=2)
    for step in (1, 2):
        x, y = batch(rank, step, 0)
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        if step == 2:
            poison(model)
        sync.finish()
        guard.after_sync(step, loss, opt)
        before = [p.detach().clone() for p in model.parameters()]
        opt.step()
        opt.zero_grad(set_to_none=True)
    guard.resolve()
    out |= {"guard_skipped": guard.skipped,
            "guard_moved": not bitwise(before, list(model.parameters()))}
    sync.close()
    return out


@pytest.mark.timeout(60)
def test_an_inf_in_one_shard_skips_the_step_on_every_rank():
    results = spawn(_inf_in_one_shard, 2, timeout=50)
    assert [r["inf_here"] for r in results] == [False, True]  # alone, the ranks would disagree
    for r in results:
        assert r["scale"] == 512.0 and not r["moved"], r  # all skipped, all halved the scale
        assert r["guard_skipped"] == [2] and not r["guard_moved"], r
