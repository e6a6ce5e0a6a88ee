#!/usr/bin/env bash
# Two tensorport builds' CPU farms, alternated, on a varied photo folder and a uniform one, with
# PyTorch's DataLoader on the same files in the same run.
#
#   bench/farm_varied.sh BEFORE_BINARY AFTER_BINARY OUT_DIR [PRODUCERS] [ROUNDS]
# (the same binary twice compares a build with itself: the spread between runs)
set -euo pipefail
before=$(realpath "$1"); after=$(realpath "$2"); out=$(realpath -m "$3")
producers=${4:-15}; rounds=${5:-2}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out"
"$here/make_sets.sh" "$out"
for set in varied uniform; do
  echo "== $set ($(ls "$out/$set" | grep -c jpg) files), $producers CPU producers, --model none"
  for r in $(seq 1 "$rounds"); do
    for which in before after; do
      bin=$before; [[ $which == after ]] && bin=$after
      printf '%s: ' "$which"
      "$bin" --log warn farm --input "$out/$set" --producers "$producers" --model none \
        --progress never --output "$out/$set-$which.jsonl" 2>&1 | grep throughput
    done
  done
  python3 "$here/peers/torch_jpeg.py" "$out/$set" --pipelines cpu-tv --workers "$producers" | grep workers
done
