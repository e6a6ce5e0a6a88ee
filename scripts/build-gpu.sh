#!/usr/bin/env bash
# Builds the GPU binaries — `tensorport` and `tensorport-dev` with `--features cuda`, the GPU test
# binary and `tensorport-bridge` (for the harness's NIXL test) — into
# dist/gpu/, on any machine, GPU or not.
#
# dfdx 0.13's CUDA build needs a CUDA toolkit at build time (nvcc for its kernels, cuBLAS and
# NVRTC to link). Point CUDA_ROOT at yours (e.g. /usr/local/cuda, 13.0). Without CUDA_ROOT, the
# CUDA 13.0 toolchain from PyPI wheels is used (this project's build machines have no GPU and no
# NVIDIA repository; scripts/cuda-toolchain.sh installs it).
#
# On the GPU machine: `source dist/gpu/gpu-env.sh; dist/gpu/install-nvrtc-paths.sh;
# dist/gpu/gpu-tests` (the tests start the `tensorport` beside them; TENSORPORT_BIN overrides).
#
# dfdx compiles a few kernels with NVRTC at run time, with two include folders whose paths are
# baked in at build time. dist/gpu/install-nvrtc-paths.sh recreates them on the machine that runs
# the binaries (it links the toolkit's include folder there, default /usr/local/cuda/include).
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -z "${CUDA_ROOT:-}" ]]; then
  env_sh="${TENSORPORT_CUDA_PREFIX:-$HOME/.cache/tensorport-cuda13}/env.sh"
  [[ -f "$env_sh" ]] || bash scripts/cuda-toolchain.sh
  # shellcheck disable=SC1090
  source "$env_sh"
fi
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target/gpu}"
# dfdx 0.13 keeps a CUDA tensor's device pointer private; patches/dfdx-0.13.0-device-ptr.patch (ours,
# a few lines) adds an accessor. It is applied to a copy of dfdx made here, never committed, and
# cargo is pointed at that copy for this build only (Cargo.lock is put back afterwards).
cargo fetch --quiet
dfdx_src=$(ls -d "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/dfdx-0.13.0 | head -1)
patched="$CARGO_TARGET_DIR/dfdx-0.13.0-tensorport"
rm -rf "$patched" && mkdir -p "$CARGO_TARGET_DIR" && cp -r "$dfdx_src" "$patched"
patch --quiet -p1 -d "$patched" < patches/dfdx-0.13.0-device-ptr.patch
cp Cargo.lock "$CARGO_TARGET_DIR/Cargo.lock.orig"
trap 'cp "$CARGO_TARGET_DIR/Cargo.lock.orig" Cargo.lock' EXIT
with_patch=(--config "patch.crates-io.dfdx.path=\"$patched\"")
cargo build --release --features cuda "${with_patch[@]}" --bin tensorport --bin tensorport-dev --example gpu_producer
# The bridge, for the GPU harness's NIXL test (its CUDA is loaded at run time: no feature).
cargo build --release "${with_patch[@]}" -p tensorport-bridge --bin tensorport-bridge
test_bin=$(cargo test --release --features cuda "${with_patch[@]}" --test gpu --no-run --message-format=json 2>/dev/null \
  | grep '"name":"gpu"' | sed -n 's/.*"executable":"\([^"]*\)".*/\1/p' | tail -1)
out=dist/gpu
rm -rf "$out" && mkdir -p "$out/nvrtc"
cp "$CARGO_TARGET_DIR/release/tensorport" "$out/tensorport"
cp "$CARGO_TARGET_DIR/release/tensorport-dev" "$out/tensorport-dev"
cp "$test_bin" "$out/gpu-tests"
cp "$CARGO_TARGET_DIR/release/examples/gpu_producer" "$out/gpu_producer"
cp "$CARGO_TARGET_DIR/release/tensorport-bridge" "$out/tensorport-bridge"
cp scripts/gpu-env.sh "$out/gpu-env.sh"
strip "$out/tensorport" "$out/tensorport-dev" "$out/gpu-tests" "$out/gpu_producer" "$out/tensorport-bridge" 2>/dev/null || true
dfdx_out=$(dirname "$(ls -td "$CARGO_TARGET_DIR"/release/build/dfdx-*/out/cuda_utils.cuh | head -1)")
cp "$dfdx_out"/*.cuh "$out/nvrtc/"
cat > "$out/install-nvrtc-paths.sh" <<SH
#!/usr/bin/env bash
# Recreates the include paths dfdx's run-time NVRTC kernels were built with.
set -e
here=\$(cd "\$(dirname "\$0")" && pwd)
mkdir -p "$dfdx_out" && cp "\$here"/nvrtc/*.cuh "$dfdx_out/"
inc="${CUDA_ROOT}/include"
if [[ ! -d "\$inc" ]]; then mkdir -p "\$(dirname "\$inc")" && ln -sfn "\${CUDA_INCLUDE:-/usr/local/cuda/include}" "\$inc"; fi
SH
chmod +x "$out/install-nvrtc-paths.sh"
echo "built into $out:"; ls -la "$out"
