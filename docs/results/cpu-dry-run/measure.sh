#!/usr/bin/env bash
# The dry run at N = 8 ... 1024 for each sync, REPS passes (a pass: every sync and N, smallest
# first), one process at a time. Each run's dry_run.json and dry_run_info.json go to
# $OUT/<sync>-n<N>-r<pass>/; $OUT/times.log gets one line of fields a run (the command's own
# wall and CPU seconds, from bash's time). Usage: measure.sh OUT [REPS] [SYNCS...]; NS='1024'
# for some world sizes only; EXTRA='sync.zero=3' more overrides for every run, TAG='-zero3' in
# its directories' names. hring runs on nodes of 8 ranks (dist.node_size=8).
set -euo pipefail
OUT=${1:?usage: measure.sh OUT [REPS] [SYNCS...]}
REPS=${2:-3}
shift 2 || true
SYNCS=${*:-tree ring hring}
PY=${PY:-python}
mkdir -p "$OUT"
TIMEFORMAT='%R %U %S'
for rep in $(seq 1 "$REPS"); do
  for sync in $SYNCS; do
    for n in ${NS:-8 16 32 64 128 256 512 1024}; do
      dir="$OUT/$sync${TAG:-}-n$n-r$rep"
      node=$([ "$sync" = hring ] && echo dist.node_size=8 || true)
      { time "$PY" -m ddp_lab.dry_run world_size="$n" sync="$sync" $node ${EXTRA:-} \
          hydra.run.dir="$dir" hydra.output_subdir=null > "$dir.out" 2> "$dir.err"; } 2> "$OUT/.time"
      read -r wall user sys < "$OUT/.time"
      echo "sync=$sync${TAG:-} world_size=$n pass=$rep wall_s=$wall user_s=$user sys_s=$sys" \
        "load1=$(cut -d' ' -f1 /proc/loadavg)" >> "$OUT/times.log"
    done
  done
done
