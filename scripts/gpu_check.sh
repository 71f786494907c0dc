#!/usr/bin/env bash
# Run infinikv's CUDA path on a GPU machine (or on CPU: DEVICE=cpu CONTEXTS=512,1024).
# Results go to $OUT/gpu_check.json when OUT is set.
set -euo pipefail
cd "$(dirname "$0")/.."
make setup
DEVICE=${DEVICE:-$(.venv/bin/python -c 'import torch; print("cuda" if torch.cuda.is_available() else "cpu")')}
.venv/bin/python scripts/gpu_check.py --device "$DEVICE" --contexts "${CONTEXTS:-4096,16384,32768}" --steps "${STEPS:-16}"
