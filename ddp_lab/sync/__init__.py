"""Gradient synchronisers. `build_sync` is the one place that turns `sync=` into an object."""

from __future__ import annotations

from ddp_lab.config import ConfigError
from ddp_lab.dist import DistInfo
from ddp_lab.sync.base import GradSync
from ddp_lab.sync.bucketed import BucketedSync
from ddp_lab.sync.ddp import DDPSync
from ddp_lab.sync.none import NoSync
from ddp_lab.sync.zero import ShardedSync


def build_sync(scfg, info: DistInfo) -> GradSync:
    if scfg.name == "none":
        if info.world_size > 1:
            raise ConfigError(f"sync=none with world size {info.world_size} would train "
                              f"{info.world_size} diverging replicas; use sync=ddp (or naive/ring/tree)")
        return NoSync()
    if scfg.name == "ddp":
        return DDPSync(scfg, info.device, info.world_size)
    if scfg.name in ("naive", "ring", "tree"):
        if scfg.zero:  # ZeRO: each rank updates its shard of every bucket
            return ShardedSync(scfg, info.device, info.world_size)
        return BucketedSync(scfg, info.device, info.world_size)
    raise ConfigError(f"sync={scfg.name} is not available yet")


__all__ = ["BucketedSync", "DDPSync", "GradSync", "NoSync", "ShardedSync", "build_sync"]
