#!/usr/bin/env bash
# One-GPU checks of our syncs' CUDA path, ZeRO's memory and the scaling sweep's single-GPU point:
#   1. tests/test_sync_cuda.py (side stream + events, races provoked on purpose)
#   2. sync=ring / tree / naive and ring at sync.zero=1|2 (overlap on) vs sync=none at world
#      size 1 over NCCL: the same parameters after 20 steps, up to the GPU's run-to-run noise
#      (cuDNN's backward is not deterministic): sync=none is run twice to show that floor
#   3. python -m ddp_lab.bench.memory_fit measure_zero=[0,1,2]: 224 px AlexNet with AdamW, the
#      bytes held per stage (counted) and the peak, predicted vs torch.cuda.max_memory_allocated
#   4. SCALE=1 only: python -m ddp_lab.scale (N=1 on NCCL for every sync) + the simulation
#   scripts/gpu_sync_check.sh [out_dir]
set -euo pipefail
OUT_DIR=${1:-${OUT:-outputs/gpu_sync_check}}
mkdir -p "$OUT_DIR"
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
FAILED=()  # a failed part costs its own output only; the script still exits 1 at the end
python3 -m pytest -q -p no:cacheprovider tests/test_sync_cuda.py > "$OUT_DIR/test_sync_cuda.log" 2>&1 \
  || FAILED+=(test_sync_cuda)
tail -5 "$OUT_DIR/test_sync_cuda.log"
common="data=synthetic data.num_samples=4096 model.default_classes=10 model.dropout=0 train.max_steps=20 train.progress=false train.resume=never train.eval_every_epochs=0 train.cudnn_benchmark=false"
variants=(none none ring tree naive "ring sync.zero=1" "ring sync.zero=2")
for i in "${!variants[@]}"; do
  v=${variants[$i]}
  name=$i-$(echo "$v" | tr " =" "__")
  python3 -m ddp_lab.train $common sync=$v hydra.run.dir="$OUT_DIR/ws1/$name" > "$OUT_DIR/ws1_$name.log" 2>&1 || { echo "FAILED sync=$v"; tail -15 "$OUT_DIR/ws1_$name.log"; FAILED+=("sync=$v"); }
done
python3 - "$OUT_DIR/ws1" <<'PY'
import os, sys, torch
root = sys.argv[1]
ref = torch.load(f"{root}/0-none/checkpoint.pt", weights_only=True)["model"]
for name in sorted(os.listdir(root))[1:]:
    try:
        got = torch.load(f"{root}/{name}/checkpoint.pt", weights_only=True)["model"]
    except FileNotFoundError:
        print(f"sync={name}: no checkpoint"); continue
    d = max((ref[k].double() - got[k].double()).abs().max().item() for k in ref)
    print(f"sync={name.split('-', 1)[1]} vs sync=none on CUDA, 20 steps: max |param diff| = {d:.3g}")
PY
python3 -m ddp_lab.bench.memory_fit models=[alexnet] seed_table=false zero_stages=[] 'measure_zero=[0,1,2]' 'measure_precisions=[fp32,bf16]' hydra.run.dir="$OUT_DIR/memory_fit" > "$OUT_DIR/memory_fit.log" 2>&1 || FAILED+=(memory_fit)
grep -A8 "^== ZeRO at world size 1" "$OUT_DIR/memory_fit.log" || true
if [ "${SCALE:-0}" = 1 ]; then
  timeout 300 python3 -m ddp_lab.scale hydra.run.dir="$OUT_DIR/scale" > "$OUT_DIR/scale.log" 2>&1 || FAILED+=(scale)
  tail -60 "$OUT_DIR/scale.log"
fi
if [ ${#FAILED[@]} -gt 0 ]; then
  echo "failed: ${FAILED[*]} (logs in $OUT_DIR)"
  exit 1
fi
