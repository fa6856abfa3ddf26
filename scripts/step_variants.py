"""Where a training step's time goes: variants of one bare AlexNet step, timed side by side.

    python scripts/step_variants.py [--net alexnet] [--batch 256] [--steps 50] [--rounds 3]
                                    [--only a,b] [--smoke] [--host-costs]

Each variant is the reference step (autocast forward, backward, fused SGD, zero_grad) with one
thing changed or added; the table gives img/s and the ratio to the first (eager) row. "+loop"
variants add, one at a time, the per-step work the ddp_lab loop does on top of the reference
(the data stream's batches, the non-finite guard, step-timer events, loss bookkeeping, the
LR scheduler), so the loop's overhead can be attributed; `--host-costs` times each of those
pieces alone, in host microseconds a call. `--smoke` runs a tiny CPU version.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from ddp_lab.bench.common import back_to_back_ms, sync  # noqa: E402
from ddp_lab.data import DeviceBatches, SyntheticImages  # noqa: E402
from ddp_lab.graph import GraphedStep  # noqa: E402
from ddp_lab.guard import Guard  # noqa: E402
from ddp_lab.metrics import StepTimer  # noqa: E402
from ddp_lab.models import build_model  # noqa: E402


def build(net, batch, device, amp, cl, compile_mode=None, extras=(), cudnn_limit=None,
          graph=False, stem="standard"):
    """One training step as a closure. `extras` adds the ddp_lab loop's own per-step pieces (the
    real classes, not copies): data (DeviceBatches of SyntheticImages), guard (Guard.after_sync and
    end_step), events (StepTimer marks), loss (loss bookkeeping), sched (LambdaLR). The closure's
    `pieces` are those pieces alone, for host_costs."""
    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    torch.backends.cudnn.benchmark = True
    if cudnn_limit is not None:
        torch.backends.cudnn.benchmark_limit = cudnn_limit
    size, classes = (224, 1000) if net == "alexnet" else (32, 10)
    fmt = torch.channels_last if cl else torch.contiguous_format
    model = build_model(net, classes, 0.5, stem).to(device, memory_format=fmt)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-4, fused=True)
    fwd = model
    if compile_mode:
        torch._dynamo.reset()
        fwd = torch.compile(model, mode=compile_mode)
    x0 = torch.randn(batch, 3, size, size, device=device).contiguous(memory_format=fmt)
    y0 = torch.randint(0, classes, (batch,), device=device)
    images = SyntheticImages(50_000, size, classes, 256, 0, device, amp or torch.float32)
    images.to_channels_last() if cl else None
    perm = torch.randperm(50_000)
    stream = DeviceBatches(images, lambda epoch: perm, batch, device, True)  # the loop's own
    batches = iter(())
    tcfg = SimpleNamespace(nonfinite="skip", consistency_every=0)
    info = SimpleNamespace(rank=0, world_size=1)
    checks = Guard(tcfg, info, model, torch.amp.GradScaler(enabled=False), 10**9)
    # recorded and resolved each step, as in the loop
    timer = StepTimer(device, warmup=0)
    timer.restart()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 - s / 1e6)
    loss_window = torch.zeros((), device=device)
    state = {"i": 0}

    def data():
        nonlocal batches
        if "data" not in extras:
            return x0, y0
        state["i"] += 1
        x, y = next(batches, (None, None))
        if x is None:  # a new epoch: one gather of all of it, then views (as in the loop)
            batches = stream.epoch(0)
            x, y = next(batches)
        return x.contiguous(memory_format=fmt), y

    def mark(phase):
        if "events" in extras:
            timer.mark(phase)

    def step():
        nonlocal loss_window
        x, y = data()
        mark("data")
        with torch.autocast(device.type, dtype=amp) if amp else contextlib.nullcontext():
            loss = F.cross_entropy(fwd(x), y)
        mark("forward")
        loss.backward()
        mark("backward")
        if "guard" in extras:
            checks.after_sync(state["i"], loss, opt)
        mark("comm")
        opt.step()
        opt.zero_grad(set_to_none=True)
        if "sched" in extras:
            sched.step()
        mark("optim")
        if "events" in extras:
            timer.end_step()
        if "guard" in extras:
            checks.end_step(state["i"], sync_point=False)
        if "loss" in extras:
            loss_window += loss.detach()
        return loss.detach()

    def prime():
        """Gradients and a loss for the pieces to work on, as right after the backward of a step
        past the first (whose optimizer has state: the guard then decides on the device)."""
        for _ in range(2):
            opt.zero_grad(set_to_none=True)
            with torch.autocast(device.type, dtype=amp) if amp else contextlib.nullcontext():
                loss = F.cross_entropy(fwd(x0), y0)
            loss.backward()
            if not opt.state:
                opt.step()
        state["loss"] = loss.detach()

    def events():
        for phase in ("data", "forward", "backward", "comm", "optim"):
            timer.mark(phase)
        timer.end_step()

    step.prime = prime
    step.pieces = {
        "data": data, "events": events, "sched": sched.step,
        "guard": lambda: (checks.after_sync(state["i"], state["loss"], opt),
                          checks.end_step(state["i"], sync_point=False)),
        "loss": lambda: loss_window.add_(state["loss"]),
        "one tiny op": lambda: loss_window.add_(1),  # the unit: one op's host cost
    }
    if not graph:
        return step
    graphed = GraphedStep(step)  # the training loop's train.cuda_graph: eager calls, then capture
    return lambda: graphed()[1]


def time_steps(step, device, steps, warmup):
    for _ in range(warmup):
        step()
    sync(device)
    times, loss = back_to_back_ms(step, device, steps)
    assert torch.isfinite(loss).all(), "non-finite loss"
    return sum(times), statistics.median(times)


def host_costs(step, device, calls: int = 100, warmup: int = 20) -> dict[str, float]:
    """Host microseconds per call of each of the loop's per-step pieces, alone: the time to issue
    `calls` calls back to back, without waiting for the GPU (few enough to stay within CUDA's
    launch queue), so it is what the piece costs a host-bound step."""
    step.prime()
    out = {}
    for name, piece in step.pieces.items():
        for _ in range(warmup):
            piece()
        sync(device)
        t0 = time.perf_counter()
        for _ in range(calls):
            piece()
        out[name] = (time.perf_counter() - t0) / calls * 1e6
        sync(device)
    return out


def profile_top(step, device, k=15):
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            step()
        torch.cuda.synchronize()
    tot = {}
    for e in prof.events():
        if e.device_type == DeviceType.CUDA:
            tot[e.name] = tot.get(e.name, 0) + e.time_range.elapsed_us()
    all_us = sum(tot.values())
    print(f"profile: {all_us / 5 / 1e3:.2f} ms kernel time per step, {len(tot)} kernels")
    for name, us in sorted(tot.items(), key=lambda kv: -kv[1])[:k]:
        print(f"  {us / 5 / 1e3:7.3f} ms {100 * us / all_us:5.1f}%  {name[:120]}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--net", default="alexnet")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=1, help="time every variant this many times "
                    "in turn; medians reported")
    ap.add_argument("--only", default="")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--host-costs", action="store_true", help="only the host cost of each of the "
                    "loop's pieces, alone (eager bf16, channels_last)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    device = torch.device("cpu" if a.smoke or not torch.cuda.is_available() else "cuda")
    if a.smoke:
        a.net, a.batch, a.steps, a.warmup, a.rounds = "alexnet_cifar", 2, 2, 1, 2
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1,
                            store=dist.HashStore())  # one process: no rendezvous, no port
    bf16, fp16 = torch.bfloat16, torch.float16
    loop = ("data", "guard", "events", "loss", "sched")
    if a.host_costs:
        costs = host_costs(build(a.net, a.batch, device, amp=bf16, cl=True, extras=loop), device)
        print(f"\nhost cost of the loop's pieces, {a.net} batch {a.batch} on {device}")
        for name, us in costs.items():
            print(f"{name:12} {us:8.1f} us a call")
        with open(os.path.join(a.out, "host_costs.json"), "w") as f:
            json.dump({"net": a.net, "batch": a.batch, "us_per_call": costs}, f, indent=1)
        dist.destroy_process_group()
        return
    s2d = dict(stem="space_to_depth")
    variants = {
        "eager bf16 cl": dict(amp=bf16, cl=True),
        "eager bf16 cl s2d": dict(amp=bf16, cl=True, **s2d),
        **{f"+loop {e}": dict(amp=bf16, cl=True, extras=(e,)) for e in loop},
        "+loop all": dict(amp=bf16, cl=True, extras=loop),
        "eager bf16 cl s2d +loop all": dict(amp=bf16, cl=True, extras=loop, **s2d),
        "eager bf16 cl s2d graph": dict(amp=bf16, cl=True, graph=True, **s2d),
        "eager bf16 cl graph": dict(amp=bf16, cl=True, graph=True),
        # In the graph: each piece of the loop's own work, captured with the step (timer events
        # cannot be captured; the loop records them between replays).
        **{f"graph +loop {e}": dict(amp=bf16, cl=True, graph=True, extras=(e,))
           for e in loop if e != "events"},
        "compile bf16 cl": dict(amp=bf16, cl=True, compile_mode="default"),
        "compile bf16 cl +loop all": dict(amp=bf16, cl=True, compile_mode="default", extras=loop),
        "compile bf16 cl s2d": dict(amp=bf16, cl=True, compile_mode="default", **s2d),
        "compile bf16 cl s2d +loop all": dict(amp=bf16, cl=True, compile_mode="default",
                                              extras=loop, **s2d),
        "compile fp16 cl s2d": dict(amp=fp16, cl=True, compile_mode="default", **s2d),
        "compile bf16 cl s2d graph": dict(amp=bf16, cl=True, compile_mode="default", graph=True,
                                          **s2d),
    }
    if a.only:
        # A variant's exact name selects just it; anything else, every variant containing it.
        keep = a.only.split(",")
        variants = {k: v for k, v in variants.items()
                    if k in keep or any(s in k for s in keep if s not in variants)}
    if device.type == "cpu":
        variants = {k: v for k, v in variants.items() if "graph" not in k and "fp16" not in k}
    # Every variant is built first, then timed `--rounds` times in turn: the host's speed drifts
    # by ~10% within minutes, and a ratio of rows timed far apart would measure that drift.
    steps, rows = {}, {}
    for name, kw in variants.items():
        try:
            steps[name] = build(a.net, a.batch, device, **kw)
        except Exception as e:  # one failing variant must not cost the others
            print(f"{name}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
            rows[name] = {"variant": name, "error": str(e)[:300]}
    timed = {name: [] for name in steps}
    for round_ in range(a.rounds):
        for name, step in list(steps.items()):
            t0 = time.perf_counter()
            try:
                total_ms, med_ms = time_steps(step, device, a.steps, a.warmup)
            except Exception as e:  # e.g. a compile that fails on its first call
                print(f"{name}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
                rows[name] = {"variant": name, "error": str(e)[:300]}
                del steps[name], timed[name]
                continue
            timed[name].append((total_ms, med_ms))
            print(f"round {round_ + 1}/{a.rounds} {name}: {a.batch * a.steps / total_ms * 1e3:.0f} "
                  f"img/s (median step {med_ms:.3f} ms, {time.perf_counter() - t0:.0f} s)",
                  flush=True)
        for name, times in timed.items():  # medians over the rounds so far (a timeout keeps them)
            total_ms = statistics.median(t for t, _ in times)
            med_ms = statistics.median(m for _, m in times)
            rows[name] = {"variant": name, "img_s": a.batch * a.steps / total_ms * 1e3,
                          "img_s_med": a.batch / med_ms * 1e3, "step_ms_med": med_ms,
                          "rounds": len(times)}
        with open(os.path.join(a.out, "step_variants.json"), "w") as f:
            json.dump({"net": a.net, "batch": a.batch, "steps": a.steps,
                       "rows": [rows[n] for n in variants if n in rows]}, f, indent=1)
    if a.profile and device.type == "cuda":
        for name in ("eager bf16 cl s2d", "compile bf16 cl s2d"):
            if name in steps:
                print(f"profile of {name}:")
                profile_top(steps[name], device)
    rows = [rows[n] for n in variants if n in rows]
    ref = next((r["img_s"] for r in rows if "img_s" in r), float("nan"))
    print(f"\n{a.net}, batch {a.batch}, {a.steps} timed steps on {device}, median of {a.rounds} "
          "rounds")
    for r in rows:
        if "img_s" in r:
            print(f"{r['variant']:40} {r['img_s']:9.0f} img/s  {r['img_s'] / ref:6.3f}  "
                  f"{r['step_ms_med']:7.3f} ms")
        else:
            print(f"{r['variant']:40} failed")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
