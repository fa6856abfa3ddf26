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


LOOP = ("data", "guard", "events", "loss", "sched")  # the loop's per-step pieces, in table order


def _model_and_optimizer(net, classes, stem, device, fmt, compile_mode):
    """The model, its fused SGD, and the forward a step calls: the model, or its compiled self."""
    model = build_model(net, classes, 0.5, stem).to(device, memory_format=fmt)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-4, fused=True)
    if not compile_mode:
        return model, opt, model
    torch._dynamo.reset()
    return model, opt, torch.compile(model, mode=compile_mode)


class VariantStep:
    """One training step, called as `step()`. `extras` adds the ddp_lab loop's own per-step pieces
    (the real classes, not copies): data (DeviceBatches of SyntheticImages), guard (Guard.after_sync
    and end_step), events (StepTimer marks), loss (loss bookkeeping), sched (LambdaLR). `pieces`
    are those pieces alone, for host_costs, once `prime()` has made a loss and gradients."""

    def __init__(self, net, batch, device, amp, cl, compile_mode=None, extras=(), stem="standard"):
        torch.manual_seed(0)
        size, classes = (224, 1000) if net == "alexnet" else (32, 10)
        self.device, self.amp, self.extras = device, amp, extras
        self.fmt = fmt = torch.channels_last if cl else torch.contiguous_format
        self.model, self.opt, self.forward = _model_and_optimizer(net, classes, stem, device, fmt,
                                                                  compile_mode)
        self.x0 = torch.randn(batch, 3, size, size, device=device).contiguous(memory_format=fmt)
        self.y0 = torch.randint(0, classes, (batch,), device=device)
        images = SyntheticImages(50_000, size, classes, 256, 0, device, amp or torch.float32)
        if cl:
            images.to_channels_last()
        perm = torch.randperm(50_000)
        # the loop's own data stream
        self.stream = DeviceBatches(images, lambda epoch: perm, batch, device, True)
        self.batches = iter(())
        tcfg = SimpleNamespace(nonfinite="skip", consistency_every=0)
        info = SimpleNamespace(rank=0, world_size=1)
        self.checks = Guard(tcfg, info, self.model, torch.amp.GradScaler(enabled=False), 10**9)
        # recorded and resolved each step, as in the loop
        self.timer = StepTimer(device, warmup=0)
        self.timer.restart()
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: 1.0 - s / 1e6)
        self.loss_window = torch.zeros((), device=device)
        self.i = 0  # batches drawn: the step number the guard sees
        self.loss = None  # prime()'s, for the pieces

    def autocast(self):
        if not self.amp:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.amp)

    def data(self):
        if "data" not in self.extras:
            return self.x0, self.y0
        self.i += 1
        x, y = next(self.batches, (None, None))
        if x is None:  # a new epoch: one gather of all of it, then views (as in the loop)
            self.batches = self.stream.epoch(0)
            x, y = next(self.batches)
        return x.contiguous(memory_format=self.fmt), y

    def mark(self, phase):
        if "events" in self.extras:
            self.timer.mark(phase)

    def __call__(self):
        x, y = self.data()
        self.mark("data")
        with self.autocast():
            loss = F.cross_entropy(self.forward(x), y)
        self.mark("forward")
        loss.backward()
        self.mark("backward")
        if "guard" in self.extras:
            self.checks.after_sync(self.i, loss, self.opt)
        self.mark("comm")
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if "sched" in self.extras:
            self.sched.step()
        self.mark("optim")
        if "events" in self.extras:
            self.timer.end_step()
        if "guard" in self.extras:
            self.checks.end_step(self.i, sync_point=False)
        if "loss" in self.extras:
            self.loss_window += loss.detach()
        return loss.detach()

    def prime(self):
        """Gradients and a loss for the pieces to work on, as right after the backward of a step
        past the first (whose optimizer has state: the guard then decides on the device)."""
        for _ in range(2):
            self.opt.zero_grad(set_to_none=True)
            with self.autocast():
                loss = F.cross_entropy(self.forward(self.x0), self.y0)
            loss.backward()
            if not self.opt.state:
                self.opt.step()
        self.loss = loss.detach()

    def events(self):
        for phase in ("data", "forward", "backward", "comm", "optim"):
            self.timer.mark(phase)
        self.timer.end_step()

    def guard(self):
        self.checks.after_sync(self.i, self.loss, self.opt)
        self.checks.end_step(self.i, sync_point=False)

    @property
    def pieces(self):
        return {
            "data": self.data, "events": self.events, "sched": self.sched.step,
            "guard": self.guard,
            "loss": lambda: self.loss_window.add_(self.loss),
            "one tiny op": lambda: self.loss_window.add_(1),  # the unit: one op's host cost
        }


def build(net, batch, device, amp, cl, compile_mode=None, extras=(), graph=False,
          stem="standard"):
    """One training step as a callable: a VariantStep, or with `graph` that step captured in a
    CUDA graph as the loop captures it."""
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    torch.backends.cudnn.benchmark = True
    step = VariantStep(net, batch, device, amp, cl, compile_mode, extras, stem)
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


def parse_args():
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
    if a.smoke:
        a.net, a.batch, a.steps, a.warmup, a.rounds = "alexnet_cifar", 2, 2, 1, 2
    return a


