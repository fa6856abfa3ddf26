#!/bin/bash
# main vs guard branch (its tree exported to /work/main/.device/guard), alternated, 3 rounds,
# N=1 and N=2, 1 thread per rank, sync=ring and sync=ddp, on the 2-core VM.
set -u
OUT=/work/dev/guard-vm3
source /work/main/.venv/bin/activate
for rep in 1 2 3; do
  for n in 1 2; do
    for s in ring ddp; do
      for side in main guard; do
        tree=$([ $side = main ] && echo /work/main || echo /work/main/.device/guard)
        d=$OUT/n$n-$s-$side-r$rep
        (cd $tree && OMP_NUM_THREADS=1 PYTHONPATH=$tree timeout 300 python -m torch.distributed.run --standalone \
          --nproc_per_node=$n -m ddp_lab.train sync=$s data=synthetic model.default_classes=10 \
          train.batch_size=32 train.max_steps=25 train.timing_warmup=5 train.log_every=25 \
          train.calibrate_steps=0 train.progress=false train.resume=never hydra.run.dir=$d > $d.log 2>&1); rc=$?
        echo "$(date +%T) $side n=$n sync=$s rep=$rep rc=$rc load=$(cut -d' ' -f1 /proc/loadavg)" >> $OUT/order.log
        rm -rf $d/checkpoint* $d/events.*
      done
    done
  done
done
