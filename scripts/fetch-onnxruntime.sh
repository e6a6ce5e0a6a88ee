#!/usr/bin/env bash
# Unpacks ONNX Runtime's shared libraries from PyPI's wheel into target/onnxruntime, where
# `tensorport serve/farm --model x.onnx` finds them (or set TENSORPORT_ORT to another
# libonnxruntime.so). Only the libraries are kept; nothing is installed into Python. Needs
# python3 with pip and PyPI access.
#
#   scripts/fetch-onnxruntime.sh [--gpu] [DEST]   (default: target/onnxruntime of this checkout)
#
# --gpu takes onnxruntime-gpu (CUDA 13, cuDNN 9: the CUDA and TensorRT execution providers;
# ~256 MB) instead of the CPU build (~24 MB). Either serves the CPU.
set -euo pipefail
version=1.31.1
package=onnxruntime
if [[ ${1:-} == --gpu ]]; then
  package=onnxruntime-gpu
  shift
fi
root=$(cd "$(dirname "$0")/.." && pwd)
dest=${1:-$root/target/onnxruntime}
lib=$dest/lib/libonnxruntime.so
if [[ -f $lib && -f $dest/VERSION && $(cat "$dest/VERSION") == "$package $version" ]]; then
  echo "$lib"; exit 0
fi
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 -d "$tmp" "$package==$version" >&2
rm -rf "$dest"; mkdir -p "$dest/lib"
python3 - "$tmp"/*.whl "$dest/lib" <<'PY'
import os, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    for info in z.infolist():
        name = os.path.basename(info.filename)
        if info.filename.startswith("onnxruntime/capi/") and name.startswith("libonnxruntime"):
            with z.open(info) as src, open(os.path.join(sys.argv[2], name), "wb") as out:
                out.write(src.read())
PY
ln -sf "$(cd "$dest/lib" && ls libonnxruntime.so.* | head -n1)" "$lib"
echo "$package $version" > "$dest/VERSION"
echo "$lib"
