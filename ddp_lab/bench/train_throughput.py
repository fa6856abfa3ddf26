"""Training throughput of the ddp_lab loop against a minimal bare PyTorch loop, side by side in one
process: same model, batch, precision, channels_last, compile, optimizer (SGD momentum), synthetic
data already on the device. A matrix over precision x channels_last x compile x batch.

    python -m ddp_lab.bench.train_throughput                                  # 224 px AlexNet, GPU
    python -m ddp_lab.bench.train_throughput precisions=[bf16] channels_last=[true] compile=[true]
    python -m ddp_lab.bench.train_throughput net=alexnet_cifar batches=[512,2048]
    python -m ddp_lab.bench.train_throughput profile=true                    # top kernels per precision
    python -m ddp_lab.bench.train_throughput device=cpu                      # AlexNet-CIFAR, tiny

The two sides of a row:
- ddp: `ddp_lab.train.train(cfg, run_dir)` in-process with data=synthetic sync=none, composed from
  conf/ like the CLI would; its `train_img_per_s` counts timed steps only (its StepTimer: CUDA
  events, `timing_warmup` steps left out, and the clock restarted after evaluation and
  checkpointing, which therefore do not count).
- bare: `bare_loop` (ddp_lab/bench/bare.py), the reference: one fixed random batch on the device,
  autocast forward, (scaled) backward, optimizer step, zero_grad(set_to_none). CUDA events at each
  step boundary (no host sync inside the timed steps), warm-up steps left out.
img/s = batch * steps / sum(step times) for both (`ratio`: of the medians over repeats), and
batch / median step (`ratio_med`). With repeats, `ratio_paired` is the median of each repeat's
own ratio (its two loops ran back to back, so slow drift of a shared host cancels), and
`ratio_lo`..`ratio_hi` their range: the noise, in the table; `ratio_med_paired` the same median
of each repeat's ratio of median steps.
The ddp side also pays for what a real loop does: indexing its data pool, labels, LR schedule,
loss bookkeeping, a step timer; the ratio is that overhead. Where the host bounds the step (a
small model, eager), a shared host moves it by a few percent from run to run, and single repeats
by far more, even pinned to an idle core: pin it (`scripts/loop_overhead.sh`), use repeats, and
read `ratio_paired` / `ratio_med_paired`.

MFU = achieved / peak, achieved = FLOPs per image per training step (counted by
`ddp_lab.perf.compute`) x img/s; `mfu_sheet` against the datasheet peak of the precision,
`mfu_gemm` against the best GEMM measured by `ddp_lab.bench.gemm` (`gemm_results=.../gemm.jsonl`).
`pred_mem_gb` is `ddp_lab.perf.memory`'s predicted peak of a step, `peak_mem_gb` what the bare
loop's steps reached (`torch.cuda.max_memory_allocated`, CUDA only).

Profile (`profile=true`): a torch.profiler pass of the bare loop per precision (eager, first
batch and channels_last value), listing the top CUDA kernels by time. `tensor_core` is a name
heuristic, see `ddp_lab.bench.kernels.is_tensor_core_kernel`.
"""

from __future__ import annotations

import itertools
import os
import statistics
from dataclasses import dataclass, field

import torch
from hydra.core.config_store import ConfigStore

from ddp_lab.bench.bare import bare_loop, free_memory
from ddp_lab.bench.common import entry, plot_lines, report, resolve_device, write_info, write_rows
from ddp_lab.bench.kernels import profile_pass
from ddp_lab.cli import compose
from ddp_lab.config import ConfigError


