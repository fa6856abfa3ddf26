#!/usr/bin/env bash
# Every benchmark of the seeds' claims (and issue 4's anchors) on one GPU, in under 8 minutes.
#
#   scripts/gpu_bench.sh [OUT_DIR]        # default: $OUT if set, else outputs/gpu_bench
#
# Writes OUT_DIR/<bench>/ (JSON lines, CSV, PNG, *_info.json per benchmark), OUT_DIR/logs/<bench>.log
# (everything the benchmark printed) and OUT_DIR/summary.txt, and prints one line per benchmark
# and the summary table last. Each step gets a timeout out of a total budget (BUDGET_S, default
# 450 s), so a slow or stuck step costs its own results only; the order puts what the others need
# (the GEMM peaks, for MFU) first and the slowest (torch.compile) last.
#
# Environment: PYTHON (default python3), BUDGET_S. ONLY="train_cifar train_stem" runs just those
# steps (the others are listed as not selected). SMOKE=1 runs the same steps on the CPU with tiny
# sizes (a check of this script and the benchmarks' CPU paths, not a measurement).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${1:-${OUT:-outputs/gpu_bench}}
PY=${PYTHON:-python3}
BUDGET_S=${BUDGET_S:-450}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# Every step, by name, with its tiny CPU arguments for SMOKE=1.
declare -A SMOKE_ARGS=(
  [gemm]="device=cpu cpu_sizes=[64,128] numpy_n=256 numpy_single_thread_n=128"
  [train_throughput]="device=cpu cpu_batches=[8] cpu_steps=2 cpu_warmup=1 cpu_precisions=[fp32] channels_last=[false]"
  [profile]="device=cpu cpu_batches=[8] cpu_precisions=[fp32] profile_steps=1"
  [memory]="device=cpu cpu_sizes_mb=[1,8] iters=2"
  [vector_add]="device=cpu max_exp=5 iters=2"
  [memory_fit]="device=cpu measure_model=alexnet_cifar measure_batch=4 measure_steps=1 measure_precisions=[fp32]"
  [train_cifar]="device=cpu cpu_batches=[8] cpu_steps=2 cpu_warmup=1 cpu_precisions=[fp32] channels_last=[false]"
  [train_compile]="device=cpu cpu_batches=[8] cpu_steps=2 cpu_warmup=1 cpu_precisions=[fp32] channels_last=[false] compile=[false]"
  [train_stem]="device=cpu cpu_batches=[8] cpu_steps=2 cpu_warmup=1 cpu_precisions=[fp32] channels_last=[false] compile=[false]"
)
for n in ${ONLY:-}; do
  [ -n "${SMOKE_ARGS[$n]+set}" ] || { echo "ONLY: no step named '$n' (steps: ${!SMOKE_ARGS[*]})"; exit 2; }
done
mkdir -p "$OUT_DIR/logs"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
T0=$(date +%s)
: > "$OUT_DIR/steps.tsv"
NEED_CUDA="assert torch.cuda.is_available(), 'no CUDA device'"
[ -n "${SMOKE:-}" ] && NEED_CUDA="pass"
if ! "$PY" -c "import torch, hydra, matplotlib, torchvision; $NEED_CUDA" 2>"$OUT_DIR/logs/preflight.log"; then
  echo "preflight failed: need torch with CUDA, hydra-core, matplotlib, torchvision for $PY (see logs/preflight.log)"
  cat "$OUT_DIR/logs/preflight.log"
  exit 1
fi
"$PY" -c "import torch, os; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU', 'cpus', os.cpu_count())"

