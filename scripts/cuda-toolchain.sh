#!/usr/bin/env bash
# Installs a build-time CUDA 13.0 toolchain from PyPI wheels, for building the GPU binaries on a
# machine with no GPU, no driver and no NVIDIA package repository (scripts/build-gpu.sh runs it when
# CUDA_ROOT is unset). Needs python3 with pip, gcc, and access to PyPI. Safe to re-run.
#
#   scripts/cuda-toolchain.sh            # into $TENSORPORT_CUDA_PREFIX [~/.cache/tensorport-cuda13]
#   source ~/.cache/tensorport-cuda13/env.sh
#
# What it makes, and why:
#   site/nvidia/cu13/        the toolkit (nvcc, NVVM, headers, cuBLAS, NVRTC, cuRAND); CUDA_ROOT
#   .../lib64/stubs/libcuda.so  a link-time stand-in for the driver (SONAME libcuda.so.1): dfdx's
#                            CUDA build links -lcuda; the real library comes with the driver on
#                            the GPU machine. Never put the stub on LD_LIBRARY_PATH at run time.
#   bin/nvidia-smi           answers `--query-gpu=compute_cap` only: dfdx's build script asks it
#                            which architecture to compile for (FAKE_COMPUTE_CAP, default 9.0 =
#                            Hopper, the H100/H200)
#   env.sh                   CUDA_ROOT, CUDA_PATH, PATH and CUDA_COMPUTE_CAP for cargo
#
# nvcc stays at 13.0.x so its PTX can be JIT-compiled by a CUDA 13.0 driver (R580); the library
# majors (libcublas.so.13, libnvrtc.so.13, libcurand.so.10) must match the GPU machine's.
set -euo pipefail

prefix="${TENSORPORT_CUDA_PREFIX:-$HOME/.cache/tensorport-cuda13}"
python="${PYTHON:-python3}"
wheels=(
  nvidia-cuda-nvcc==13.0.88 nvidia-cuda-crt==13.0.88 nvidia-nvvm==13.0.88
  nvidia-cuda-runtime==13.0.96 nvidia-cuda-cccl==13.0.85 nvidia-cuda-nvrtc==13.0.88
  nvidia-cublas==13.0.2.14 nvidia-curand==10.4.0.35
)
site="$prefix/site"
root="$site/nvidia/cu13"

say() { echo "[cuda-toolchain] $*"; }
die() { echo "[cuda-toolchain] error: $*" >&2; exit 1; }

command -v gcc >/dev/null || die "gcc is needed (apt-get install gcc g++)"
"$python" -m pip --version >/dev/null 2>&1 || die "pip is needed (apt-get install python3-pip)"

mkdir -p "$prefix/bin" "$site"
manifest="$prefix/wheels.txt"
if [[ "$(cat "$manifest" 2>/dev/null)" != "$(printf '%s\n' "${wheels[@]}")" ]]; then
  say "installing ${#wheels[@]} CUDA 13.0 wheels into $site (about 1.3 GB)"
  "$python" -m pip install --quiet --no-deps --only-binary=:all: --upgrade --target "$site" "${wheels[@]}" \
    || die "pip could not install the wheels (is PyPI reachable?)"
  printf '%s\n' "${wheels[@]}" > "$manifest"
fi
[[ -x "$root/bin/nvcc" ]] || chmod +x "$root"/bin/* "$root"/nvvm/bin/* 2>/dev/null || true
[[ -x "$root/bin/nvcc" ]] || die "no nvcc under $root/bin after installing the wheels"

# The wheels ship only versioned libraries; the linker's -lNAME wants libNAME.so.
for lib in "$root"/lib/lib{cublas,cublasLt,nvrtc,curand,cudart}.so.*; do
  [[ -e "$lib" ]] || continue
  base="${lib##*/}"; ln -sfn "$base" "$root/lib/${base%%.so*}.so"
done
# Build scripts look in lib64 as well as lib, and nvcc for headers under targets/<arch>/include.
mkdir -p "$root/lib64/stubs" "$root/targets/x86_64-linux"
for f in "$root"/lib/*; do [[ -e "$root/lib64/${f##*/}" ]] || ln -s "$f" "$root/lib64/${f##*/}"; done
ln -sfn ../../include "$root/targets/x86_64-linux/include"

# The driver stub: every driver entry point cuda.h declares, plus every one the cudarc version
# dfdx links against names (some were dropped from cuda.h since), each returning an error.
stub="$root/lib64/stubs/libcuda.so"
if [[ ! -f "$stub" ]]; then
  syms="$prefix/libcuda-symbols.txt"
  # cudarc's sources come with the project's dependencies: on a fresh machine, fetch them first.
  cudarc_sys() { ls "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/cudarc-0.9.*/src/driver/sys.rs 2>/dev/null; }
  if [[ -z "$(cudarc_sys)" ]]; then
    say "fetching the project's crates (cudarc's driver bindings name the stub's symbols)"
    (cd "$(dirname "$0")/.." && cargo fetch --quiet) || die "cargo fetch failed (is crates.io reachable?)"
  fi
  [[ -n "$(cudarc_sys)" ]] || die "no cudarc 0.9 sources under ${CARGO_HOME:-$HOME/.cargo}/registry after cargo fetch"
  {
    grep -oP 'CUresult CUDAAPI \K\w+' "$root/include/cuda.h"
    grep -oP '^#define\s+cu\w+\s+\Kcu\w+' "$root/include/cuda.h"
    for sys in $(cudarc_sys); do
      grep -oP 'pub fn \Kcu\w+(?=\()' "$sys"
    done
  } | sort -u > "$syms"
  sed 's/.*/int &(void) { return 999; }/' "$syms" > "$prefix/libcuda-stub.c"
  gcc -shared -fPIC -o "$stub" -Wl,-soname,libcuda.so.1 "$prefix/libcuda-stub.c"
  say "driver stub with $(wc -l < "$syms") entry points: $stub"
fi

cat > "$prefix/bin/nvidia-smi" <<'SMI'
#!/bin/sh
# Build-time stand-in: only `nvidia-smi --query-gpu=compute_cap --format=csv` is asked for.
printf 'compute_cap\n%s\n' "${FAKE_COMPUTE_CAP:-9.0}"
SMI
chmod +x "$prefix/bin/nvidia-smi"

cat > "$prefix/env.sh" <<ENV
# Source before building tensorport with --features cuda (scripts/build-gpu.sh does).
export CUDA_ROOT="$root" CUDA_PATH="$root"
export PATH="$root/bin:$prefix/bin:\$PATH"
export CUDA_COMPUTE_CAP="\${CUDA_COMPUTE_CAP:-90}" FAKE_COMPUTE_CAP="\${FAKE_COMPUTE_CAP:-9.0}"
ENV
say "$("$root/bin/nvcc" --version | grep -o 'release [0-9.]*')"
say "ready: source $prefix/env.sh"
