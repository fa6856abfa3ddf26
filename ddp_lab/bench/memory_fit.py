"""Will it fit? Bytes of weights, gradients, optimizer states and master copies per way of
training or serving a model, and how many GPUs that takes: the seed's "a model must fit in VRAM"
table for GPT-3 175B and LLaMA-2 70B, reproduced and corrected. Pure arithmetic (runs anywhere);
`measure=true` on a GPU also runs training steps and compares the predicted peak with
`torch.cuda.max_memory_allocated`.

    python -m ddp_lab.bench.memory_fit                                  # GPT-3 175B, LLaMA-2 70B
    python -m ddp_lab.bench.memory_fit models=[resnet50,vit_b_16] gpu_gb=80
    python -m ddp_lab.bench.memory_fit models=[] params=[1e9]           # a raw parameter count
    python -m ddp_lab.bench.memory_fit measure=true                     # predicted vs measured
    python -m ddp_lab.bench.memory_fit models=[llama2_70b] gpu_gb=80 zero_stages=[1,2,3]
    python -m ddp_lab.bench.memory_fit measure_zero=[0,1,2,3] measure_precisions=[bf16]  # a GPU

Schemes (bytes per parameter, Adam; see ddp_lab.perf.memory):
  fp32_train   4 weights + 4 grads + 8 Adam                         = 16
  mixed_train  2 fp16/bf16 weights + 2 grads + 4 fp32 master + 8 Adam = 16  (the "usual 16")
  amp_train    torch.autocast as ddp_lab does it: fp32 weights/grads/Adam = 16, + 2 transient
  bf16_train   pure bf16 weights, grads and Adam states               = 8
  *_infer      weights only: fp32 4, bf16/fp16 2, int8 1
`gpus` = ceil(total / gpu_gb): perfect sharding (ZeRO-3/FSDP or tensor/pipeline parallelism), a
lower bound. Activations, KV cache, workspaces and fragmentation come on top; plain data
parallelism (DDP, this lab) shards nothing, so each GPU must hold the whole `total`.

ZeRO (table `zero`, the Ultra-Scale Playbook's): per GPU at each of `zero_gpus` data-parallel
ranks, and how many GPUs of `gpu_gb` GB stage s needs for the training state to fit (`gpus`;
`never` where what stays whole is already too big). Mixed precision + Adam, P parameters:
  stage 0  16P              (plain data parallelism)
  stage 1   4P + 12P/N      (optimizer states and fp32 master copy sharded; ddp_lab sync.zero=1)
  stage 2   2P + 14P/N      (gradients too; sync.zero=2)
  stage 3       16P/N       (weights too: ZeRO-3 / FSDP; sync.zero=3)

`measure_zero` (table `zero_measured`, ddp_lab/bench/zero_peak.py): each stage trained by
ddp_lab's loop at world size 1, the bytes held (counted) and the peak, predicted and measured.
`measure_overrides` adds training overrides to those runs, e.g. cuDNN's autotuner off to see
what its workspaces add to the peak (`'measure_overrides=["train.cudnn_benchmark=false"]'`);
what the prediction reads (model, batch, precision, sync, optimizer, data) is refused there.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
from hydra.core.config_store import ConfigStore

from ddp_lab.bench.common import entry, plot_lines, report, resolve_device, series_of, write_info
from ddp_lab.config import ConfigError
from ddp_lab.perf import memory as mem

GB = mem.GB

# (row name, training scheme or None for inference, inference dtype)
SCHEME_ROWS = [
    ("fp32_train", "fp32", None), ("mixed_train", "mixed", None), ("amp_train", "torch_amp", None),
    ("bf16_train", "bf16", None), ("fp32_infer", None, "fp32"), ("bf16_infer", None, "bf16"),
    ("fp16_infer", None, "fp16"), ("int8_infer", None, "int8"),
]

# The seed article's table (GB): FP32 and "after mixed-precision optimisation", and its "at least
# 4 A100 80GB".
SEED_TABLE = {"gpt3_175b": (700.0, 280.0), "llama2_70b": (280.0, 112.0)}


@dataclass
class MemoryFitConfig:
    models: list[str] = field(default_factory=lambda: ["gpt3_175b", "llama2_70b"])
    params: list[float] = field(default_factory=list)  # raw parameter counts, e.g. [1e9, 7e9]
    optimizer: str = "adam"  # adam | adamw | sgd_momentum | sgd
    gpu_gb: float = 141.0  # H200; 80 for A100/H100 80GB
    seed_table: bool = True  # print the seed's table next to ours (for gpt3_175b / llama2_70b)
    seed_gpu_gb: float = 80.0  # the seed's A100 80GB
    measure: bool = False  # run training steps and compare predicted vs measured peak memory
    device: str = "auto"  # for measure
    measure_model: str = "alexnet"  # a ddp_lab model (alexnet | alexnet_cifar)
    measure_batch: int = 256
    measure_precisions: list[str] = field(default_factory=lambda: ["fp32", "bf16"])
    measure_channels_last: bool = True
    measure_steps: int = 5
    # ZeRO stages (0-3) to train with ddp_lab's own loop (sync=ring, AdamW) at world size 1:
    # predicted vs measured peak, and the bytes held, counted from storages
    measure_zero: list[int] = field(default_factory=list)
    # training overrides every measure_zero run gets last, e.g. ["train.cudnn_benchmark=false"]
    measure_overrides: list[str] = field(default_factory=list)
    zero_stages: list[int] = field(default_factory=lambda: [0, 1, 2, 3])  # [] leaves the table out
    zero_gpus: list[int] = field(default_factory=lambda: [8, 64, 1024])  # N for the per-GPU GB
    zero_scheme: str = "mixed"  # fp32 | mixed | torch_amp | bf16 (ddp_lab.perf.memory.SCHEMES)
    plot: bool = False


ConfigStore.instance().store(name="bench_memory_fit_schema", node=MemoryFitConfig)


def fit_rows(name: str, params: float, optimizer: str, gpu_gb: float) -> list[dict]:
    rows = []
    for label, scheme, dtype in SCHEME_ROWS:
        if scheme is not None:
            b = mem.training_bytes(params, scheme, optimizer)
        else:
            w = mem.inference_bytes(params, dtype)
            b = {"weights": w, "grads": 0.0, "optimizer": 0.0, "master": 0.0, "transient": 0.0,
                 "total": w, "bytes_per_param": mem.BYTES[dtype]}
        rows.append({"model": name, "params_b": params / 1e9, "scheme": label,
                     "bytes_per_param": b["bytes_per_param"], "weights_gb": b["weights"] / GB,
                     "grads_gb": b["grads"] / GB, "optim_gb": b["optimizer"] / GB,
                     "master_gb": b["master"] / GB, "transient_gb": b["transient"] / GB,
                     "total_gb": b["total"] / GB, "gpu_gb": gpu_gb,
                     "gpus": mem.gpus_needed(b["total"], gpu_gb),
                     "headroom_gb": gpu_gb - b["total"] / GB / mem.gpus_needed(b["total"], gpu_gb),
                     "fits_one_gpu": b["total"] <= gpu_gb * GB})
    return rows


def zero_rows(name: str, params: float, cfg) -> list[dict]:
    """Per-GPU bytes of each ZeRO stage at cfg.zero_gpus ranks, and the GPUs each stage needs."""
    rows = []
    for stage in cfg.zero_stages:
        row = {"model": name, "params_b": params / 1e9, "stage": stage}
        for n in cfg.zero_gpus:
            b = mem.zero_bytes(params, stage, n, cfg.zero_scheme, cfg.optimizer)
            row[f"gb_per_gpu_at_{n}"] = b["total"] / GB
        gpus = mem.gpus_for_zero(params, stage, cfg.gpu_gb, cfg.zero_scheme, cfg.optimizer)
        row |= {"gpu_gb": cfg.gpu_gb, "gpus": "never" if gpus is None else gpus}
        rows.append(row)
    return rows


def seed_rows(cfg) -> tuple[list[dict], list[str]]:
    """The seed's table next to the arithmetic, and what is wrong with it (computed, not typed in)."""
    rows = []
    for name, (seed_fp32, seed_mixed) in SEED_TABLE.items():
        nominal, actual = mem.PRESETS[name]
        half_w = mem.inference_bytes(nominal, "bf16")
        train = mem.training_bytes(nominal, "mixed", "adam")["total"]
        rows.append({"model": name, "params_b": nominal / 1e9, "arch_params_b": actual / 1e9,
                     "seed_fp32_gb": seed_fp32,
                     "fp32_weights_gb": mem.inference_bytes(nominal, "fp32") / GB,
                     "fp32_adam_train_gb": mem.training_bytes(nominal, "fp32", "adam")["total"] / GB,
                     "seed_mixed_gb": seed_mixed, "seed_b_per_param": seed_mixed * GB / nominal,
                     "fp16_weights_gb": half_w / GB, "mixed_adam_train_gb": train / GB,
                     "gpus_seed_mixed": mem.gpus_needed(seed_mixed * GB, cfg.seed_gpu_gb),
                     "gpus_fp16_infer": mem.gpus_needed(half_w, cfg.seed_gpu_gb),
                     "gpus_train": mem.gpus_needed(train, cfg.seed_gpu_gb),
                     "h200s_train": mem.gpus_needed(train, cfg.gpu_gb)})
    g, l = rows
    a = f"{cfg.seed_gpu_gb:g} GB"
    notes = [
        f"gpus_* columns count {a} GPUs (the seed's A100 80GB), h200s_train {cfg.gpu_gb:g} GB ones",
        f"seed FP32 column = weights only at 4 B/param ({g['params_b']:.0f}e9 x 4 = "
        f"{g['fp32_weights_gb']:.0f} GB): right for fp32 inference, not training. Training in fp32 "
        f"with Adam holds weights + grads + 2 moments = 16 B/param = {g['fp32_adam_train_gb']:.0f} GB "
        f"for GPT-3, {l['fp32_adam_train_gb']:.0f} GB for LLaMA-2 70B",
        f"seed 'mixed precision' column = {g['seed_b_per_param']:.1f} B/param, which is no format: "
        f"fp16/bf16 weights alone are 2 B/param ({g['fp16_weights_gb']:.0f} / "
        f"{l['fp16_weights_gb']:.0f} GB). Mixed-precision training does not shrink the training "
        "state: 2 + 2 + 4 master + 8 Adam = 16 B/param, the same as fp32; it saves activation "
        "memory and time (tensor cores), not weight memory",
        f"seed's 'at least 4 A100 80GB': {g['gpus_seed_mixed']} x {a} only covers its own "
        f"{g['seed_mixed_gb']:.0f} GB. GPT-3 needs {g['gpus_fp16_infer']} such GPUs just for fp16 "
        f"weights and >= {g['gpus_train']} to train with Adam, before activations; LLaMA-2 70B "
        f"needs {l['gpus_fp16_infer']} for bf16 weights and >= {l['gpus_train']} to train",
        "and those GPUs must shard the model (ZeRO-3/FSDP, tensor or pipeline parallelism): data "
        "parallelism alone (DDP) keeps a full copy on every GPU",
        f"nominal parameter counts as in the seed; from the published shapes GPT-3 has "
        f"{g['arch_params_b']:.1f} B, LLaMA-2 70B {l['arch_params_b']:.1f} B (arch_params_b)",
        "GB = 1e9 B (the seed's unit); an 'A100 80GB' has 80 GiB = 85.9e9 B",
    ]
    return rows, notes


