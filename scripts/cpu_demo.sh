#!/usr/bin/env bash
# Two CPU ranks on the bundled digits (gloo).
set -euo pipefail
torchrun --standalone --nproc_per_node=2 -m ddp_lab.train "$@"
