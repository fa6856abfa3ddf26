#!/bin/bash
# The compression study at a small scale (2 ranks, digits, AlexNet-CIFAR with 512-wide hidden
# layers, 44 steps), then the element count of the full AlexNet-CIFAR (4096 wide) for fp32 and
# PowerSGD r = 2. From the repository root: bash docs/results/cpu-compression/measure.sh
# (OUT=elsewhere to keep these). The outputs it copies here: study/, count/, start22/ (PowerSGD
# r = 2 after one uncompressed epoch; run after the other two, on its own).
set -eu  # (-e: a study refused, say over an earlier one in OUT, copies nothing here)
cd "$(dirname "$0")/../../.."
OUT=${OUT:-outputs/bench/compression}
HERE=docs/results/cpu-compression
date +%T > "$HERE/load.log"
nice -n 5 python -m ddp_lab.bench.compression nproc=[2] gbps=[0,10,1] \
  link_arms=[fp32,powersgd-r2,topk-1pct] steps=44 target_accuracy=0.6 model.fc_width=512 \
  hydra.run.dir="$OUT/study" > "$OUT.study.log" 2>&1
echo "$(date +%T) study rc=$? $(uptime | sed 's/.*load/load/')" >> "$HERE/load.log"
nice -n 5 python -m ddp_lab.bench.compression arms=[fp32,powersgd-r2] seeds=[0] nproc=[2] \
  gbps=[0] steps=3 timing_warmup=1 target_accuracy=0 plot=false train.eval_every_epochs=0 \
  hydra.run.dir="$OUT/count" > "$OUT.count.log" 2>&1
echo "$(date +%T) count rc=$? $(uptime | sed 's/.*load/load/')" >> "$HERE/load.log"
nice -n 5 python -m ddp_lab.bench.compression arms=[fp32,powersgd-r2] nproc=[2] gbps=[0] \
  steps=44 compress_start=22 target_accuracy=0.6 model.fc_width=512 \
  hydra.run.dir="$OUT/start22" > "$OUT.start22.log" 2>&1
echo "$(date +%T) start22 rc=$? $(uptime | sed 's/.*load/load/')" >> "$HERE/load.log"
for part in study count start22; do
  mkdir -p "$HERE/$part"
  cp "$OUT/$part"/{runs,arms}.jsonl "$OUT/$part/compression_info.json" "$HERE/$part/"
  cp "$OUT/$part"/*.png "$HERE/$part/" 2>/dev/null
  for d in "$OUT/$part"/runs/*/; do
    mkdir -p "$HERE/$part/runs/$(basename "$d")"
    cp "$d/summary.json" "$HERE/$part/runs/$(basename "$d")/" 2>/dev/null
  done
done
