"""Fault injection for tests and demos: `fault.*` in the config, all off by default.

    fault.kill_rank=1 fault.at_step=5       rank 1 dies (SIGKILL) as step 5 begins
    fault.hang_rank=1 fault.at_step=3       rank 1 stops responding as step 3 begins (fault.hang_s)
    fault.perturb_rank=1 fault.at_step=3    rank 1's first parameter moves by one ulp: a divergence
    fault.nan_at_step=4 fault.nan_rank=0    rank 0's logits become NaN (fault.nan_value=inf: inf)

Steps are 1-based, as in the logs. A fault fires only in torchrun's first attempt
(TORCHELASTIC_RESTART_COUNT=0), so under `--max-restarts` the restarted group runs clean and
shows what survives the fault.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from dataclasses import dataclass

import torch

from ddp_lab.errors import ConfigError
from ddp_lab.keys import key, text

log = logging.getLogger("ddp_lab")


@dataclass
class FaultConfig:
    """Everything off by default; a fault fires in torchrun's first attempt only, so a restarted
    group runs clean."""
    # the step (1-based) at which kill_rank / hang_rank / perturb_rank act
    at_step: int = key(0, at_least=0)
    kill_rank: int = -1  # SIGKILL this rank at fault.at_step; -1: none
    hang_rank: int = -1  # this rank stops responding at fault.at_step; -1: none
    hang_s: float = key(0.0, at_least=0)  # how long the hang lasts; 0: until the process is killed
    perturb_rank: int = -1  # nudge one parameter of this rank by one ulp at fault.at_step; -1: none
    nan_at_step: int = key(0, at_least=0)  # make the loss non-finite at this step; 0: never
    nan_rank: int = 0  # ... on this rank only
    nan_value: str = key("nan", choices=("nan", "inf"))


def check_fault(cfg) -> None:
    """Fault injection that would silently do nothing. (Ranks past the world size: `Faults`, which
    knows it.)"""
    f = cfg.fault
    ranks = {k: getattr(f, k) for k in ("kill_rank", "hang_rank", "perturb_rank", "nan_rank")}
    for name, rank in ranks.items():
        if rank < -1 or (name == "nan_rank" and rank < 0):
            raise ConfigError(f"fault.{name}={rank} must be a rank (>= 0)"
                              + ("" if name == "nan_rank" else " or -1 for none"))
    armed = max(f.kill_rank, f.hang_rank, f.perturb_rank) >= 0
    if armed and f.at_step == 0:
        raise ConfigError("fault.kill_rank / fault.hang_rank / fault.perturb_rank need "
                          "fault.at_step=<step> (1-based)")
    unread = [("fault.at_step", f.at_step, 0, "fault.kill_rank / hang_rank / perturb_rank", armed),
              ("fault.hang_s", f.hang_s, 0.0, "fault.hang_rank", f.hang_rank >= 0),
              ("fault.nan_rank", f.nan_rank, 0, "fault.nan_at_step", f.nan_at_step > 0),
              ("fault.nan_value", f.nan_value, "nan", "fault.nan_at_step", f.nan_at_step > 0)]
    for dotted, value, default, needs, read in unread:
        if not read and value != default:
            raise ConfigError(f"{dotted}={text(value)} has no effect without {needs}; set that "
                              "too, or leave it out")


def first_attempt() -> bool:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0


class Faults:
    def __init__(self, fcfg, rank: int, world_size: int, model: torch.nn.Module):
        for name in ("kill_rank", "hang_rank", "perturb_rank", "nan_rank"):
            r = getattr(fcfg, name)
            if r >= world_size or r < -1:
                raise ConfigError(f"fault.{name}={r}: world size is {world_size} (ranks 0.."
                                  f"{world_size - 1}, -1 for none)")
        self.cfg, self.rank, self.model = fcfg, rank, model
        self.armed = first_attempt()
        self._nan_now = False
        if self.armed and fcfg.nan_at_step and fcfg.nan_rank == rank:
            model.register_forward_hook(self._poison)

    def _poison(self, module, inputs, output):
        if self._nan_now and module.training:
            self._nan_now = False  # once per step: the first micro-step is enough
            log.warning("fault: rank %d's logits set to %s at step %d", self.rank,
                        self.cfg.nan_value, self.cfg.nan_at_step)
            return output * float(self.cfg.nan_value)
        return output

    def on_step(self, step: int) -> None:
        """At the start of every step (1-based), before its forward."""
        if not self.armed:
            return
        f = self.cfg
        self._nan_now = step == f.nan_at_step
        if step != f.at_step:
            return
        if f.kill_rank == self.rank:
            _say(f"fault: killing rank {self.rank} (SIGKILL) at step {step}")
            os.kill(os.getpid(), signal.SIGKILL)
        if f.hang_rank == self.rank:
            _say(f"fault: rank {self.rank} hangs at step {step}"
                 + (f" for {f.hang_s:g} s" if f.hang_s else " until killed"))
            deadline = time.monotonic() + (f.hang_s or float("inf"))
            while time.monotonic() < deadline:
                time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
        if f.perturb_rank == self.rank:
            p = next(self.model.parameters())
            with torch.no_grad():
                flat = p.view(-1)
                flat[0] = torch.nextafter(flat[0], torch.tensor(float("inf"), dtype=p.dtype,
                                                                device=p.device))
            log.warning("fault: rank %d's first parameter moved by one ulp at step %d",
                        self.rank, step)


def _say(msg: str) -> None:
    """Every rank may inject; rank != 0 logs only warnings, so print straight to stderr."""
    print(f"[rank {os.environ.get('RANK', '0')}] {msg}", file=sys.stderr, flush=True)
