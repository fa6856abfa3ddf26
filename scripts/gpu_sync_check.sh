#!/usr/bin/env bash
# One-GPU checks of our syncs' CUDA path and the scaling sweep's single-GPU point:
#   1. tests/test_sync_cuda.py (side stream + events, races provoked on purpose)
#   2. sync=ring / tree / naive (overlap on) vs sync=none at world size 1 over NCCL: same params
#   3. python -m ddp_lab.scale (N=1 on NCCL for ddp, naive, ring, tree) + the simulation
#   scripts/gpu_sync_check.sh [out_dir]
set -uo pipefail
OUT_DIR=${1:-${OUT:-outputs/gpu_sync_check}}
mkdir -p "$OUT_DIR"
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
python3 -m pytest -q -p no:cacheprovider tests/test_sync_cuda.py 2>&1 | tail -5
common="data=synthetic data.num_samples=4096 model.default_classes=10 model.dropout=0 train.max_steps=20 train.progress=false train.resume=never train.eval_every_epochs=0 train.cudnn_benchmark=false"
for s in none ring tree naive; do
  python3 -m ddp_lab.train $common sync=$s hydra.run.dir="$OUT_DIR/ws1/$s" > "$OUT_DIR/ws1_$s.log" 2>&1 || { echo "FAILED sync=$s"; tail -15 "$OUT_DIR/ws1_$s.log"; }
done
python3 - "$OUT_DIR/ws1" <<'PY'
import sys, torch
root = sys.argv[1]
ref = torch.load(f"{root}/none/checkpoint.pt", weights_only=True)["model"]
for s in ("ring", "tree", "naive"):
    try:
        got = torch.load(f"{root}/{s}/checkpoint.pt", weights_only=True)["model"]
    except FileNotFoundError:
        print(f"sync={s}: no checkpoint"); continue
    d = max((ref[k].double() - got[k].double()).abs().max().item() for k in ref)
    print(f"sync={s} vs sync=none on CUDA, 20 steps: max |param diff| = {d:.3g}")
PY
timeout 300 python3 -m ddp_lab.scale hydra.run.dir="$OUT_DIR/scale" > "$OUT_DIR/scale.log" 2>&1; echo "scale rc=$?"
tail -60 "$OUT_DIR/scale.log"
