"""sync=fsdp: torch's `fully_shard` (FSDP2), the reference for ZeRO-3 as sync=ddp is for all-reduce.

prepare(model)
    Rank 0's parameters and buffers are broadcast first (FSDP2 assumes equal replicas and makes
    none). Then `fully_shard` each module that holds parameters of its own, innermost first, and
    the root last: a unit is one module's parameters (a convolution's or a linear layer's weight
    and bias). Every parameter becomes a DTensor sharded on dim 0 over the ranks (`Shard(0)`,
    the last shard padded); this rank keeps only its rows.
the step
    Before a unit's forward its parameters are all-gathered, and freed after it
    (`sync.reshard_after_forward=true`; false keeps them until backward, one all-gather fewer a
    step, the whole model's weights held). Backward gathers each unit again and reduce-scatters
    its gradients: each rank gets the averaged gradient of its rows, as a DTensor `.grad`.
    Reductions are SUM then divide by N (`set_force_sum_reduction_for_comms`): gloo has no AVG,
    and it is our rule everywhere else (DESIGN.md).
everything else is torch's, on DTensors
    The optimizer holds the sharded parameters (its state is sharded alike); torch's
    `clip_grad_norm_` reduces the shards' norms over the ranks; `no_sync()` is
    `set_requires_gradient_sync(False)` (gradients accumulate unsharded, communicated at the last
    micro-step); fp16's GradScaler is ours for ZeRO (`ShardedScaler`: each rank sees only its
    shards' inf/NaN, the verdicts are all-reduced).
bytes
    Counted where FSDP hands each unit's flat buffer to the backend: our all-gather and
    reduce-scatter objects wrap FSDP's own (`set_custom_all_gather`/`_reduce_scatter`), so
    nothing about the collectives changes. (Not at the dispatcher, as sync=ddp counts
    ZeroRedundancyOptimizer's broadcasts around its step: FSDP communicates from hooks all
    through forward and backward, and a dispatch mode there would put a Python call on every op
    of the step it times.) Payload is the all-gather's output and the reduce-scatter's input
    (padding included), and bus bytes by nccl-tests' convention: payload x (N-1)/N for both,
    what a ring sends per rank. What the backend then moves is its own (gloo reduce-scatters
    with all-reduces: pytorch#149869). From one finish() to the next, as the other syncs count.
on CPU
    gloo runs it as it is in torch 2.14: it has the flat all-gather and reduce-scatter FSDP2
    calls. Not timed (comm_busy_ms is NaN) and not on train.trace's timeline: FSDP's collectives
    run inside its own hooks.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
from torch.distributed.fsdp._fully_shard._fsdp_collectives import (DefaultAllGather,
                                                                   DefaultReduceScatter)

from ddp_lab.dtypes import DTYPES
from ddp_lab.sync.base import GradSync
from ddp_lab.sync.config import SYNCS
from ddp_lab.sync.zero import ShardedScaler


class Handed:
    """Payload bytes handed to the backend since the last `take()`, by collective."""

    def __init__(self):
        self.all_gather = self.reduce_scatter = 0

    def take(self) -> tuple[int, int]:
        out, self.all_gather, self.reduce_scatter = (self.all_gather, self.reduce_scatter), 0, 0
        return out


class CountedAllGather(AllGather):
    """FSDP's own all-gather, counting the output buffer it fills (the whole unit)."""

    def __init__(self, handed: Handed):
        self.handed, self.inner = handed, DefaultAllGather()

    def allocate(self, size, *, dtype, device):
        return self.inner.allocate(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        self.handed.all_gather += output_tensor.numel() * output_tensor.element_size()
        return self.inner(output_tensor=output_tensor, input_tensor=input_tensor, group=group,
                          async_op=async_op)


class CountedReduceScatter(ReduceScatter):
    """FSDP's own reduce-scatter, counting the input buffer it reduces (the unit's gradients)."""

    def __init__(self, handed: Handed):
        self.handed, self.inner = handed, DefaultReduceScatter()

    def allocate(self, size, *, dtype, device):
        return self.inner.allocate(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        self.handed.reduce_scatter += input_tensor.numel() * input_tensor.element_size()
        return self.inner(output_tensor=output_tensor, input_tensor=input_tensor, group=group,
                          op=op, async_op=async_op)


@SYNCS.register("fsdp", reads=("reshard_after_forward", "comm_dtype"))
class FSDPSync(GradSync):
    forward_communicates = True
    name = "fsdp"

    def __init__(self, scfg, device: torch.device, world_size: int):
        self.device, self.world_size = device, world_size
        self.reshard_after_forward = bool(scfg.reshard_after_forward)
        self.reduce_dtype = None if scfg.comm_dtype == "fp32" else DTYPES[scfg.comm_dtype]
        self.handed = Handed()
        self.units: list[FSDPModule] = []  # innermost first, the root last
        self._last = (0, 0)  # (all-gather, reduce-scatter) payload bytes of the last step

    def prepare(self, model: nn.Module) -> nn.Module:
        with torch.no_grad():
            for t in [*model.parameters(), *model.buffers()]:
                dist.broadcast(t.detach(), src=0)
        mesh = init_device_mesh(self.device.type, (self.world_size,))
        policy = MixedPrecisionPolicy(reduce_dtype=self.reduce_dtype)
        leaves = [m for m in model.modules()
                  if m is not model and any(True for _ in m.parameters(recurse=False))]
        for module in [*reversed(leaves), model]:  # fully_shard wants the inner ones first
            fully_shard(module, mesh=mesh, reshard_after_forward=self.reshard_after_forward,
                        mp_policy=policy)
            module.set_custom_all_gather(CountedAllGather(self.handed))
            module.set_custom_reduce_scatter(CountedReduceScatter(self.handed))
            module.set_force_sum_reduction_for_comms(True)
            self.units.append(module)
        return model

    def build_optimizer(self, model: nn.Module, cls: type, kwargs: dict) -> torch.optim.Optimizer:
        """Over the DTensor parameters. torch has no DTensor rule for fused SGD
        (`aten._fused_sgd_`; fused AdamW has one): SGD runs foreach (check_sync refuses an
        explicit optim.impl=fused)."""
        if cls is torch.optim.SGD and kwargs.get("fused"):
            kwargs = dict(kwargs, fused=False, foreach=True)
        return cls(model.parameters(), **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Micro-steps that accumulate unsharded gradients, reduce-scattered at the last one."""
        self.units[-1].set_requires_gradient_sync(False)  # the root: every unit under it too
        try:
            yield
        finally:
            self.units[-1].set_requires_gradient_sync(True)

    def finish(self) -> None:
        self._last = self.handed.take()

    def grad_scaler(self, scaler: torch.amp.GradScaler) -> torch.amp.GradScaler:
        """ZeRO's (ddp_lab/sync/zero.py): torch's ShardedGradScaler, FSDP1's, also all-reduces
        the verdicts, but its found_inf does not fit fused AdamW's step on DTensors."""
        return ShardedScaler.like(scaler)

    # ---- checkpoints: DTensors, which DCP writes shard by shard and reshards on load ----

    def state_shards(self, model: nn.Module, optimizer) -> tuple[dict, dict]:
        """torch's sharded state dicts of the model and optimizer (DTensors, `step` a tensor
        per parameter), flattened to `model.<name>` and `optim.<name>.<state>`."""
        return _flat(*get_state_dict(model, optimizer)), {"world_size": self.world_size}

    def load_state_shards(self, model: nn.Module, optimizer, shards, layout: dict) -> None:
        """Into the state dicts torch makes for this model and optimizer (an optimizer not yet
        stepped gets its state made first, by a step of lr 0), in place: DCP reads the part of
        each DTensor this rank holds, whatever world size wrote it."""
        model_state, optim_state = get_state_dict(model, optimizer)
        shards.read(_flat(model_state, optim_state))
        set_state_dict(model, optimizer, model_state_dict=model_state,
                       optim_state_dict=optim_state)

    def comm_buffers(self):
        return None  # FSDP's gathered units and reduce buffers are its own: not counted

    def bytes_per_step(self) -> int:
        """Bus bytes of the last step (nccl-tests' convention; see the module)."""
        n = self.world_size
        return int(sum(self._last) * (n - 1) / n)

    def comm_stats(self) -> dict:
        all_gather, reduce_scatter = self._last
        return {**super().comm_stats(), "units": len(self.units),
                "reshard_after_forward": self.reshard_after_forward,
                "payload_bytes_per_step": all_gather + reduce_scatter,
                "all_gather_payload_bytes": all_gather,
                "reduce_scatter_payload_bytes": reduce_scatter,
                "bytes_per_step_is": "bus bytes by nccl-tests' convention: payload handed to the "
                                     "backend x (N-1)/N for all-gathers and reduce-scatters"}


def _flat(model_state: dict, optim_state: dict) -> dict:
    """The tensors of torch's model and optimizer state dicts by key (views of them, not copies:
    what DCP reads into them lands in the state dicts)."""
    tensors = {f"model.{k}": v for k, v in model_state.items()}
    for name, state in optim_state["state"].items():
        tensors.update({f"optim.{name}.{k}": v for k, v in state.items()})
    return tensors
