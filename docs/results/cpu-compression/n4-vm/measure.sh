#!/bin/bash
# Issue 37's 4-rank arms on the 2-core VM: the 2-rank study's recipe at nproc=[4].
while pgrep -f hlink.sh >/dev/null; do sleep 10; done
cd /work/main && . .venv/bin/activate
uptime > /work/runs/c4-load.log
python -m ddp_lab.bench.compression 'nproc=[4]' 'gbps=[0,10,1]' \
  'link_arms=[fp32,powersgd-r2,topk-1pct]' steps=44 target_accuracy=0.6 model.fc_width=512 \
  hydra.run.dir=/work/runs/c4/study
uptime >> /work/runs/c4-load.log