# training keys a measure_zero run's prediction is made from (ddp_lab/bench/zero_peak.py)
MEASURE_OWNED = ("model", "precision", "sync", "optim", "data", "train.batch_size",
                 "train.max_steps", "train.channels_last")


def image_shape(cfg) -> tuple[int, int]:
    """(image size, classes) of cfg.measure_model, after checking the measure_* keys."""
    from ddp_lab.perf.compute import MODEL_DEFAULTS
    from ddp_lab.models import MODELS

    if cfg.measure_model not in MODELS:
        raise ConfigError(f"measure_model={cfg.measure_model!r} is not one of {', '.join(MODELS)}")
    if cfg.measure_batch <= 0 or cfg.measure_steps <= 0:
        raise ConfigError("measure_batch and measure_steps must be > 0")
    bad = [p for p in cfg.measure_precisions if p not in mem.PRECISION_SCHEME]
    if bad:
        raise ConfigError(f"measure_precisions: {bad[0]!r} is not one of "
                          f"{', '.join(mem.PRECISION_SCHEME)}")
    # the prediction reads these from the measure_* keys: an override would train another run
    owned = [o for o in cfg.measure_overrides if o.split("=")[0].lstrip("+~").startswith(
        MEASURE_OWNED)]
    if owned:
        raise ConfigError(f"measure_overrides: {owned[0]!r} sets what the measure_* keys (and "
                          "the runs' sync=ring, AdamW, synthetic data) decide; set those instead")
    return MODEL_DEFAULTS[cfg.measure_model]


