#!/usr/bin/env bash
# Overload and drain check (issue 13): the server with its default limits, offered RATE
# requests/s of TOKENS-token sequences (defaults 600 and 128: about 3x what this 2-core
# machine serves, 12.5k tokens/s) open loop for SECONDS; prints the status codes seen, the server's peak RSS, and the round
# trip of one valid request right after. Then the same load again, with SIGTERM sent halfway:
# every request the server accepted must be answered (loadgen's errors are then only
# UNAVAILABLE for calls refused once draining began).
#   bench/overload.sh [RATE] [SECONDS] [TOKENS]
# SERVER_FLAGS adds server flags, e.g. the Deployment's bounds (deploy/kubernetes):
#   SERVER_FLAGS="--max_batch_tokens=4096 --max_queued_bytes=134217728 ..." bench/overload.sh
set -euo pipefail
cd "$(dirname "$0")/.."
rate="${1:-600}"
seconds="${2:-10}"
tokens="${3:-128}"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
start_server() {
  build/server/attention-server --listen=127.0.0.1:0 --metrics_listen= --log_errors=false --demo_layer \
    ${SERVER_FLAGS:-} >"$work/stdout" 2>"$work/stderr" &
  server=$!
  for _ in $(seq 300); do
    port=$(awk '/listening on port/ {print $NF}' "$work/stdout")
    [ -n "$port" ] && return
    sleep 0.1
  done
  echo "server did not start" >&2
  exit 1
}
codes() { /usr/bin/python3 -c 'import json,sys; r=json.load(open(sys.argv[1])); print("sent", r["sent"], "answered OK", r["requests"], "errors by code", r["errors_by_code"])' "$1"; }

start_server
build/client/attention-loadgen --target=127.0.0.1:$port --rate="$rate" --tokens="$tokens" \
  --duration="$seconds" --json="$work/overload.json" >/dev/null
echo "overload at $rate req/s of $tokens tokens for ${seconds}s: $(codes "$work/overload.json")"
echo "server peak RSS: $(awk '/VmHWM/ {print $2, $3}' /proc/$server/status)"
build/client/attention-cli --target=127.0.0.1:$port | grep "round trip"
kill -TERM "$server"
wait "$server" && echo "server exit 0"

start_server
build/client/attention-loadgen --target=127.0.0.1:$port --rate=$((rate / 4)) --tokens="$tokens" \
  --duration="$seconds" --json="$work/drain.json" >/dev/null &
loadgen=$!
sleep "$((seconds / 2))"
kill -TERM "$server"
wait "$loadgen" || true
wait "$server" && echo "server exit 0 after SIGTERM under load"
echo "SIGTERM under load at $((rate / 4)) req/s: $(codes "$work/drain.json")"
