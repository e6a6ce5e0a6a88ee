#!/usr/bin/env bash
# DCT-scaled decoding on a varied photo folder, side by side with torchvision, in one run:
# the accuracy of tensorport's tensors with and without it against torchvision's full decode,
# the one-core rates (tensorport prep against torchvision's decode + resize + crop + normalise),
# and the farm with N CPU producers against PyTorch's DataLoader with N workers.
#
#   bench/dct_scaling.sh TENSORPORT_BINARY OUT_DIR [FILES] [PRODUCERS]
#
# Needs python3 with numpy, pillow, scikit-image, torch, torchvision and safetensors. Writes the
# varied set (bench/peers/make_jpegs.py --varied) into OUT_DIR/varied unless it is there.
set -euo pipefail
bin=$(realpath "$1"); out=$(realpath -m "$2"); files=${3:-400}; producers=${4:-15}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out"
if [[ ! -f "$out/varied/varied.tsv" ]]; then
  seeds=8
  for s in $(seq 1 $seeds); do
    python3 "$here/peers/make_jpegs.py" "$out/varied" --varied --count $((files / seeds)) --seed "$s" &
  done
  wait
fi
v="$out/varied"
echo "== accuracy against torchvision (first 200 files)"
python3 "$here/peers/torch_jpeg.py" "$v" --pipelines none --dump 200 "$out/ref.pt" | tee "$out/torch-one-core.txt"
for d in on off; do
  "$bin" --log warn prep --input "$v" --limit 200 --repeat 1 --dct-scaling $d --dump "$out/ours-$d.safetensors" > /dev/null
  echo "-- dct-scaling $d"
  python3 "$here/peers/compare_tensors.py" "$out/ours-$d.safetensors" "$out/ref.pt" || true
done
echo "== one core (the first 200 files, best of 2 passes)"
for d in on off; do
  echo "-- tensorport prep, dct-scaling $d"
  taskset -c 2 "$bin" --log warn prep --input "$v" --limit 200 --repeat 2 --dct-scaling $d | tail -4
done
echo "-- torchvision: see the 'one core' line above"
echo "== the farm with $producers CPU producers (--model none), and the DataLoader"
for d in on off; do
  echo "-- farm, dct-scaling $d"
  "$bin" --log warn farm --input "$v" --producers "$producers" --model none --dct-scaling $d \
    --progress never --output "$out/farm-$d.jsonl" 2>&1 | grep -E "throughput|done"
done
python3 "$here/peers/torch_jpeg.py" "$v" --pipelines cpu-tv --workers "$producers" | grep workers