def variants(only, device):
    """build()'s keyword arguments by variant name, in table order: those `only` selects, and on
    a CPU none that needs a CUDA graph or fp16."""
    bf16, fp16 = torch.bfloat16, torch.float16
    s2d = dict(stem="space_to_depth")
    table = {
        "eager bf16 cl": dict(amp=bf16, cl=True),
        "eager bf16 cl s2d": dict(amp=bf16, cl=True, **s2d),
        **{f"+loop {e}": dict(amp=bf16, cl=True, extras=(e,)) for e in LOOP},
        "+loop all": dict(amp=bf16, cl=True, extras=LOOP),
        "eager bf16 cl s2d +loop all": dict(amp=bf16, cl=True, extras=LOOP, **s2d),
        "eager bf16 cl s2d graph": dict(amp=bf16, cl=True, graph=True, **s2d),
        "eager bf16 cl graph": dict(amp=bf16, cl=True, graph=True),
        # In the graph: each piece of the loop's own work, captured with the step (timer events
        # cannot be captured; the loop records them between replays).
        **{f"graph +loop {e}": dict(amp=bf16, cl=True, graph=True, extras=(e,))
           for e in LOOP if e != "events"},
        "compile bf16 cl": dict(amp=bf16, cl=True, compile_mode="default"),
        "compile bf16 cl +loop all": dict(amp=bf16, cl=True, compile_mode="default", extras=LOOP),
        "compile bf16 cl s2d": dict(amp=bf16, cl=True, compile_mode="default", **s2d),
        "compile bf16 cl s2d +loop all": dict(amp=bf16, cl=True, compile_mode="default",
                                              extras=LOOP, **s2d),
        "compile fp16 cl s2d": dict(amp=fp16, cl=True, compile_mode="default", **s2d),
        "compile bf16 cl s2d graph": dict(amp=bf16, cl=True, compile_mode="default", graph=True,
                                          **s2d),
    }
    if only:
        # A variant's exact name selects just it; anything else, every variant containing it.
        keep = only.split(",")
        table = {k: v for k, v in table.items()
                 if k in keep or any(s in k for s in keep if s not in table)}
    if device.type == "cpu":
        table = {k: v for k, v in table.items() if "graph" not in k and "fp16" not in k}
    return table


def run_host_costs(a, device):
    step = build(a.net, a.batch, device, amp=torch.bfloat16, cl=True, extras=LOOP)
    costs = host_costs(step, device)
    print(f"\nhost cost of the loop's pieces, {a.net} batch {a.batch} on {device}")
    for name, us in costs.items():
        print(f"{name:12} {us:8.1f} us a call")
    with open(os.path.join(a.out, "host_costs.json"), "w") as f:
        json.dump({"net": a.net, "batch": a.batch, "us_per_call": costs}, f, indent=1)


def failed(name, e):
    """The row of a variant that failed, said at once."""
    print(f"{name}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
    return {"variant": name, "error": str(e)[:300]}


def build_all(a, device, table):
    """The built steps by name, and a row for each variant that failed to build."""
    steps, rows = {}, {}
    for name, kw in table.items():
        try:
            steps[name] = build(a.net, a.batch, device, **kw)
        except Exception as e:  # one failing variant must not cost the others
            rows[name] = failed(name, e)
    return steps, rows


def time_rounds(a, device, table, steps, rows):
    """Times every step `a.rounds` times in turn, putting its medians in `rows` and writing
    step_variants.json after every round; a step that fails is dropped from `steps`."""
    timed = {name: [] for name in steps}
    for round_ in range(a.rounds):
        for name, step in list(steps.items()):
            t0 = time.perf_counter()
            try:
                total_ms, med_ms = time_steps(step, device, a.steps, a.warmup)
            except Exception as e:  # e.g. a compile that fails on its first call
                rows[name] = failed(name, e)
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
                       "rows": [rows[n] for n in table if n in rows]}, f, indent=1)


def print_table(a, device, rows):
    """img/s of each row and its ratio to the first that has one."""
    ref = next((r["img_s"] for r in rows if "img_s" in r), float("nan"))
    print(f"\n{a.net}, batch {a.batch}, {a.steps} timed steps on {device}, median of {a.rounds} "
          "rounds")
    for r in rows:
        if "img_s" in r:
            print(f"{r['variant']:40} {r['img_s']:9.0f} img/s  {r['img_s'] / ref:6.3f}  "
                  f"{r['step_ms_med']:7.3f} ms")
        else:
            print(f"{r['variant']:40} failed")


def main():
    a = parse_args()
    device = torch.device("cpu" if a.smoke or not torch.cuda.is_available() else "cuda")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1,
                            store=dist.HashStore())  # one process: no rendezvous, no port
    if a.host_costs:
        run_host_costs(a, device)
        dist.destroy_process_group()
        return
    table = variants(a.only, device)
    # Every variant is built first, then timed `--rounds` times in turn: the host's speed drifts
    # by ~10% within minutes, and a ratio of rows timed far apart would measure that drift.
    steps, rows = build_all(a, device, table)
    time_rounds(a, device, table, steps, rows)
    if a.profile and device.type == "cuda":
        for name in ("eager bf16 cl s2d", "compile bf16 cl s2d"):
            if name in steps:
                print(f"profile of {name}:")
                profile_top(steps[name], device)
    print_table(a, device, [rows[n] for n in table if n in rows])
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
