#!/usr/bin/env bash
# End-to-end check of the monitoring contract against a REAL server and a REAL Prometheus:
#
#   tests/deploy/prometheus_integration.sh PATH/TO/fusedlayer_server PATH/TO/fusedctl
#
# 1. Every fusedlayer_server flag used by the Dockerfile, compose and Kubernetes files exists.
# 2. fusedlayer_server --demo_weights on loopback ports; wait until both ops are warm
#    (grpc.health.v1 "fusedlayer.mhc" / "fusedlayer.swa" SERVING); the Kubernetes readinessProbe
#    and the image HEALTHCHECK commands, as written, pass.
# 3. Prometheus (Debian's /usr/bin/prometheus) on loopback, scraping every 1s, evaluating every 1s,
#    with the PRODUCTION rules file loaded unchanged.
# 4. N AUTO and N FORCE_UNFUSED calls per op, interleaved, plus one UnloadWeightSet of an unknown
#    set (NOT_FOUND, so the error-ratio panel has data).
# 5. Assertions through the Prometheus HTTP API (tests/deploy/prom_check.py): exact counter deltas,
#    the hit-rate recording rule = 0.5, FusedHitRateLow pending for both ops, the selectors of
#    FusedKernelErrors / FusedCapabilityLost match the server's series and stay quiet, every
#    series selector of every rule matches the server's series, the server (started with
#    --shadow_sample_rate=1) shadow-verified every AUTO call with zero mismatches and
#    ShadowMismatch quiet, and every Grafana panel expression returns data ($__rate_interval -> 1m).
# 6. SIGTERM: the server drains and exits 0; ServiceDown goes pending (up == 0).
# 7. Restart with --disable_fused=mhc (the operator kill switch): fused_kernel_available{op="mhc"}
#    = 0, FusedCapabilityLost pending for mhc only, AUTO seam calls counted under
#    reason="disabled_by_config", ServiceDown resolved.
#
# Rules are tested as shipped, not with shortened `for:`/windows: the 5m rate windows already
# work from the second scrape on (rate() uses the samples it has), and an alert whose expression
# holds is visible as "pending" long before its `for:` elapses. That state is what a forced
# fallback can show within a test's runtime; promtool's unit tests
# (deploy/prometheus/tests) cover the pending -> firing transitions on synthetic series.
#
# Loopback only; bounded (a watchdog ends it after 150 s, every wait has its own timeout, and a
# normal run takes about 25 s); every process it starts is killed on exit. Needs (Debian 12): prometheus, curl, python3 (/usr/bin/python3).
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

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PYTHON="${PYTHON:-/usr/bin/python3}"
PROMETHEUS="${PROMETHEUS:-/usr/bin/prometheus}"
BACKEND="${FUSEDLAYER_TEST_BACKEND:-cpu}"   # cpu: deterministic on any CI machine
WEIGHT_SET="v41-flash/demo"
# AUTO calls and FORCE_UNFUSED calls, per op. FusedHitRateLow's guard needs more than 0.1
# executions/s over 5m, i.e. more than 30 per op in the window: 2 x 24 = 48 clears it.
N=24
# Hard bound on the whole run: the watchdog sends SIGTERM to this script, whose trap cleans up.
# Every single wait below is bounded too; the longest one a trap may have to sit out is a 10 s
# fusedctl call, so the script ends within DEADLINE_S + 10 s.
DEADLINE_S="${FUSEDLAYER_TEST_DEADLINE_S:-150}"
TMP="$(mktemp -d)"
SERVER_PID=""
PROM_PID=""
WATCHDOG_PID=""
OK=0

