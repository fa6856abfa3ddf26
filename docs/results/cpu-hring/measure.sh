#!/bin/bash
# hring against the flat ring on emulated nodes: 3 repeats x {2x4, 4x2} x {1, 10} Gb/s, 8 ranks.
# From the repository root: bash docs/results/cpu-hring/measure.sh (OUT=elsewhere to keep these;
# GBPS='1' for one link speed; TORCHRUN='python3 -m torch.distributed.run' where torchrun is not
# on PATH).
set -u
cd "$(dirname "$0")/../../.."
OUT=${OUT:-docs/results/cpu-hring/runs}
mkdir -p "$OUT"
for rep in 1 2 3; do
  for g in 4 2; do
    for gbps in ${GBPS:-1 10}; do
      d=$OUT/$((8 / g))x${g}-${gbps}gbps-r${rep}
      mkdir -p "$d"
      OMP_NUM_THREADS=1 nice -n 5 timeout 900 ${TORCHRUN:-torchrun} --standalone --nproc_per_node=8 \
        -m ddp_lab.bench.allreduce algos=[ring,hring,native] dtypes=[float32] \
        min_bytes=16777216 max_bytes=67108864 factor=4 plot=false \
        dist.node_size=$g dist.link.gbps=$gbps dist.link.latency_us=25 dist.link.shared=true \
        hydra.run.dir="$d" > "$d/run.log" 2>&1
      echo "$(date +%T) $d rc=$? $(uptime | sed 's/.*load/load/')" >> "$OUT/load.log"
    done
  done
done
