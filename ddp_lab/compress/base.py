"""What every compressor is given and keeps (ddp_lab/compress/__init__.py says what they do)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ddp_lab.registry import Registry

COMPRESSORS = Registry("gradient compressor", "sync.compress")


@dataclass(frozen=True)
class Ops:
    """The collectives a compressor may run on a bucket, as the sync runs its own: its algorithm,
    its group, the Recorder counting every byte."""
    world_size: int
    all_reduce: Callable[[torch.Tensor], object]  # sum in place over the ranks
    all_gather: Callable[[torch.Tensor, torch.Tensor], object]  # (this rank's piece, whole)


class Compressor:
    """The interface: see the package docstring."""

    @classmethod
    def from_config(cls, scfg) -> "Compressor":
        """One built from the sync group's keys (sync.compress_rank, sync.topk_fraction, ...)."""
        raise NotImplementedError

    def reduce(self, key: int, flat: torch.Tensor, shapes: list[torch.Size], ops: Ops) -> None:
        raise NotImplementedError

    def kept(self) -> list[torch.Tensor]:
        """The tensors kept from one step to the next (error feedback's; PowerSGD's Q)."""
        return list(self.feedback.kept.values())

    def state_dict(self) -> dict:
        raise NotImplementedError

    def load_state_dict(self, state: dict) -> None:
        raise NotImplementedError