cleanup() {
  local rc=$?
  if [[ -n "$WATCHDOG_PID" ]]; then
    kill -TERM "$WATCHDOG_PID" 2>/dev/null || true   # its trap ends its sleep too
    wait "$WATCHDOG_PID" 2>/dev/null || true
  fi
  for pid in "$SERVER_PID" "$PROM_PID"; do
    if [[ -n "$pid" ]] && kill -0 "$pid" 2>/dev/null; then
      kill -TERM "$pid" 2>/dev/null || true
    fi
  done
  for pid in "$SERVER_PID" "$PROM_PID"; do
    if [[ -n "$pid" ]]; then
      for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
      kill -KILL "$pid" 2>/dev/null || true
      wait "$pid" 2>/dev/null || true
    fi
  done
  if [[ $OK -ne 1 ]]; then
    echo "---- server log (tail) ----" >&2; tail -n 40 "$TMP/server.log" >&2 2>/dev/null || true
    echo "---- prometheus log (tail) ----" >&2; tail -n 20 "$TMP/prometheus.log" >&2 2>/dev/null || true
    echo "---- fusedctl log (tail) ----" >&2; tail -n 20 "$TMP/fusedctl.log" >&2 2>/dev/null || true
  fi
  rm -rf "$TMP"
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM
(
  trap 'kill "$sleep_pid" 2>/dev/null; exit 0' TERM
  sleep "$DEADLINE_S" &
  sleep_pid=$!
  wait "$sleep_pid"
  echo "FAIL: the test ran over ${DEADLINE_S}s" >&2
  kill -TERM $$
) &
WATCHDOG_PID=$!

step() { printf '\n== %s\n' "$*"; }

# The lists the checks below loop over come from check_manifests.py. Each is read into a file first,
# so a generator that fails (or prints nothing) fails the test instead of making its loop check
# nothing. FUSEDLAYER_MANIFEST_LISTER replaces the generator command (the tests of this script use
# it to make it fail).
if [[ -n "${FUSEDLAYER_MANIFEST_LISTER:-}" ]]; then
  read -r -a MANIFEST_LISTER <<< "$FUSEDLAYER_MANIFEST_LISTER"
else
  MANIFEST_LISTER=("$PYTHON" "$ROOT/tests/deploy/check_manifests.py")
fi
manifest_list() {  # manifest_list WHAT OUT: the non-empty list `check_manifests.py WHAT` prints, in OUT
  local rc=0
  "${MANIFEST_LISTER[@]}" "$1" > "$2" || rc=$?
  if [[ $rc -ne 0 ]]; then
    echo "FAIL: check_manifests.py $1 (the list this step checks) exited $rc" >&2
    exit 1
  fi
  if ! grep -q '[^[:space:]]' "$2"; then
    echo "FAIL: check_manifests.py $1 printed an empty list: this step would check nothing" >&2
    exit 1
  fi
}
check() { "$PYTHON" "$ROOT/tests/deploy/prom_check.py" "http://127.0.0.1:$PROM_PORT" "$@"; }

# Three distinct free loopback ports (bound by the kernel, released just before use).
read -r GRPC_PORT METRICS_PORT PROM_PORT < <("$PYTHON" - <<'PY'
import socket
socks = [socket.socket() for _ in range(3)]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(*(s.getsockname()[1] for s in socks))
PY
)
TARGET="127.0.0.1:$GRPC_PORT"

step "deployment files use only flags fusedlayer_server defines"
# --helpfull prints every flag and exits (non-zero, by Abseil's convention).
"$SERVER" --helpfull > "$TMP/helpfull.txt" 2>&1 || true
manifest_list flags "$TMP/flags.txt"
while read -r flag; do
  if ! grep -qE -- "--${flag} \(" "$TMP/helpfull.txt"; then
    echo "FAIL: deployment files pass --$flag, which fusedlayer_server does not define" >&2
    exit 1
  fi
  echo "  ok: --$flag"
done < "$TMP/flags.txt"

start_server() {  # start_server [EXTRA FLAGS...]: start and wait until both ops are warm
  "$SERVER" --demo_weights --backend="$BACKEND" --address="$TARGET" \
    --metrics_address="127.0.0.1:$METRICS_PORT" --drain_seconds=2 --cpu_threads=2 "$@" \
    >> "$TMP/server.log" 2>&1 &
  SERVER_PID=$!
  local svc i
  for svc in fusedlayer.mhc fusedlayer.swa; do
    for i in $(seq 1 120); do
      if timeout 5 "$FUSEDCTL" health --target="$TARGET" --deadline=2s --service="$svc" >/dev/null 2>&1; then break; fi
      kill -0 "$SERVER_PID" 2>/dev/null || { echo "FAIL: fusedlayer_server exited during startup" >&2; exit 1; }
      [[ $i -lt 120 ]] || { echo "FAIL: $svc not SERVING after 60s" >&2; exit 1; }
      sleep 0.5
    done
    echo "  ok: $svc SERVING"
  done
}

stop_server() {  # SIGTERM; the drain must end with exit 0 within 10 s (--drain_seconds=2)
  kill -TERM "$SERVER_PID"
  local i rc=0
  for i in $(seq 1 100); do
    kill -0 "$SERVER_PID" 2>/dev/null || break
    [[ $i -lt 100 ]] || { echo "FAIL: server still running 10s after SIGTERM (--drain_seconds=2)" >&2; exit 1; }
    sleep 0.1
  done
  wait "$SERVER_PID" || rc=$?
  SERVER_PID=""
  [[ $rc -eq 0 ]] || { echo "FAIL: server exited $rc after SIGTERM, expected 0" >&2; exit 1; }
  echo "  ok: server drained and exited 0"
}

step "start fusedlayer_server --demo_weights --backend=$BACKEND --shadow_sample_rate=1 on $TARGET (metrics :$METRICS_PORT)"
start_server --shadow_sample_rate=1

step "the Kubernetes readinessProbe and the image HEALTHCHECK commands pass on the warm server"
# Run as written in deploy/k8s/deployment.yaml and the Dockerfile, with fusedctl from PATH, the
# in-container address 127.0.0.1:50051 replaced by the test server's, and FUSEDLAYER_ADDRESS (the
# listen address the image HEALTHCHECK reads) set to the test server's.
mkdir -p "$TMP/bin"
ln -s "$FUSEDCTL" "$TMP/bin/fusedctl"
manifest_list probes "$TMP/probes.txt"
while read -r probe; do
  probe="${probe//127.0.0.1:50051/$TARGET}"
  if ! FUSEDLAYER_ADDRESS="$TARGET" PATH="$TMP/bin:$PATH" timeout 10 /bin/sh -c "$probe" >> "$TMP/fusedctl.log" 2>&1; then
    echo "FAIL: probe command failed: $probe" >&2; exit 1
  fi
  echo "  ok: $probe"
done < "$TMP/probes.txt"

step "start Prometheus on 127.0.0.1:$PROM_PORT with deploy/prometheus/fusedlayer-rules.yml"
cat > "$TMP/prometheus.yml" <<YAML
global:
  scrape_interval: 1s
  scrape_timeout: 1s
  evaluation_interval: 1s
rule_files:
  - $ROOT/deploy/prometheus/fusedlayer-rules.yml
scrape_configs:
  - job_name: fusedlayer
    static_configs:
      - targets: ['127.0.0.1:$METRICS_PORT']
YAML
"$PROMETHEUS" --config.file="$TMP/prometheus.yml" --storage.tsdb.path="$TMP/tsdb" \
  --web.listen-address="127.0.0.1:$PROM_PORT" > "$TMP/prometheus.log" 2>&1 &
PROM_PID=$!
for i in $(seq 1 60); do
  if curl -fsS "http://127.0.0.1:$PROM_PORT/-/ready" >/dev/null 2>&1; then break; fi
  kill -0 "$PROM_PID" 2>/dev/null || { echo "FAIL: prometheus exited during startup" >&2; exit 1; }
  [[ $i -lt 60 ]] || { echo "FAIL: prometheus not ready after 30s" >&2; exit 1; }
  sleep 0.5
done
rules_loaded="$(curl -fsS "http://127.0.0.1:$PROM_PORT/api/v1/rules" | "$PYTHON" -c \
  'import json,sys; print(sum(len(g["rules"]) for g in json.load(sys.stdin)["data"]["groups"]))')"
