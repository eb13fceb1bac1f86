#!/usr/bin/env bash
# Does compression buy speed end to end? `compress bench` of the W4 (RTN, groups of 64, symmetric), W4 with
# an 8-bit lm_head (w4h8: --quantize-lm-head) and W8 (RTN, per channel) checkpoints of the default model
# against the float model, measured in the same run, with float32 and then bfloat16 activations: prefill,
# decode steps at batch 1/8/32/64 against the bandwidth floor, and a Poisson workload.
# Results: benchmarks/results/quantized-speed-DATE-{w4,w4h8,w8}-{float32,bfloat16}.json
#
#   [QUANT="w4 w4h8 w8"] bash benchmarks/quantized_speed.sh [extra compress bench flags]
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=.venv/bin
DATE=$(date +%F)
mkdir -p out/speed benchmarks/results
[ -f out/speed/w4/slimlm.json ] || $BIN/compress rtn --model smollm2-135m --bits 4 --group-size 64 --sym --out out/speed/w4 --overwrite
[ -f out/speed/w4h8/slimlm.json ] || $BIN/compress rtn --model smollm2-135m --bits 4 --group-size 64 --sym --quantize-lm-head 8 --out out/speed/w4h8 --overwrite
[ -f out/speed/w8/slimlm.json ] || $BIN/compress rtn --model smollm2-135m --bits 8 --group-size -1 --sym --out out/speed/w8 --overwrite
for dtype in float32 bfloat16; do
  for q in ${QUANT:-w4 w4h8 w8}; do
    echo "== $q, $dtype activations"
    $BIN/compress bench out/speed/$q --baseline smollm2-135m --dtype $dtype "$@" \
      --json benchmarks/results/quantized-speed-$DATE-$q-$dtype.json
  done
done