# step NAME LIMIT_S MODULE [overrides...]: run one benchmark with hydra.run.dir=OUT_DIR/NAME.
step() {
  local name=$1 limit=$2 module=$3; shift 3
  if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $name "* ]]; then
    printf '%s\tnot selected\t0\n' "$name" >> "$OUT_DIR/steps.tsv"; return
  fi
  local left=$(( BUDGET_S - ($(date +%s) - T0) ))
  (( limit > left )) && limit=$left
  if (( limit < 15 )); then
    printf '%-22s skipped (budget spent)\n' "$name"; printf '%s\tskipped\t0\n' "$name" >> "$OUT_DIR/steps.tsv"; return
  fi
  local s=$(date +%s) extra=() rc=0
  if [ -n "${SMOKE:-}" ]; then read -ra extra <<< "${SMOKE_ARGS[$name]}"; fi
  timeout --kill-after=10 "$limit" "$PY" -m "ddp_lab.bench.$module" "hydra.run.dir=$OUT_DIR/$name" "$@" \
    "${extra[@]}" > "$OUT_DIR/logs/$name.log" 2>&1 || rc=$?
  local dt=$(( $(date +%s) - s )) status=ok
  if (( rc == 124 || rc == 137 )); then status="timeout after ${limit}s"
  elif (( rc != 0 )); then status="failed (exit $rc)"; fi
  printf '%-22s %-24s %4ds   (logs/%s.log)\n' "$name" "$status" "$dt" "$name"
  printf '%s\t%s\t%s\n' "$name" "$status" "$dt" >> "$OUT_DIR/steps.tsv"
  [ "$status" = ok ] || tail -n 5 "$OUT_DIR/logs/$name.log" | sed 's/^/    | /'
}

GEMM_ROWS="$OUT_DIR/gemm/gemm.jsonl"
step gemm 90 gemm sizes=[1024,2048,4096,8192] dtypes=[fp32,tf32,fp16,bf16] \
  cpu_sizes=[1024,2048,4096] cpu_dtypes=[fp32,bf16] numpy_compare=true numpy_n=10000 \
  numpy_single_thread_n=2048 plot=true
grep -q $'^gemm\tok' "$OUT_DIR/steps.tsv" && PEAKS="gemm_results=$GEMM_ROWS" || PEAKS="gemm_results="
step train_throughput 120 train_throughput net=alexnet precisions=[fp32,tf32,fp16,bf16] \
  channels_last=[false,true] compile=[false] batches=[256] steps=30 warmup=10 "$PEAKS" plot=true
step profile 60 train_throughput net=alexnet precisions=[fp32,tf32,fp16,bf16] channels_last=[true] \
  batches=[256] matrix=false profile=true profile_steps=5 top_k=12 predict_memory=false
step memory 60 memory sizes_mb=[16,256,1024,4096] plot=true
step vector_add 90 vector_add min_exp=3 max_exp=9 points_per_decade=2 plot=true
step memory_fit 45 memory_fit gpu_gb=141 measure=true measure_model=alexnet measure_batch=256 \
  measure_precisions=[fp32,tf32,fp16,bf16] measure_channels_last=true plot=true
step train_cifar 80 train_throughput net=alexnet_cifar precisions=[bf16] channels_last=[true] \
  compile=[false] cuda_graph=[false,true] batches=[512,2048] steps=30 warmup=10 "$PEAKS"
step train_compile 240 train_throughput net=alexnet precisions=[bf16] channels_last=[true] \
  compile=[true] batches=[256] steps=30 warmup=10 "$PEAKS"
step train_stem 330 train_throughput net=alexnet precisions=[bf16] channels_last=[true] \
  compile=[false,true] cuda_graph=[false,true] batches=[256] steps=30 warmup=10 'ddp_overrides=["model.stem=space_to_depth"]' "$PEAKS"

echo "total $(( $(date +%s) - T0 )) s"
"$PY" - "$OUT_DIR" <<'EOF' | tee "$OUT_DIR/summary.txt"
import json, os, sys

out = sys.argv[1]
nan = float("nan")


steps = [l.rstrip("\n").split("\t") for l in open(os.path.join(out, "steps.tsv"))]
# Steps this run finished or cut short (a timeout keeps the rows written so far); not what an
# earlier run left in OUT_DIR for steps this one did not run.
ran = {s[0] for s in steps if s[1] == "ok" or s[1].startswith("timeout")}


