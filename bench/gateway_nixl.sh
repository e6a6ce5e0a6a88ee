#!/usr/bin/env bash
# Ready tensors through the gateway, Arrow Flight against NIXL, with the local shared-memory path
# beside them, on one host, in one run: producers → `tensorport-bridge gateway` → `tensorport
# serve --model none`, an answer per tensor.
#   - local: `tensorport produce --ready` (shared memory, no gateway);
#   - Flight: `tensorport-bridge produce --ready` (the tensors inside the stream);
#   - NIXL: the same with `--transport nixl` (the gateway reads each tensor from the producer's
#     registered memory into its server's pool), over UCX's TCP transport (`UCX_TLS=tcp`, with
#     UCX's segments and with 4 MiB ones) and with UCX's own choice (shared memory on one host).
#
#   bench/gateway_nixl.sh BIN_DIR [ROUNDS] [PRODUCERS] [TENSORS]
#
# BIN_DIR holds release builds of `tensorport` and `tensorport-bridge`; ROUNDS (2), PRODUCERS
# (1: producers at once in each row), TENSORS (12000, shared among the producers); [3,224,224]
# f32 tensors (602,112 bytes), 64 in flight per producer, 8 per Arrow batch. NIXL comes from
# scripts/fetch-nixl.sh, or TENSORPORT_NIXL if set. Rates are aggregate tensors per second over
# each row's wall time, start-up included.
set -euo pipefail
B=$(cd "$1" && pwd); rounds=${2:-2}; np=${3:-1}; total=${4:-12000}
# shellcheck source=bench/nixl_env.sh
source "$(dirname "$0")/nixl_env.sh"
W=$(mktemp -d); chmod 700 "$W"
trap 'pkill -TERM -P $$ 2>/dev/null || true; rm -rf "$W"' EXIT
echo "machine: $(nproc) cores, $(date -u +%F); NIXL $(cat "$TENSORPORT_NIXL/VERSION" 2>/dev/null || echo '?'); $np producer(s), $total tensors"
"$B/tensorport-bridge" token "$W/tok" 2> /dev/null
"$B/tensorport" serve --socket "$W/s" --model none --log warn > "$W/s.log" 2>&1 &
for _ in $(seq 100); do [[ -S "$W/s" ]] && break; sleep 0.1; done
per=$((total / np))
row() { # LABEL ENV... -- COMMAND (@ for the producer's number): NP copies at once
  local label=$1; shift
  local envs=()
  while [[ $1 != -- ]]; do envs+=("$1"); shift; done
  shift
  local cmd=$* pids="" t0 t1 gpid=""
  if [[ $cmd == *gateway* ]]; then
    rm -f "$W/gw"
    env "${envs[@]}" "$B/tensorport-bridge" gateway --listen 127.0.0.1:0 --socket "$W/s" --token-file "$W/tok" \
      --in-flight 64 > "$W/gw" 2> "$W/gwlog" & gpid=$!
    for _ in $(seq 100); do grep -q listening "$W/gw" 2> /dev/null && break; sleep 0.1; done
    cmd=${cmd//URL/$(sed -n 's/^listening on \([^ ]*\) .*/\1/p' "$W/gw")}
  fi
  t0=$(date +%s.%N)
  for k in $(seq 0 $((np - 1))); do env "${envs[@]}" bash -c "${cmd//@/$k}" > "$W/out.$k" 2> "$W/err.$k" & pids="$pids $!"; done
  # shellcheck disable=SC2086
  wait $pids || true
  t1=$(date +%s.%N)
  [[ -n $gpid ]] && { kill "$gpid"; wait "$gpid" 2> /dev/null || true; }
  local n errors
  n=$(cat "$W"/out.* | wc -l); errors=$(cat "$W"/out.* | grep -c '"error"' || true)
  awk -v l="$label" -v n="$n" -v e="$errors" -v t0="$t0" -v t1="$t1" \
    'BEGIN { printf "%-52s %6d results (%d errors) in %6.2f s: %8.0f tensors/s\n", l, n, e, t1 - t0, n / (t1 - t0) }'
  if (( n != total )); then tail -3 "$W"/err.* "$W/gwlog" 2> /dev/null; fi
  rm -f "$W"/out.* "$W"/err.*
}
R="$B/tensorport-bridge produce --token-file $W/tok --gateway URL --ready --synthetic $per --in-flight 64 --batch 8 --name r@ -o - # gateway"
for r in $(seq 1 "$rounds"); do
  echo "== round $r"
  row "local (shared memory)" X=1 -- "$B/tensorport produce --socket $W/s --ready --synthetic $per --in-flight 64 --name l@ -o -"
  row "gateway, Flight" X=1 -- "$R"
  row "gateway, NIXL over TCP" UCX_TLS=$TCP -- "${R/ #/ --transport nixl #}"
  row "gateway, NIXL over TCP, 4 MiB segments" UCX_TLS=$TCP UCX_TCP_TX_SEG_SIZE=4m UCX_TCP_RX_SEG_SIZE=4m -- "${R/ #/ --transport nixl #}"
  row "gateway, NIXL, UCX's choice (shared memory)" X=1 -- "${R/ #/ --transport nixl #}"
done
