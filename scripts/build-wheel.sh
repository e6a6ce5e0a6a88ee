#!/usr/bin/env bash
# Builds the Python wheel: the extension (maturin, abi3) with the `tensorport` executable inside
# it as `tensorport/bin/tensorport`, so `pip install` on a machine without Rust gives
# `import tensorport`, `tensorport.Loader` and the `tensorport` command.
#
#   scripts/build-wheel.sh [OUT_DIR]     # default target/wheels; needs maturin (pip install maturin)
# For the CUDA build of the executable (`serve --device cuda`), run scripts/build-gpu.sh first
# and set TENSORPORT_WHEEL_BIN=dist/gpu/tensorport.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-target/wheels}
bin=${TENSORPORT_WHEEL_BIN:-}
if [[ -z "$bin" ]]; then
  cargo build --release --bin tensorport
  bin=target/release/tensorport
fi
log=$(mktemp)
mkdir -p python/tensorport/bin
trap 'rm -rf python/tensorport/bin "$log"' EXIT
cp "$bin" python/tensorport/bin/tensorport
strip python/tensorport/bin/tensorport 2>/dev/null || true
maturin build --release --strip -o "$out" 2>&1 | tee "$log"
wheel=$(sed -n 's/.*Built wheel.* to \(.*\.whl\)$/\1/p' "$log" | tail -1)
# The executable is ignored by git, which maturin follows: pyproject.toml names it; make sure.
python3 -m zipfile -l "$wheel" | grep -q 'tensorport/bin/tensorport' \
  || { echo "build-wheel: $wheel does not carry tensorport/bin/tensorport" >&2; exit 1; }
echo "$wheel carries the tensorport executable"