[[ "$rules_loaded" -eq 6 ]] || { echo "FAIL: Prometheus loaded $rules_loaded rules, expected 6" >&2; exit 1; }
echo "  ok: ready, $rules_loaded rules loaded"
check wait-scraped 30

# A server-side error: UnloadWeightSet of an unknown set answers NOT_FOUND (fusedctl seam/swa check
# the weight set against ListWeightSets first, so an unknown set there never reaches the server).
unload_unknown() {
  if timeout 10 "$FUSEDCTL" unload no-such-set --target="$TARGET" > "$TMP/notfound.log" 2>&1; then
    echo "FAIL: unloading an unknown weight set succeeded" >&2; exit 1
  fi
  grep -q NOT_FOUND "$TMP/notfound.log" || {
    echo "FAIL: unloading an unknown weight set did not give NOT_FOUND:" >&2; cat "$TMP/notfound.log" >&2; exit 1; }
}
# The server creates a fusedlayer_requests_total{code!="OK"} series on its first error, already at
# 1, so rate() cannot see that first error. Make it exist (and be scraped) before the traffic; the
# second NOT_FOUND below is then a visible increase for the error-ratio panel.
unload_unknown
check wait-series 'fusedlayer_requests_total{job="fusedlayer",method="UnloadWeightSet",code="NOT_FOUND"}' 20
check snapshot "$TMP/baseline.json"

step "traffic: $N AUTO + $N FORCE_UNFUSED calls per op, interleaved; one NOT_FOUND"
call() {  # call OP PATH
  timeout 10 "$FUSEDCTL" "$1" --target="$TARGET" --weight_set="$WEIGHT_SET" --tokens=4 --path="$2" \
    >> "$TMP/fusedctl.log" 2>&1 || { echo "FAIL: fusedctl $1 --path=$2 failed" >&2; exit 1; }
}
for _ in $(seq 1 "$N"); do
  for op in seam swa; do
    call "$op" auto
    call "$op" force_unfused
  done
done
unload_unknown
echo "  ok: $((4 * N)) calls, and NOT_FOUND from UnloadWeightSet of an unknown set"

step "Prometheus: counters, recording rule, alerts"
check wait-counters "$TMP/baseline.json" "$N" 30
sleep 2   # at least one rule evaluation (1s) after the scrape that saw the last call
check traffic "$TMP/baseline.json" "$N"
check rule-selectors "$ROOT/deploy/prometheus/fusedlayer-rules.yml"
check shadow "$N" 30

step "Grafana dashboard: every panel expression returns data (\$__rate_interval -> 1m)"
check dashboard "$ROOT/deploy/grafana/dashboards/fusedlayer.json" 1m

step "SIGTERM: drain, exit 0, ServiceDown pending"
stop_server
check wait-alert ServiceDown pending 20

step "restart with --disable_fused=mhc: FusedCapabilityLost pending for mhc, ServiceDown resolved"
start_server --disable_fused=mhc
for _ in $(seq 1 "$N"); do call seam auto; done
check capability-lost mhc disabled_by_config "$N" 20
stop_server

OK=1
printf '\nOK: Prometheus integration passed (server %s, backend %s)\n' "$SERVER" "$BACKEND"
