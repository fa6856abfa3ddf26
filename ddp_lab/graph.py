"""Whole-step CUDA graphs (`train.cuda_graph=true`): the step's forward, backward, non-finite
guard and optimizer update captured once and replayed, one host call instead of ~100 kernel
launches. For models whose step is bounded by how fast the host issues ops (AlexNet-CIFAR on an
H200: an op's host time is far more than its GPU time), it is the difference between
the GPU waiting and the GPU working.

A graph replays fixed work on fixed addresses, so everything the step reads or writes must stay
put between replays: the batch is copied into static input tensors, the learning rate lives in a
device tensor (`DeviceLR`), the guard's verdict is copied out after each
replay (`Guard.replayed`), and the loss is accumulated into a tensor that outlives the step.
What decides on the host inside a step cannot be captured; `check_supported` refuses it up front.
"""

from __future__ import annotations

import torch

from ddp_lab.errors import ConfigError

EAGER_CALLS = 3  # eager calls before the capture: cuDNN plans, cuBLAS workspaces, optimizer state


def check_supported(cfg, device: torch.device) -> None:
    """Refuse, naming each reason, what a captured step cannot do."""
    problems = []
    if device.type != "cuda":
        problems.append(f"CUDA graphs need a CUDA device (this run is on {device.type})")
    if cfg.sync.name != "none":
        problems.append(f"sync={cfg.sync.name} drives its communication from the host; use "
                        "sync=none (one process)")
    if cfg.precision.grad_scaler:
        problems.append(f"precision={cfg.precision.name}'s GradScaler adjusts the loss scale on "
                        "the host; use precision=bf16")
    if cfg.optim.name != "sgd":
        problems.append(f"optim={cfg.optim.name}: only SGD's capture has been checked on a GPU "
                        "(AdamW would also need capturable=True); use optim=sgd")
    if cfg.optim.impl not in ("auto", "fused"):
        problems.append(f"optim.impl={cfg.optim.impl}: the step needs the fused optimizer (it "
                        "reads the learning rate and the guard's skip flag on the device)")
    if cfg.train.compile and cfg.train.compile_mode in ("reduce-overhead", "max-autotune"):
        problems.append(f"train.compile_mode={cfg.train.compile_mode} makes CUDA graphs of its "
                        "own; use compile_mode=default or max-autotune-no-cudagraphs")
    if cfg.fault.nan_at_step:
        problems.append("fault.nan_at_step poisons the logits from a Python hook, which a replay "
                        "does not run")
    if problems:
        raise ConfigError("train.cuda_graph=true: " + "; ".join(problems))


class DeviceLR:
    """Each param group's learning rate as a device tensor, which a replay reads. Call `update`
    after every `scheduler.step()`: newer torch schedulers fill a tensor LR in place, older ones
    assign a float, which `update` writes back into the tensor (a graph keeps the address it
    captured)."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.groups = optimizer.param_groups
        self.tensors = [torch.tensor(float(g["lr"]), dtype=torch.float32,  # fused kernels: fp32
                                     device=g["params"][0].device) for g in self.groups]
        for group, lr in zip(self.groups, self.tensors):
            group["lr"] = lr

    def update(self) -> None:
        for group, lr in zip(self.groups, self.tensors):
            if group["lr"] is not lr:
                lr.fill_(float(group["lr"]))
                group["lr"] = lr


class GraphedStep:
    """`fn(*inputs)` run eagerly for the first EAGER_CALLS calls (on a side stream, as capture
    requires of warm-up), captured on the next and replayed from then on. Each call first copies
    its `inputs` into static tensors (made from the first call's), which `fn` always receives, so
    eager and replayed calls do the same work on the same addresses.

    `__call__` returns (what happened: "eager" | "captured" | "replayed", fn's output); a
    captured call has run the step too (capture, then a replay)."""

    def __init__(self, fn, eager_calls: int = EAGER_CALLS):
        self.fn, self.eager_left = fn, eager_calls
        self.static: list[torch.Tensor] | None = None
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out = None
        self.side = torch.cuda.Stream()

    def __call__(self, *inputs: torch.Tensor):
        if self.static is None:
            self.static = [t.clone() for t in inputs]  # clone keeps the memory format
        else:
            for dst, src in zip(self.static, inputs):
                dst.copy_(src)
        if self.eager_left:
            self.eager_left -= 1
            self.side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.side):
                out = self.fn(*self.static)
            torch.cuda.current_stream().wait_stream(self.side)
            return "eager", out
        what = "replayed"
        if self.graph is None:
            self.graph, what = torch.cuda.CUDAGraph(), "captured"
            try:
                with torch.cuda.graph(self.graph):  # recorded, not run
                    self.out = self.fn(*self.static)
            except RuntimeError as e:
                cause = e  # the capture's own end raises last: the first error says what happened
                while cause.__context__ is not None:
                    cause = cause.__context__
                raise ConfigError(
                    "train.cuda_graph=true: capturing the training step failed (something in it "
                    "waits for the host or changes shape between steps); run with "
                    f"train.cuda_graph=false. Error: {str(cause).strip().splitlines()[0][:300]}"
                ) from e
        self.graph.replay()
        return what, self.out


class GraphedTrainStep:
    """train.cuda_graph: the loop's step (ddp_lab.step.TrainStep: `step(step, micro_batches,
    mark)`) as one CUDA graph, called the same way. The micro-batches go through GraphedStep's
    static inputs, the learning rate through `DeviceLR` (updated before each call: the scheduler
    stepped after the last one), and after a replay the guard keeps that step's verdict. Phases
    inside a graph cannot be marked: the loop times the whole step as one phase, `graph`."""

    last_phase = "graph"

    def __init__(self, step_fn, optimizer: torch.optim.Optimizer, guard):
        self.lr = DeviceLR(optimizer)
        self.guard = guard
        self.loss_sum = step_fn.loss_sum  # a replay adds into the tensor the capture saw
        self.step = 0  # the step being run, read by the eager and the captured call
        self.graphed = GraphedStep(lambda *tensors: step_fn(
            self.step, list(zip(tensors[::2], tensors[1::2])), lambda phase: None))

    def __call__(self, step: int, micro_batches: list, mark=None) -> None:
        self.step = step
        self.lr.update()
        what, _ = self.graphed(*(t for batch in micro_batches for t in batch))
        if what != "eager":
            self.guard.replayed(step)
