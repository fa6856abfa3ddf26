"""Floating-point formats by the names configs use (`sync.comm_dtype`, the simulation's
`sim.grad_dtypes`): the torch dtype behind each name, and its size in bytes, from torch itself."""

from __future__ import annotations

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def element_size(name: str) -> int:
    """Bytes of one element of format `name` (fp32 4, bf16 and fp16 2)."""
    return DTYPES[name].itemsize