def load(step, *parts):
    path = os.path.join(out, step, *parts)
    return [json.loads(l) for l in open(path)] if step in ran and os.path.exists(path) else []


def f(x, fmt="{:.3g}"):
    return "-" if x is None or x != x else fmt.format(x)


lines = []
add = lambda what, seed, here: lines.append((what, seed, here))
gemm = load("gemm", "gemm.jsonl")
g = {(r["device"], r["dtype"], r["n"]): r for r in gemm}
best = {d: max((r["tflops"] for r in gemm if r["device"] == "cuda" and r["dtype"] == d and r["ok"]),
               default=nan) for d in ("fp32", "tf32", "fp16", "bf16")}
cpu4k = g.get(("cpu", "fp32", 4096), {}).get("tflops", nan)
gpu4k = g.get(("cuda", "bf16", 4096), {}).get("tflops", nan)
gpu4k32 = g.get(("cuda", "fp32", 4096), {}).get("tflops", nan)
add("GEMM best TFLOP/s fp32|tf32|fp16|bf16", "A100: 19.5 | - | 312 | 312",
    " | ".join(f(best[d], "{:.0f}") for d in best) + f"  (#wrong {sum(not r['ok'] for r in gemm)})")
add("GEMM 4096^2 GPU/CPU(fp32)", "100-1000x", f"fp32 {f(gpu4k32 / cpu4k, '{:.0f}')}x, bf16 "
    f"{f(gpu4k / cpu4k, '{:.0f}')}x (CPU fp32 {f(cpu4k)} TFLOP/s)")
add("tensor cores bf16 / fp32", "~10x", f"{f(best['bf16'] / best['fp32'], '{:.1f}')}x")
np_rows = {r["what"]: r for r in load("gemm", "numpy_vs_gpu.jsonl")}
npt = next((r for k, r in np_rows.items() if k.startswith("numpy np.dot (all")), {})
np1 = next((r for k, r in np_rows.items() if "1 thread" in k), {})
g64 = next((r for k, r in np_rows.items() if k.endswith("fp64") and k.startswith("torch")), {})
gbf = next((r for k, r in np_rows.items() if k.endswith("bf16") and k.startswith("torch")), {})
add("10000^2 numpy dot vs GPU", "120 s vs 0.8 s (150x)",
    f"numpy {f(npt.get('time_s'))} s (1 thread ~{f(np1.get('time_s'))} s), GPU fp64 "
    f"{f(g64.get('time_s'))} s, bf16 {f(gbf.get('time_s'))} s")
va_info = os.path.join(out, "vector_add", "vector_add_info.json")
cross = (json.load(open(va_info)).get("crossover", {})
         if "vector_add" in ran and os.path.exists(va_info) else {})
for k in ("gpu kernel only vs cpu (all threads)", "gpu incl. transfer (pageable) vs cpu (all threads)",
          "gpu incl. transfer (pinned) vs cpu (1 thread)"):
    add(f"vector add: {k}", "large vectors only", f"from n = {cross.get(k, '-')}")
mem = load("memory", "memory.jsonl")
top = max((r["size_mb"] for r in mem), default=None)
bw = {r["kind"]: r["gbs"] for r in mem if r["size_mb"] == top}
add(f"copy bandwidth GB/s ({f(top, '{:.0f}')} MB)", "DDR4 50 vs HBM2 1500 (30x)",
    f"host {f(bw.get('host_copy'), '{:.0f}')} vs device {f(bw.get('device_copy'), '{:.0f}')} "
    f"({f(bw.get('device_copy', nan) / bw.get('host_copy', nan), '{:.0f}')}x); H2D pinned "
    f"{f(bw.get('h2d_pinned'), '{:.0f}')}, pageable {f(bw.get('h2d_pageable'), '{:.0f}')}")