def measure_rows(cfg) -> list[dict]:
    """Predicted (ddp_lab.perf.memory) vs measured peak memory of the bare training loop."""
    from ddp_lab.bench.bare import bare_loop
    from ddp_lab.bench.train_throughput import row_overrides
    from ddp_lab.cli import compose
    from ddp_lab.models import MODELS

    device = resolve_device(cfg.device)
    size, classes = image_shape(cfg)
    rows = []
    for precision in cfg.measure_precisions:
        model = MODELS[cfg.measure_model](num_classes=classes)
        pred = mem.predict_training_memory(model, cfg.measure_batch, size, precision,
                                           "sgd_momentum", cfg.measure_channels_last)
        del model
        tcfg = compose(row_overrides(
            cfg.measure_model, precision, cfg.measure_channels_last, False, cfg.measure_batch,
            cfg.measure_steps, 2, device, 0))
        out = bare_loop(tcfg, device, steps=cfg.measure_steps, warmup=2)
        row = {"model": cfg.measure_model, "batch": cfg.measure_batch, "precision": precision,
               **{f"pred_{k}_gb": v / GB for k, v in pred.items()
                  if k not in ("params", "activations_per_sample")},
               "measured_peak_gb": out["peak_mem_bytes"] / GB}
        row["measured_over_pred"] = row["measured_peak_gb"] / row["pred_total_gb"]
        rows.append(row)
    return rows


