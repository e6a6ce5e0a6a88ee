#!/usr/bin/env bash
# NIXL's one-sided reads of a producer's host memory (tensorport-nixl's nixl-bench) beside the
# Arrow Flight bridge (tensorport-bridge produce → gateway → tensorport serve --model none), one
# process on each side, [3,224,224] f32 tensors (602,112 bytes), on one host, in one run:
#   - NIXL over UCX's TCP transport (UCX_TLS=tcp: 4 MiB segments, with 8 MiB socket buffers,
#     NIXL's writes beside its reads, and UCX's defaults) on loopback;
#   - NIXL with UCX's own choice (shared memory between two processes of one host);
#   - the bridge, ready tensors, 64 in flight, 8 per Arrow batch (as bench/bridge.sh);
#   - one TCP stream over loopback, the kernel's bound for the TCP rows (python3 sockets).
# The NIXL rows move the bytes only (producer slot → reader memory); the bridge's rows end in the
# server's pool with an answer per tensor.
#
#   bench/nixl.sh BIN_DIR [ROUNDS]     (BIN_DIR: target/release, with nixl-bench,
#                                       tensorport and tensorport-bridge; NIXL from
#                                       scripts/fetch-nixl.sh, or TENSORPORT_NIXL if set)
set -euo pipefail
B=$(cd "$1" && pwd); rounds=${2:-2}
# shellcheck source=bench/nixl_env.sh
source "$(dirname "$0")/nixl_env.sh"
W=$(mktemp -d); chmod 700 "$W"
trap 'pkill -TERM -P $$ 2>/dev/null || true; rm -rf "$W"' EXIT
echo "machine: $(nproc) cores, $(date -u +%F); NIXL $(cat "$TENSORPORT_NIXL/VERSION")"
"$B/tensorport-bridge" token "$W/tok" 2> /dev/null
nixl() { # LABEL ENV...: one holder, one reader, 3 s of reads (OP=write: writes) with 16 in flight
  local label=$1; shift
  printf '%-52s ' "$label"
  env "$@" bash -c "sleep 12 | '$B/nixl-bench' hold --slots 64 | '$B/nixl-bench' read --seconds 3 --in-flight 16 --op ${OP:-read}" 2>&1 | tail -1
}
for r in $(seq 1 "$rounds"); do
  echo "== round $r"
  nixl "NIXL, UCX_TLS=$TCP (4 MiB segments)" UCX_TLS=$TCP UCX_TCP_TX_SEG_SIZE=4m UCX_TCP_RX_SEG_SIZE=4m
  nixl "NIXL, UCX_TLS=$TCP (4 MiB segments, 8 MiB socket buffers)" UCX_TLS=$TCP UCX_TCP_TX_SEG_SIZE=4m \
    UCX_TCP_RX_SEG_SIZE=4m UCX_TCP_SNDBUF=8m UCX_TCP_RCVBUF=8m
  OP=write nixl "NIXL writes, UCX_TLS=$TCP (4 MiB segments)" UCX_TLS=$TCP UCX_TCP_TX_SEG_SIZE=4m UCX_TCP_RX_SEG_SIZE=4m
  nixl "NIXL, UCX_TLS=$TCP (UCX's defaults)" UCX_TLS=tcp
  nixl "NIXL, UCX's choice (shared memory)" UCX_DUMMY=
  # The server and gateway run only for their row (the server's threads would share the cores).
  rm -f "$W/s" "$W/gw"
  "$B/tensorport" serve --socket "$W/s" --model none --log warn > "$W/s.log" 2>&1 & spid=$!
  for _ in $(seq 100); do [[ -S "$W/s" ]] && break; sleep 0.1; done
  "$B/tensorport-bridge" gateway --listen 127.0.0.1:0 --socket "$W/s" --token-file "$W/tok" --in-flight 64 > "$W/gw" 2> "$W/gwlog" & gpid=$!
  for _ in $(seq 100); do grep -q listening "$W/gw" 2> /dev/null && break; sleep 0.1; done
  url=$(sed -n 's/^listening on \([^ ]*\) .*/\1/p' "$W/gw")
  t0=$(date +%s.%N)
  n=$("$B/tensorport-bridge" produce --token-file "$W/tok" --gateway "$url" --ready --synthetic 12000 \
        --in-flight 64 --batch 8 --name r -o - 2> /dev/null | wc -l)
  t1=$(date +%s.%N)
  awk -v n="$n" -v t0="$t0" -v t1="$t1" \
    'BEGIN { printf "%-52s %s results: %.0f tensors/s\n", "Arrow Flight bridge, loopback", n, n / (t1 - t0) }'
  kill "$gpid" "$spid"; wait "$gpid" "$spid" 2> /dev/null || true
  python3 - <<'PY'
import socket, threading, time
n = 2 << 30; buf = bytearray(4 << 20)
s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen(1)
def sink():
    c, _ = s.accept(); mv = memoryview(bytearray(4 << 20)); got = 0
    while got < n:
        got += c.recv_into(mv)
t = threading.Thread(target=sink); t.start()
c = socket.create_connection(s.getsockname()); t0 = time.time(); sent = 0
while sent < n:
    sent += c.send(buf)
t.join(); dt = time.time() - t0
print(f"{'one TCP stream on loopback (python3)':52s} {n / dt / 1e9:.2f} GB/s = {n / dt / 602112:.0f} tensors/s")
PY
done
