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
from ddp_lab.compress import COMPRESSORS
from ddp_lab.errors import ConfigError
from ddp_lab.keys import key
from ddp_lab.registry import Registry

SYNCS = Registry("sync algorithm", "sync")


@dataclass
class SyncConfig:
    name: str = key(MISSING, choices=SYNCS)  # none | ddp | naive | ring | tree | fsdp
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
    # Gradient compression, bucket by bucket (ddp_lab/compress): none | bf16 | fp16 (the all-reduce
    # in 16 bits; ours: sync.comm_dtype's other name) | powersgd | topk. sync=ddp runs torch's own
    # comm hooks (bf16_compress_hook, fp16_compress_hook, powerSGD_hook): the reference.
    compress: str = key("none", choices=("none", "bf16", "fp16", *COMPRESSORS), read_by=SYNCS)
    compress_rank: int = key(2, at_least=1, only_with=("compress", ("powersgd",)))  # PowerSGD's r
    # top-k: the share of each bucket's entries a rank sends, in (0, 1]
    topk_fraction: float = key(0.01, positive=True, at_most=1.0, only_with=("compress", ("topk",)))
    # keep what compression left out and add it to the next step's gradient
    error_feedback: bool = key(True, only_with=("compress", ("powersgd", "topk")))
    # steps sent uncompressed before compression begins
    compress_start: int = key(0, at_least=0, only_with=("compress", ("powersgd", "topk")))
    # PowerSGD compresses a matrix only where (rows + cols) r x this < rows x cols (torch's rule)
    min_compression_rate: float = key(2.0, positive=True, only_with=("compress", ("powersgd",)))
    # Sharded parameters (sync.zero=3, sync=fsdp): free each unit's parameters after its forward
    # and gather them again for its backward (true), or keep them from forward to backward
    # (false: one all-gather fewer a step, every unit's whole parameters held in between)
    reshard_after_forward: bool = key(True, read_by=SYNCS)


def wire_dtype(scfg) -> str:
    """The dtype our syncs' buckets hold: sync.compress=bf16|fp16, else sync.comm_dtype (the
    older name of the same 16-bit all-reduce)."""
    return scfg.compress if scfg.compress in ("bf16", "fp16") else scfg.comm_dtype


def shards_state(scfg) -> bool:
    """Whether each rank holds only part of the training state (ZeRO, FSDP): its checkpoints are
    then sharded (ddp_lab/sharded_checkpoint.py), not checkpoint.pt."""
    return scfg.name == "fsdp" or scfg.zero > 0


def check_sync(cfg) -> None:
    s = cfg.sync
    if s.name == "fsdp" and cfg.optim.name == "sgd" and cfg.optim.impl == "fused":
        raise ConfigError("optim.impl=fused with sync=fsdp and optim=sgd: torch has no fused SGD "
                          "for DTensor parameters (aten._fused_sgd_); use optim.impl=foreach "
                          "(auto picks it)")
    if s.name == "ddp" and s.zero == 3:
        raise ConfigError("sync.zero=3 with sync=ddp: torch's fully sharded data parallelism is "
                          f"sync=fsdp (its fully_shard); ours is sync={'|'.join(OURS)} sync.zero=3")
    if not s.reshard_after_forward and s.zero != 3 and s.name != "fsdp":
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
    check_compress(s)


def check_compress(s) -> None:
    """sync.compress against the rest of the group: what cannot go together, in one line."""
    sixteen = s.compress in ("bf16", "fp16")
    if s.compress != "none" and s.comm_dtype != "fp32" and s.comm_dtype != s.compress:
        raise ConfigError(f"sync.compress={s.compress} with sync.comm_dtype={s.comm_dtype}: "
                          "comm_dtype is the 16-bit all-reduce's older name and compressors take "
                          "fp32 gradients; set sync.compress alone")
    if s.compress == "topk" and s.name == "ddp":
        raise ConfigError("sync.compress=topk with sync=ddp: torch has no top-k comm hook, and "
                          "top-k needs an all-gather; use sync=" + "|".join(OURS))
    if not sixteen and s.compress != "none" and s.zero:
        raise ConfigError(f"sync.compress={s.compress} with sync.zero={s.zero}: compression of "
                          "reduce-scattered shards is not built; use sync.zero=0")
    if s.compress == "powersgd" and s.name == "ddp" and s.compress_start < 2:
        raise ConfigError(f"sync.compress_start={s.compress_start} with sync=ddp "
                          "sync.compress=powersgd: torch's powerSGD_hook needs >= 2 with error "
                          "feedback or warm start, and sync=ddp warm-starts (DDP rebuilds its "
                          "buckets after the first step)")
