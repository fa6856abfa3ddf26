"""Typed configuration: the schema Hydra validates every composed config against.

The YAML files in `conf/` choose values; these dataclasses say which keys exist and what type each
has, so a misspelled key or a string where a number belongs fails at composition with Hydra's own
message. Checks that need more than a type (a batch size of 0, a backend without devices) live in
`validate` and raise `ConfigError`, which the entry points print as one line and exit 2.
"""

from __future__ import annotations

import math
import os
import typing
from dataclasses import MISSING as NO_DEFAULT
from dataclasses import dataclass, field, fields, is_dataclass

from hydra.core.config_store import ConfigStore
from omegaconf import II, MISSING, DictConfig, ListConfig, OmegaConf

from ddp_lab.buckets import DEFAULT_BUCKET_MB
from ddp_lab.errors import ConfigError


@dataclass
class ModelConfig:
    name: str = MISSING  # alexnet | alexnet_cifar
    # The input resolution the architecture is built for; the sizes each model can take:
    # ddp_lab/models IMAGE_SIZES (alexnet_cifar 31..46 px, alexnet >= 63)
    image_size: int = MISSING
    default_classes: int = MISSING  # classes for data without labels of its own (synthetic), >= 2
    dropout: float = 0.5  # 0 turns dropout off
    # How the first convolution is computed: standard | space_to_depth (same parameters and
    # function, a stride-1 conv over the space-to-depth image: ddp_lab/models/stem.py)
    stem: str = "standard"
    # Width of the two hidden fully connected layers, where AlexNet keeps most of its parameters:
    # fewer gradient bytes to send for about the same compute (the tests' runs use 512)
    fc_width: int = 4096


@dataclass
class DataConfig:
    name: str = MISSING  # digits | synthetic | cifar10 | imagefolder
    # A data set's own parameters (root, download, num_workers; num_samples, val_samples,
    # pool_size) are ignored by the others; augment, on_device and num_classes are refused where
    # they would be.
    root: str = ""  # cifar10 / imagefolder: where the data lives
    download: bool = False  # cifar10: fetch into root if it is missing
    image_size: int = II("model.image_size")  # another size must be one the model takes
    num_classes: int = II("model.default_classes")  # synthetic only; others know their own
    num_samples: int = 50_000  # synthetic: length of the (virtual) training set
    val_samples: int = 1_024  # synthetic: length of the validation set
    # synthetic: distinct random images kept on the device (at most num_samples of them are read)
    pool_size: int = 256
    augment: bool = False  # random crop + flip, seeded per sample and epoch; not for synthetic
    # digits / cifar10: keep the set on the training device (synthetic is always made there,
    # imagefolder is decoded on the host; on CPU both places are one)
    on_device: bool = True
    num_workers: int = 4  # imagefolder: decoding processes per rank


@dataclass
class SyncConfig:
    name: str = MISSING  # none | ddp | naive | ring | tree
    # sync=none communicates nothing: any of these off its default is refused there.
    # Gradient bucket size (MiB), ours and DDP's (its bucket_cap_mb); 0: a bucket per parameter
    bucket_mb: float = DEFAULT_BUCKET_MB
    overlap: bool = True  # ours: start bucket all-reduces during backward (DDP always does)
    comm_dtype: str = "fp32"  # fp32 | bf16 | fp16: dtype gradients travel in (ours and DDP)
    gradient_as_bucket_view: bool = False  # DDP only
    static_graph: bool = False  # DDP only
    # ZeRO stage: 0 none; 1 optimizer state sharded over the ranks; 2 gradients too (reduce-scatter
    # instead of all-reduce). naive|ring|tree: ddp_lab/sync/zero.py; ddp: 1 only, torch's
    # ZeroRedundancyOptimizer
    zero: int = 0


