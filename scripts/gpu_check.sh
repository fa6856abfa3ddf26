#!/usr/bin/env bash
# GPU check of the training loop: one short run per setting (224 px AlexNet and AlexNet-CIFAR, on
# synthetic data and on digits), then a table of img/s and the step-time breakdown from each
# summary.json. Checkpoints only at the end: digits has a few steps per epoch, and a checkpoint
# per epoch would drain the GPU's queue every few steps.
#   scripts/gpu_check.sh [out_dir] [extra overrides...]
set -euo pipefail
OUT_DIR=${1:-${OUT:-outputs/gpu_check}}; shift || true
mkdir -p "$OUT_DIR"
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
common="data=synthetic train.max_steps=${STEPS:-60} train.checkpoint_every=${STEPS:-60} train.timing_warmup=10 train.eval_every_epochs=0 train.progress=false train.resume=never"
run() {  # name, overrides...
  local name=$1; shift
  python3 -m ddp_lab.train $common hydra.run.dir="$OUT_DIR/$name" "$@" "${EXTRA[@]}" > "$OUT_DIR/$name.log" 2>&1 \
    || { echo "FAILED $name"; tail -20 "$OUT_DIR/$name.log"; FAILED+=("$name"); }
}
EXTRA=("$@")
FAILED=()  # a failed run costs its own row only; the script still exits 1 at the end
run fp32        model=alexnet sync=none precision=fp32 train.batch_size=256
run tf32        model=alexnet sync=none precision=tf32 train.batch_size=256
run fp16        model=alexnet sync=none precision=fp16 train.batch_size=256
run bf16        model=alexnet sync=none precision=bf16 train.batch_size=256
run bf16_cl     model=alexnet sync=none precision=bf16 train.batch_size=256 train.channels_last=true
run bf16_cl_ddp model=alexnet sync=ddp  precision=bf16 train.batch_size=256 train.channels_last=true
run bf16_cl_compile model=alexnet sync=none precision=bf16 train.batch_size=256 train.channels_last=true train.compile=true
run bf16_cl_s2d model=alexnet model.stem=space_to_depth sync=none precision=bf16 train.batch_size=256 train.channels_last=true
run bf16_cl_s2d_compile model=alexnet model.stem=space_to_depth sync=none precision=bf16 train.batch_size=256 train.channels_last=true train.compile=true
run bf16_cl_s2d_compile_graph model=alexnet model.stem=space_to_depth sync=none precision=bf16 train.batch_size=256 train.channels_last=true train.compile=true train.cuda_graph=true
run bf16_cl_digits model=alexnet data=digits sync=none precision=bf16 train.batch_size=256 train.channels_last=true
run cifar_synth model=alexnet_cifar sync=none precision=bf16 train.batch_size=512 train.channels_last=true
run cifar_digits model=alexnet_cifar data=digits sync=none precision=bf16 train.batch_size=512 train.channels_last=true
run cifar_synth_graph model=alexnet_cifar sync=none precision=bf16 train.batch_size=512 train.channels_last=true train.cuda_graph=true
run cifar_digits_graph model=alexnet_cifar data=digits sync=none precision=bf16 train.batch_size=512 train.channels_last=true train.cuda_graph=true
python3 - "$OUT_DIR" <<'PY'
import json, os, sys
out = sys.argv[1]
print(f"{'run':28} {'img/s':>9} {'step':>7} {'fwd':>6} {'bwd':>6} {'exp.comm':>8} {'optim':>6} {'graph':>6} {'data':>6} {'GiB':>5}")
for name in sorted(os.listdir(out)):
    p = os.path.join(out, name, "summary.json")
    if not os.path.exists(p):
        continue
    s = json.load(open(p)); t = s["time_ms"]
    print(f"{name:28} {s['train_img_per_s']:9.0f} {t.get('step',0):7.2f} {t.get('forward',0):6.2f} {t.get('backward',0):6.2f} "
          f"{t.get('exposed_comm',0):8.2f} {t.get('optim',0):6.2f} {t.get('graph',0):6.2f} {t.get('data',0):6.2f} "
          f"{s.get('max_memory_allocated_GiB',0):5.1f}")
PY
if [ ${#FAILED[@]} -gt 0 ]; then
  echo "failed: ${FAILED[*]} (logs in $OUT_DIR)"
  exit 1
fi
