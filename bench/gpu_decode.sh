#!/usr/bin/env bash
# The GPU producers' decoder on varied photos, by image size and chroma subsampling, with
# torchvision's nvJPEG pipeline on the same files, in one run: one process decoding batches of
# 32 (`tensorport prep --nvjpeg`, which prints the GPU's time per image in nvJPEG's decode and in
# the resize/crop/normalise kernel), with `--gpu-upsampling interpolate` (the default) and
# `replicate`, and the tensors' distance from torchvision's CPU decode for each.
#
#   bench/gpu_decode.sh TENSORPORT_BINARY OUT_DIR [UNIFORM_PER_SEED] [VARIED_PER_SEED]
#
# The sets come from bench/make_sets.sh (defaults 250 and 150: 2,000 uniform and 1,200 varied
# files). The varied set's colour baseline files (those the JPEG engines decode) are linked into
# OUT_DIR/by/{colour,444,422,420,large,small}. Needs the CUDA build, torch, torchvision and
# safetensors.
set -euo pipefail
bin=$(realpath "$1"); out=$(realpath -m "$2")
here=$(cd "$(dirname "$0")" && pwd)
"$here/make_sets.sh" "$out" "${3:-250}" "${4:-150}"
by="$out/by"; rm -rf "$by"; mkdir -p "$by"/{colour,444,422,420,large,small}
# varied.tsv: name, width, height, quality, subsampling (0 4:4:4, 1 4:2:2, 2 4:2:0), progressive, gray
while IFS=$'\t' read -r name w h _ css prog gray; do
  [[ $prog == 0 && $gray == 0 ]] || continue
  f="$out/varied/$name"
  ln -sf "$f" "$by/colour/$name"
  case $css in 0) ln -sf "$f" "$by/444/$name" ;; 1) ln -sf "$f" "$by/422/$name" ;; *) ln -sf "$f" "$by/420/$name" ;; esac
  if (( w * h >= 2000000 )); then ln -sf "$f" "$by/large/$name"; elif (( w * h < 500000 )); then ln -sf "$f" "$by/small/$name"; fi
done < "$out/varied/varied.tsv"
echo "== one process, batches of 32, best of 2 passes; torchvision's nvJPEG pipeline on the same files"
for d in "$out/uniform" "$by"/{colour,444,422,420,large,small}; do
  echo "-- $(basename "$d"): $(find "$d" -name '*.jpg' | wc -l) files"
  for u in interpolate replicate; do
    { "$bin" --log warn prep --input "$d" --nvjpeg --repeat 2 --batch 32 --gpu-upsampling $u 2>&1 || true; } \
      | grep -E "images/s|per image|error" | tr '\n' ' ' | sed "s/^/   $u: /" || true; echo
  done
  python3 "$here/peers/torch_jpeg.py" "$d" --pipelines gpu-nvjpeg 2>&1 | grep -E "gpu-nvjpeg|error" | sed 's/^/   torchvision /' || true
done
echo "== against torchvision's CPU decode, the first 200 colour baseline files"
python3 "$here/peers/torch_jpeg.py" "$by/colour" --pipelines none --dump 200 "$out/ref.pt" > /dev/null
for u in interpolate replicate; do
  "$bin" --log warn prep --input "$by/colour" --limit 200 --nvjpeg --repeat 1 --gpu-upsampling $u \
    --dump "$out/gpu-$u.safetensors" > /dev/null
  echo "-- --gpu-upsampling $u"
  python3 "$here/peers/compare_tensors.py" "$out/gpu-$u.safetensors" "$out/ref.pt" || true
done
