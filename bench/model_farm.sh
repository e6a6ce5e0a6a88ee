#!/usr/bin/env bash
# The farm with and without the bundled model, on the GPU: what the model costs end to end.
# A uniform JPEG set and a varied one, CPU producers and GPU producers, each with --model none,
# the model at fp32 and the model at a reduced precision, one after the other in one run.
#
#   bench/model_farm.sh TENSORPORT_BINARY OUT_DIR [CPU_PRODUCERS] [GPU_PRODUCERS] [PRECISION]
# (defaults 15, 2, f16; OUT_DIR keeps the generated images between runs)
set -euo pipefail
bin=$(realpath "$1"); out=$(realpath -m "$2")
cpu=${3:-15}; gpu=${4:-2}; precision=${5:-f16}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out"
"$here/make_sets.sh" "$out" 1000
for set in uniform varied; do
  n=$(find "$out/$set" -name '*.jpg' | wc -l)
  for producers in "--producers $cpu" "--producers 0 --gpu-producers $gpu"; do
    for model in "--model none" "--precision f32" "--precision $precision"; do
      printf '%s (%s files), %s, %s: ' "$set" "$n" "$producers" "$model"
      # shellcheck disable=SC2086
      "$bin" --log warn farm --device cuda --input "$out/$set" $producers $model \
        --progress never --output "$out/out.jsonl" 2>&1 | grep throughput | sed 's/^ *//'
    done
  done
done
