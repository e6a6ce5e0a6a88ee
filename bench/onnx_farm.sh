#!/usr/bin/env bash
# An ONNX network (ResNet-50 from bench/peers/resnet50_onnx.py) on the GPU through ONNX Runtime:
# the model alone (model-bench, batches already on the GPU) beside the default GPU farm end to
# end (a folder of JPEGs -> result lines) with the model, with `--model none`, and with two model
# workers, on the uniform set (bench/make_sets.sh) listed REPEAT times, two rounds. Each farm
# line is its summary's throughput (after start-up) and batches.
#
#   bench/onnx_farm.sh TENSORPORT MODELS_DIR SETS_DIR [REPEAT]
#
# TENSORPORT_ORT names onnxruntime-gpu's libonnxruntime.so; LD_LIBRARY_PATH must reach CUDA 13,
# cuBLAS and cuDNN 9 (scripts/gpu-env.sh). TENSORPORT_TIMEOUT: seconds any one command may take.
set -euo pipefail
lim=(); [[ -n ${TENSORPORT_TIMEOUT:-} ]] && lim=(timeout "$TENSORPORT_TIMEOUT")
tp=$1; models=$2; sets=$3; repeat=${4:-5}
list=$(mktemp); trap 'rm -f "$list"' EXIT
for _ in $(seq "$repeat"); do find "$sets/uniform" -name '*.jpg' | sort; done > "$list"
echo "inputs: $(wc -l < "$list") ($repeat x the uniform set)"
for m in resnet50 resnet50_f16; do
  "${lim[@]}" "$tp" --log warn model-bench --device cuda --model "$models/$m.onnx" \
    --batch 32,64,128 --seconds 2 | grep '|'
done
for round in 1 2; do
  for cfg in "none" "resnet50" "resnet50_f16" "resnet50 --workers 2" "resnet50_f16 --workers 2"; do
    set -- $cfg; m=$1; shift
    model=$models/$m.onnx; [[ $m == none ]] && model=none
    summary=$("${lim[@]}" "$tp" --log warn farm --device cuda --model "$model" "$@" \
      --input-list "$list" --progress never -o /dev/null 2>&1 | grep -E 'throughput|batches' || true)
    echo "round $round, $cfg: $(echo "$summary" | tr -s ' ' | tr '\n' ' ')"
  done
done
