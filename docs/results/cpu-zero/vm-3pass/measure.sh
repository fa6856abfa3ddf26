#!/bin/bash
# ZeRO stages 0-3 on 2 ranks of the 2-core VM, 3 passes: the 16-core sweep's recipe.
cd /work/main && . .venv/bin/activate
uptime
python -m ddp_lab.scale profile=cpu 'nproc=[2]' 'syncs=[ring]' \
  'sweep=["sync.zero=0","sync.zero=1","sync.zero=2","sync.zero=3"]' \
  simulate=false predict.calibrate=false predict.probe=false repeats=3 \
  hydra.run.dir=/work/runs/zero2
uptime
