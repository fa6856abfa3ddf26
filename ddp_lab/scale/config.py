"""Typed schema of `conf/scale.yaml` (the sweep driver's own config; each point's training config
is `conf/config.yaml` plus the overrides the sweep passes to it)."""

from __future__ import annotations

from dataclasses import dataclass, field

from hydra.core.config_store import ConfigStore

from ddp_lab.buckets import DEFAULT_BUCKET_MB
from ddp_lab.errors import ConfigError
from ddp_lab.perf.step import ZERO_OPS


@dataclass
class PredictConfig:
    table: str = ""  # allreduce.jsonl/.csv of `python -m ddp_lab.bench.allreduce`; "": calibrate
    calibrate: bool = True  # no table: time all-reduces at each world size of the sweep first
    sizes_kb: list[int] = field(default_factory=list)  # calibration message sizes; []: by device
    max_regimes: int = 3  # message-size regimes the fit may use (it uses the fewest that fit)
    probe: bool = True  # measure interference at each world size > 1 (ddp_lab/scale/interfere.py)
    probe_rounds: int = 4  # timed rounds of the probe's conditions (after one warm-up round)
    # World sizes whose calibration and probes predict every point (ddp_lab/perf/predict.py):
    # [1, 2, 4] in a sweep to 8 calibrates and probes at 2 and 4 only and extrapolates N=8,
    # which still runs, to be compared. []: each N from its own measurements.
    from_nproc: list[int] = field(default_factory=list)
    timeout_s: float = 300.0


@dataclass
class SimConfig:
    world_sizes: list[int] = field(default_factory=lambda: [8, 16, 32, 64, 128, 256, 512, 1024])
    models: list[str] = field(default_factory=lambda: ["alexnet", "alexnet_cifar", "resnet50",
                                                       "vgg16"])
    networks: list[str] = field(default_factory=lambda: ["ib400", "ib100", "eth25", "measured"])
    network: str = "ib400"  # the one whose tables are printed in full
    grad_dtypes: list[str] = field(default_factory=lambda: ["fp32", "bf16"])
    bucket_mb: float = DEFAULT_BUCKET_MB
    bucket_sweep: list[float] = field(default_factory=lambda: [1.0, 5.0, 10.0, 25.0, 50.0, 100.0,
                                                               250.0, 0.0])  # 0: one bucket
    batch_per_gpu: int = 256
    overlap: bool = True
    # Results files of one GPU's measured training throughput (a train_throughput table, a run's
    # summary.json; paths from the repository's root): the compute each model's communication
    # has to hide behind. The default: 224 px AlexNet, bf16 + channels_last, batch 256, on an H200.
    compute_from: list[str] = field(default_factory=lambda: [
        "docs/results/h200-loop-vs-bare/restructured/a224/this_1.jsonl"])
    # Single-GPU training throughput (img/s at batch_per_gpu) for a model no file measured: these
    # defaults are assumptions (H100/H200-class, bf16 autocast); a value given here is used as
    # given, before any file's.
    img_per_s: dict[str, float] = field(default_factory=lambda: {
        "alexnet": 12000.0, "alexnet_cifar": 60000.0, "resnet50": 3000.0, "resnet101": 1700.0,
        "vgg16": 1100.0})
    use_measured: bool = True  # a model the sweep ran at N=1 on a GPU: its measured compute
    # GPUs: NCCL's kernels take SMs and memory bandwidth from backward while they overlap it, and
    # backward's kernels from NCCL. Not measured here yet (the probe needs 2+ GPUs): an assumption
    # (backward and all-reduce slowdowns while both run), shown with a band from band[0] to
    # band[1] for both.
    interference: dict[str, float] = field(default_factory=lambda: {"compute": 1.05,
                                                                    "comm": 1.1})
    interference_band: list[float] = field(default_factory=lambda: [1.0, 1.3])
    # ZeRO (ddp_lab/perf/simulate.py): the stages compared, the model sizes (billions of
    # parameters: AlexNet, GPT-2 XL, 7B, 13B, 70B, GPT-3) and the GPU memory they must fit.
    zero_stages: list[int] = field(default_factory=lambda: [0, 1, 2, 3])
    zero_params_b: list[float] = field(default_factory=lambda: [0.061, 1.5, 7.0, 13.0, 70.0,
                                                                175.0])
    gpu_gb: float = 80.0


