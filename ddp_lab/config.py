"""Typed configuration: the schema Hydra validates every composed config against.

The YAML files in `conf/` choose values; these dataclasses say which keys exist and what type each
has, so a misspelled key or a string where a number belongs fails at composition with Hydra's own
message. Checks that need more than a type (a batch size of 0, a backend without devices) live in
`validate` and raise `ConfigError`, which the entry points print as one line and exit 2.
"""

from __future__ import annotations

import os
import typing
from dataclasses import dataclass, field, fields, is_dataclass

from hydra.core.config_store import ConfigStore
from omegaconf import II, MISSING


class ConfigError(ValueError):
    """A user error in the configuration or environment: printed as one clear line, exit code 2."""


@dataclass
class ModelConfig:
    name: str = MISSING  # alexnet | alexnet_cifar
    image_size: int = MISSING  # the input resolution the architecture is built for
    default_classes: int = MISSING  # classes for data without labels of its own (synthetic)
    dropout: float = 0.5  # 0 turns dropout off
    # How the first convolution is computed: standard | space_to_depth (same parameters and
    # function, a stride-1 conv over the space-to-depth image: ddp_lab/models/stem.py)
    stem: str = "standard"


@dataclass
class DataConfig:
    name: str = MISSING  # digits | synthetic | cifar10 | imagefolder
    root: str = ""  # cifar10 / imagefolder: where the data lives
    download: bool = False  # cifar10: fetch into root if it is missing
    image_size: int = II("model.image_size")
    num_classes: int = II("model.default_classes")  # synthetic only; others know their own
    num_samples: int = 50_000  # synthetic: length of the (virtual) training set
    val_samples: int = 1_024  # synthetic: length of the validation set
    pool_size: int = 256  # synthetic: distinct random images kept on the device
    augment: bool = False  # random crop + horizontal flip, seeded per sample and epoch
    on_device: bool = True  # keep in-memory data sets on the training device
    num_workers: int = 4  # imagefolder: decoding processes per rank


@dataclass
class SyncConfig:
    name: str = MISSING  # none | ddp | naive | ring | tree
    bucket_mb: float = 25.0  # gradient bucket size (MiB), ours and DDP's (its bucket_cap_mb)
    overlap: bool = True  # start bucket all-reduces during backward
    comm_dtype: str = "fp32"  # fp32 | bf16 | fp16: dtype gradients travel in
    gradient_as_bucket_view: bool = False  # DDP only
    static_graph: bool = False  # DDP only


@dataclass
class PrecisionConfig:
    name: str = MISSING  # fp32 | tf32 | fp16 | bf16
    autocast_dtype: str = "none"  # none | float16 | bfloat16
    tf32: bool = False  # allow TF32 tensor-core math for fp32 matmul/conv
    grad_scaler: bool = False  # dynamic loss scaling (needed for float16)
    init_scale: float = 65536.0
    growth_interval: int = 2000


@dataclass
class OptimConfig:
    name: str = MISSING  # sgd | adamw
    lr: float = MISSING
    momentum: float = 0.9  # sgd
    nesterov: bool = False  # sgd
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])  # adamw
    eps: float = 1e-8  # adamw
    weight_decay: float = 5e-4
    impl: str = "auto"  # auto | fused | foreach | for_loop
    schedule: str = "cosine"  # cosine | constant (after the linear warm-up)
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0  # cosine floor, as a fraction of lr
    grad_clip: float = 0.0  # max global grad norm; 0 disables clipping