@dataclass
class PrecisionConfig:
    name: str = MISSING  # fp32 | tf32 | fp16 | bf16: the group sets the keys below to agree
    autocast_dtype: str = "none"  # none | float16 | bfloat16; must be what name says
    # Allow TF32 tensor-core math for fp32 matmul/conv: fp32 false, tf32 true, either under
    # autocast. CUDA only: on CPU it changes nothing.
    tf32: bool = False
    # Dynamic loss scaling, for fp16/bf16 only. precision=fp16 grad_scaler=false is allowed (it
    # shows why the scaler exists: small gradients underflow to zero).
    grad_scaler: bool = False
    init_scale: float = 65536.0  # grad_scaler only
    growth_interval: int = 2000  # grad_scaler only


@dataclass
class OptimConfig:
    name: str = MISSING  # sgd | adamw; the other one's keys are refused off their defaults
    lr: float = MISSING
    momentum: float = 0.9  # sgd, in [0, 1)
    nesterov: bool = False  # sgd, needs momentum > 0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])  # adamw, two in [0, 1)
    eps: float = 1e-8  # adamw, > 0
    weight_decay: float = 5e-4
    impl: str = "auto"  # auto | fused | foreach | for_loop
    schedule: str = "cosine"  # cosine | constant (after the linear warm-up)
    # May exceed the run: it then ends still warming up (short test runs do, with sgd's 20)
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0  # cosine floor, as a fraction of lr, in [0, 1]
    grad_clip: float = 0.0  # max global grad norm; 0 disables clipping


@dataclass
class TrainConfig:
    epochs: int = 10
    max_steps: int = 0  # > 0 overrides epochs
    batch_size: int = 64  # per rank, per micro-step
    accum_steps: int = 1  # micro-steps per optimizer step; only the last communicates
    log_every: int = 10  # steps between metrics.jsonl / TensorBoard rows; the last is always logged
    timing_warmup: int = 5  # steps left out of timing statistics (a run this short reports none)
    calibrate_steps: int = 5  # timed backward passes without communication (0: skip)
    eval_every_epochs: int = 1  # 0: evaluate only at the end
    channels_last: bool = False
    compile: bool = False
    compile_mode: str = "default"  # train.compile=true: default | max-autotune | ...
    # Capture the whole step (forward, backward, guard, optimizer) as one CUDA graph and replay
    # it: for host-bound small models. CUDA, sync=none, no GradScaler (ddp_lab/graph.py).
    cuda_graph: bool = False
    cudnn_benchmark: bool = True  # CUDA only
    progress: bool = True  # progress bar on rank 0
    resume: str = "auto"  # auto | never | path to a checkpoint
    stop_at_step: int = 0  # > 0: stop at this step as if interrupted (checkpoint written)
    # (a step past the run's last is refused: check_steps_reachable)
    checkpoint_every: int = 0  # steps between checkpoints; 0: end of each epoch and at the end
    keep_every: int = 0  # also keep checkpoint_step<N>.pt every this many steps; 0: never
    # fp32/bf16 inf/NaN loss or grads: skip the step on every rank | stop | off (no per-step
    # check, whose read pass shows on a graphed AlexNet-CIFAR step: docs/results/h200-loop-vs-bare;
    # checkpoints still refuse NaN)
    nonfinite: str = "skip"
    consistency_every: int = 100  # steps between cross-rank parameter checksums; 0: never
    # Record a timeline of train.trace_steps consecutive steps after the timing warm-up on every
    # rank: trace.json (Perfetto), timeline.png and summary.json's overlap block (ddp_lab/trace.py).
    trace: bool = False
    trace_steps: int = 3


@dataclass
class DistConfig:
    backend: str = "auto"  # auto | gloo | nccl
    # A collective that waits longer than this fails instead of hanging; at least 1
    timeout_s: float = 300.0


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
    "sync.zero": (0, 1, 2),
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

POSITIVE = ("train.batch_size", "train.accum_steps", "train.log_every", "train.trace_steps",
            "model.image_size", "model.fc_width", "data.image_size",
            "data.num_classes", "data.num_samples", "data.val_samples", "data.pool_size",
            "dist.timeout_s", "optim.lr", "optim.eps", "precision.init_scale",
            "precision.growth_interval")
