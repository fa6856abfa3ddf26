#!/bin/bash
# 2 ranks on the quiet 2-core VM: every arm without a link and at 10 and 1 Gb/s, the arms taking
# turns; the compressors timed alone first (compress_alone.json). From the repository root;
# OUT=<run dir>.
uptime > "$OUT.load"
python -m ddp_lab.bench.compression 'nproc=[2]' 'gbps=[0,10,1]' \
  'seeds=[0,1,2]' steps=16 timing_steps=12 timing_warmup=4 repeats=3 target_accuracy=0 \
  train.eval_every_epochs=0 model.fc_width=512 hydra.run.dir="$OUT"
uptime >> "$OUT.load"