@dataclass
class TrainConfig:
    epochs: int = 10
    max_steps: int = 0  # > 0 overrides epochs
    batch_size: int = 64  # per rank, per micro-step
    accum_steps: int = 1  # micro-steps per optimizer step; only the last communicates
    log_every: int = 10  # steps between metrics.jsonl / TensorBoard rows
    timing_warmup: int = 5  # steps left out of timing statistics
    calibrate_steps: int = 5  # timed backward passes without communication (0: skip)
    eval_every_epochs: int = 1  # 0: evaluate only at the end
    channels_last: bool = False
    compile: bool = False
    compile_mode: str = "default"  # torch.compile mode: default | max-autotune | ...
    # Capture the whole step (forward, backward, guard, optimizer) as one CUDA graph and replay
    # it: for host-bound small models. CUDA, sync=none, no GradScaler (ddp_lab/graph.py).
    cuda_graph: bool = False
    cudnn_benchmark: bool = True
    progress: bool = True  # progress bar on rank 0
    resume: str = "auto"  # auto | never | path to a checkpoint
    stop_at_step: int = 0  # > 0: stop at this step as if interrupted (checkpoint written)
    checkpoint_every: int = 0  # steps between checkpoints; 0: end of each epoch and at the end
    keep_every: int = 0  # also keep checkpoint_step<N>.pt every this many steps; 0: never
    # fp32/bf16 inf/NaN loss or grads: skip the step on every rank | stop | off (no per-step
    # check: its read pass costs ~3.5% of a graphed AlexNet-CIFAR step; checkpoints still refuse NaN)
    nonfinite: str = "skip"
    consistency_every: int = 100  # steps between cross-rank parameter checksums; 0: never


@dataclass
class DistConfig:
    backend: str = "auto"  # auto | gloo | nccl
    timeout_s: float = 300.0  # a collective that waits longer than this fails instead of hanging


@dataclass
class FaultConfig:
    """Fault injection for tests and demos (ddp_lab/fault.py). Everything off by default; a fault
    fires in torchrun's first attempt only, so a restarted group runs clean."""
    at_step: int = 0  # the step (1-based) at which kill_rank / hang_rank / perturb_rank act
    kill_rank: int = -1  # SIGKILL this rank at fault.at_step; -1: none
    hang_rank: int = -1  # this rank stops responding at fault.at_step; -1: none
    hang_s: float = 0.0  # how long the hang lasts; 0: until the process is killed
    perturb_rank: int = -1  # nudge one parameter of this rank by one ulp at fault.at_step; -1: none
    nan_at_step: int = 0  # make the loss non-finite at this step; 0: never
    nan_rank: int = 0  # ... on this rank only
    nan_value: str = "nan"  # nan | inf


@dataclass
class Config:
    model: ModelConfig = MISSING
    data: DataConfig = MISSING
    sync: SyncConfig = MISSING
    precision: PrecisionConfig = MISSING
    optim: OptimConfig = MISSING
    train: TrainConfig = field(default_factory=TrainConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)
    seed: int = 0


CHOICES = {
    "model.name": ("alexnet", "alexnet_cifar"),
    "model.stem": ("standard", "space_to_depth"),
    "data.name": ("digits", "synthetic", "cifar10", "imagefolder"),
    "sync.name": ("none", "ddp", "naive", "ring", "tree"),
    "sync.comm_dtype": ("fp32", "bf16", "fp16"),
    "precision.name": ("fp32", "tf32", "fp16", "bf16"),
    "precision.autocast_dtype": ("none", "float16", "bfloat16"),
    "optim.name": ("sgd", "adamw"),
    "optim.impl": ("auto", "fused", "foreach", "for_loop"),
    "optim.schedule": ("cosine", "constant"),
    "dist.backend": ("auto", "gloo", "nccl"),
    "train.compile_mode": ("default", "reduce-overhead", "max-autotune",
                           "max-autotune-no-cudagraphs"),
    "train.nonfinite": ("skip", "stop", "off"),
    "fault.nan_value": ("nan", "inf"),
}

POSITIVE = ("train.batch_size", "train.accum_steps", "train.log_every",
            "model.image_size",
            "data.num_classes", "data.num_samples", "data.val_samples", "data.pool_size",
            "dist.timeout_s", "optim.lr")
