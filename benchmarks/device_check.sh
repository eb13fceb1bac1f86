#!/usr/bin/env bash
# The one GPU check (../shared/device/README.md): ceilings, kernel correctness on the GPU, W4A16 GEMM vs bf16
# cuBLAS, paged decode attention vs copy bandwidth. JSON under $OUT, a ratio table last; < 8 minutes.
#   on the device:  PYTHONUNBUFFERED=1 bash benchmarks/device_check.sh
#   here, no GPU:   bash benchmarks/device_check.sh --dry-run     (Triton interpreter, tiny shapes, no timings)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=python3
[ -x .venv/bin/python ] && PY=.venv/bin/python
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ "${1:-}" != "--dry-run" ]; then
    nvidia-smi -L || true
fi
"$PY" -c 'import sys, torch, triton; print("python", sys.version.split()[0], "torch", torch.__version__, "triton", triton.__version__)'
exec "$PY" benchmarks/device_check.py --out "${OUT:-out/device_check}" "$@"
