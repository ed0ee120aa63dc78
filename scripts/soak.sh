#!/usr/bin/env bash
# Soak test: a real fusedlayer_server (CPU backend, demo weights, loopback, bearer tokens) under
# sustained mixed load from `fusedctl soak`: valid and invalid compute calls, a client loading and
# unloading a weight set throughout (--churn), and calls refused by authorization (an unknown token,
# none, a compute-only token unloading); asserting zero unexpected status codes and bounded server
# RSS growth. Registered in ctest (RUN_SERIAL) with the binaries as arguments; also run by hand:
#
#   scripts/soak.sh PATH/TO/fusedlayer_server PATH/TO/fusedctl
#   SOAK_CLIENTS=64 SOAK_SECONDS=300 scripts/soak.sh build/server/fusedlayer_server build/client/fusedctl
#
# Environment (defaults): SOAK_CLIENTS=32, SOAK_SECONDS=60, SOAK_WARMUP=20 (seconds at full
# concurrency before the RSS baseline: long enough for the allocator arenas of 32 concurrent 4.4 MiB
# requests to reach their peak; with 5 s two clean-clone CI runs measured 65.7 and 65.2 MiB of
# "growth" that a run with the baseline taken later did not show), SOAK_MAX_RSS_GROWTH_MB=64, SOAK_CPU_THREADS=2.
# The server runs with --max_tokens=256 so that `tokens_over_limit` (T = 257, INVALID_ARGUMENT) is
# cheap enough to send; valid requests use T <= 64. Every process it starts is killed on exit.
set -euo pipefail

if [[ $# -ne 2 ]]; then
  echo "usage: $0 PATH/TO/fusedlayer_server PATH/TO/fusedctl" >&2
  exit 2
fi
SERVER="$(realpath "$1")"
FUSEDCTL="$(realpath "$2")"
for b in "$SERVER" "$FUSEDCTL"; do
  [[ -x "$b" ]] || { echo "FAIL: $b is not an executable" >&2; exit 1; }
done
CLIENTS="${SOAK_CLIENTS:-32}"
SECONDS_="${SOAK_SECONDS:-60}"
WARMUP="${SOAK_WARMUP:-20}"
MAX_RSS="${SOAK_MAX_RSS_GROWTH_MB:-64}"
CPU_THREADS="${SOAK_CPU_THREADS:-2}"

TMP="$(mktemp -d)"
SERVER_PID=""
cleanup() {
  if [[ -n "$SERVER_PID" ]] && kill -0 "$SERVER_PID" 2>/dev/null; then
    kill -KILL "$SERVER_PID" 2>/dev/null || true
    wait "$SERVER_PID" 2>/dev/null || true
  fi
  rm -rf "$TMP"
}
trap cleanup EXIT

# Two fresh tokens: fusedctl soak's own (compute,admin: it computes and churns) and a compute-only
# one for the authorization cases. Loopback, so tokens without TLS are accepted (local credentials).
token() { od -An -tx1 -N32 /dev/urandom | tr -d ' \n'; }
ADMIN_TOKEN="$(token)"
COMPUTE_TOKEN="$(token)"
umask 077
printf '%s compute,admin\n%s compute\n' "$ADMIN_TOKEN" "$COMPUTE_TOKEN" >"$TMP/tokens"
printf '%s\n' "$COMPUTE_TOKEN" >"$TMP/compute_token"

# The server picks its own free ports (:0) and logs them; no port races with parallel tests.
"$SERVER" --backend=cpu --cpu_threads="$CPU_THREADS" --demo_weights --max_tokens=256 \
  --address=127.0.0.1:0 --metrics_address=127.0.0.1:0 --drain_seconds=10 \
  --auth_tokens_file="$TMP/tokens" >"$TMP/server.log" 2>&1 &
SERVER_PID=$!
PORT=""
for _ in $(seq 1 600); do  # up to 60 s: the demo sets are generated and warmed up first
  PORT="$(sed -n 's/.*serving fusedlayer\.v1\.FusedLayer .*(port \([0-9]*\)).*/\1/p' "$TMP/server.log" | head -n1)"
  [[ -n "$PORT" ]] && break
  kill -0 "$SERVER_PID" 2>/dev/null || { cat "$TMP/server.log" >&2; echo "FAIL: server exited" >&2; exit 1; }
  sleep 0.1
done
[[ -n "$PORT" ]] || { cat "$TMP/server.log" >&2; echo "FAIL: server did not start" >&2; exit 1; }
TARGET="127.0.0.1:$PORT"
for svc in fusedlayer.mhc fusedlayer.swa; do
  "$FUSEDCTL" health --target="$TARGET" --deadline=10s --service="$svc" >/dev/null \
    || { cat "$TMP/server.log" >&2; echo "FAIL: $svc not SERVING" >&2; exit 1; }
done

echo "soak: server pid $SERVER_PID on $TARGET; $CLIENTS clients + 1 churning, ${WARMUP}s warm-up + ${SECONDS_}s"
rc=0
FUSEDCTL_TOKEN="$ADMIN_TOKEN" "$FUSEDCTL" soak --target="$TARGET" --deadline=60s --concurrency="$CLIENTS" \
  --duration="$SECONDS_" --warmup="$WARMUP" --server_pid="$SERVER_PID" --max_rss_growth_mb="$MAX_RSS" \
  --churn --compute_token_file="$TMP/compute_token" || rc=$?

# The server must still drain and exit 0 after the soak.
kill -TERM "$SERVER_PID"
src=0
wait "$SERVER_PID" || src=$?
SERVER_PID=""
if [[ $src -ne 0 ]]; then
  tail -n 50 "$TMP/server.log" >&2
  echo "FAIL: server exited $src after SIGTERM" >&2
  exit 1
fi
if [[ $rc -ne 0 ]]; then
  echo "FAIL: fusedctl soak exited $rc" >&2
  exit 1
fi
echo "PASS: soak"