def _check_zero_stages(stages, key: str, allowed) -> None:
    if any(s not in allowed for s in stages):
        raise ConfigError(f"{key}={list(stages)}: stages are {', '.join(map(str, allowed))}")


def _check_zero(cfg) -> None:
    _check_zero_stages(cfg.zero_stages, "zero_stages", mem.ZERO_STAGES)
    if cfg.zero_scheme not in mem.SCHEMES:
        raise ConfigError(f"zero_scheme={cfg.zero_scheme!r} is not one of {', '.join(mem.SCHEMES)}")
    if not cfg.zero_gpus or min(cfg.zero_gpus) < 1:
        raise ConfigError(f"zero_gpus={list(cfg.zero_gpus)} must be GPU counts >= 1")


def run(cfg, run_dir: str) -> list[dict]:
    if cfg.optimizer not in mem.OPTIMIZER_STATES:
        raise ConfigError(f"optimizer={cfg.optimizer!r} is not one of {', '.join(mem.OPTIMIZER_STATES)}")
    if cfg.gpu_gb <= 0:
        raise ConfigError(f"gpu_gb={cfg.gpu_gb} must be > 0")
    _check_zero_stages(cfg.measure_zero, "measure_zero", mem.ZERO_STAGES)
    if cfg.measure or cfg.measure_zero:
        image_shape(cfg)  # bad measure_* keys fail before any table
    entries = []
    for name in cfg.models:
        try:
            entries.append((name, mem.count_parameters(name)))
        except ValueError as e:
            raise ConfigError(str(e)) from None
    entries += [(f"{p:.3g} params", float(p)) for p in cfg.params]
    if not entries:
        raise ConfigError("nothing to estimate: give models=[...] or params=[...]")

    rows = [r for name, p in entries for r in fit_rows(name, p, cfg.optimizer, cfg.gpu_gb)]
    report(rows, run_dir, "memory_fit",
           ["model", "params_b", "scheme", "bytes_per_param", "weights_gb", "grads_gb", "optim_gb",
            "master_gb", "total_gb", "gpus", "headroom_gb", "fits_one_gpu"],
           title=f"memory to train / serve, optimizer {cfg.optimizer}, {cfg.gpu_gb:g} GB GPUs",
           notes=["gpus = ceil(total / gpu_gb) with perfect sharding: a lower bound; activations, "
                  "KV cache, workspaces and fragmentation come on top, and must fit in headroom_gb "
                  "(what is left per GPU)",
                  "amp_train also makes 16-bit weight copies each step (transient_gb in the files)"])
    if cfg.zero_stages:
        _check_zero(cfg)
        zrows = [r for name, p in entries for r in zero_rows(name, p, cfg)]
        report(zrows, run_dir, "zero",
               ["model", "params_b", "stage", *(f"gb_per_gpu_at_{n}" for n in cfg.zero_gpus),
                "gpu_gb", "gpus"],
               title=f"ZeRO: training state per GPU (GB), {cfg.zero_scheme} + {cfg.optimizer}",
               notes=["stage 1 shards optimizer states and master copies, 2 gradients too, 3 "
                      "weights too (FSDP); gpus = the fewest GPUs of gpu_gb for which the state "
                      "fits, before activations ('never': the unsharded part alone is too big)"])
    if cfg.seed_table and any(name in SEED_TABLE for name, _ in entries):
        srows, notes = seed_rows(cfg)
        report(srows, run_dir, "seed_table", title="the seed's table vs ours (GB)", notes=notes)
    if cfg.measure:
        mrows = measure_rows(cfg)
        report(mrows, run_dir, "memory_measured",
               ["model", "batch", "precision", "pred_weights_gb", "pred_grads_gb",
                "pred_optimizer_gb", "pred_autocast_copies_gb", "pred_input_gb",
                "pred_activations_gb", "pred_total_gb", "measured_peak_gb", "measured_over_pred"],
               title="predicted vs measured peak memory of a training step (bare loop)",
               notes=["measured = torch.cuda.max_memory_allocated over the timed steps (nan on "
                      "the CPU); the difference is cuDNN/cuBLAS workspaces, gradient temporaries "
                      "and the allocator's rounding"])
    if cfg.measure_zero:
        from ddp_lab.bench import zero_peak

        zero_peak.report_measured(cfg, run_dir)
    if cfg.plot:
        series = series_of(rows, "scheme", "params_b", "total_gb")
        plot_lines(series, os.path.join(run_dir, "memory_fit.png"), xlabel="parameters (B)",
                   ylabel="GB", title="memory by scheme", logx=True, logy=True)
    write_info(run_dir, "memory_fit", cfg, torch.device("cpu") if not cfg.measure
               else resolve_device(cfg.device))
    return rows


main = entry(run, "bench/memory_fit")


if __name__ == "__main__":
    main()