NON_NEGATIVE = ("train.epochs", "train.max_steps", "train.timing_warmup", "train.calibrate_steps",
                "train.eval_every_epochs",
                "train.stop_at_step", "train.checkpoint_every", "train.keep_every",
                "data.num_workers", "optim.warmup_steps", "optim.weight_decay", "optim.grad_clip",
                "sync.bucket_mb", "train.consistency_every", "fault.at_step", "fault.nan_at_step",
                "fault.hang_s")
# key: (low, high, whether high itself is allowed); low always is
BOUNDED = {"model.dropout": (0.0, 1.0, False), "optim.momentum": (0.0, 1.0, False),
           "optim.min_lr_ratio": (0.0, 1.0, True)}
# Keys that only some values of another key read: key -> (that key, the values that read it).
# Where nothing reads a key, a value other than the schema's default is refused: a run never
# records a setting it did not have (a sweep over sync.overlap would otherwise label DDP rows with
# an overlap DDP cannot turn off). A data set's own parameters (data.root, download, num_workers;
# synthetic's num_samples, val_samples, pool_size) are left out, like a path: another data set
# has its own, and a benchmark switching data sets (bench.train_throughput's ddp_overrides)
# keeps them.
SCOPED = {
    "data.augment": ("data.name", ("digits", "cifar10", "imagefolder")),  # not random images
    # synthetic data is made on the device; imagefolder's is decoded on the host: only false counts
    "data.on_device": ("data.name", ("digits", "cifar10", "imagefolder")),
    "sync.bucket_mb": ("sync.name", ("ddp", "naive", "ring", "tree")),
    "sync.comm_dtype": ("sync.name", ("ddp", "naive", "ring", "tree")),
    "sync.overlap": ("sync.name", ("naive", "ring", "tree")),  # DDP always overlaps
    "sync.gradient_as_bucket_view": ("sync.name", ("ddp",)),
    "sync.static_graph": ("sync.name", ("ddp",)),
    "sync.zero": ("sync.name", ("ddp", "naive", "ring", "tree")),  # none: nothing to shard over
    "precision.init_scale": ("precision.grad_scaler", (True,)),
    "precision.growth_interval": ("precision.grad_scaler", (True,)),
    "optim.momentum": ("optim.name", ("sgd",)),
    "optim.nesterov": ("optim.name", ("sgd",)),
    "optim.betas": ("optim.name", ("adamw",)),
    "optim.eps": ("optim.name", ("adamw",)),
    "optim.min_lr_ratio": ("optim.schedule", ("cosine",)),
    "train.compile_mode": ("train.compile", (True,)),
    "train.trace_steps": ("train.trace", (True,)),
}
# precision.name -> the autocast_dtype it means, and the tf32 it means (None: either, for the ops
# autocast leaves in fp32)
PRECISIONS = {"fp32": ("none", False), "tf32": ("none", True), "fp16": ("float16", None),
              "bf16": ("bfloat16", None)}


def _get(cfg, dotted: str):
    node = cfg
    for part in dotted.split("."):
        node = getattr(node, part)
    return node


def _text(value) -> str:
    """A value as it is written on the command line: true, [0.9,0.999], fp32."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, ListConfig)):
        return "[" + ",".join(map(str, value)) + "]"
    return str(value)


def _option(key: str, *values) -> str:
    """`sync=naive|ring` for a group's name, `train.compile=false` for any other key."""
    return f"{key.removesuffix('.name')}={'|'.join(map(_text, values))}"


def _schema_default(key: str):
    group, name = key.split(".")
    f = next(f for f in fields(typing.get_type_hints(Config)[group]) if f.name == name)
    return f.default_factory() if f.default_factory is not NO_DEFAULT else f.default


def _is_set(cfg, key: str) -> bool:
    """Whether `key` was given a value of its own, not left interpolating another key's."""
    group, name = key.split(".")
    node = getattr(cfg, group)
    return not (isinstance(node, DictConfig) and OmegaConf.is_interpolation(node, name))


