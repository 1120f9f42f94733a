#!/usr/bin/env bash
# Issue 23: CALLERS closed-loop callers (default 8), every request carrying the same inline
# layer (E=EMBED, HEADS heads, seeded random init; defaults BERT-base's 768 and 12) of
# TOKENS-token queries, for SECONDS against a default server. Prints requests/s answered OK
# and the errors by code. SERVER picks the binary, to compare two builds, e.g. one built
# from a clone of an older commit:
#   SERVER=/tmp/before/build/server/attention-server bench/inline_layers.sh
# SERVER_FLAGS adds server flags, e.g. --inline_layer_cache_bytes=0 (queueing, no cache).
#   bench/inline_layers.sh [CALLERS] [SECONDS] [TOKENS] [EMBED] [HEADS]
set -euo pipefail
cd "$(dirname "$0")/.."
callers="${1:-8}"
seconds="${2:-10}"
tokens="${3:-16}"
embed="${4:-768}"
heads="${5:-12}"
server_binary="${SERVER:-build/server/attention-server}"
work=$(mktemp -d)
: >"$work/stdout"  # exists before the server writes it, for the port lookup below
"$server_binary" --listen=127.0.0.1:0 --metrics_listen= --log_errors=false ${SERVER_FLAGS:-} \
  >"$work/stdout" 2>"$work/stderr" &
server=$!
trap 'kill -TERM "$server" 2>/dev/null; wait "$server" 2>/dev/null; rm -rf "$work"' EXIT
for _ in $(seq 300); do
  port=$(awk '/listening on port/ {print $NF}' "$work/stdout")
  [ -n "$port" ] && break
  sleep 0.1
done
[ -n "$port" ] || { echo "server did not start" >&2; exit 1; }
build/client/attention-loadgen --target=127.0.0.1:$port --concurrency="$callers" \
  --tokens="$tokens" --embed_dim="$embed" --inline_layer_heads="$heads" \
  --duration="$seconds" --json="$work/report.json" >/dev/null
/usr/bin/python3 -c '
import json, sys
r = json.load(open(sys.argv[1]))
print("%s: %s callers, inline E=%s H=%s, %s tokens: %.1f requests/s OK, errors by code %s"
      % (sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5], sys.argv[6],
         r["requests_per_second"], r["errors_by_code"]))' \
  "$work/report.json" "$server_binary" "$callers" "$embed" "$heads" "$tokens"
