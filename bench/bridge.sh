#!/usr/bin/env bash
# The cross-host bridge against the local path, on one host over loopback, in one run:
# `tensorport produce` (shared memory) and `tensorport-bridge produce` (Arrow Flight, through a
# gateway) feeding the same `tensorport serve --model none`.
#
#   bench/bridge.sh BIN_DIR [JPEG_DIR] [DEVICE]
#
# BIN_DIR holds `tensorport` and `tensorport-bridge` (release builds: target/release, or
# dist/gpu with the bridge copied beside it); JPEG_DIR (optional) a folder of JPEGs, linked into
# 8 folders of 2,400 for the real-JPEG round; DEVICE: cpu (default) or cuda. Figures are
# aggregate tensors per second over each group's wall time, start-up included.
# NIXL=1 adds a row to the real-JPEG round: the same producers with `--transport nixl` (UCX's
# choice of transport; NIXL from scripts/fetch-nixl.sh or TENSORPORT_NIXL). JPEG_ONLY=1 runs
# only the real-JPEG rounds; ROUNDS (2) sets how many rounds.
set -euo pipefail
B=$(cd "$1" && pwd); J=${2:+$(cd "$2" && pwd)}; DEV=${3:-cpu}
if [[ -n "${NIXL:-}" ]]; then
  # shellcheck source=bench/nixl_env.sh
  source "$(dirname "$0")/nixl_env.sh"
fi
W=$(mktemp -d); chmod 700 "$W"; cd "$W"
trap 'pkill -TERM -P $$ 2>/dev/null || true; rm -rf "$W"' EXIT
"$B/tensorport-bridge" token tok 2> /dev/null
echo "machine: $(nproc) cores; device $DEV; $(date -u +%F)"
start() { # IMAGE_SIZE NAME: a server and a gateway in front of it
  "$B/tensorport" serve --socket "$W/$2" --device "$DEV" --model none --image-size "$1" --log warn > "$2.log" 2>&1 &
  for _ in $(seq 100); do [[ -S "$W/$2" ]] && break; sleep 0.1; done
  "$B/tensorport-bridge" gateway --listen 127.0.0.1:0 --socket "$W/$2" --token-file tok --in-flight 64 > "$2.gw" 2> "$2.gwlog" &
  for _ in $(seq 100); do grep -q listening "$2.gw" 2> /dev/null && break; sleep 0.1; done
}
url() { sed -n 's/^listening on \([^ ]*\) .*/\1/p' "$1.gw"; }
group() { # LABEL N COMMAND (with @ for the copy's number): N copies at once, aggregate rate
  local label=$1 n=$2 cmd=$3 pids="" t0 t1
  t0=$(date +%s.%N)
  for k in $(seq 0 $((n - 1))); do eval "${cmd//@/$k}" > "out.$k" 2> "err.$k" & pids="$pids $!"; done
  # shellcheck disable=SC2086
  wait $pids
  t1=$(date +%s.%N)
  python3 - "$label" "$t0" "$t1" out.* <<'PY'
import json, sys
label, t0, t1, files = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), sys.argv[4:]
lines = [json.loads(l) for f in files for l in open(f)]
errors = sum(1 for l in lines if "error" in l)
print(f"{label:46s} {len(lines):7d} results ({errors} errors) in {t1 - t0:6.2f} s: {len(lines) / (t1 - t0):9.1f} tensors/s")
PY
  rm -f out.* err.*
}
start 224 s224; U=$(url s224)
start 32 s32; U32=$(url s32)
L="$B/tensorport produce"; R="$B/tensorport-bridge produce --token-file tok"
for rep in $(seq 1 "${ROUNDS:-2}"); do
  if [[ -z "${JPEG_ONLY:-}" ]]; then
    echo "== round $rep: ready [3,224,224] f32 (602 KB), 24,000 tensors, 64 in flight per producer"
    for n in 1 8; do
      group "local  x$n --in-flight 64" $n "$L --socket $W/s224 --ready --synthetic $((24000 / n)) --in-flight 64 --name l@ -o -"
      group "bridge x$n --in-flight 64 --batch 8" $n "$R --gateway $U --ready --synthetic $((24000 / n)) --in-flight 64 --batch 8 --name r@ -o -"
    done
    echo "== round $rep: ready [3,32,32] f32 (12 KiB), 200,000 tensors, 256 in flight per producer"
    for n in 1 8; do
      group "local  x$n --in-flight 256" $n "$L --socket $W/s32 --image-size 32 --ready --synthetic $((200000 / n)) --in-flight 256 --name l@ -o -"
      group "bridge x$n --in-flight 256 --batch 64" $n "$R --gateway $U32 --image-size 32 --ready --synthetic $((200000 / n)) --in-flight 256 --batch 64 --name r@ -o -"
    done
  fi
  if [[ -n "$J" ]]; then
    if [[ ! -d j0 ]]; then
      for k in 0 1 2 3 4 5 6 7; do
        mkdir -p "j$k"; i=0
        while (( i < 2400 )); do for f in "$J"/*.jpg; do (( i < 2400 )) || break; ln -s "$f" "j$k/$i.jpg"; i=$((i + 1)); done; done
      done
    fi
    echo "== round $rep: real JPEGs, 8 producers x 2,400 files, the standard transform"
    group "local  x8 --in-flight 64" 8 "$L --socket $W/s224 --input $W/j@ --in-flight 64 --name l@ -o -"
    group "bridge x8 --in-flight 64 --batch 8" 8 "$R --gateway $U --input $W/j@ --in-flight 64 --batch 8 --name r@ -o -"
    if [[ -n "${NIXL:-}" ]]; then
      group "bridge x8 --transport nixl" 8 "$R --gateway $U --input $W/j@ --in-flight 64 --batch 8 --transport nixl --name n@ -o -"
    fi
  fi
done