def validate(cfg) -> None:
    """Reject, before anything runs, values that are well typed but cannot be honoured, alone or
    together: one line naming the key and what to do."""
    _check_choices_and_ranges(cfg)
    _check_scoped(cfg)
    _check_model_and_data(cfg)
    _check_precision(cfg)
    _check_sync(cfg)
    _check_optim(cfg)
    _check_run_length(cfg)
    _check_reliability(cfg)
    _check_faults(cfg)


def _check_choices_and_ranges(cfg) -> None:
    for key, allowed in CHOICES.items():
        value = _get(cfg, key)
        if value not in allowed:
            raise ConfigError(f"{key}={value!r} is not one of {', '.join(map(str, allowed))}")
    for group, schema in typing.get_type_hints(Config).items():
        hints = typing.get_type_hints(schema) if is_dataclass(schema) else {}
        for name, hint in hints.items():
            value = getattr(getattr(cfg, group), name)
            numbers = value if hint == list[float] else [value] if hint is float else []
            if not all(math.isfinite(v) for v in numbers):  # nan passes no comparison, inf all
                raise ConfigError(f"{group}.{name}={_text(value)} must be finite")
    for key in POSITIVE:
        if not _get(cfg, key) > 0:
            raise ConfigError(f"{key}={_get(cfg, key)} must be > 0")
    for key in NON_NEGATIVE:
        if not _get(cfg, key) >= 0:
            raise ConfigError(f"{key}={_get(cfg, key)} must be >= 0")
    for key, (low, high, closed) in BOUNDED.items():
        value = _get(cfg, key)
        if not (low <= value <= high if closed else low <= value < high):
            bracket = "]" if closed else ")"
            raise ConfigError(f"{key}={value} must be in [{low:g}, {high:g}{bracket}")


def _check_scoped(cfg) -> None:
    for key, (owner, readers) in SCOPED.items():
        value, default, chosen = _get(cfg, key), _schema_default(key), _get(cfg, owner)
        if chosen not in readers and _text(value) != _text(default):
            raise ConfigError(f"{key}={_text(value)} has no effect with {_option(owner, chosen)}, "
                              f"only with {_option(owner, *readers)}; leave it at {_text(default)}")


def _check_model_and_data(cfg) -> None:
    from ddp_lab.models import image_size_problem

    m, d = cfg.model, cfg.data
    for key in ("model.image_size", "data.image_size"):
        problem = image_size_problem(m.name, _get(cfg, key))
        if problem and (key == "model.image_size" or _is_set(cfg, key)):
            raise ConfigError(f"{key}={_get(cfg, key)}: {problem}")
    if d.name == "synthetic" and d.num_classes < 2:
        source = "data.num_classes" if _is_set(cfg, "data.num_classes") else "model.default_classes"
        raise ConfigError(f"{source}={d.num_classes}: a classifier needs at least 2 classes")
    if d.name != "synthetic" and _is_set(cfg, "data.num_classes"):
        raise ConfigError(f"data.num_classes={d.num_classes} has no effect with data={d.name}, "
                          "which has labels of its own, only with data=synthetic; leave it out")
    if d.name in ("cifar10", "imagefolder") and not d.root:
        raise ConfigError(f"data={d.name} needs data.root=<directory>")


def _check_precision(cfg) -> None:
    p = cfg.precision
    autocast, tf32 = PRECISIONS[p.name]
    if p.autocast_dtype != autocast:
        raise ConfigError(f"precision.autocast_dtype={p.autocast_dtype} contradicts "
                          f"precision={p.name} (which autocasts to {autocast}); choose the "
                          "precision group instead (precision=fp16 or precision=bf16)")
    if tf32 is not None and p.tf32 != tf32:
        raise ConfigError(f"precision.tf32={_text(p.tf32)} contradicts precision={p.name}; use "
                          f"precision={'tf32' if p.tf32 else 'fp32'} instead")
    if p.grad_scaler and autocast == "none":
        raise ConfigError(f"precision.grad_scaler=true: loss scaling keeps float16 gradients "
                          f"from underflowing, and precision={p.name} has none; use precision=fp16")


