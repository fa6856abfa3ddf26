#!/usr/bin/env bash
# The ddp_lab loop against the bare loop where the loop's own host work shows: by default
# AlexNet-CIFAR, bf16 + channels_last, eager, batch 512 on one GPU (BENCH sets another). Pinned
# to one idle core: unpinned, on a shared host, the ratio moves +-8% from run to run. Prints one
# table row per run, with the per-repeat ratios' median and range (ratio_paired, ratio_lo,
# ratio_hi), into summary.txt too.
#
#   scripts/loop_overhead.sh [TREE ...]
#
# TREEs are other checkouts (e.g. `git worktree add /tmp/before <commit>`) to compare with this
# one: each round runs this tree, then each TREE, so slow drift of the host hits all alike (each
# TREE's ddp_lab/bench/train_throughput.py must report ratio_paired: copy this tree's). Then
# the host cost of each of the loop's pieces alone (scripts/step_variants.py --host-costs).
# Paths (TREEs, OUT_DIR, RUNS_DIR) are taken from where the script is run.
# Environment:
#   BENCH        train_throughput's settings (default: the AlexNet-CIFAR eager line below)
#   EXTRA        more of its arguments, e.g. its cpu_* sizes for a check on a CPU
#   VARIANTS     ';'-separated extra override lists of the ddp_lab loop, each run as one more
#                row per round (e.g. "train.nonfinite=off;data=digits")
#   OUT_DIR      the rows and a summary (default $OUT, else outputs/loop_overhead)
#   RUNS_DIR     the benchmark's run dirs (default /tmp/loop_overhead)
#   CORE         the core to pin to (default: the idlest, picked before each run; a list such
#                as 1-15 unpins)
#   ROUNDS (2), STEPS (300), WARMUP (10), REPEATS (5), RUN_TIMEOUT (300 s a run),
#   HOST_COSTS (1; 0: skip them)
set -euo pipefail
set -f  # arguments such as batches=[512] are not file patterns
# Paths given relative to where the script is run from, made absolute before it moves.
TREES=()
for tree in "$@"; do TREES+=("$(realpath -m "$tree")"); done
OUT_DIR=$(realpath -m "${OUT_DIR:-${OUT:-outputs/loop_overhead}}")
RUNS_DIR=$(realpath -m "${RUNS_DIR:-/tmp/loop_overhead}")
cd "$(dirname "$0")/.."
mkdir -p "$OUT_DIR"
: > "$OUT_DIR/summary.txt"
PY=${PYTHON:-python3}

# The core with the least load over 2 s (of those this process may use): on a shared host some
# are busy with other work, and a loop pinned to one of those measures that work.
idlest_core() {
  $PY - <<'EOF'
import os, time
def ticks():  # core -> (idle, total) jiffies
    out = {}
    for line in open("/proc/stat"):
        f = line.split()
        if f[0].startswith("cpu") and f[0] != "cpu":
            v = [int(x) for x in f[1:]]
            out[int(f[0][3:])] = (v[3] + v[4], sum(v))
    return out
a = ticks(); time.sleep(2); b = ticks()
cores = sorted(c for c in os.sched_getaffinity(0) if c in a and c in b)
cores = cores[1:] or cores  # core 0 takes most interrupts: not the first choice
load = {c: 1 - (b[c][0] - a[c][0]) / max(1, b[c][1] - a[c][1]) for c in cores}
core = min(load, key=load.get)
print(core, f"{load[core]:.0%}")
EOF
}
BENCH=${BENCH:-net=alexnet_cifar precisions=[bf16] channels_last=[true] cuda_graph=[false] batches=[512]}
ARGS="$BENCH steps=${STEPS:-300} warmup=${WARMUP:-10} repeats=${REPEATS:-5} ${EXTRA:-}"

# run NAME TREE [OVERRIDE ...]: one train_throughput invocation; its rows and one line kept.
run() {
  local name=$1 tree=$2; shift 2
  local dir=$RUNS_DIR/$name overrides=""
  # quoted list items: an override holds '=' (ddp_overrides=['train.nonfinite=off'])
  [ $# -gt 0 ] && overrides="ddp_overrides=[$(printf "'%s'," "$@" | sed 's/,$//')]"
  local core load
  read -r core load <<< "${CORE:-$(idlest_core)}"
  rm -rf "$dir" "$OUT_DIR/$name.jsonl"
  (cd "$tree" && PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" timeout "${RUN_TIMEOUT:-300}" taskset -c "$core" \
    $PY -m ddp_lab.bench.train_throughput $ARGS $overrides hydra.run.dir="$dir") \
    > "$OUT_DIR/$name.log" 2>&1 || { echo "$name: FAILED (see $name.log)"; FAILED+=("$name"); }
  cp "$dir"/train_throughput.jsonl "$OUT_DIR/$name.jsonl" 2>/dev/null || true
  printf '%-14s core %-3s (load %4s)  %s\n' "$name" "$core" "${load:-?}" "$($PY -c '
import json, sys
r = json.loads(open(sys.argv[1]).readline())
print("bare %7.0f img/s  loop %7.0f img/s  loop/bare %.3f (%.3f..%.3f), of median steps %.3f"
      % tuple(r[k] for k in ("bare_img_s", "ddp_img_s", "ratio_paired", "ratio_lo", "ratio_hi",
                             "ratio_med_paired")))
' "$OUT_DIR/$name.jsonl" 2>/dev/null || echo "no result")" | tee -a "$OUT_DIR/summary.txt"
}

FAILED=()  # a failed run costs its own row only; the script still exits 1 at the end
IFS=';' read -r -a VARIANT_LIST <<< "${VARIANTS:-}"
for round in $(seq "${ROUNDS:-2}"); do
  run "this_$round" .
  i=0
  for tree in "${TREES[@]}"; do i=$((i + 1)); run "tree${i}_$round" "$tree"; done
  v=0
  for variant in "${VARIANT_LIST[@]}"; do
    v=$((v + 1)); read -r -a ov <<< "$variant"
    if [ ${#ov[@]} -gt 0 ]; then run "variant${v}_$round" . "${ov[@]}"; fi
  done
done
if [ "${HOST_COSTS:-1}" != 0 ]; then
  taskset -c "$(idlest_core | cut -d' ' -f1)" $PY scripts/step_variants.py --net alexnet_cifar \
    --batch 512 --host-costs --out "$OUT_DIR" > "$OUT_DIR/host_costs.log" 2>&1 \
    || { echo "host costs: FAILED (see host_costs.log)"; FAILED+=(host_costs); }
  tail -8 "$OUT_DIR/host_costs.log"
fi
if [ ${#FAILED[@]} -gt 0 ]; then
  echo "failed: ${FAILED[*]}"
  exit 1
fi
