"""The contract between the training loop and a gradient synchroniser.

The loop does, every step:
    with sync.no_sync():  ... forward + backward ...   # every micro-step but the last
    ... forward + backward ...                         # last micro-step: communication starts
    sync.finish()                                      # grads are now averaged over all ranks
and never asks which algorithm it is talking to.
"""

from __future__ import annotations

import contextlib

from torch import nn


class GradSync:
    name = "base"
    tracer = None  # train.trace: a ddp_lab.trace.Tracer the sync stamps its communication into

    def _tracing(self) -> bool:
        return self.tracer is not None and self.tracer.step is not None

    def prepare(self, model: nn.Module) -> nn.Module:
        """Make replicas equal (broadcast from rank 0) and install hooks; return the module to call."""
        raise NotImplementedError

    def no_sync(self):
        """Micro-steps inside this context accumulate gradients locally without communicating."""
        return contextlib.nullcontext()

    def finish(self) -> None:
        """Block (the optimizer) until every gradient is averaged across ranks."""

    def bytes_per_step(self) -> int:
        """Bytes this rank sends per synchronised step (0 where the sync cannot count them)."""
        return 0

    # ---- optional measurements, for the scaling work (safe defaults) ----

    def comm_busy_ms(self) -> float:
        """Milliseconds spent communicating in the last synchronised step (NaN if not measured).
        With bytes_per_step() it gives the achieved bandwidth: bytes / busy time."""
        return float("nan")

    def comm_stats(self) -> dict:
        """Everything the sync measured about its communication, as plain data."""
        return {"bytes_per_step": self.bytes_per_step(), "comm_busy_ms": self.comm_busy_ms()}

    def close(self) -> None:
        """Remove hooks and stop helper threads (optional: they are daemons)."""