def _check_sync(cfg) -> None:
    s = cfg.sync
    if s.name == "ddp" and s.zero > 1:
        raise ConfigError(f"sync.zero={s.zero} with sync=ddp: torch's ZeroRedundancyOptimizer "
                          "shards optimizer state only (ZeRO-1); use sync.zero=1, or "
                          f"sync=naive|ring|tree sync.zero={s.zero}")


def _check_optim(cfg) -> None:
    o = cfg.optim
    if o.name == "adamw" and not (len(o.betas) == 2 and all(0 <= b < 1 for b in o.betas)):
        raise ConfigError(f"optim.betas={_text(o.betas)} must be two numbers in [0, 1), "
                          "e.g. optim.betas=[0.9,0.999]")
    if o.name == "sgd" and o.nesterov and o.momentum == 0:
        raise ConfigError("optim.nesterov=true needs optim.momentum > 0")


def _check_run_length(cfg) -> None:
    t = cfg.train
    if t.epochs == 0 and t.max_steps == 0:
        raise ConfigError("set train.epochs or train.max_steps to something > 0")
    if t.max_steps:
        check_steps_reachable(cfg, t.max_steps, "train.max_steps")


def check_steps_reachable(cfg, total_steps: int, why: str) -> None:
    """Refuse a stop or a fault at a step past the run's last, `total_steps` (`why`: where that
    number comes from). validate() checks runs of train.max_steps; a run counted in epochs learns
    its length from the data, so its builder calls this once it knows."""
    t, f = cfg.train, cfg.fault
    fault_at = f.at_step if max(f.kill_rank, f.hang_rank, f.perturb_rank) >= 0 else 0
    for key, step in (("train.stop_at_step", t.stop_at_step), ("fault.at_step", fault_at),
                      ("fault.nan_at_step", f.nan_at_step)):
        if step > total_steps:
            raise ConfigError(f"{key}={step} is past the run's last step ({why}: "
                              f"{total_steps}): it would never happen")


def _check_reliability(cfg) -> None:
    t = cfg.train
    if cfg.dist.timeout_s < 1:
        raise ConfigError(f"dist.timeout_s={cfg.dist.timeout_s:g} is too short for ranks to meet "
                          "(connecting to the rendezvous store alone can take longer); use >= 1")
    if t.resume not in ("auto", "never") and not os.path.isfile(t.resume):
        raise ConfigError(f"train.resume={t.resume!r} is not auto, never or an existing checkpoint "
                          "file")


def _check_faults(cfg) -> None:
    """Fault injection that would silently do nothing. (Ranks past the world size: fault.py,
    which knows it.)"""
    f = cfg.fault
    ranks = {k: getattr(f, k) for k in ("kill_rank", "hang_rank", "perturb_rank", "nan_rank")}
    for key, rank in ranks.items():
        if rank < -1 or (key == "nan_rank" and rank < 0):
            raise ConfigError(f"fault.{key}={rank} must be a rank (>= 0)"
                              + ("" if key == "nan_rank" else " or -1 for none"))
    armed = max(f.kill_rank, f.hang_rank, f.perturb_rank) >= 0
    if armed and f.at_step == 0:
        raise ConfigError("fault.kill_rank / fault.hang_rank / fault.perturb_rank need "
                          "fault.at_step=<step> (1-based)")
    unread = [("fault.at_step", f.at_step, 0, "fault.kill_rank / hang_rank / perturb_rank", armed),
              ("fault.hang_s", f.hang_s, 0.0, "fault.hang_rank", f.hang_rank >= 0),
              ("fault.nan_rank", f.nan_rank, 0, "fault.nan_at_step", f.nan_at_step > 0),
              ("fault.nan_value", f.nan_value, "nan", "fault.nan_at_step", f.nan_at_step > 0)]
    for key, value, default, needs, read in unread:
        if not read and value != default:
            raise ConfigError(f"{key}={_text(value)} has no effect without {needs}; set that "
                              "too, or leave it out")


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