seed = {r["model"]: r for r in load("memory_fit", "seed_table.jsonl")}
for m, r in seed.items():
    add(f"{m} GB: fp32 | mixed", f"{r['seed_fp32_gb']:.0f} | {r['seed_mixed_gb']:.0f}, >= 4 A100",
        f"weights {r['fp32_weights_gb']:.0f} | {r['fp16_weights_gb']:.0f}; Adam training "
        f"{r['mixed_adam_train_gb']:.0f} -> >= {r['gpus_train']} A100-80GB / {r['h200s_train']} H200")
for r in load("memory_fit", "memory_measured.jsonl"):
    add(f"peak memory {r['model']} b{r['batch']} {r['precision']}", "(predicted)",
        f"pred {r['pred_total_gb']:.2f} GB, measured {f(r['measured_peak_gb'])} GB")
width = max(len(a) for a, _, _ in lines) if lines else 10
print(f"\n== summary ({out}) ==")
print(f"{'claim':<{width}}  {'seed / issue says':<28}  measured")
for a, b, c in lines:
    print(f"{a:<{width}}  {b:<28}  {c}")

tt = load("train_throughput", "train_throughput.jsonl") + load("train_cifar", "train_throughput.jsonl") \
    + load("train_compile", "train_throughput.jsonl") + load("train_stem", "train_throughput.jsonl")
anchors = {("alexnet", "fp32", False, False, 256): "11.4k", ("alexnet", "tf32", False, False, 256): "21.8k",
           ("alexnet", "fp16", False, False, 256): "27.3k", ("alexnet", "bf16", False, False, 256): "27.9k",
           ("alexnet", "bf16", True, False, 256): "35.6k", ("alexnet", "bf16", True, True, 256): "41.6k",
           ("alexnet_cifar", "bf16", True, False, 512): "121k", ("alexnet_cifar", "bf16", True, False, 2048): "441k"}
if tt:
    print("\nmodel          stem      prec  cl  comp  batch  ddp_img/s  bare_img/s  ratio  anchor(bare)  TFLOP/s  MFU(sheet)  MFU(gemm)  mem pred/peak GB")
    for r in tt:
        key = (r["model"], r["precision"], r["channels_last"], r["compile"], r["batch"])
        stem = r.get("stem", "standard")
        anchor = anchors.get(key, "-") if stem == "standard" else "-"
        print(f"{r['model']:<13}  {stem[:8]:<8}  {r['precision']:<4}  {int(r['channels_last']):>2}  {int(r['compile']):>4}  "
              f"{r['batch']:>5}  {r['ddp_img_s']:>9.0f}  {r['bare_img_s']:>10.0f}  {r['ratio']:>5.3f}  "
              f"{anchor:>12}  {r['ddp_tflops']:>7.1f}  {f(r['mfu_sheet'], '{:.1%}'):>10}  "
              f"{f(r['mfu_gemm'], '{:.1%}'):>9}  {f(r.get('pred_mem_gb'), '{:.2f}')}/{f(r.get('peak_mem_gb'), '{:.2f}')}")
prof = load("profile", "profile_summary.jsonl")
if prof:
    print("\ntensor-core share of GPU kernel time (profile, bare loop, batch 256, channels_last):")
    print("  " + ", ".join(f"{p['precision']} {p['tensor_core_pct']:.0f}%" for p in prof))
bad = [s for s in steps if s[1] not in ("ok", "not selected")]
print("\nsteps: " + ", ".join(f"{s[0]} {s[1]} ({s[2]} s)" for s in steps))
if bad:
    print("NOT OK: " + ", ".join(s[0] for s in bad) + " -> see logs/")
EOF
# Every step that ran must have finished: a failed or cut-short step fails the script.
awk -F'\t' '$2 != "ok" && $2 != "not selected" {bad = 1} END {exit bad}' "$OUT_DIR/steps.tsv"
