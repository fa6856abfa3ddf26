#!/bin/bash
# Interleaved: for each seed, the same two runs without a link and with every message held 1 us.
cd /work/main && . .venv/bin/activate
for round in 0 1 2; do
  for link in none hold1us; do
    extra=(); [ $link = hold1us ] && extra=(dist.link.latency_us=1)
    python -m ddp_lab.bench.compression 'arms=[fp32,powersgd-r2]' "seeds=[$round]" 'nproc=[4]' \
      'gbps=[0]' steps=12 timing_warmup=4 target_accuracy=0 plot=false model.fc_width=512 \
      train.eval_every_epochs=0 "${extra[@]}" hydra.run.dir=/work/runs/hold2/r$round-$link \
      | grep -E "^\[|^    4"
    uptime
  done
done
