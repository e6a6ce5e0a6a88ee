#!/usr/bin/env bash
# Unpacks NVIDIA's NIXL (with its C API and UCX) from PyPI's nixl-cu13 wheel into target/nixl,
# where tensorport-nixl finds it (or set TENSORPORT_NIXL to another copy). Only the shared
# libraries are kept; nothing is installed into Python. Needs python3 with pip and PyPI access.
#
#   scripts/fetch-nixl.sh [DEST]        (default: target/nixl of this checkout)
set -euo pipefail
version=1.5.1
root=$(cd "$(dirname "$0")/.." && pwd)
dest=${1:-$root/target/nixl}
lib=$dest/.nixl_cu13.mesonpy.libs/libnixl_capi.so
if [[ -f $lib && -f $dest/VERSION && $(cat "$dest/VERSION") == "$version" ]]; then
  echo "$lib"; exit 0
fi
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 -d "$tmp" "nixl-cu13==$version" >&2
rm -rf "$dest"; mkdir -p "$dest"
python3 - "$tmp"/nixl_cu13-*.whl "$dest" <<'PY'
import sys, zipfile
keep = (".nixl_cu13.mesonpy.libs/", "nixl_cu13.libs/")
with zipfile.ZipFile(sys.argv[1]) as z:
    for info in z.infolist():
        if info.filename.startswith(keep):
            z.extract(info, sys.argv[2])
PY
echo "$version" > "$dest/VERSION"
echo "$lib"
