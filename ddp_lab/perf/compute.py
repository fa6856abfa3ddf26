"""The workload's compute: FLOPs per image (counted, and analytic for plain CNNs), each layer's
parameters and FLOPs (`profile_model`: what the step model cuts into buckets and walks backward
through), achieved TFLOP/s and MFU against a peak (datasheet, or measured by `ddp_lab.bench.gemm`).

    python -m ddp_lab.perf.compute            # FLOPs of both AlexNets, counted vs analytic

Conventions, the same everywhere here:
- A FLOP is one multiply or one add: a multiply-accumulate (MAC) is 2 FLOPs. The seed article's
  "AlexNet is about 0.7 GFLOPs per image forward" counts MACs; torchvision's AlexNet is 0.714 GMAC
  = 1.43 GFLOP forward.
- Only convolutions and matrix products are counted (what `torch.utils.flop_counter` counts):
  bias adds, ReLU, pooling, dropout, softmax/cross-entropy and the optimizer are left out. They
  are memory-bound and well under 1% of AlexNet's arithmetic (ReLU is one op per activation; a
  convolution is 2*Cin*k*k ops per output).
- Backward = gradient w.r.t. the weights (as many FLOPs as forward) + gradient w.r.t. the layer's
  input (as many again), except the first layer, whose input (the images) needs no gradient. So a
  training step is 3 x forward - forward(first layer): 4.14 GFLOP per 224 px AlexNet image, the
  issue's anchor.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class Flops:
    """FLOPs per image."""

    forward: float
    backward: float

    @property
    def step(self) -> float:
        """A training step: forward + backward (the optimizer's few FLOPs per parameter left out)."""
        return self.forward + self.backward


def count_flops(model: nn.Module, input_shape: tuple[int, ...], batch: int = 2,
                device: str | torch.device = "meta") -> Flops:
    """FLOPs per image of `model` on inputs of `input_shape` (C, H, W), counted by
    `torch.utils.flop_counter.FlopCounterMode` over a forward and a backward of cross-entropy.

    On the meta device by default: the counter needs only shapes, so nothing is computed (a model
    with real weights is copied to meta first, the original is left alone)."""
    from torch.utils.flop_counter import FlopCounterMode

    device = torch.device(device)
    if device.type == "meta" and any(p.device.type != "meta" for p in model.parameters()):
        import copy

        model = copy.deepcopy(model).to("meta")
    model = model.to(device)
    x = torch.randn(batch, *input_shape, device=device)
    with FlopCounterMode(display=False) as fwd_counter:
        out = model(x)
    forward = fwd_counter.get_total_flops()
    target = torch.zeros(batch, dtype=torch.long, device=device)
    with FlopCounterMode(display=False) as bwd_counter:
        F.cross_entropy(out.float(), target).backward()
    backward = bwd_counter.get_total_flops()
    model.zero_grad(set_to_none=True)
    return Flops(forward / batch, backward / batch)


def analytic_flops(model: nn.Module, image_size: int, in_channels: int = 3) -> tuple[Flops, list[dict]]:
    """FLOPs per image from the layer shapes alone, for feed-forward CNNs whose modules are
    registered in execution order (both AlexNets, VGG): Conv2d, pooling, Linear; shape-preserving
    layers (ReLU, Dropout, ...) are passed over. Returns (Flops, one dict per counted layer).

    conv: 2 * Cout * Hout * Wout * (Cin / groups) * kh * kw; linear: 2 * in * out. Backward:
    2 x forward for every layer but the first (no gradient for the images), which gets 1 x."""
    c, h, w = in_channels, image_size, image_size
    features = None  # flattened size once we reach the classifier
    layers: list[dict] = []
    for name, m in model.named_modules():
        if list(m.children()):
            continue  # containers: their leaves come next, in order
        if isinstance(m, nn.Conv2d):
            if c != m.in_channels:
                raise ValueError(f"{name}: expects {m.in_channels} channels, gets {c}")
            kh, kw = m.kernel_size
            h = (h + 2 * m.padding[0] - m.dilation[0] * (kh - 1) - 1) // m.stride[0] + 1
            w = (w + 2 * m.padding[1] - m.dilation[1] * (kw - 1) - 1) // m.stride[1] + 1
            c = m.out_channels
            flops = 2 * c * h * w * (m.in_channels // m.groups) * kh * kw
            layers.append({"layer": name, "kind": "conv", "out": f"{c}x{h}x{w}", "forward": flops})
        elif isinstance(m, (nn.MaxPool2d, nn.AvgPool2d)):
            k, s, p = (_pair(m.kernel_size), _pair(m.stride or m.kernel_size), _pair(m.padding))
            ceil = getattr(m, "ceil_mode", False)
            rnd = math.ceil if ceil else math.floor
            h = rnd((h + 2 * p[0] - k[0]) / s[0]) + 1
            w = rnd((w + 2 * p[1] - k[1]) / s[1]) + 1
        elif isinstance(m, nn.AdaptiveAvgPool2d):
            h, w = _pair(m.output_size)
        elif isinstance(m, nn.Linear):
            features = features if features is not None else c * h * w
            if features != m.in_features:
                raise ValueError(f"{name}: expects {m.in_features} inputs, gets {features}")
            features = m.out_features
            layers.append({"layer": name, "kind": "linear", "out": str(features),
                           "forward": 2 * m.in_features * m.out_features})
        elif any(True for _ in m.parameters(recurse=False)):
            raise ValueError(f"{name}: {type(m).__name__} has parameters and is not counted here")
    if not layers:
        raise ValueError("no Conv2d or Linear layers found")
    forward = sum(l["forward"] for l in layers)
    backward = 2 * forward - layers[0]["forward"]
    return Flops(forward, backward), layers


def _pair(v) -> tuple[int, int]:
    return tuple(v) if isinstance(v, (tuple, list)) else (v, v)


# ---- per-layer parameters and FLOPs ---------------------------------------------------------

@dataclass(frozen=True)
class Layer:
    name: str
    params: tuple[int, ...]  # numel of each parameter the layer owns, registration order
    flops: float  # forward FLOPs per image (2 per multiply-add)


@dataclass(frozen=True)
class ModelProfile:
    name: str
    image_size: int
    layers: tuple[Layer, ...]  # in forward (execution) order

    @property
    def parameters(self) -> int:
        return sum(sum(layer.params) for layer in self.layers)

    @property
    def flops_per_image(self) -> float:
        return sum(layer.flops for layer in self.layers)

    def gradients_in_backward_order(self) -> list[tuple[int, float]]:
        """(numel, ready_fraction) per parameter, in the order backward produces them: the
        fraction of the backward time (~ the forward FLOPs) done when its gradient exists."""
        total = self.flops_per_image or 1.0
        done, out = 0.0, []
        for layer in reversed(self.layers):
            done += layer.flops
            out.extend((numel, done / total) for numel in reversed(layer.params))
        return out


MODEL_DEFAULTS = {  # name -> (image size, classes)
    "alexnet": (224, 1000), "alexnet_cifar": (32, 10), "resnet50": (224, 1000),
    "resnet101": (224, 1000), "vgg16": (224, 1000),
}
_PROFILES: dict[tuple, ModelProfile] = {}


def profile_model(name: str, image_size: int | None = None,
                  num_classes: int | None = None, fc_width: int = 4096) -> ModelProfile:
    """Parameters and forward FLOPs of every layer, from one forward pass on the meta device (no
    memory, no compute). Knows the lab's models and torchvision's resnet50/resnet101/vgg16."""
    size, classes = MODEL_DEFAULTS.get(name, (image_size, num_classes))
    size, classes = image_size or size, num_classes or classes
    key = (name, size, classes, fc_width)
    if key in _PROFILES:
        return _PROFILES[key]
    with torch.device("meta"):
        if name in ("alexnet", "alexnet_cifar"):
            from ddp_lab.models import build_model
            model = build_model(name, classes, 0.0, fc_width=fc_width)
        elif name in ("resnet50", "resnet101", "vgg16"):
            import torchvision
            model = getattr(torchvision.models, name)(weights=None, num_classes=classes)
        else:
            raise ValueError(f"unknown model {name!r}: expected one of {', '.join(MODEL_DEFAULTS)}")
    layers: list[Layer] = []
    seen: set[int] = set()

    def hook(module, inputs, output):
        if id(module) in seen:
            return
        seen.add(id(module))
        if isinstance(module, nn.Conv2d):
            k = module.in_channels // module.groups * module.kernel_size[0] * module.kernel_size[1]
            flops = 2.0 * output.numel() * k
        elif isinstance(module, nn.Linear):
            flops = 2.0 * output.numel() * module.in_features
        else:
            flops = 0.0
        params = tuple(p.numel() for p in module.parameters(recurse=False) if p.requires_grad)
        if flops or params:
            layers.append(Layer(module_names[id(module)], params, flops))

    module_names = {id(m): n for n, m in model.named_modules()}
    handles = [m.register_forward_hook(hook) for m in model.modules()
               if not list(m.children())]
    with torch.no_grad():
        model(torch.empty(1, 3, size, size, device="meta"))
    for h in handles:
        h.remove()
    profile = ModelProfile(name, size, tuple(layers))
    assert profile.parameters == sum(p.numel() for p in model.parameters() if p.requires_grad)
    _PROFILES[key] = profile
    return profile


# ---- peaks, achieved TFLOP/s, MFU -------------------------------------------------------------

# Datasheet peaks, dense (no 2:4 sparsity), TFLOP/s, SXM boards unless named. fp32 is the
# CUDA-core rate; fp64 (DGEMM on DMMA tensor cores from A100 on), tf32, fp16 and bf16 are tensor-core
# rates (fp16/bf16 with fp32 accumulation).
# Sources: NVIDIA H100/H200 and A100 datasheets. These are marketing upper bounds at boost clock;
# `ddp_lab.bench.gemm` measures what a GEMM really reaches, which is less.
DATASHEET_PEAKS = {
    "H200": {"fp64": 67.0, "fp32": 67.0, "tf32": 494.7, "fp16": 989.4, "bf16": 989.4},
    "H100 SXM": {"fp64": 67.0, "fp32": 67.0, "tf32": 494.7, "fp16": 989.4, "bf16": 989.4},
    "H100 PCIe": {"fp64": 51.0, "fp32": 51.0, "tf32": 378.0, "fp16": 756.0, "bf16": 756.0},
    "A100": {"fp64": 19.5, "fp32": 19.5, "tf32": 156.0, "fp16": 312.0, "bf16": 312.0},
    "V100": {"fp64": 7.8, "fp32": 15.7, "fp16": 125.0},
}


def device_family(device_name: str) -> str | None:
    """'NVIDIA H200' -> 'H200'; None for devices without a datasheet row (CPUs, others)."""
    name = device_name.upper()
    if "H200" in name:
        return "H200"
    if "H100" in name:
        return "H100 PCIe" if "PCIE" in name else "H100 SXM"
    for fam in ("A100", "V100"):
        if fam in name:
            return fam
    return None


def datasheet_peak(device_name: str, precision: str) -> float:
    """Datasheet TFLOP/s for `precision` (fp32 | tf32 | fp16 | bf16) on the named device; nan
    where unknown. Mixed precision (autocast) runs its matmuls and convolutions in 16 bits, so its
    peak is the 16-bit one."""
    fam = device_family(device_name)
    if fam is None:
        return float("nan")
    return DATASHEET_PEAKS[fam].get(precision, float("nan"))


def measured_peaks(gemm_jsonl: str, device_type: str = "cuda") -> dict[str, float]:
    """Best TFLOP/s per dtype on `device_type` from a `ddp_lab.bench.gemm` gemm.jsonl (only rows
    whose result checked out)."""
    best: dict[str, float] = {}
    with open(gemm_jsonl) as f:
        for line in f:
            row = json.loads(line)
            if row.get("device") != device_type or not row.get("ok", True):
                continue
            best[row["dtype"]] = max(best.get(row["dtype"], 0.0), float(row["tflops"]))
    return best


def achieved_tflops(flops_per_image: float, img_per_s: float) -> float:
    return flops_per_image * img_per_s / 1e12


def mfu(achieved: float, peak: float) -> float:
    """Model FLOPs utilisation: achieved / peak (nan when the peak is unknown)."""
    return achieved / peak if peak and peak == peak and peak > 0 else float("nan")


def _main() -> None:
    from ddp_lab.models import build_model
    from ddp_lab.tables import format_table

    rows = []
    for name, size, classes in (("alexnet", 224, 1000), ("alexnet_cifar", 32, 10)):
        model = build_model(name, classes, 0.5)
        counted = count_flops(model, (3, size, size))
        analytic, _ = analytic_flops(model, size)
        rows.append({"model": name, "image": size, "params_m": sum(p.numel() for p in model.parameters()) / 1e6,
                     "fwd_gflop": counted.forward / 1e9, "bwd_gflop": counted.backward / 1e9,
                     "step_gflop": counted.step / 1e9, "analytic_step_gflop": analytic.step / 1e9,
                     "fwd_gmac": counted.forward / 2e9})
    print(format_table(rows))


if __name__ == "__main__":
    _main()
