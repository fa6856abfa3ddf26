"""The workload's memory: bytes for weights, gradients, optimizer states and master copies per
precision scheme, and per GPU under each ZeRO stage (`zero_bytes`); activation memory of a CNN
measured from the tensors autograd saves; the predicted peak of a training step, to hold against
`torch.cuda.max_memory_allocated`; and what a ddp_lab run should hold per rank (`predict_held`,
against what ddp_lab/held_memory.py counts).

Units: GB = 1e9 bytes (the seed articles' and the parameter-count arithmetic's unit). GPU memory
sizes sold as "80 GB" / "141 GB" are closer to GiB (an A100 80GB has 80 GiB = 85.9e9 B); counting
them as 1e9-byte GB is the conservative side, and the CUDA context takes some of it anyway.

What is left out, on purpose, and comes on top of every number here: activations of models we
only know by parameter count (they depend on batch, sequence length, checkpointing), KV caches,
temporary buffers and library workspaces (cuBLAS/cuDNN), NCCL buffers, and allocator fragmentation
(typically 5-30%).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ddp_lab import buckets
from ddp_lab.compress.powersgd import as_matrix

GB = 1e9

BYTES = {"fp64": 8, "fp32": 4, "tf32": 4, "fp16": 2, "bf16": 2, "int8": 1, "int4": 0.5}

# Optimizer state tensors per parameter.
OPTIMIZER_STATES = {"sgd": 0, "sgd_momentum": 1, "adam": 2, "adamw": 2}


@dataclass(frozen=True)
class Scheme:
    """Bytes per parameter of one way of training."""

    weights: float  # the weights the forward uses (persistent)
    grads: float
    state: float  # per optimizer state tensor
    master: float  # fp32 master copy of the weights (mixed precision)
    transient: float  # 16-bit weight copies autocast makes for the forward/backward
    what: str


SCHEMES = {
    "fp32": Scheme(4, 4, 4, 0, 0, "fp32 weights, grads and optimizer states (TF32 is the same)"),
    "mixed": Scheme(2, 2, 4, 4, 0, "16-bit weights + grads, fp32 master copy and optimizer states "
                                  "(Megatron/DeepSpeed mixed precision: 16 B/param with Adam)"),
    "torch_amp": Scheme(4, 4, 4, 0, 2, "torch.autocast (ddp_lab precision=bf16|fp16): fp32 "
                                       "weights/grads/states, + 16-bit weight copies per step"),
    "bf16": Scheme(2, 2, 2, 0, 0, "pure bf16: weights, grads and optimizer states in bf16, "
                                  "no master copy"),
}

# ddp_lab's precision= option -> the scheme it trains with.
PRECISION_SCHEME = {"fp32": "fp32", "tf32": "fp32", "fp16": "torch_amp", "bf16": "torch_amp"}


def training_bytes(params: float, scheme: str = "fp32", optimizer: str = "sgd_momentum") -> dict:
    """Bytes of the training state of `params` parameters: weights, grads, optimizer states,
    master copies (+ autocast's transient copies, counted separately). Activations not included.

    1e9 parameters, fp32 + SGD momentum: 4 + 4 + 4 = 12 B/param = 12 GB.
    Mixed precision + Adam: 2 + 2 + 4 (master) + 4 + 4 (Adam m, v) = 16 B/param."""
    if scheme not in SCHEMES:
        raise ValueError(f"unknown scheme {scheme!r}; one of {', '.join(SCHEMES)}")
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"unknown optimizer {optimizer!r}; one of {', '.join(OPTIMIZER_STATES)}")
    s = SCHEMES[scheme]
    out = {"weights": params * s.weights, "grads": params * s.grads,
           "optimizer": params * s.state * OPTIMIZER_STATES[optimizer],
           "master": params * s.master, "transient": params * s.transient}
    out["total"] = out["weights"] + out["grads"] + out["optimizer"] + out["master"]
    out["bytes_per_param"] = out["total"] / params if params else 0.0
    return out


ZERO_STAGES = (0, 1, 2, 3)


def zero_bytes(params: float, stage: int, world_size: int, scheme: str = "mixed",
               optimizer: str = "adam") -> dict:
    """Bytes per GPU of the training state under ZeRO stage `stage` on `world_size` GPUs (the
    Ultra-Scale Playbook's table): stage 1 shards the optimizer states and master copies, 2 the
    gradients too, 3 the weights too (ZeRO-3 / FSDP); 0 is plain data parallelism.
    Mixed precision + Adam, P params: 0: 16P; 1: 4P + 12P/N; 2: 2P + 14P/N; 3: 16P/N."""
    if stage not in ZERO_STAGES:
        raise ValueError(f"ZeRO stage must be one of {ZERO_STAGES}, got {stage}")
    b = training_bytes(params, scheme, optimizer)
    split = {k: b[k] / world_size if stage >= first else b[k] for k, first in
             (("optimizer", 1), ("master", 1), ("grads", 2), ("weights", 3))}
    split["total"] = sum(split.values())
    return split


def gpus_for_zero(params: float, stage: int, gpu_gb: float, scheme: str = "mixed",
                  optimizer: str = "adam") -> int | None:
    """The fewest GPUs of `gpu_gb` GB whose per-GPU share at ZeRO `stage` fits (training state
    only: activations come on top); None when no number does (what stays whole is too big)."""
    b = training_bytes(params, scheme, optimizer)
    whole = sum(b[k] for k, first in (("optimizer", 1), ("master", 1), ("grads", 2),
                                       ("weights", 3)) if stage < first)
    sharded = b["total"] - whole
    room = gpu_gb * GB - whole
    if room <= 0:
        return None
    return max(1, math.ceil(sharded / room)) if sharded else 1


def inference_bytes(params: float, dtype: str = "bf16") -> float:
    """Bytes of the weights alone in `dtype` (no activations, no KV cache)."""
    return params * BYTES[dtype]


def gpus_needed(total_bytes: float, gpu_gb: float) -> int:
    """GPUs of `gpu_gb` GB that can hold `total_bytes` if it is split perfectly across them
    (ZeRO-3/FSDP sharding, or tensor/pipeline parallelism). A lower bound: activations,
    workspaces and fragmentation come on top, and plain data parallelism (DDP) splits nothing:
    every replica must hold everything."""
    return max(1, math.ceil(total_bytes / (gpu_gb * GB)))


# ---- parameter counts ----------------------------------------------------------------------

def transformer_params(layers: int, d_model: int, vocab: int, d_ff: int | None = None,
                       kv_dim: int | None = None, gated: bool = False, tied: bool = True,
                       positions: int = 0) -> int:
    """Parameters of a decoder-only transformer from its shape (biases and norms included only
    approximately: they are < 0.1%). Attention: q, o of d x d, k, v of d x kv_dim; MLP: 2 (or 3
    when gated, SwiGLU) matrices of d x d_ff; embeddings (tied or not) and learned positions."""
    d_ff = d_ff or 4 * d_model
    kv_dim = kv_dim or d_model
    attn = 2 * d_model * d_model + 2 * d_model * kv_dim
    mlp = (3 if gated else 2) * d_model * d_ff
    norms_biases = 4 * d_model + (0 if gated else d_ff + 4 * d_model)
    embed = vocab * d_model * (1 if tied else 2) + positions * d_model
    return layers * (attn + mlp + norms_biases) + embed


# Named models the seed articles use: the nominal count (what the table is computed with) and
# the count from the published architecture.
PRESETS = {
    "gpt3_175b": (175e9, transformer_params(96, 12288, 50257, positions=2048)),
    "llama2_70b": (70e9, transformer_params(80, 8192, 32000, d_ff=28672, kv_dim=1024,
                                            gated=True, tied=False)),
    "llama2_7b": (7e9, transformer_params(32, 4096, 32000, d_ff=11008, gated=True, tied=False)),
}


def count_parameters(name: str, num_classes: int | None = None) -> int:
    """Parameters of a preset (gpt3_175b, llama2_70b, llama2_7b: nominal count), a ddp_lab model
    (alexnet, alexnet_cifar) or any torchvision classification model, built on the meta device."""
    if name in PRESETS:
        return int(PRESETS[name][0])
    return sum(p.numel() for p in build_meta_model(name, num_classes).parameters())


def build_meta_model(name: str, num_classes: int | None = None) -> nn.Module:
    from ddp_lab.models import MODELS

    with torch.device("meta"):
        if name in MODELS:
            return MODELS[name](num_classes=num_classes or (1000 if name == "alexnet" else 10))
        import torchvision

        if name not in torchvision.models.list_models():
            raise ValueError(f"unknown model {name!r}: not a preset ({', '.join(PRESETS)}), a "
                             "ddp_lab model or a torchvision model name")
        kwargs = {"num_classes": num_classes} if num_classes else {}
        return torchvision.models.get_model(name, weights=None, **kwargs)


# ---- activations and the peak of a training step -----------------------------------------------

def saved_tensor_bytes(model: nn.Module, x: torch.Tensor, autocast_dtype: torch.dtype | None,
                       exclude: tuple[torch.Tensor, ...] = ()) -> int:
    """Bytes of the distinct tensors autograd saves for backward during one forward + loss of
    `model` on `x` (counted once per storage, through `torch.autograd.graph.saved_tensors_hooks`),
    leaving out the storages of the parameters and of `exclude` (the input), which live anyway."""
    skip = {p.untyped_storage().data_ptr() for p in model.parameters()}
    skip |= {t.untyped_storage().data_ptr() for t in exclude}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        st = t.untyped_storage()
        if st.data_ptr() not in skip:
            seen[st.data_ptr()] = max(seen.get(st.data_ptr(), 0), st.nbytes())
        return t

    ctx = (torch.autocast(x.device.type, dtype=autocast_dtype) if autocast_dtype is not None
           else torch.autocast(x.device.type, enabled=False))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), ctx:
        out = model(x)
        loss = F.cross_entropy(out.float(), torch.zeros(len(x), dtype=torch.long, device=x.device))
    del loss, out
    return sum(seen.values())


def activation_bytes(model: nn.Module, input_shape: tuple[int, ...],
                     autocast_dtype: torch.dtype | None = None,
                     channels_last: bool = False) -> tuple[float, float]:
    """(bytes per sample, bytes independent of the batch) that autograd keeps for backward.

    Measured, not modelled: one forward at batch 1 and one at batch 2 on the CPU (real tensors,
    so storages can be told apart), then a line through the two points. The slope is the
    activations (conv/linear inputs, ReLU outputs, pool indices, dropout masks, ...); the
    intercept is what does not grow with the batch, under autocast the 16-bit weight copies that
    backward needs (the others are freed when the autocast region ends). The saved set is the same
    on CUDA but for details: both max-pools save int64 indices, but the CPU's dropout keeps a float
    mask where CUDA keeps a bool one (3 B more per dropout input element here: a small share of
    224 px AlexNet's activations, a larger one of AlexNet-CIFAR's)."""
    import copy

    model = copy.deepcopy(model).to("cpu").train()
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    model = model.to(memory_format=fmt)
    sizes = []
    for b in (1, 2):
        x = torch.randn(b, *input_shape).contiguous(memory_format=fmt)
        sizes.append(saved_tensor_bytes(model, x, autocast_dtype, exclude=(x,)))
    per_sample = float(sizes[1] - sizes[0])
    return per_sample, float(sizes[0] - per_sample)


AUTOCAST = {"fp32": None, "tf32": None, "fp16": torch.float16, "bf16": torch.bfloat16}


def predict_training_memory(model: nn.Module, batch: int, image_size: int, precision: str = "fp32",
                            optimizer: str = "sgd_momentum", channels_last: bool = False,
                            activations: tuple[float, float] | None = None) -> dict:
    """Predicted bytes of one training step of an image model at `batch` under ddp_lab's
    `precision` (fp32 | tf32 | fp16 | bf16; the 16-bit ones are torch autocast): the training
    state, the 16-bit weight copies, the input batch and the saved activations. Their sum is the
    prediction for `torch.cuda.max_memory_allocated` over a step (grads are counted whole: in
    AlexNet most parameters sit in the last layers, whose gradients exist while nearly all
    activations are still held); workspaces and temporaries make the measured peak differ."""
    params = sum(p.numel() for p in model.parameters())
    state = training_bytes(params, PRECISION_SCHEME[precision], optimizer)
    per_sample, fixed = activation_bytes(model, (3, image_size, image_size), AUTOCAST[precision],
                                         channels_last)
    out = {"params": params, "weights": state["weights"], "grads": state["grads"],
           "optimizer": state["optimizer"], "autocast_copies": max(fixed, 0.0),
           "input": batch * 3 * image_size * image_size * 4 + batch * 8,
           "activations": per_sample * batch, "activations_per_sample": per_sample}
    out["total"] = sum(out[k] for k in ("weights", "grads", "optimizer", "autocast_copies",
                                         "input", "activations"))
    return out


# ---- what a training run should hold (held_memory.py counts what it does) ------------------

def predict_held(numels: Sequence[int], world_size: int, rank: int, sync: str, zero: int,
                 states: int, bucket_mb: float, comm_elem: int, overlap: bool,
                 scratch_numel: Callable | None = None, elem: int = 4,
                 units: Sequence[int] | None = None, reshard_after_forward: bool = True,
                 compress_numel: int | None = 0) -> dict:
    """The most rank `rank` of a ddp_lab run should hold in a step, by design (fp32 parameters:
    precision=bf16|fp16 autocasts, it does not store 16-bit copies): parameters of `numels`
    elements (registration order), `states` optimizer tensors per element, on `world_size` ranks.
    What held_memory.py counts at its points, the largest of them.
      ours (naive|ring|tree): zero=0 parameters P, gradients P, buckets P (a flat copy to
        all-reduce). zero>=1 state P/N; gradients P/N (the shards') plus those made and not yet
        packed (`_in_step`); buckets P at zero=1, the IN_FLIGHT largest at zero>=2 (the
        pool). zero=3 (`units`: each unit's elements, forward order) parameters P/N plus the
        units gathered at that moment. Receive scratch: the most any bucket's reduction keeps
        (`scratch_numel`: ddp_lab.comm's, per algorithm), on the communication thread with
        overlap; at zero=1|2 the parameters' all-gather's on the training thread (one buffer for
        both where the thread and the dtype are the same; zero=3: always one thread).
      ddp: gradients P; its buckets and scratch are inside its C++ reducer and the backend (None:
        not counted); zero=1 state P/N (ZeroRedundancyOptimizer assigns whole parameters: a
        rank's share can be uneven).
      fsdp: torch's fully_shard: parameters, gradients and state P/N each (every parameter's
        dim 0 cut in N, the last piece padded); its gathered units and reduce buffers are its own
        (None: not counted).
    Compression's kept state: `compress_numel` elements of the buckets' dtype (None: not
    counted). AdamW's step counters (4 B per tensor) are left out."""
    n, p = world_size, sum(numels) * elem
    compressed = None if compress_numel is None else compress_numel * comm_elem
    if sync == "fsdp":
        return {"params_bytes": p / n, "grads_bytes": p / n, "optimizer_state_bytes": states * p / n,
                "comm_buffer_bytes": None, "comm_scratch_bytes": None,
                "compress_state_bytes": compressed}
    sharded = zero >= 1
    state = states * p / (n if sharded else 1)
    if sync in ("ddp", "none"):
        return {"params_bytes": p, "grads_bytes": p, "optimizer_state_bytes": state,
                "comm_buffer_bytes": None if sync == "ddp" else 0,
                "comm_scratch_bytes": None if sync == "ddp" else 0,
                "compress_state_bytes": compressed}
    sizes = list(units)[::-1] if zero == 3 else [  # backward's order, as the sync cuts them
        sum(numels[::-1][i] for i in g)
        for g in buckets.plan([k * comm_elem for k in numels[::-1]], bucket_mb, "ours")]
    params, grads = _in_step(sizes, n, zero, overlap, reshard_after_forward)
    reduce_op = "all_reduce" if zero < 2 else "reduce_scatter"
    reduce = max(scratch_numel(sync, reduce_op, b, n, rank, comm_elem) for b in sizes) * comm_elem
    gather = max(scratch_numel(sync, "all_gather", b, n, rank, elem)
                 for b in sizes) * elem if sharded else 0
    one_thread = zero == 3 or not overlap
    return {"params_bytes": params * elem, "grads_bytes": grads * elem,
            "optimizer_state_bytes": state,
            "comm_buffer_bytes": sum(sorted(sizes)[-buckets.IN_FLIGHT:] if zero >= 2 else sizes)
            * comm_elem,
            "comm_scratch_bytes": max(reduce, gather) if one_thread and comm_elem == elem
            else reduce + gather,
            "compress_state_bytes": compressed}


def compress_state_numel(bucket_shapes: Sequence[Sequence[tuple]], compress: str, rank: int,
                         min_rate: float, error_feedback: bool) -> int:
    """Elements a compressor keeps from step to step, by design (ddp_lab/compress): with error
    feedback each bucket's own; PowerSGD also each compressed matrix's Q, cols x r (which
    matrices, and their shapes: `as_matrix`, as PowerSGD cuts them). `bucket_shapes`: each bucket's parameter shapes."""
    kept = 0
    for shapes in bucket_shapes:
        kept += sum(math.prod(s) for s in shapes) if error_feedback else 0
        for shape in shapes if compress == "powersgd" else ():
            _, cols, r, compressed = as_matrix(shape, rank, min_rate)
            kept += cols * r if compressed else 0
    return kept


def _in_step(sizes: Sequence[int], n: int, zero: int, overlap: bool,
             reshard_after_forward: bool) -> tuple[float, float]:
    """(parameter, gradient) elements held at the moment of a step that holds the most, buckets
    (ZeRO-3: units) of `sizes` elements in backward order. zero>=1 releases a bucket's gradients
    when it packs it (in bucket order: as backward makes them with overlap, all in finish()
    without), zero=3 a unit's parameters after its forward (reshard_after_forward) and after its
    backward; with overlap the next unit is gathered ahead (prefetch)."""
    whole = sum(sizes)
    if zero == 0:
        return whole, whole
    made = lambda j: sizes[j] if overlap else sum(sizes[:j + 1])  # gradients not yet packed
    if zero < 3:
        return whole, whole / n + (max(sizes) if overlap else whole)
    ahead = lambda units, i: units[i + 1] if overlap and i + 1 < len(units) else 0  # prefetched
    forward = sizes[::-1]
    moments = [(forward[i] + ahead(forward, i), 0) for i in range(len(forward))
               if reshard_after_forward]  # before each unit is freed after its forward
    moments += [(sizes[j] + ahead(sizes, j) if reshard_after_forward else sum(sizes[j:]), made(j))
                for j in range(len(sizes))]  # once each unit's gradients are all made
    gathered, grads = max(moments, key=sum)
    return whole / n + gathered, whole / n + grads
