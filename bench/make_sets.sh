#!/usr/bin/env bash
# The two JPEG sets the farm benchmarks use, made once into OUT_DIR/uniform and OUT_DIR/varied
# (bench/peers/make_jpegs.py, eight generators at a time, reproducible by seed).
#
#   bench/make_sets.sh OUT_DIR [UNIFORM_PER_SEED] [VARIED_PER_SEED]
# (defaults 250 and 150: 2,000 uniform and 1,200 varied files)
set -euo pipefail
out=$(realpath -m "$1"); uniform=${2:-250}; varied=${3:-150}
here=$(cd "$(dirname "$0")" && pwd)
[[ -f "$out/varied/varied.tsv" && -d "$out/uniform" ]] && exit 0
for s in $(seq 1 8); do
  python3 "$here/peers/make_jpegs.py" "$out/varied" --varied --count "$varied" --seed "$s" > /dev/null &
  python3 "$here/peers/make_jpegs.py" "$out/uniform" --count "$uniform" --seed "$s" > /dev/null &
done
wait
