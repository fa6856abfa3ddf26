"""Error feedback: each rank keeps, per bucket, what compression left out of its gradient and adds
it to the next one (Seide et al. 2014; Karimireddy et al. 2019: biased compressors converge with
it). With x = g + e the gradient and what was kept, and `sent` what this step applied for it:

    e' = x - sent,  so  sent_1 + ... + sent_T + e_T = g_1 + ... + g_T  (nothing lost for good)
"""

from __future__ import annotations

import torch


class Feedback:
    """The kept errors of one compressor, by bucket key; off: nothing kept, nothing added."""

    def __init__(self, on: bool):
        self.on = on
        self.kept: dict[int, torch.Tensor] = {}

    def add(self, key: int, flat: torch.Tensor) -> torch.Tensor | None:
        """x = g + e in place in `flat`; returns a copy of x (to subtract what is sent from)."""
        if not self.on:
            return None
        if key in self.kept:
            flat.add_(self.kept[key])
        return flat.clone()

    def keep(self, key: int, x: torch.Tensor | None, sent: torch.Tensor,
             finite: torch.Tensor) -> None:
        """e = x - sent, for the next step (x as `add` returned it), where `finite` (a 0-dim bool
        tensor) holds; else the e kept before stays (none before: zeros, which add nothing).
        Chosen on the device by torch.where: a Python `if` on it would wait for a GPU every
        bucket."""
        if x is not None:
            e = x.sub_(sent)
            before = self.kept[key] if key in self.kept else e.new_zeros(())
            self.kept[key] = torch.where(finite, e, before, out=e)

    def state_dict(self) -> dict:
        return {str(k): v for k, v in self.kept.items()}

    def load_state_dict(self, state: dict) -> None:
        self.kept = {int(k): v.clone() for k, v in state.items()}
