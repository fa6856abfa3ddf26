"""Typed configuration: the schema Hydra validates every composed config against.

The YAML files in `conf/` choose values; the dataclasses say which keys exist and what type each
has, so a misspelled key or a string where a number belongs fails at composition with Hydra's own
message. Each group's dataclass lives with the code that reads it, its keys declared with their
rules (`ddp_lab.keys.key`), and its checks that need several keys at once beside it (`check_*`).
`validate` runs them all before anything runs; a `ConfigError` is printed as one line, exit 2.

    model      ddp_lab/models/config.py    data       ddp_lab/data/config.py
    sync       ddp_lab/sync/config.py      precision  ddp_lab/precision.py
    optim      ddp_lab/optim.py            dist       ddp_lab/dist.py
    fault      ddp_lab/fault.py            train      here
"""

from __future__ import annotations

import os
import typing
from dataclasses import dataclass, field, fields, is_dataclass

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from ddp_lab.data.config import DataConfig, check_data
from ddp_lab.dist import DistConfig, check_dist
from ddp_lab.errors import ConfigError
from ddp_lab.fault import FaultConfig, check_fault
from ddp_lab.keys import check_keys, key
from ddp_lab.models.config import ModelConfig, check_model
from ddp_lab.optim import OptimConfig, check_optim
from ddp_lab.precision import PrecisionConfig, check_precision
from ddp_lab.sync.config import SyncConfig, check_sync


@dataclass
class TrainConfig:
    epochs: int = key(10, at_least=0)
    max_steps: int = key(0, at_least=0)  # > 0 overrides epochs
    batch_size: int = key(64, positive=True)  # per rank, per micro-step
    # micro-steps per optimizer step; only the last communicates
    accum_steps: int = key(1, positive=True)
    # steps between metrics.jsonl / TensorBoard rows; the last is always logged
    log_every: int = key(10, positive=True)
    # steps left out of timing statistics (a run this short reports none)
    timing_warmup: int = key(5, at_least=0)
    # timed backward passes without communication (0: skip)
    calibrate_steps: int = key(5, at_least=0)
    eval_every_epochs: int = key(1, at_least=0)  # 0: evaluate only at the end
    channels_last: bool = False
    compile: bool = False
    compile_mode: str = key("default", choices=("default", "reduce-overhead", "max-autotune",
                                                "max-autotune-no-cudagraphs"),
                            only_with=("compile", (True,)))
    # Capture the whole step (forward, backward, guard, optimizer) as one CUDA graph and replay
    # it: for host-bound small models. CUDA, sync=none, no GradScaler (ddp_lab/graph.py).
    cuda_graph: bool = False
    cudnn_benchmark: bool = True  # CUDA only
    progress: bool = True  # progress bar on rank 0
    resume: str = "auto"  # auto | never | path to a checkpoint (sharded: its directory)
    # > 0: stop at this step as if interrupted (checkpoint written)
    # (a step past the run's last is refused: check_steps_reachable)
    stop_at_step: int = key(0, at_least=0)
    # steps between checkpoints; 0: end of each epoch and at the end
    checkpoint_every: int = key(0, at_least=0)
    # also keep checkpoint_step<N>.pt every this many steps; 0: never
    keep_every: int = key(0, at_least=0)
    # fp32/bf16 inf/NaN loss or grads: skip the step on every rank | stop | off (no per-step
    # check, whose read pass shows on a graphed AlexNet-CIFAR step: docs/results/h200-loop-vs-bare;
    # checkpoints still refuse NaN)
    nonfinite: str = key("skip", choices=("skip", "stop", "off"))
    # steps between cross-rank parameter checksums; 0: never
    consistency_every: int = key(100, at_least=0)
    # Record a timeline of train.trace_steps consecutive steps after the timing warm-up on every
    # rank: trace.json (Perfetto), timeline.png and summary.json's overlap block (ddp_lab/trace.py).
    trace: bool = False
    trace_steps: int = key(3, positive=True, only_with=("trace", (True,)))


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


def validate(cfg) -> None:
    """Reject, before anything runs, values that are well typed but cannot be honoured, alone or
    together: one line naming the key and what to do."""
    check_keys(cfg, Config)
    for check in (check_model, check_data, check_precision, check_sync, check_optim, check_train,
                  check_dist, check_fault):
        check(cfg)


def check_train(cfg) -> None:
    t = cfg.train
    if t.epochs == 0 and t.max_steps == 0:
        raise ConfigError("set train.epochs or train.max_steps to something > 0")
    if t.max_steps:
        check_steps_reachable(cfg, t.max_steps, "train.max_steps")
    if t.resume not in ("auto", "never") and not os.path.exists(t.resume):
        raise ConfigError(f"train.resume={t.resume!r} is not auto, never or an existing checkpoint "
                          "(a file, or a sharded checkpoint's directory)")


def check_steps_reachable(cfg, total_steps: int, why: str) -> None:
    """Refuse a stop or a fault at a step past the run's last, `total_steps` (`why`: where that
    number comes from). validate() checks runs of train.max_steps; a run counted in epochs learns
    its length from the data, so its builder calls this once it knows."""
    t, f = cfg.train, cfg.fault
    fault_at = f.at_step if max(f.kill_rank, f.hang_rank, f.perturb_rank) >= 0 else 0
    for name, step in (("train.stop_at_step", t.stop_at_step), ("fault.at_step", fault_at),
                       ("fault.nan_at_step", f.nan_at_step)):
        if step > total_steps:
            raise ConfigError(f"{name}={step} is past the run's last step ({why}: "
                              f"{total_steps}): it would never happen")


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
