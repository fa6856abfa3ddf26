#!/bin/bash
# hring and the flat ring training on 2x2 emulated nodes, a shared link per node, 2-core VM.
cd /work/main && . .venv/bin/activate
for sync in hring ring; do
  python -m ddp_lab.bench.compression 'arms=[fp32]' 'seeds=[0,1,2]' 'nproc=[4]' 'gbps=[0,10,1]' \
    steps=16 timing_steps=12 timing_warmup=4 repeats=3 target_accuracy=0 plot=false \
    sync=$sync dist.node_size=2 dist.link.shared=true train.eval_every_epochs=0 \
    hydra.run.dir=/work/runs/hlink/$sync
  uptime
done
