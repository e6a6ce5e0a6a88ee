#!/usr/bin/env bash
# Device tensors from a remote GPU producer through the gateway with NIXL, against the local
# device path and NIXL's own reads, on one GPU host, in one run. [32,3,224,224] f32 tensors
# (19,267,584 bytes), ready (written once into the producer's GPU slots):
#   - local device path: `tensorport-dev gpu bench-ipc` (a GPU producer process hands ready device
#     tensors to a server process, which fences and copies each: no gateway);
#   - NIXL's reads alone: `nixl-bench hold --gpu 0 | nixl-bench read --gpu 0` (GPU memory to GPU
#     memory, 8 in flight), and its writes (`read --op write`: UCX picks its protocols for
#     writes apart from reads), with UCX's choice, with CUDA IPC reads turned on where UCX turns
#     them off for want of NVLink (UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y), with UCX's pipelined RMA
#     protocols forced on (UCX_RMA_PPLN_ENABLE=y), and with UCX_TLS=tcp,cuda_copy;
#   - the gateway: `tensorport-bridge produce --ready --shape 32,3,224,224 --transport nixl
#     --gpu 0` → `tensorport-bridge gateway` (device buffers of a GPU producer session) →
#     `tensorport serve --device cuda --sink`, an answer per tensor, the four UCX settings;
#   - Flight beside it: the same tensors from host memory inside the stream.
#
#   bench/gateway_nixl_gpu.sh BIN_DIR [TENSORS] [ROUNDS]
#
# BIN_DIR holds the CUDA `tensorport` (scripts/build-gpu.sh), `tensorport-bridge` and
# `nixl-bench`; NIXL from TENSORPORT_NIXL (scripts/fetch-nixl.sh). TENSORS (4000) per gateway
# row, ROUNDS (2) of the gateway rows; SKIP_NIXL_BENCH=1 leaves out NIXL's own reads. A gateway
# row gives tensors per second over its wall time, start-up included (the gateway's and the
# producer's agents, UCX's connection: seconds), and from its first answer to its last; a
# producer that has not finished in 60 s is stopped and its row shows what was answered.
set -euo pipefail
B=$(cd "$1" && pwd); total=${2:-4000}; rounds=${3:-2}
: "${TENSORPORT_NIXL:?set TENSORPORT_NIXL to the folder scripts/fetch-nixl.sh makes}"
export TENSORPORT_NIXL UCX_WARN_UNUSED_ENV_VARS=n
W=$(mktemp -d); chmod 700 "$W"
trap 'pkill -TERM -P $$ 2>/dev/null || true; rm -rf "$W"' EXIT
bytes=19267584
echo "machine: $(nproc) cores, $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $(date -u +%F); NIXL $(cat "$TENSORPORT_NIXL/VERSION")"
echo "== local device path (tensorport-dev gpu bench-ipc, ready tensors, timeline fences)"
"$B/tensorport-dev" --log warn gpu bench-ipc --handoffs 20000 --producer-work none --fence timeline \
  --server-sync none --bytes $bytes 2>&1 | grep -vE "^\s*$" | tail -4
echo "== NIXL's reads and writes alone, GPU to GPU, 16 slots, 8 in flight, 3 s"
choice="(UCX's choice)"
GET=UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y
PPLN=UCX_RMA_PPLN_ENABLE=y
[[ -n "${SKIP_NIXL_BENCH:-}" ]] || for op in read write; do for tls in "" get ppln tcp,cuda_copy; do
  case $tls in
    "") printf '%-6s %-44s ' "$op" "$choice"; set -- X=1 ;;
    get) printf '%-6s %-44s ' "$op" "$GET"; set -- "$GET" ;;
    ppln) printf '%-6s %-44s ' "$op" "$PPLN"; set -- "$PPLN" ;;
    *) printf '%-6s %-44s ' "$op" "UCX_TLS=$tls"; set -- "UCX_TLS=$tls" ;;
  esac
  env "$@" timeout 30 bash -c "sleep 8 | '$B/nixl-bench' hold --gpu 0 --slots 16 --slot-len $bytes | '$B/nixl-bench' read --gpu 0 --in-flight 8 --seconds 3 --op $op" 2>&1 | tail -1
done; done
"$B/tensorport-bridge" token "$W/tok" 2> /dev/null
"$B/tensorport" serve --device cuda --sink --socket "$W/s" --slot-size $bytes --log warn > "$W/s.log" 2>&1 &
for _ in $(seq 300); do [[ -S "$W/s" ]] && break; sleep 0.1; done
row() { # LABEL ENV... -- ARGS: a gateway and a producer with ENV (the gateway does the reads)
  local label=$1; shift
  local envs=(X=1)
  while [[ $1 != -- ]]; do envs+=("$1"); shift; done
  shift
  rm -f "$W/gw"
  env "${envs[@]}" "$B/tensorport-bridge" gateway --listen 127.0.0.1:0 --nixl-device --socket "$W/s" --token-file "$W/tok" \
    --in-flight 16 --max-tensor-mib 32 > "$W/gw" 2> "$W/gwlog" &
  local gpid=$! t0 t1 n url
  for _ in $(seq 100); do grep -q listening "$W/gw" 2> /dev/null && break; sleep 0.1; done
  url=$(sed -n 's/^listening on \([^ ]*\) .*/\1/p' "$W/gw")
  t0=$EPOCHREALTIME
  # The answers as they arrive: how many, and when the first and the last came.
  read -r n first last < <(env "${envs[@]}" timeout 60 "$B/tensorport-bridge" produce --token-file "$W/tok" \
      --gateway "$url" --ready --shape 32,3,224,224 --synthetic "$total" --in-flight 16 --batch 4 -o - "$@" \
      2> "$W/err" | {
    n=0 first=0 last=0
    while IFS= read -r l; do
      [[ $l == *'"error"'* ]] && continue
      n=$((n + 1)); last=$EPOCHREALTIME; [[ $first == 0 ]] && first=$last
    done
    echo "$n $first $last"
  })
  t1=$EPOCHREALTIME
  kill "$gpid"; wait "$gpid" 2> /dev/null || true
  awk -v l="$label" -v n="$n" -v t0="$t0" -v t1="$t1" -v f="$first" -v z="$last" 'BEGIN {
    after = (n > 1 && z > f) ? sprintf("%8.0f", (n - 1) / (z - f)) : "       -"
    printf "%-52s %6d answered in %6.2f s: %8.0f tensors/s; %s after the first answer\n", l, n, t1 - t0, n / (t1 - t0), after }'
  [[ $n == "$total" ]] || tail -3 "$W/err" "$W/gwlog"
}
echo "== through the gateway into serve --device cuda --sink, 16 in flight, 4 per batch"
for r in $(seq 1 "$rounds"); do
  row "NIXL from GPU slots, UCX's choice" -- --transport nixl --gpu 0
  row "NIXL from GPU slots, $GET" "$GET" -- --transport nixl --gpu 0
  row "NIXL from GPU slots, $PPLN" "$PPLN" -- --transport nixl --gpu 0
  row "NIXL from GPU slots, UCX_TLS=tcp,cuda_copy" UCX_TLS=tcp,cuda_copy -- --transport nixl --gpu 0
  row "Flight, from host memory" --
done