@dataclass
class TrainThroughputConfig:
    device: str = "auto"  # auto | cpu | cuda
    # (not model= / precision=: those are config groups in conf/, which this app shares)
    net: str = "alexnet"  # alexnet | alexnet_cifar
    precisions: list[str] = field(default_factory=lambda: ["fp32", "tf32", "fp16", "bf16"])
    channels_last: list[bool] = field(default_factory=lambda: [False, True])
    compile: list[bool] = field(default_factory=lambda: [False])
    # Whole-step CUDA graph (train.cuda_graph), on both sides; CUDA only, not with fp16
    cuda_graph: list[bool] = field(default_factory=lambda: [False])
    batches: list[int] = field(default_factory=lambda: [256])
    steps: int = 30  # timed steps per loop
    warmup: int = 10  # steps before timing (cuDNN autotuning, compilation)
    # What runs instead when device resolves to cpu (a CPU cannot do 224 px AlexNet quickly):
    cpu_net: str = "alexnet_cifar"
    cpu_precisions: list[str] = field(default_factory=lambda: ["fp32", "bf16"])
    cpu_batches: list[int] = field(default_factory=lambda: [16])
    cpu_steps: int = 5
    cpu_warmup: int = 2
    repeats: int = 1  # alternate bare/ddp this many times per row; medians reported
    # Extra overrides of the composed config. The ddp_lab loop runs it; the bare loop takes its
    # model (model.stem too), precision and optimizer values from it.
    ddp_overrides: list[str] = field(default_factory=list)
    seed: int = 0
    predict_memory: bool = True
    gemm_results: str = ""  # a gemm.jsonl from ddp_lab.bench.gemm: measured peaks for mfu_gemm
    matrix: bool = True  # false: skip the throughput matrix (e.g. profile only)
    keep_checkpoints: bool = False  # the ddp_lab side writes checkpoint.pt (large for AlexNet)
    profile: bool = False
    profile_steps: int = 5
    top_k: int = 12
    plot: bool = False


ConfigStore.instance().store(name="bench_train_throughput_schema", node=TrainThroughputConfig)


# ---- the ddp_lab config of a row ---------------------------------------------------------------

def row_overrides(model: str, precision: str, channels_last: bool, compile_: bool, batch: int,
                  steps: int, warmup: int, device: torch.device, seed: int,
                  extra: list[str] = (), cuda_graph: bool = False) -> list[str]:
    return [f"model={model}", "data=synthetic", "sync=none", f"precision={precision}",
            f"train.batch_size={batch}", f"train.channels_last={str(channels_last).lower()}",
            f"train.compile={str(compile_).lower()}", f"train.cuda_graph={str(cuda_graph).lower()}",
            f"train.max_steps={warmup + steps + cuda_graph}",  # the capture step is not timed
            f"train.timing_warmup={warmup}", "train.progress=false", "train.eval_every_epochs=0",
            "train.resume=never", f"train.log_every={warmup + steps + cuda_graph}",
            # one checkpoint, at the end: a small real set's epochs are a few steps each, and a
            # checkpoint per epoch (the default) would drain the GPU's queue every few steps
            f"train.checkpoint_every={warmup + steps + cuda_graph}",
            f"data.val_samples={batch}",  # evaluation is not timed; keep it short anyway
            f"data.num_samples={max(50_000, batch * (warmup + steps + 1))}",  # one epoch, no refill
            f"dist.backend={'nccl' if device.type == 'cuda' else 'gloo'}", f"seed={seed}", *extra]


def paired_ratios(ddps: list[dict], bares: list[dict]) -> dict:
    """ddp / bare img/s of each repeat (its two loops ran back to back): median and range; and
    the median of each repeat's ratio of median steps (blind to a few stalled steps)."""
    pairs = list(zip(ddps, bares, strict=True))
    ratios = [d["img_s"] / b["img_s"] for d, b in pairs]
    med_ratios = [d["img_s_med"] / b["img_s_med"] for d, b in pairs]
    return {"ratio_paired": statistics.median(ratios), "ratio_lo": min(ratios),
            "ratio_hi": max(ratios), "ratios": ratios,
            "ratio_med_paired": statistics.median(med_ratios)}


def ddp_loop(cfg, run_dir: str, keep_checkpoints: bool = False) -> dict:
    from ddp_lab.train import train

    if cfg.train.compile:
        torch._dynamo.reset()  # as for the bare loop: a fresh compile, no cache-limit fallback
    summary = train(cfg, run_dir)
    if not keep_checkpoints:
        for f in os.listdir(run_dir):
            if f.startswith("checkpoint") and f.endswith(".pt"):
                os.remove(os.path.join(run_dir, f))
    step_ms = summary["time_ms"].get("step", float("nan"))
    return {"img_s": summary["train_img_per_s"],
            "img_s_med": summary["global_batch"] / (step_ms / 1e3) if step_ms else float("nan"),
            "step_ms_med": step_ms, "timed_steps": summary["timed_steps"], "summary": summary}


# ---- the benchmark -----------------------------------------------------------------------------