def check_sim(sim) -> None:
    """sim's ZeRO keys, before any work."""
    bad = [s for s in sim.zero_stages if s not in ZERO_OPS]
    if bad:
        raise ConfigError(f"sim.zero_stages: {bad} not among the simulated stages "
                          f"{sorted(ZERO_OPS)}")
    if float(sim.gpu_gb) <= 0 or any(float(b) <= 0 for b in sim.zero_params_b):
        raise ConfigError("sim.gpu_gb and every sim.zero_params_b must be > 0")


def check_from_nproc(from_nproc, sizes) -> tuple[int, ...]:
    """predict.from_nproc against the sweep's world sizes `sizes`, before any work: as a
    tuple; () where it is empty."""
    listed, sizes = tuple(sorted({int(n) for n in from_nproc})), sorted(set(sizes))
    outside = [n for n in listed if n not in sizes]
    if outside:
        raise ConfigError(f"predict.from_nproc={list(from_nproc)}: N={outside} not among the "
                          f"sweep's world sizes {sizes}")
    unseen = [n for n in sizes if n > 1 and n not in listed]
    if listed and unseen and sum(n > 1 for n in listed) < 2:
        raise ConfigError(f"predict.from_nproc={list(from_nproc)}: predicting N={unseen} needs "
                          "at least 2 world sizes > 1 to fit how the all-reduce grows with N")
    return listed


@dataclass
class ScaleConfig:
    nproc: list[int] = field(default_factory=list)  # world sizes; []: 1, 2, 4, ... local GPUs/cpu_procs
    cpu_procs: int = 2  # largest CPU world size of the automatic list
    syncs: list[str] = field(default_factory=lambda: ["ddp", "naive", "ring", "tree"])
    sweep: list[str] = field(default_factory=list)  # extra swept settings, each "k=v k=v": a series
    args: list[str] = field(default_factory=list)  # overrides for every point
    mode: str = "weak"  # weak: fixed per-GPU batch | strong: fixed global batch
    global_batch: int = 0  # strong: the fixed global batch; 0: per-rank batch x largest world size
    profile: str = "auto"  # auto | cpu | gpu: default point settings (model, batch, steps, ...)
    point_timeout_s: float = 0.0  # 0: 300 on CPU, 600 on GPU
    threads_per_rank: int = 0  # CPU points: OMP threads per rank, the same at every N; 0: auto
    keep_checkpoints: bool = False  # points' checkpoints are deleted after reading the summary
    emit: str = "none"  # none | torchrun | slurm: print multi-node command lines instead of running
    nodes: list[int] = field(default_factory=lambda: [1, 2, 4])  # emit: node counts
    gpus_per_node: int = 0  # emit: 0 = local GPU count (8 without GPUs)
    collect: list[str] = field(default_factory=list)  # point run dirs to tabulate instead of running
    # Passes over every point (each followed by its interference probe); a row is the point's
    # median pass: a shared machine's load drifts over minutes. 0: 3 on a machine of <= 4 cores
    # or one busy as the sweep starts (1-minute load average above half its cores), else 1.
    repeats: int = 0
    simulate: str = "true"  # true: sweep then simulation | false | only: simulation alone
    env: dict[str, str] = field(default_factory=lambda: {"NCCL_NVLS_ENABLE": "0"})  # setdefault'ed
    predict: PredictConfig = field(default_factory=PredictConfig)
    sim: SimConfig = field(default_factory=SimConfig)


def register_scale_config() -> None:
    ConfigStore.instance().store(name="scale_schema", node=ScaleConfig)
