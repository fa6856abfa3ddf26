#!/usr/bin/env bash
# The single-GPU headline figures, each a median of RUNS runs with its range, every run's rows kept:
#   precision  the precision x channels_last matrix of 224 px AlexNet: the ddp_lab loop and a bare
#              loop side by side, RUNS repeats each (their img/s per repeat in *_img_s_runs)
#   stem       bf16 + channels_last + the space-to-depth stem + torch.compile, RUNS repeats
#   gemm       the GEMM benchmark, RUNS separate runs (TFLOP/s per dtype and size)
#   memory     the copy-bandwidth benchmark, RUNS separate runs
#
#   scripts/gpu_repeats.sh OUT_DIR [PART ...]        # default: every part; RUNS=3
#   PRECISIONS='[fp32,bf16]' scripts/gpu_repeats.sh OUT_DIR precision   # a part of the matrix
#
# Each part runs under its own timeout (PART_TIMEOUT_S, 400 s), writes OUT_DIR/<part>/...,
# and a failed part costs its own rows only; the script exits 1 at the end naming it.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${1:?usage: scripts/gpu_repeats.sh OUT_DIR [PART ...]}; shift
if [ $# -gt 0 ]; then PARTS=("$@"); else PARTS=(precision stem gemm memory); fi
RUNS=${RUNS:-3}
PY=${PYTHON:-python3}
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
mkdir -p "$OUT_DIR"
FAILED=()

part() {  # NAME COMMAND...: one part under its timeout, its output in OUT_DIR/NAME.log
  local name=$1; shift
  echo "== $name ($(date +%T))"
  timeout "${PART_TIMEOUT_S:-400}" "$@" > "$OUT_DIR/$name.log" 2>&1 \
    || { echo "FAILED $name"; tail -5 "$OUT_DIR/$name.log"; FAILED+=("$name"); }
}

for p in "${PARTS[@]}"; do
  case $p in
    precision) part precision "$PY" -m ddp_lab.bench.train_throughput net=alexnet \
                 "precisions=${PRECISIONS:-[fp32,tf32,fp16,bf16]}" 'channels_last=[false,true]' 'batches=[256]' \
                 repeats="$RUNS" hydra.run.dir="$OUT_DIR/precision" ;;
    stem) part stem "$PY" -m ddp_lab.bench.train_throughput net=alexnet 'precisions=[bf16]' \
            'channels_last=[true]' 'compile=[true]' 'batches=[256]' repeats="$RUNS" \
            'ddp_overrides=["model.stem=space_to_depth"]' hydra.run.dir="$OUT_DIR/stem" ;;
    gemm) for r in $(seq "$RUNS"); do
            part "gemm_run$r" "$PY" -m ddp_lab.bench.gemm device=cuda 'cpu_sizes=[1024]' \
              hydra.run.dir="$OUT_DIR/gemm/run$r"
          done ;;
    memory) for r in $(seq "$RUNS"); do
              part "memory_run$r" "$PY" -m ddp_lab.bench.memory device=cuda \
                hydra.run.dir="$OUT_DIR/memory/run$r"
            done ;;
    *) echo "unknown part $p (precision stem gemm memory)"; exit 2 ;;
  esac
done
if [ ${#FAILED[@]} -gt 0 ]; then
  echo "failed: ${FAILED[*]} (logs in $OUT_DIR)"
  exit 1
fi
