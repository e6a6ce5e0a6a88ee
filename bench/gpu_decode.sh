#!/usr/bin/env bash
# The GPU producers' decoder by image size and chroma subsampling, with torchvision's nvJPEG
# pipeline on the same files, in one run: one process decoding batches of 32 (`tensorport prep
# --nvjpeg`, which prints the GPU's time per image in nvJPEG's decode and in the
# resize/crop/normalise kernel, the host time of the engines' calls, and how many images the
# hybrid decoder took with its threads' time per image) with `--gpu-decode engines`, `by-chroma`
# and `split` (with replicated chroma, as it needs to share subsampled files; the engines'
# replicating row beside it), and the tensors' distance from torchvision's CPU decode.
#
#   bench/gpu_decode.sh TENSORPORT_BINARY OUT_DIR [UNIFORM_PER_SEED] [VARIED_PER_SEED] [MIXED_PER_SEED]
#
# The sets come from bench/make_sets.sh (defaults 250, 150 and 150). The mixed set's files
# (baseline colour photos) are linked into OUT_DIR/by/{444,422,420,large,small} by chroma and
# size, the varied set's colour baseline files into OUT_DIR/by/colour. THREADS="4 15" runs the
# by-chroma and split rows with each count of host threads (default 4, a GPU producer's beside CPU
# producers); ACCURACY_ONLY=1 runs only the comparison with torchvision. Needs the CUDA build,
# torch, torchvision and safetensors.
set -euo pipefail
bin=$(realpath "$1"); out=$(realpath -m "$2")
here=$(cd "$(dirname "$0")" && pwd)
"$here/make_sets.sh" "$out" "${3:-250}" "${4:-150}" "${5:-150}"
by="$out/by"; rm -rf "$by"; mkdir -p "$by"/{colour,444,422,420,large,small}
# varied.tsv: name, width, height, quality, subsampling (0 4:4:4, 1 4:2:2, 2 4:2:0), progressive, gray
while IFS=$'\t' read -r name _ _ _ _ prog gray; do
  [[ $prog == 0 && $gray == 0 ]] && ln -sf "$out/varied/$name" "$by/colour/$name"
done < "$out/varied/varied.tsv"
while IFS=$'\t' read -r name w h _ css _ _; do
  f="$out/mixed/$name"
  case $css in 0) ln -sf "$f" "$by/444/$name" ;; 1) ln -sf "$f" "$by/422/$name" ;; *) ln -sf "$f" "$by/420/$name" ;; esac
  if (( w * h >= 2000000 )); then ln -sf "$f" "$by/large/$name"; elif (( w * h < 500000 )); then ln -sf "$f" "$by/small/$name"; fi
done < "$out/mixed/varied.tsv"
prep() { # label dir flags...
  local label=$1 d=$2; shift 2
  { "$bin" --log warn prep --input "$d" --nvjpeg --repeat 2 --batch 32 "$@" 2>&1 || true; } \
    | grep -E "images/s|per image|hybrid decoder|error" | tr '\n' ' ' | sed "s/^/   $label: /"; echo
}
[[ -n ${ACCURACY_ONLY:-} ]] || echo "== one process, batches of 32, best of 2 passes; torchvision's nvJPEG pipeline on the same files"
[[ -n ${ACCURACY_ONLY:-} ]] || for d in "$out/mixed" "$by"/{444,422,420,large,small,colour} "$out/uniform"; do
  echo "-- $(basename "$d"): $(find -L "$d" -name '*.jpg' | wc -l) files"
  prep "engines" "$d" --gpu-decode engines
  prep "engines, replicated chroma" "$d" --gpu-decode engines --gpu-upsampling replicate
  for t in ${THREADS:-4}; do
    prep "by-chroma, $t threads" "$d" --gpu-decode by-chroma --cpu-threads "$t"
    prep "split, replicated chroma, $t threads" "$d" --gpu-decode split --gpu-upsampling replicate --cpu-threads "$t"
  done
  python3 "$here/peers/torch_jpeg.py" "$d" --pipelines gpu-nvjpeg 2>&1 | grep -E "gpu-nvjpeg|error" | sed 's/^/   torchvision /' || true
done
echo "== against torchvision's CPU decode, the first 200 files of each"
for d in "$by/444" "$by/420" "$out/mixed"; do
  python3 "$here/peers/torch_jpeg.py" "$d" --pipelines none --dump 200 "$out/ref.pt" > /dev/null
  for g in engines by-chroma "split --gpu-upsampling replicate"; do
    # shellcheck disable=SC2086
    "$bin" --log warn prep --input "$d" --limit 200 --nvjpeg --repeat 1 --gpu-decode $g \
      --dump "$out/gpu.safetensors" > /dev/null
    echo "-- $(basename "$d"), --gpu-decode $g"
    python3 "$here/peers/compare_tensors.py" "$out/gpu.safetensors" "$out/ref.pt" || true
  done
done
