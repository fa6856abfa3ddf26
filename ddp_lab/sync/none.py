"""sync=none: a single process; nothing to synchronise."""

from torch import nn

from ddp_lab.sync.base import GradSync
from ddp_lab.sync.config import SYNCS


@SYNCS.register("none")  # reads no sync.* key: nothing to communicate
class NoSync(GradSync):
    name = "none"

    def prepare(self, model: nn.Module) -> nn.Module:
        return model
