"""The tensors alive at the peak of a training step, counted by torch's own MemTracker on fake
tensors (no memory is allocated and no arithmetic done), for a model at the real batch size:

    python scripts/step_tensor_peak.py OUT.json [--model alexnet] [--batch 256] [--channels-last]

It runs two steps of forward, cross-entropy, backward and AdamW (fp32, the CPU's kernels' output
shapes) under `torch.distributed._tools.mem_tracker.MemTracker` and writes the second step's
peak by category (parameters, gradients, activations, temporaries, optimizer state), in bytes,
beside ddp_lab's own prediction of the activations (`ddp_lab.perf.memory.activation_bytes`).
Library workspaces (cuDNN, cuBLAS) are not tensors and are not in it: on the GPU, what the
allocator's peak holds beyond this count is theirs. Only fp32 is counted: the CPU's autocast
keeps other dtypes than CUDA's.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker

from ddp_lab.perf.compute import MODEL_DEFAULTS
from ddp_lab.perf.memory import activation_bytes, build_meta_model


def tensor_peak(model_name: str, batch: int, channels_last: bool) -> dict[str, int]:
    """The second step's peak, bytes per MemTracker category."""
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    size, classes = MODEL_DEFAULTS[model_name]
    # The parameters are real (a module cannot be converted once its tensors are fake); every
    # tensor the steps make is fake.
    model = build_meta_model(model_name).to_empty(device="cpu").to(memory_format=fmt)
    with FakeTensorMode(allow_non_fake_inputs=True):
        optimizer = torch.optim.AdamW(model.parameters(), foreach=False)
        x = torch.randn(batch, 3, size, size).contiguous(memory_format=fmt)
        y = torch.randint(0, classes, (batch,))
        tracker = MemTracker()
        tracker.track_external(model, optimizer)
        with tracker:
            for step in range(2):
                F.cross_entropy(model(x), y).backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                if step == 0:  # the first step makes the optimizer state; the second is a step
                    tracker.reset_mod_stats()
        peak = tracker.get_tracker_snapshot("peak")
    (per_device,) = peak.values()
    return {str(kind).split(".")[-1].lower(): int(n) for kind, n in per_device.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out")
    parser.add_argument("--model", default="alexnet", choices=["alexnet", "alexnet_cifar"])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--channels-last", action="store_true")
    a = parser.parse_args()
    counted = tensor_peak(a.model, a.batch, a.channels_last)
    size = MODEL_DEFAULTS[a.model][0]
    per_sample, fixed = activation_bytes(build_meta_model(a.model).to_empty(device="cpu"),
                                         (3, size, size), None, a.channels_last)
    row = {"model": a.model, "batch": a.batch, "channels_last": a.channels_last,
           "torch": torch.__version__, "peak_bytes": counted,
           "predicted_activations_bytes": int(per_sample * a.batch + fixed)}
    with open(a.out, "w") as f:
        json.dump(row, f, indent=1)
    print(json.dumps(row, indent=1))


if __name__ == "__main__":
    main()
