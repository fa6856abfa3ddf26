"""The sync group: `sync.*`'s keys and their checks, and SYNCS, the names `sync=` chooses from.

Each sync registers itself beside its code with the keys of the group it reads
(`@SYNCS.register("ddp", reads=(...))`); a key no chosen sync reads is refused off its default,
so the list of who reads what is that one declaration. `build_sync` (ddp_lab/sync/__init__.py)
turns the name into an object.
"""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import MISSING

from ddp_lab.buckets import DEFAULT_BUCKET_MB
from ddp_lab.comm import OURS
from ddp_lab.errors import ConfigError
from ddp_lab.keys import key
from ddp_lab.registry import Registry

SYNCS = Registry("sync algorithm", "sync")


@dataclass
class SyncConfig:
    name: str = key(MISSING, choices=SYNCS)  # none | ddp | naive | ring | tree
    # sync=none communicates nothing: any of these off its default is refused there.
    # Gradient bucket size (MiB), ours and DDP's (its bucket_cap_mb); 0: a bucket per parameter
    bucket_mb: float = key(DEFAULT_BUCKET_MB, at_least=0, read_by=SYNCS)
    # ours: start bucket all-reduces during backward (DDP always does)
    overlap: bool = key(True, read_by=SYNCS)
    # the dtype gradients travel in (ours and DDP)
    comm_dtype: str = key("fp32", choices=("fp32", "bf16", "fp16"), read_by=SYNCS)
    gradient_as_bucket_view: bool = key(False, read_by=SYNCS)  # DDP only
    static_graph: bool = key(False, read_by=SYNCS)  # DDP only
    # ZeRO stage: 0 none; 1 optimizer state sharded over the ranks; 2 gradients too (reduce-scatter
    # instead of all-reduce); 3 parameters too, gathered module by module. naive|ring|tree:
    # ddp_lab/sync/zero.py, zero3.py; ddp: 1 only, torch's ZeroRedundancyOptimizer; none: nothing
    # to shard over
    zero: int = key(0, choices=(0, 1, 2, 3), read_by=SYNCS)
    # zero=3: free each unit's parameters after its forward and gather them again for its
    # backward (true), or keep them from forward to backward (false: a forward's all-gathers only)
    reshard_after_forward: bool = key(True, read_by=SYNCS)


def check_sync(cfg) -> None:
    s = cfg.sync
    if s.name == "ddp" and s.zero == 3:
        raise ConfigError("sync.zero=3 with sync=ddp: torch's fully sharded data parallelism is "
                          f"sync=fsdp (its fully_shard); ours is sync={'|'.join(OURS)} sync.zero=3")
    if not s.reshard_after_forward and s.zero != 3:
        raise ConfigError(f"sync.reshard_after_forward=false has no effect at sync.zero={s.zero}, "
                          "only at sync.zero=3 (parameters sharded); leave it at true")
    if s.zero == 3 and cfg.train.compile:
        raise ConfigError("train.compile=true with sync.zero=3: ZeRO-3's module hooks gather and "
                          "free parameters around each module, which torch.compile does not "
                          "trace; run with train.compile=false")
    if s.zero == 3 and cfg.fault.perturb_rank >= 0:
        raise ConfigError("fault.perturb_rank with sync.zero=3: the parameters are sharded, there "
                          "are no replicas to make differ; use sync.zero<=2")
    if s.name == "ddp" and s.zero > 1:
        raise ConfigError(f"sync.zero={s.zero} with sync=ddp: torch's ZeroRedundancyOptimizer "
                          f"shards optimizer state only (ZeRO-1); use sync.zero=1, or "
                          f"sync={'|'.join(OURS)} sync.zero={s.zero}")
