#!/bin/bash
# 2 ranks on the quiet VM, interleaved: for each seed, the same two runs (fp32, top-k 1%) without
# a link and with every message held 1 us (no bandwidth limit). From the repository root; OUT=<dir>.
for round in 0 1 2; do
  for link in none hold1us; do
    extra=(); [ $link = hold1us ] && extra=(dist.link.latency_us=1)
    python -m ddp_lab.bench.compression 'arms=[fp32,topk-1pct]' "seeds=[$round]" 'nproc=[2]' \
      'gbps=[0]' steps=12 timing_warmup=4 target_accuracy=0 plot=false model.fc_width=512 \
      train.eval_every_epochs=0 "${extra[@]}" hydra.run.dir=$OUT/r$round-$link \
      | grep -E "^\[|^    2"
    uptime
  done
done