@dataclass
class Bench:
    """What every row of one run shares: the device, the net and its sizes, FLOPs and peaks."""
    device: torch.device
    model: str  # a ddp_lab model name (net=, or cpu_net= on a CPU)
    precisions: list[str]
    batches: list[int]
    steps: int
    warmup: int
    size: int  # image side, px
    flops: float  # per image per training step
    dev_name: str
    measured: dict  # dtype -> the best GEMM TFLOP/s of gemm_results=, for mfu_gemm
    net: torch.nn.Module | None  # a CPU copy for the memory prediction (predict_memory=true)
    activations: dict = field(default_factory=dict)  # (precision, channels_last) -> bytes


def check_config(cfg, model: str, precisions, batches, steps: int, warmup: int) -> None:
    from ddp_lab.perf import memory as mem
    from ddp_lab.models import MODELS

    if model not in MODELS:
        raise ConfigError(f"net={model!r} is not one of {', '.join(MODELS)}")
    if steps <= 0 or warmup < 0 or cfg.repeats <= 0 or min(batches, default=0) <= 0:
        raise ConfigError("steps and repeats must be > 0, warmup >= 0, batches > 0")
    bad = [p for p in precisions if p not in mem.PRECISION_SCHEME]
    if bad:
        raise ConfigError(f"precision {bad[0]!r} is not one of {', '.join(mem.PRECISION_SCHEME)}")


def build_bench(cfg) -> Bench:
    """The run's settings (the cpu_* ones on a CPU), checked, with what every row needs."""
    from ddp_lab.perf import compute
    from ddp_lab.models import MODELS

    device = resolve_device(cfg.device)
    on_cpu = device.type == "cpu"
    model = cfg.cpu_net if on_cpu else cfg.net
    precisions = cfg.cpu_precisions if on_cpu else cfg.precisions
    batches = cfg.cpu_batches if on_cpu else cfg.batches
    steps, warmup = (cfg.cpu_steps, cfg.cpu_warmup) if on_cpu else (cfg.steps, cfg.warmup)
    check_config(cfg, model, precisions, batches, steps, warmup)
    size = 224 if model == "alexnet" else 32
    classes = 1000 if model == "alexnet" else 10
    flops = compute.count_flops(MODELS[model](num_classes=classes), (3, size, size)).step
    dev_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    measured = {}
    if cfg.gemm_results:
        if not os.path.exists(cfg.gemm_results):
            raise ConfigError(f"gemm_results={cfg.gemm_results!r} does not exist")
        measured = compute.measured_peaks(cfg.gemm_results, device.type)  # this device's peaks
    net = MODELS[model](num_classes=classes) if cfg.predict_memory else None
    return Bench(device, model, precisions, batches, steps, warmup, size, flops, dev_name,
                 measured, net)


def matrix(cfg, b: Bench) -> list[tuple]:
    """The rows to run: (precision, channels_last, compile, cuda_graph, batch) each."""
    graphs = [g for g in cfg.cuda_graph if not (g and b.device.type == "cpu")]
    if len(graphs) < len(cfg.cuda_graph):
        print("cuda_graph=true rows skipped: CUDA graphs need a CUDA device", flush=True)
    combos = [c for c in itertools.product(b.precisions, cfg.channels_last, cfg.compile, graphs,
                                           b.batches)
              if not (c[3] and c[0] == "fp16")]  # fp16's GradScaler decides on the host
    return combos if cfg.matrix else []


def run_pair(cfg, b: Bench, tcfg, name: str, run_dir: str) -> tuple[list[dict], list[dict]]:
    """Both loops, `repeats` times, alternating which goes first; returns (bares, ddps)."""
    bares, ddps = [], []
    for rep in range(cfg.repeats):
        order = ("bare", "ddp") if rep % 2 == 0 else ("ddp", "bare")
        for side in order:
            free_memory(b.device)
            if side == "bare":
                bares.append(bare_loop(tcfg, b.device, b.steps, b.warmup))
            else:
                ddps.append(ddp_loop(tcfg, os.path.join(run_dir, "ddp_lab", f"{name}_r{rep}"),
                                     cfg.keep_checkpoints))
    return bares, ddps


def predicted_memory_gb(b: Bench, precision: str, cl: bool, batch: int) -> float:
    from ddp_lab.perf import memory as mem

    if (precision, cl) not in b.activations:  # the activation measurement is a CPU forward
        b.activations[(precision, cl)] = mem.activation_bytes(b.net, (3, b.size, b.size),
                                                              mem.AUTOCAST[precision], cl)
    pred = mem.predict_training_memory(b.net, batch, b.size, precision, "sgd_momentum", cl,
                                       activations=b.activations[(precision, cl)])
    return pred["total"] / 1e9


