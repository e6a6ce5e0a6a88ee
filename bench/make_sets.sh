#!/usr/bin/env bash
# The JPEG sets the farm benchmarks use, made once into OUT_DIR/uniform, OUT_DIR/varied and
# OUT_DIR/mixed (bench/peers/make_jpegs.py, eight generators at a time, reproducible by seed):
# small ImageNet-like files; a photo collection with progressive and grayscale files; baseline
# colour photos of mixed size and chroma.
#
#   bench/make_sets.sh OUT_DIR [UNIFORM_PER_SEED] [VARIED_PER_SEED] [MIXED_PER_SEED]
# (defaults 250, 150 and 150: 2,000 uniform, 1,200 varied and 1,200 mixed files)
#
# Each set also gets a list that repeats its files, sorted, to at least 15,000 inputs
# (OUT_DIR/SET.list: `farm --input-list`), so a run reaches its steady state.
set -euo pipefail
out=$(realpath -m "$1"); uniform=${2:-250}; varied=${3:-150}; mixed=${4:-150}
here=$(cd "$(dirname "$0")" && pwd)
lists() {
  for set in uniform varied mixed; do
    find "$out/$set" -name '*.jpg' | sort > "$out/$set.files"
    n=$(wc -l < "$out/$set.files")
    [[ $n -gt 0 ]] || continue
    for _ in $(seq $(( (15000 + n - 1) / n ))); do cat "$out/$set.files"; done > "$out/$set.list"
    rm "$out/$set.files"
  done
}
if [[ -f "$out/varied/varied.tsv" && -f "$out/mixed/varied.tsv" && -d "$out/uniform" ]]; then
  [[ -f "$out/mixed.list" ]] || lists
  exit 0
fi
for s in $(seq 1 8); do
  python3 "$here/peers/make_jpegs.py" "$out/varied" --varied --count "$varied" --seed "$s" > /dev/null &
  python3 "$here/peers/make_jpegs.py" "$out/uniform" --count "$uniform" --seed "$s" > /dev/null &
  python3 "$here/peers/make_jpegs.py" "$out/mixed" --mixed --count "$mixed" --seed "$s" > /dev/null &
done
wait
lists
