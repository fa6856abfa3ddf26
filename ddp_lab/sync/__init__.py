"""Gradient synchronisers. `build_sync` is the one place that turns `sync=` into an object; the
names it knows are SYNCS (ddp_lab/sync/config.py), where each sync registers itself."""

from __future__ import annotations

from ddp_lab.comm import OURS
from ddp_lab.dist import DistInfo
from ddp_lab.errors import ConfigError
from ddp_lab.sync.base import GradSync
from ddp_lab.sync.config import SYNCS, SyncConfig
# Imported, so registered, in the order listings show: nothing, torch's DDP, ours, then torch's
# FSDP (the reference for ZeRO-3, sharded as ours are).
from ddp_lab.sync.none import NoSync
from ddp_lab.sync.ddp import DDPSync
from ddp_lab.sync.bucketed import BucketedSync
from ddp_lab.sync.zero import ShardedSync
from ddp_lab.sync.fsdp import FSDPSync
from ddp_lab.sync.zero3 import ZeRO3Sync


def build_sync(scfg, info: DistInfo) -> GradSync:
    sync = SYNCS[scfg.name]
    if sync is NoSync:
        if info.world_size > 1:
            raise ConfigError(f"sync=none with world size {info.world_size} would train "
                              f"{info.world_size} diverging replicas; use sync=ddp "
                              f"(or {'/'.join(OURS)})")
        return NoSync()
    if sync is BucketedSync and scfg.zero:  # ZeRO: each rank updates its shard of every bucket
        sync = ZeRO3Sync if scfg.zero == 3 else ShardedSync
    return sync(scfg, info.device, info.world_size)


__all__ = ["BucketedSync", "DDPSync", "FSDPSync", "GradSync", "NoSync", "SYNCS", "ShardedSync", "SyncConfig",
           "ZeRO3Sync", "build_sync"]