def make_row(b: Bench, combo: tuple, stem: str, bares: list[dict], ddps: list[dict]) -> dict:
    """One table row from both loops' repeats: img/s, ratios, TFLOP/s, MFU, memory, checks."""
    from ddp_lab.perf import compute

    precision, cl, comp, graph, batch = combo
    med = lambda xs, k: statistics.median(x[k] for x in xs)
    row = {"model": b.model, "stem": stem, "precision": precision,
           "channels_last": cl, "compile": comp, "cuda_graph": graph,
           "batch": batch, "steps": b.steps,
           "ddp_img_s": med(ddps, "img_s"), "bare_img_s": med(bares, "img_s")}
    # every repeat's throughput (and so a range): the medians above are of these
    row["ddp_img_s_runs"] = [x["img_s"] for x in ddps]
    row["bare_img_s_runs"] = [x["img_s"] for x in bares]
    row["ratio"] = row["ddp_img_s"] / row["bare_img_s"]
    row["ddp_img_s_med"], row["bare_img_s_med"] = med(ddps, "img_s_med"), med(bares, "img_s_med")
    row["ratio_med"] = row["ddp_img_s_med"] / row["bare_img_s_med"]
    row["ddp_step_ms"], row["bare_step_ms"] = med(ddps, "step_ms_med"), med(bares, "step_ms_med")
    row.update(paired_ratios(ddps, bares))
    row["gflop_per_img"] = b.flops / 1e9
    row["ddp_tflops"] = compute.achieved_tflops(b.flops, row["ddp_img_s"])
    row["mfu_sheet"] = compute.mfu(row["ddp_tflops"], compute.datasheet_peak(b.dev_name, precision))
    gemm_dtype = "tf32" if precision == "tf32" else precision
    row["mfu_gemm"] = compute.mfu(row["ddp_tflops"], b.measured.get(gemm_dtype, float("nan")))
    if b.net is not None:
        row["pred_mem_gb"] = predicted_memory_gb(b, precision, cl, batch)
        row["peak_mem_gb"] = med(bares, "peak_mem_bytes") / 1e9
    row["bare_loss"] = bares[-1]["loss"]
    row["ok"] = bool(all(d["timed_steps"] == b.steps for d in ddps)
                     and all(x["loss"] == x["loss"] and abs(x["loss"]) != float("inf")
                             for x in bares))
    return row


def run_matrix(cfg, b: Bench, combos: list[tuple], run_dir: str) -> list[dict]:
    rows = []
    for i, combo in enumerate(combos):
        precision, cl, comp, graph, batch = combo
        name = f"{precision}_cl{int(cl)}_compile{int(comp)}{'_graph' * graph}_b{batch}"
        print(f"[{i + 1}/{len(combos)}] {name}", flush=True)
        tcfg = compose(row_overrides(b.model, precision, cl, comp, batch, b.steps,
                                                  b.warmup, b.device, cfg.seed, cfg.ddp_overrides,
                                                  graph))
        bares, ddps = run_pair(cfg, b, tcfg, name, run_dir)
        row = make_row(b, combo, tcfg.model.stem, bares, ddps)
        rows.append(row)
        print(f"    ddp {row['ddp_img_s']:.0f} img/s, bare {row['bare_img_s']:.0f} img/s, "
              f"ratio {row['ratio']:.3f}", flush=True)
    return rows


def matrix_notes(rows: list[dict], b: Bench) -> list[str]:
    notes = [f"device {b.dev_name}; FLOPs per image per training step {b.flops / 1e9:.3f} G "
             "(conv + matmul, forward + backward)",
             f"{sum(not r['ok'] for r in rows)} row(s) with a failed check (a non-finite loss, or "
             "fewer timed steps than asked)"]
    if not rows:
        return notes
    best = max(rows, key=lambda r: r["ddp_img_s"])
    notes.append(f"best ddp_lab row: {best['precision']} channels_last={best['channels_last']} "
                 f"compile={best['compile']} cuda_graph={best['cuda_graph']} batch "
                 f"{best['batch']}: {best['ddp_img_s']:.0f} img/s, {best['ddp_tflops']:.1f} "
                 f"TFLOP/s, MFU {best['mfu_sheet']:.1%} of the datasheet peak")
    notes.append("ddp_lab / bare, paired by repeat: median over rows "
                 f"{statistics.median(r['ratio_paired'] for r in rows):.3f} (lowest row "
                 f"{min(r['ratio_paired'] for r in rows):.3f}); the issue's target is >= 0.97")
    fp32 = {(r["compile"], r["cuda_graph"], r["batch"]): r["ddp_img_s"] for r in rows
            if r["precision"] == "fp32" and not r["channels_last"]}
    for r in rows:
        key = (r["compile"], r["cuda_graph"], r["batch"])
        if r["precision"] == "bf16" and r["channels_last"] and key in fp32:
            notes.append(f"bf16 + channels_last vs fp32 (compile={r['compile']}, cuda_graph="
                         f"{r['cuda_graph']}, batch {r['batch']}): "
                         f"{r['ddp_img_s'] / fp32[key]:.2f}x "
                         "(target >= 3x)")
    return notes


