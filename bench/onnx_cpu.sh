#!/usr/bin/env bash
# An ONNX network on the CPU through ONNX Runtime's CPU execution provider, end to end from a
# list of JPEGs to result lines, beside the same file in onnxruntime's Python API fed by a
# Pillow worker pool (bench/peers/onnx_cpu_pipeline.py), in one run:
#
# - the model alone: `model-bench --model` (batches already in memory) and onnxruntime's Python
#   API on a resident batch, batch 32;
# - ROUNDS rounds, each: the farm with the model at its default (3 CPU producers, the model's
#   threads on every core) and with one producer, then the Python pipeline with 1 and NPROC
#   workers.
#
# Each farm line is its summary's throughput (after start-up) and batches.
#
#   bench/onnx_cpu.sh TENSORPORT MODEL.onnx LIST [ROUNDS]
#
# PYTHON names a Python with numpy, pillow and onnxruntime (default python3). The farm finds ONNX
# Runtime as it always does (TENSORPORT_ORT, or scripts/fetch-onnxruntime.sh's target/onnxruntime).
set -euo pipefail
tp=$1; model=$2; list=$3; rounds=${4:-2}
py=${PYTHON:-python3}
here=$(cd "$(dirname "$0")" && pwd)
cores=$(nproc)
echo "$(wc -l < "$list") inputs, $cores cores ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'))"
"$tp" --log warn model-bench --device cpu --model "$model" --batch 32 --seconds 10 | grep '|'
"$py" "$here/peers/onnx_cpu_pipeline.py" "$list" "$model" --alone --workers 0 2>/dev/null \
  | grep alone || true
for r in $(seq "$rounds"); do
  for mix in "default" "1-producer -p 1"; do
    set -- $mix; name=$1; shift
    summary=$("$tp" --log warn farm --model "$model" "$@" --input-list "$list" \
      --progress never -o /dev/null 2>&1 | grep -E 'throughput|batches' || true)
    echo "round $r, farm $name: $(echo "$summary" | tr -s ' ' | tr '\n' ' ')"
  done
  "$py" "$here/peers/onnx_cpu_pipeline.py" "$list" "$model" --workers "1,$cores" \
    | sed "s/^/round $r, /"
done
