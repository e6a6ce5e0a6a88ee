#!/usr/bin/env bash
# The farm with and without the bundled model, on the GPU: what the model costs end to end.
# For each round, each producer mix and each model (--model none first), one farm run over the
# uniform set listed REPEAT times; rounds alternate, so the machine's drift touches every row.
# Prints one table row per run (images/s after start-up), then each model's rate over the same
# round's --model none.
#
#   bench/model_farm.sh TENSORPORT_BINARY OUT_DIR [ROUNDS] [REPEAT]
# (defaults 2 rounds, the set listed 20 times: 40,000 inputs; OUT_DIR keeps the generated
# images between runs). Mixes: 2 GPU producers alone, the default mix, 15 CPU producers.
# Models: none, f32 (the default), f16, tf32.
set -euo pipefail
bin=$(realpath "$1"); out=$(realpath -m "$2")
rounds=${3:-2}; repeat=${4:-20}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out"
"$here/make_sets.sh" "$out" 250 150
list="$out/uniform-x$repeat.list"
ls -d "$out"/uniform/*.jpg > "$out/uniform.list"
for _ in $(seq "$repeat"); do cat "$out/uniform.list"; done > "$list"
mixes=("-p 0 --gpu-producers 2" "" "-p 15")
names=("2 GPU" "default mix" "15 CPU")
models=("--model none" "--precision f32" "--precision f16" "--precision tf32")
echo "uniform set: $(wc -l < "$out/uniform.list") files, $(wc -l < "$list") inputs"
echo "| round | producers | model | images/s after start-up | ÷ none |"
echo "| ---: | --- | --- | ---: | ---: |"
for r in $(seq "$rounds"); do
  for m in "${!mixes[@]}"; do
    none=""
    for model in "${models[@]}"; do
      # shellcheck disable=SC2086
      summary=$("$bin" --log warn farm --device cuda --input-list "$list" ${mixes[$m]} $model \
        --progress never --output "$out/out.jsonl" 2>&1 || true)
      rate=$(sed -n 's/.*; \([0-9.]*\) after start-up.*/\1/p' <<<"$summary")
      if [[ -z "$rate" ]]; then
        echo "| $r | ${names[$m]} | $model | failed: $(tail -1 <<<"$summary") | |"
        continue
      fi
      [[ "$model" == "--model none" ]] && none=$rate
      ratio=$([[ -n "$none" ]] && awk -v a="$rate" -v b="$none" 'BEGIN { printf "%.2f", a / b }')
      echo "| $r | ${names[$m]} | $model | $rate | $ratio |"
    done
  done
done
