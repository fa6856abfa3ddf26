#!/usr/bin/env bash
# Multi-node training through torchrun's c10d rendezvous (no home-made launcher).
# Run this same command on every node; only NODE0 (the rendezvous host) must be reachable.
#
#   NNODES=2 NPROC=8 NODE0=10.0.0.1 ./scripts/multinode.sh model=alexnet data=synthetic precision=bf16
#
# Optional: NPROC (default: this node's GPU count), PORT (29400), RDZV_ID, MAX_RESTARTS (1).
# DRY_RUN=1 prints the environment it sets and the torchrun command line, and launches nothing.
#
# Security: torch's TCPStore has no authentication and listens on all interfaces. Use a trusted,
# isolated network only. The run directory (hydra.run.dir) must be on a shared file system so that
# every rank resumes from the same checkpoint; only global rank 0 writes to it.
set -euo pipefail
: "${NNODES:?set NNODES}" "${NODE0:?set NODE0 (rendezvous host)}"
NPROC=${NPROC:-$(python -c 'import torch; print(max(1, torch.cuda.device_count()))')}
PORT=${PORT:-29400}
RDZV_ID=${RDZV_ID:-ddp_lab_$(date +%Y%m%d)}
# A restart across nodes needs a fresh rendezvous store per attempt (docs/reliability.md).
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
cmd=(torchrun --nnodes="$NNODES" --nproc_per_node="$NPROC"
     --rdzv-backend=c10d --rdzv-endpoint="$NODE0:$PORT" --rdzv-id="$RDZV_ID"
     --max-restarts="${MAX_RESTARTS:-1}"
     -m ddp_lab.train "$@")
if [[ "${DRY_RUN:-0}" == 1 ]]; then
  echo "export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=$TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
  printf '%q ' "${cmd[@]}" | sed 's/ $/\n/'
  exit 0
fi
exec "${cmd[@]}"