MATRIX_COLUMNS = ["stem", "precision", "channels_last", "compile", "cuda_graph", "batch",
                  "ddp_img_s", "bare_img_s", "ratio", "ratio_med", "ratio_paired", "ratio_lo",
                  "ratio_hi", "ratio_med_paired", "ddp_step_ms", "ddp_tflops", "mfu_sheet",
                  "mfu_gemm", "pred_mem_gb", "peak_mem_gb", "ok"]


def run_profiles(cfg, b: Bench, run_dir: str) -> list[dict]:
    """One profiler pass per precision (eager, the first channels_last value and batch): each
    one's top kernels, then the share on tensor cores of all; returns the per-precision summaries."""
    kernels, summaries = [], []
    for precision in b.precisions:
        tcfg = compose(row_overrides(b.model, precision, cfg.channels_last[0], False,
                                     b.batches[0], b.steps, b.warmup, b.device, cfg.seed,
                                     cfg.ddp_overrides))
        free_memory(b.device)
        try:
            top, summ = profile_pass(tcfg, b.device, cfg.profile_steps, cfg.top_k)
        except Exception as e:  # a profiler that fails here must not cost the other results
            error = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else e}"
            print(f"warning: profile of {precision} failed ({error}); its profile_summary row "
                  "says so", flush=True)
            summaries.append({"precision": precision, "error": error})
            continue
        kernels += top
        summaries.append(summ)
        report(top, run_dir, f"kernels_{precision}",
               ["kernel", "calls_per_step", "ms_per_step", "pct", "tensor_core"],
               title=f"top {'CUDA kernels' if b.device.type == 'cuda' else 'CPU ops'}: {precision}")
    report(summaries, run_dir, "profile_summary",
           title="share of GPU kernel time on tensor cores, per precision",
           notes=["tensor_core: a kernel-name heuristic (MMA / 16-bit / TF32 markers, "
                  "overruled by ffma/sgemm/f32f32 SIMT markers); see is_tensor_core_kernel",
                  "fp32 (TF32 off) should be near 0%, bf16/fp16 (and tf32) mostly tensor cores"])
    write_rows(kernels, run_dir, "kernels")
    return summaries


def plot_matrix(rows: list[dict], model: str, run_dir: str) -> None:
    xs = list(range(len(rows)))
    plot_lines({"ddp_lab": (xs, [r["ddp_img_s"] for r in rows]),
                "bare": (xs, [r["bare_img_s"] for r in rows])},
               os.path.join(run_dir, "train_throughput.png"),
               xlabel="row (see train_throughput.csv)", ylabel="img/s",
               title=f"{model}: ddp_lab vs bare loop")


def run(cfg, run_dir: str) -> list[dict]:
    b = build_bench(cfg)
    combos = matrix(cfg, b)
    rows = run_matrix(cfg, b, combos, run_dir)
    if combos:
        report(rows, run_dir, "train_throughput", [c for c in MATRIX_COLUMNS if c in rows[0]],
               title=f"training throughput: {b.model}, ddp_lab loop vs bare PyTorch loop",
               notes=matrix_notes(rows, b))
    prof_summary = run_profiles(cfg, b, run_dir) if cfg.profile else []
    if cfg.plot and rows:
        plot_matrix(rows, b.model, run_dir)
    write_info(run_dir, "train_throughput", cfg, b.device, flops_per_image_step=b.flops,
               measured_peaks=b.measured, profile=prof_summary)
    return rows


main = entry(run, "bench/train_throughput")


if __name__ == "__main__":
    main()
