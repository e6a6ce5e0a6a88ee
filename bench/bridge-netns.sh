#!/usr/bin/env bash
# The bridge between two network namespaces: two "hosts" on one machine joined by a veth pair,
# each with its own network stack and address (needs root and iproute2; openssl for TLS). The
# inference host runs `tensorport serve --model none` and a gateway; the preprocessing host runs
# `tensorport-bridge produce`. Measured in one run: plaintext (--allow-plaintext) and TLS, with
# ready 602 KB tensors and 12 KiB tensors.
#
#   sudo bench/bridge-netns.sh BIN_DIR
#
# BIN_DIR holds release builds of `tensorport` and `tensorport-bridge` (target/release).
set -euo pipefail
B=$(cd "$1" && pwd)
W=$(mktemp -d); chmod 700 "$W"
A=tp-infer-$$; P=tp-prep-$$
cleanup() {
  ip netns pids "$A" 2> /dev/null | xargs -r kill 2> /dev/null || true
  ip netns del "$A" 2> /dev/null || true
  ip netns del "$P" 2> /dev/null || true
  rm -rf "$W"
}
trap cleanup EXIT
ip netns add "$A"; ip netns add "$P"
ip link add "va$$" type veth peer name "vp$$"
ip link set "va$$" netns "$A"; ip link set "vp$$" netns "$P"
ip -n "$A" addr add 10.77.0.1/24 dev "va$$"; ip -n "$P" addr add 10.77.0.2/24 dev "vp$$"
for ns in "$A" "$P"; do ip -n "$ns" link set lo up; done
ip -n "$A" link set "va$$" up; ip -n "$P" link set "vp$$" up
cd "$W"
"$B/tensorport-bridge" token tok 2> /dev/null
# A CA and the gateway's certificate for 10.77.0.1.
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -keyout ca.key -out ca.pem \
  -days 1 -subj /CN=tp-bench-ca 2> /dev/null
openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -keyout gw.key -out gw.csr \
  -subj /CN=gateway 2> /dev/null
printf 'subjectAltName=IP:10.77.0.1\n' > san.ext
openssl x509 -req -in gw.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out gw.pem -days 1 \
  -extfile san.ext 2> /dev/null
echo "machine: $(nproc) cores; two network namespaces joined by veth; $(date -u +%F)"
start() { # IMAGE_SIZE NAME PORT TLS(0/1): a server and a gateway in the inference namespace
  ip netns exec "$A" "$B/tensorport" serve --socket "$W/$2" --device cpu --model none --image-size "$1" --log warn > "$2.log" 2>&1 &
  for _ in $(seq 100); do [[ -S "$W/$2" ]] && break; sleep 0.1; done
  local tls=(--allow-plaintext)
  [[ $4 == 1 ]] && tls=(--tls-cert gw.pem --tls-key gw.key)
  ip netns exec "$A" "$B/tensorport-bridge" gateway --listen "10.77.0.1:$3" --socket "$W/$2" \
    --token-file tok --in-flight 64 "${tls[@]}" > "$2.gw" 2> "$2.gwlog" &
  for _ in $(seq 100); do grep -q listening "$2.gw" 2> /dev/null && break; sleep 0.1; done
}
run() { # LABEL URL ARGS...
  local label=$1 url=$2; shift 2
  local out
  out=$(ip netns exec "$P" "$B/tensorport-bridge" produce --gateway "$url" --token-file tok \
    --tls-ca ca.pem --ready "$@" -o /dev/null 2>&1 | tail -1)
  printf '%-34s %s\n' "$label" "$out"
}
start 224 s224 7001 0; start 224 t224 7002 1; start 32 s32 7003 0; start 32 t32 7004 1
for rep in 1 2; do
  echo "== round $rep"
  run "602 KB, plaintext" http://10.77.0.1:7001 --synthetic 12000 --in-flight 64 --batch 8
  run "602 KB, TLS" https://10.77.0.1:7002 --synthetic 12000 --in-flight 64 --batch 8
  run "12 KiB, plaintext" http://10.77.0.1:7003 --image-size 32 --synthetic 100000 --in-flight 256 --batch 64
  run "12 KiB, TLS" https://10.77.0.1:7004 --image-size 32 --synthetic 100000 --in-flight 256 --batch 64
done
