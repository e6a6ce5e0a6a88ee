#!/usr/bin/env bash
# An ONNX network (ResNet-50 from bench/peers/resnet50_onnx.py) on the GPU through ONNX Runtime:
# the model alone (model-bench, batches already on the GPU) beside the default GPU farm end to
# end (a folder of JPEGs -> result lines), with the model and with --model none, on the uniform
# set (bench/make_sets.sh) listed REPEAT times. Rates after start-up, from the farm's summary.
#
#   bench/onnx_farm.sh TENSORPORT MODELS_DIR SETS_DIR [REPEAT] [PRECISIONS]
#
# PRECISIONS: "f32 f16" by default (resnet50.onnx, resnet50_f16.onnx). TENSORPORT_ORT names
# onnxruntime-gpu's libonnxruntime.so; LD_LIBRARY_PATH must reach CUDA 13, cuBLAS and cuDNN 9.
set -euo pipefail
# TENSORPORT_TIMEOUT: seconds any one command may take (default: no limit).
lim=(); [[ -n ${TENSORPORT_TIMEOUT:-} ]] && lim=(timeout "$TENSORPORT_TIMEOUT")
tp=$1; models=$2; sets=$3; repeat=${4:-5}; precisions=${5:-"f32 f16"}
list=$(mktemp); trap 'rm -f "$list"' EXIT
for _ in $(seq "$repeat"); do find "$sets/uniform" -name '*.jpg' | sort; done > "$list"
echo "inputs: $(wc -l < "$list") ($repeat x the uniform set)"
for p in $precisions; do
  m=$models/resnet50.onnx; [[ $p == f16 ]] && m=$models/resnet50_f16.onnx
  "${lim[@]}" "$tp" --log warn model-bench --device cuda --model "$m" --batch 32,128,256 --seconds 3
done
rate() { grep -o 'throughput.*' | sed 's/throughput *//'; }
for round in 1 2; do
  echo "round $round"
  echo "none: $("${lim[@]}" "$tp" --log warn farm --device cuda --model none --input-list "$list" --progress never -o /dev/null | rate)"
  for p in $precisions; do
    m=$models/resnet50.onnx; [[ $p == f16 ]] && m=$models/resnet50_f16.onnx
    echo "$p: $("${lim[@]}" "$tp" --log warn farm --device cuda --model "$m" --input-list "$list" --progress never -o /dev/null | rate)"
  done
done