NON_NEGATIVE = ("train.epochs", "train.max_steps", "train.timing_warmup", "train.calibrate_steps",
                "train.eval_every_epochs",
                "train.stop_at_step", "train.checkpoint_every", "train.keep_every",
                "data.num_workers", "optim.warmup_steps", "optim.weight_decay", "optim.grad_clip",
                "sync.bucket_mb", "train.consistency_every", "fault.at_step", "fault.nan_at_step",
                "fault.hang_s")


def _get(cfg, dotted: str):
    node = cfg
    for part in dotted.split("."):
        node = getattr(node, part)
    return node


def validate(cfg) -> None:
    """Reject values that are well typed but meaningless, with a message naming the key."""
    for key, allowed in CHOICES.items():
        value = _get(cfg, key)
        if value not in allowed:
            raise ConfigError(f"{key}={value!r} is not one of {', '.join(allowed)}")
    for key in POSITIVE:
        if not _get(cfg, key) > 0:
            raise ConfigError(f"{key}={_get(cfg, key)} must be > 0")
    for key in NON_NEGATIVE:
        if not _get(cfg, key) >= 0:
            raise ConfigError(f"{key}={_get(cfg, key)} must be >= 0")
    if not 0.0 <= cfg.model.dropout < 1.0:
        raise ConfigError(f"model.dropout={cfg.model.dropout} must be in [0, 1)")
    if cfg.train.epochs == 0 and cfg.train.max_steps == 0:
        raise ConfigError("set train.epochs or train.max_steps to something > 0")
    _validate_reliability(cfg)
    if cfg.data.name in ("cifar10", "imagefolder") and not cfg.data.root:
        raise ConfigError(f"data={cfg.data.name} needs data.root=<directory>")


def _validate_reliability(cfg) -> None:
    t, f = cfg.train, cfg.fault
    if t.resume not in ("auto", "never") and not os.path.isfile(t.resume):
        raise ConfigError(f"train.resume={t.resume!r} is not auto, never or an existing checkpoint "
                          "file")
    if (f.kill_rank >= 0 or f.hang_rank >= 0 or f.perturb_rank >= 0) and f.at_step == 0:
        raise ConfigError("fault.kill_rank / fault.hang_rank / fault.perturb_rank need "
                          "fault.at_step=<step> (1-based)")


# Keys that change nothing about what a run trains (when nothing goes wrong): how it is logged,
# timed, checkpointed, guarded and where its data lives; a name ending in a group ("fault") covers
# the group. The run dir's name leaves them out (conf/config.yaml, through `neutral_keys`), so the
# same command with another log interval resumes the same run, and so does the resume digest
# (checkpoint.config_digest). train.cuda_graph replays the eager step's kernels (bitwise, with
# dropout off: tests/test_cuda_graph.py); train.calibrate_steps runs under fork_rng.
NEUTRAL = ("train.resume", "train.stop_at_step", "train.progress", "train.log_every",
           "train.checkpoint_every", "train.keep_every", "train.timing_warmup",
           "train.calibrate_steps", "train.nonfinite", "train.consistency_every",
           "train.cuda_graph", "dist.timeout_s", "data.num_workers", "data.root", "data.download",
           "fault")


def is_neutral(key: str) -> bool:
    """Whether the dotted config key `key` is in NEUTRAL (itself or inside a neutral group)."""
    return any(key == n or key.startswith(n + ".") for n in NEUTRAL)


def neutral_keys() -> list[str]:
    """NEUTRAL with each group spelt out as its keys: Hydra matches override keys exactly."""
    groups = typing.get_type_hints(Config)
    keys = []
    for name in NEUTRAL:
        group = groups.get(name)
        keys += [f"{name}.{f.name}" for f in fields(group)] if is_dataclass(group) else [name]
    return keys


def register_configs() -> None:
    ConfigStore.instance().store(name="schema", node=Config)
