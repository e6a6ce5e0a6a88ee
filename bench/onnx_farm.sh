#!/usr/bin/env bash
# An ONNX network (ResNet-50 from bench/peers/resnet50_onnx.py, f32 and f16) on the GPU through
# ONNX Runtime, end to end from a folder of JPEGs to result lines, on the uniform and the varied
# set of bench/make_sets.sh, beside the model alone and the peers, in one run:
#
# - the model alone: `model-bench` (batches already on the GPU), and with PEERS=1 the same file
#   in onnxruntime's Python API (bench/peers/onnx_model.py);
# - the farm with the model: its default mix, CPU producers only, and GPU producers only; and
#   `--model none` (the pipeline's own ceiling);
# - with PEERS=1, the Python pipelines into the same file and network
#   (bench/peers/onnx_pipelines.py: the DataLoader and DALI into onnxruntime-gpu and into the
#   network under torch.compile).
#
# Each farm line is its summary's throughput (after start-up) and batches; each set is listed
# REPEAT times (the uniform set) or REPEAT_VARIED times (the others). SETS picks the sets
# (default "uniform varied"; "mixed" is bench/make_sets.sh's baseline photos of mixed size and
# chroma).
#
#   bench/onnx_farm.sh TENSORPORT MODELS_DIR SETS_DIR [REPEAT] [REPEAT_VARIED]
#
# With PEERS=1 the model alone also runs as the network in PyTorch (bench/peers/resnet50_torch.py:
# eager, and under torch.compile with TORCH_COMPILE=1).
#
# ALONE=0 leaves out the model alone (measured once, in an earlier run); PIPELINES picks
# onnx_pipelines.py's pipelines (default: all four). The peers run onnxruntime at its best
# settings (ORT_SETTINGS=defaults: onnxruntime's own defaults). MPS_MODES lists the farm's --mps
# modes to run each mix with (default "auto off": with and without MPS). MODELS picks the
# networks (default "none resnet50 resnet50_f16"), MIXES the producer mixes (';'-separated, each
# a name and its flags; default: the farm's default, CPU producers only, 2 GPU producers only),
# HW_LOADS DALI's hw_decoder_load values (default "0.65,0.9").
#
# TENSORPORT_ORT names onnxruntime-gpu's libonnxruntime.so; LD_LIBRARY_PATH must reach CUDA 13,
# cuBLAS and cuDNN 9 (scripts/gpu-env.sh). TENSORPORT_TIMEOUT: seconds any one command may take.
set -euo pipefail
lim=(); [[ -n ${TENSORPORT_TIMEOUT:-} ]] && lim=("timeout" "$TENSORPORT_TIMEOUT")
tp=$1; models=$2; sets=$3; repeat=${4:-5}; repeat_varied=${5:-2}
here=$(cd "$(dirname "$0")" && pwd)
lists=$(mktemp -d); trap 'rm -rf "$lists"' EXIT
for _ in $(seq "$repeat"); do find "$sets/uniform" -name '*.jpg' | sort; done > "$lists/uniform"
for s in varied mixed; do
  [[ -d "$sets/$s" ]] || continue
  for _ in $(seq "$repeat_varied"); do find "$sets/$s" -name '*.jpg' | sort; done > "$lists/$s"
done
cores=$(nproc)
for m in ${MODELS:-resnet50 resnet50_f16}; do
  [[ ${ALONE:-1} == 0 ]] && break
  [[ $m == none ]] && continue
  "${lim[@]}" "$tp" --log warn model-bench --device cuda --model "$models/$m.onnx" \
    --batch 32,128,256 --seconds 2 | grep '|'
  if [[ ${PEERS:-0} == 1 ]]; then
    for settings in defaults best; do
      "${lim[@]}" python3 "$here/peers/onnx_model.py" "$models/$m.onnx" --provider cuda \
        --settings "$settings" --batch 32,128,256 --seconds 2 | grep '|' \
        || echo "onnx_model.py $m $settings failed"
    done
  fi
done
if [[ ${PEERS:-0} == 1 && ${ALONE:-1} == 1 ]]; then
  # The network itself in PyTorch, eager (and with TORCH_COMPILE=1 under torch.compile).
  engines=eager; [[ ${TORCH_COMPILE:-0} == 1 ]] && engines=eager,compile
  "${lim[@]}" python3 "$here/peers/resnet50_torch.py" --batch 32,128,256 --seconds 2 \
    --engines "$engines" | grep '|' || echo "resnet50_torch.py failed"
fi
# MIXES: the producer mixes, separated by ';', each a name and its farm flags.
mixes=${MIXES:-"default;cpu -p $((cores - 1)) --gpu-producers 0;gpu -p 0 --gpu-producers 2"}
for s in ${SETS:-uniform varied}; do
  echo "$s: $(wc -l < "$lists/$s") inputs"
  for m in ${MODELS:-none resnet50 resnet50_f16}; do
    model=$models/$m.onnx; [[ $m == none ]] && model=none
    IFS=';' read -ra each <<< "$mixes"
    for mix in "${each[@]}"; do
      for mps in ${MPS_MODES:-auto off}; do
        set -- $mix; name=$1; shift
        t0=$(date +%s.%N)
        summary=$("${lim[@]}" "$tp" --log warn farm --device cuda --model "$model" "$@" \
          --mps "$mps" --input-list "$lists/$s" --progress never -o /dev/null 2>&1 \
          | grep -E 'throughput|batches|producers|MPS|error' || true)
        wall=$(awk "BEGIN{printf \"%.1f\", $(date +%s.%N) - $t0}")
        echo "$s, $m, $name, mps $mps: $(echo "$summary" | tr -s ' ' | tr '\n' ' ') (whole run $wall s)"
      done
    done
  done
  if [[ ${PEERS:-0} == 1 ]]; then
    for m in ${MODELS:-resnet50 resnet50_f16}; do
      [[ $m == none ]] && continue
      "${lim[@]}" python3 "$here/peers/onnx_pipelines.py" "$lists/$s" "$models/$m.onnx" \
        ${PIPELINES:+--pipelines "$PIPELINES"} --hw-load "${HW_LOADS:-0.65,0.9}" 2>&1 \
        | sed "s/^/$s, $m, /" | grep -v Warning || echo "$s, $m: onnx_pipelines.py failed"
    done
  fi
done
