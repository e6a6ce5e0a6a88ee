#!/usr/bin/env bash
# The farm's producer mixes on the uniform and the varied JPEG sets, `--model none` — the default
# (no -p/--gpu-producers) first —, with torchvision's nvJPEG pipeline, PyTorch's DataLoader
# (15 workers) and, where `nvidia.dali` imports, DALI's mixed pipeline on the same files in the
# same run. Needs a CUDA build of tensorport and a GPU.
#
#   bench/farm_mix.sh BINARY OUT_DIR [UNIFORM_PER_SEED] [VARIED_PER_SEED]
# (defaults 1000 and 150: 8,000 uniform and 1,200 varied files; see bench/make_sets.sh)
set -euo pipefail
bin=$(realpath "$1"); out=$(realpath -m "$2")
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out"
"$here/make_sets.sh" "$out" "${3:-1000}" "${4:-150}"
mixes=("" "-p 15" "-p 0 --gpu-producers 1" "-p 0 --gpu-producers 2" "-p 8 --gpu-producers 2" "-p 12 --gpu-producers 2 --routing by-kind")
for set in uniform varied; do
  n=$(ls "$out/$set" | grep -c jpg)
  echo "== $set, $n files: images/s after start-up (whole run)"
  echo "| producers | images/s after start-up | whole run | results by CPU / GPU producers |"
  echo "| --- | ---: | ---: | --- |"
  for mix in "${mixes[@]}"; do
    # shellcheck disable=SC2086
    s=$("$bin" --log warn farm --input "$out/$set" $mix --device cuda --model none \
          --progress never --output "$out/$set.jsonl" 2>&1)
    after=$(sed -n 's/.*; \([0-9.]*\) after start-up.*/\1/p' <<<"$s")
    whole=$(sed -n 's/^throughput *\([0-9.]*\) images.*/\1/p' <<<"$s")
    kind=$(sed -n 's/^by kind *CPU producers \([0-9]*\) results, GPU producers \([0-9]*\)/\1 \/ \2/p' <<<"$s")
    grep -q INCOMPLETE <<<"$s" && kind="$kind INCOMPLETE"
    picked=$(sed -n "s/^producers *\\([^(]*\\) (.*/\\1/p" <<<"$s" | head -1)
    echo "| \`${mix:-default ($picked)}\` | $after | $whole | ${kind:-all CPU} |"
  done
  python3 "$here/peers/torch_jpeg.py" "$out/$set" --pipelines gpu-nvjpeg,cpu-tv --workers 15 \
    | grep -E "gpu-nvjpeg|workers"
  if python3 -c "import nvidia.dali" 2>/dev/null; then
    python3 "$here/peers/dali_jpeg.py" "$out/$set" --pipelines mixed --hw-load 0.9,0.65 --threads 15 \
      | grep dali || true
  else
    echo "(DALI not installed: no DALI column)"
  fi
done
