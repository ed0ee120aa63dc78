#!/usr/bin/env bash
# Builds the CPU image (Dockerfile --target cpu) and tests it the way a deployment runs it.
#
#   scripts/test-image.sh                 build the image, test it, remove it
#   scripts/test-image.sh --image=NAME    test an image built before (kept afterwards)
#   scripts/test-image.sh --file=PATH     build from another Dockerfile (a variant; same context)
#   scripts/test-image.sh --build-only=DIR    build the image only, keep it, note it in DIR (empty
#                                             or new); a later --check-built=DIR tests it and removes
#                                             it with its layers. scripts/test.sh builds the image in
#                                             the background this way while its other stages run.
#
# Engine: Docker when a Docker engine answers (`docker info`), else podman. No registry is needed:
# when the base image debian:12 is not present, it is made locally with mmdebstrap (Debian 12
# minbase + ca-certificates) and imported; it stays cached for the next run (remove it with
# `podman rmi docker.io/library/debian:12`). Container options that some hosts refuse (crun on a
# hybrid cgroup layout, raising rlimits, bridge networking) are replaced by fallbacks only when the
# plain command fails on a tiny probe (podman: --runtime runc, explicit --ulimit, --cgroup-manager
# cgroupfs, --network=host, --isolation=chroot, --storage-driver=vfs); the log says which were used.
#
# The container runs as deploy/k8s runs it: --read-only with a tmpfs /tmp, capabilities dropped,
# no-new-privileges, weights from a read-only mount, and the listen port set through
# FUSEDLAYER_ADDRESS to a free, non-default port. Checks:
#   - the image config: USER 10001:10001, the HEALTHCHECK kept (docker format), the entrypoint
#     refusing an --address flag (exit 64);
#   - the server process (PID 1) runs as uid/gid 10001; the root filesystem and /weights are
#     read-only, /tmp writable;
#   - the image's own HEALTHCHECK turns healthy on the non-default port, and the same command
#     fails when FUSEDLAYER_ADDRESS names a port nothing listens on (it can fail);
#   - through the published port: gRPC health SERVING (whole server, fusedlayer.mhc, fusedlayer.swa),
#     the weight set loaded from the manifest in the read-only mount (ListWeightSets source), an mHC
#     seam and an SWA call answered on the fused path (--path=require_fused), whose outputs
#     (fusedctl --seed, --output) are byte for byte those of the same calls served by the build
#     tree's fusedlayer_server on the host from the same manifest;
#   - /metrics lists the fallback counters (every op) and counted the two fused calls;
#   - stop (SIGTERM) drains: exit code 0 and the server's "shut down cleanly" log line.
# Everything it made (containers, the image it built and its intermediate layers, temp dirs) is
# removed on exit, also on failure. Needs fusedctl on the host: $BUILD_DIR/client/fusedctl (default
# build/), or FUSEDCTL=PATH, and the reference server $BUILD_DIR/server/fusedlayer_server, or
# FUSEDLAYER_SERVER=PATH; when missing they are built (CPU configuration, those targets only).
# Ports are free ones picked by the kernel (never 50051, which other tests may use).
#
#   IMAGE_TEST_KEEP_CACHE=1   keep the intermediate build layers (faster re-runs; CI never sets it)
#
# Packages (Debian 12, scripts/install-deps.sh): podman runc mmdebstrap uidmap slirp4netns
# fuse-overlayfs curl python3. Runs as root or rootless podman.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD="${BUILD_DIR:-$ROOT/build}"
PYTHON=/usr/bin/python3
[ -x "$PYTHON" ] || PYTHON=python3

IMAGE=""
DOCKERFILE="$ROOT/Dockerfile"
BUILD_ONLY=""        # --build-only=DIR: where the image's name and the layers before it are noted
CHECK_BUILT=""       # --check-built=DIR: test (and then remove) the image a --build-only run noted
for arg in "$@"; do
  case "$arg" in
    --image=*) IMAGE="${arg#--image=}" ;;
    --file=*) DOCKERFILE="$(realpath "${arg#--file=}")" ;;
    --build-only=*) BUILD_ONLY="${arg#--build-only=}" ;;
    --check-built=*) CHECK_BUILT="${arg#--check-built=}" ;;
    *) echo "usage: $0 [--image=NAME | --file=DOCKERFILE] [--build-only=DIR | --check-built=DIR]" >&2; exit 2 ;;
  esac
done
if [ -n "$CHECK_BUILT" ]; then
  IMAGE="$(cat "$CHECK_BUILT/image")" || { echo "FAIL: no image noted in $CHECK_BUILT" >&2; exit 1; }
fi

step() { printf '\n== %s\n' "$*"; }
fail() { echo "FAIL: $*" >&2; exit 1; }
ok() { echo "  ok: $*"; }

RUN_ID="fusedlayer-image-test-$$"
TMP="$(mktemp -d)"
BUILT_IMAGE=""       # the tag this run built (removed on exit)
LAYERS_BEFORE=""     # image ids present before the build (the ones after it that are new are ours)
CONTAINERS=()
REF_PID=""          # the host reference server (killed on exit)
ENGINE=""
E=()                 # the engine command with its global options, e.g. (podman --storage-driver=vfs)

cleanup() {
  local rc=$? c id
  set +e
  if [ -n "$REF_PID" ]; then kill -KILL "$REF_PID" 2>/dev/null; wait "$REF_PID" 2>/dev/null; fi
  if [ -n "$ENGINE" ]; then
    for c in "${CONTAINERS[@]}"; do "${E[@]}" rm -f "$c" > /dev/null 2>&1; done
    # A --build-only run that succeeded leaves its image (and layers) to the --check-built run.
    if [ -n "$BUILT_IMAGE" ] && { [ -z "$BUILD_ONLY" ] || [ $rc -ne 0 ]; }; then
      "${E[@]}" rmi -f "$BUILT_IMAGE" > /dev/null 2>&1
      if [ "${IMAGE_TEST_KEEP_CACHE:-0}" != 1 ] && [ -n "$LAYERS_BEFORE" ]; then
        # Intermediate layers of this build (also of a failed one): every image id that is new.
        for id in $("${E[@]}" images -a -q --no-trunc 2>/dev/null | sort -u); do
          grep -qxF "$id" "$LAYERS_BEFORE" || "${E[@]}" rmi -f "$id" > /dev/null 2>&1
        done
      fi
    fi
  fi
  rm -rf "$TMP"
  [ $rc -eq 0 ] || echo "image test FAILED (exit $rc); removed its containers, images and temp files" >&2
  exit $rc
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# ------------------------------------------------------------------------------------------------
step "engine"
if command -v docker > /dev/null 2>&1 && docker info > /dev/null 2>&1; then
  ENGINE=docker
  E=(docker)
elif command -v podman > /dev/null 2>&1; then
  ENGINE=podman
  E=(podman)
else
  fail "neither a Docker engine (docker info) nor podman found (scripts/install-deps.sh installs podman)"
fi
echo "  using $ENGINE"
BASE=debian:12
[ "$ENGINE" = podman ] && BASE=docker.io/library/debian:12

ensure_base() {  # makes debian:12 from Debian packages when the engine does not have it
  if "${E[@]}" image inspect "$BASE" > /dev/null 2>&1; then
    echo "  base image $BASE present"
    return
  fi
  if [ ! -s "$TMP/base.tar" ]; then
    command -v mmdebstrap > /dev/null || fail "no $BASE image and no mmdebstrap to make one"
    echo "  making $BASE with mmdebstrap (Debian 12 minbase + ca-certificates; kept for the next run)"
    mmdebstrap --quiet --variant=minbase --include=ca-certificates bookworm "$TMP/base.tar" \
      > "$TMP/mmdebstrap.log" 2>&1 || { cat "$TMP/mmdebstrap.log" >&2; fail "mmdebstrap failed"; }
  fi
  "${E[@]}" import "$TMP/base.tar" "$BASE" > /dev/null
  echo "  imported $BASE"
}

# Probes: a tiny build (RUN needs a working runtime and DNS, as apt-get in the real build does) and
# a tiny read-only, non-root container. Each candidate adds fallbacks to the previous one.
mkdir -p "$TMP/probe"
printf 'FROM %s\nRUN getent hosts deb.debian.org > /dev/null\n' "$BASE" > "$TMP/probe/Dockerfile"
NOFILE="$(ulimit -n)"
[ "$NOFILE" = unlimited ] && NOFILE=65536
# An explicit nproc below the caller's: some hosts refuse setting even an equal limit for the container.
NPROC=4096
ULIMITS=(--ulimit "nofile=$NOFILE:$NOFILE" --ulimit "nproc=$NPROC:$NPROC")
BUILD_FLAGS=()
RUN_FLAGS=()
pick_podman_flags() {  # sets BUILD_FLAGS and RUN_FLAGS; returns 1 when no candidate works
  local cand probe_tag="localhost/$RUN_ID-probe:latest" found=0
  local -a build_cands=("" "--runtime runc" "--runtime runc --network=host" "--isolation=chroot --network=host")
  local -a run_cands=("" "--runtime runc" "--runtime runc ${ULIMITS[*]}")
  for cand in "${build_cands[@]}"; do
    # shellcheck disable=SC2086  # cand is a list of options
    if "${E[@]}" build --pull=never --layers=false $cand -t "$probe_tag" "$TMP/probe" > "$TMP/probe-build.log" 2>&1; then
      read -r -a BUILD_FLAGS <<< "$cand"
      found=1
      "${E[@]}" rmi -f "$probe_tag" > /dev/null 2>&1 || true
      break
    fi
  done
  [ $found = 1 ] || { cat "$TMP/probe-build.log" >&2; return 1; }
  found=0
  for cand in "${run_cands[@]}"; do
    # shellcheck disable=SC2086
    if "${E[@]}" run --rm $cand --read-only --tmpfs /tmp --user 10001:10001 "$BASE" true > "$TMP/probe-run.log" 2>&1; then
      read -r -a RUN_FLAGS <<< "$cand"
      found=1
      break
    fi
  done
  [ $found = 1 ] || { cat "$TMP/probe-run.log" >&2; return 1; }
}

if [ "$ENGINE" = podman ]; then
  ensure_base
  if ! pick_podman_flags; then
    # Some hosts cannot mount overlay layers (e.g. overlay on overlay): the vfs driver always works.
    for gopt in "--cgroup-manager=cgroupfs" "--storage-driver=vfs" "--storage-driver=vfs --cgroup-manager=cgroupfs"; do
      read -r -a E <<< "podman $gopt"
      echo "  retrying with podman $gopt"
      ensure_base
      if pick_podman_flags; then break; fi
      [ "$gopt" != "--storage-driver=vfs --cgroup-manager=cgroupfs" ] || fail "no podman configuration could build and run a probe (log above)"
    done
  fi
  echo "  podman global options: ${E[*]:1}"
  echo "  build options: --pull=never --format docker ${BUILD_FLAGS[*]}"
  echo "  run options: ${RUN_FLAGS[*]}"
else
  ensure_base
fi

# ------------------------------------------------------------------------------------------------
if [ -n "$CHECK_BUILT" ]; then
  # Removed on exit with the layers its build made, as if this run had built it.
  BUILT_IMAGE="$IMAGE"
  LAYERS_BEFORE="$CHECK_BUILT/layers-before"
elif [ -z "$IMAGE" ]; then
  IMAGE="localhost/$RUN_ID:cpu"
  step "build the CPU image ($ENGINE, $DOCKERFILE --target cpu) as $IMAGE"
  "${E[@]}" images -a -q --no-trunc | sort -u > "$TMP/layers-before"
  LAYERS_BEFORE="$TMP/layers-before"
  BUILT_IMAGE="$IMAGE"
  t=$SECONDS
  if [ "$ENGINE" = podman ]; then
    # docker format: the OCI image format has no HEALTHCHECK, podman would drop it.
    "${E[@]}" build --pull=never --format docker "${BUILD_FLAGS[@]}" -f "$DOCKERFILE" --target cpu -t "$IMAGE" "$ROOT" \
      > "$TMP/build.log" 2>&1 || { tail -n 60 "$TMP/build.log" >&2; fail "image build failed"; }
  else
    docker build -f "$DOCKERFILE" --target cpu -t "$IMAGE" "$ROOT" > "$TMP/build.log" 2>&1 \
      || { tail -n 60 "$TMP/build.log" >&2; fail "image build failed"; }
  fi
  ok "built in $((SECONDS - t)) s"
  if [ -n "$BUILD_ONLY" ]; then
    mkdir -p "$BUILD_ONLY"
    cp "$LAYERS_BEFORE" "$BUILD_ONLY/layers-before"
    echo "$IMAGE" > "$BUILD_ONLY/image"
    ok "kept as $IMAGE for --check-built=$BUILD_ONLY"
    exit 0
  fi
fi
"${E[@]}" image inspect "$IMAGE" > /dev/null || fail "no image $IMAGE"

# ------------------------------------------------------------------------------------------------
step "fusedctl and the reference server on the host"
FUSEDCTL="${FUSEDCTL:-$BUILD/client/fusedctl}"
REF_SERVER="${FUSEDLAYER_SERVER:-$BUILD/server/fusedlayer_server}"
missing=()
[ -x "$FUSEDCTL" ] || missing+=(fusedctl)
[ -x "$REF_SERVER" ] || missing+=(fusedlayer_server)
if [ ${#missing[@]} -gt 0 ]; then
  echo "  building ${missing[*]} in $BUILD"
  cmake -S "$ROOT" -B "$BUILD" -G Ninja -DFUSEDLAYER_CUDA=OFF > "$TMP/cmake.log" 2>&1 \
    || { cat "$TMP/cmake.log" >&2; fail "cmake configure failed"; }
  cmake --build "$BUILD" --target "${missing[@]}" > "$TMP/cmake.log" 2>&1 \
    || { tail -n 40 "$TMP/cmake.log" >&2; fail "${missing[*]} build failed"; }
fi
ok "$FUSEDCTL"
ok "$REF_SERVER"

# ------------------------------------------------------------------------------------------------
step "image configuration"
user="$("${E[@]}" image inspect --format '{{.Config.User}}' "$IMAGE")"
[ "$user" = 10001:10001 ] || fail "image USER is '$user', expected 10001:10001"
ok "USER $user"
hc_json="$("${E[@]}" image inspect --format '{{json .Config.Healthcheck.Test}}' "$IMAGE")"
# ["CMD","/bin/sh","-c","..."] -> the command line, one argument a line (NUL-free JSON strings).
"$PYTHON" -c 'import json,sys; t=json.loads(sys.argv[1] or "null") or []; assert t and t[0]=="CMD", t; print("\n".join(t[1:]))' \
  "$hc_json" > "$TMP/healthcheck.args" 2>/dev/null || fail "image has no HEALTHCHECK CMD (got: $hc_json)"
mapfile -t HEALTHCHECK < "$TMP/healthcheck.args"
ok "HEALTHCHECK ${HEALTHCHECK[*]}"
hc_env="$("${E[@]}" image inspect --format '{{range .Config.Env}}{{println .}}{{end}}' "$IMAGE" | grep '^FUSEDLAYER_ADDRESS=' || true)"
[ "$hc_env" = "FUSEDLAYER_ADDRESS=0.0.0.0:50051" ] || fail "image ENV FUSEDLAYER_ADDRESS is '$hc_env', expected 0.0.0.0:50051"
ok "$hc_env"

rc=0
"${E[@]}" run --rm "${RUN_FLAGS[@]}" --read-only "$IMAGE" --address=0.0.0.0:6000 > "$TMP/refused.log" 2>&1 || rc=$?
if [ $rc -ne 64 ] || ! grep -q 'FUSEDLAYER_ADDRESS' "$TMP/refused.log"; then
  cat "$TMP/refused.log" >&2; fail "entrypoint accepted --address (exit $rc), expected exit 64 naming FUSEDLAYER_ADDRESS"
fi
ok "entrypoint refuses --address (exit 64): $(grep -m 1 '^fusedlayer-entrypoint:' "$TMP/refused.log")"

# ------------------------------------------------------------------------------------------------
step "weight set on a read-only mount"
WEIGHTS="$TMP/weights"
"$PYTHON" "$ROOT/tests/deploy/make_test_weight_set.py" "$WEIGHTS" image-test/small
chmod 0755 "$TMP" "$WEIGHTS"
chmod 0644 "$WEIGHTS"/*

read -r GRPC_PORT METRICS_PORT REF_PORT < <("$PYTHON" - <<'PY'
import socket
socks = [socket.socket() for _ in range(3)]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(*(s.getsockname()[1] for s in socks))
PY
)
if [ "$GRPC_PORT" = 50051 ] || [ "$REF_PORT" = 50051 ]; then fail "picked port 50051"; fi
TARGET="127.0.0.1:$GRPC_PORT"

start_container() {  # start_container NAME NETWORK(bridge|host)
  local name="$1" net="$2" host=0.0.0.0
  local -a netopts=(-p "127.0.0.1:$GRPC_PORT:$GRPC_PORT" -p "127.0.0.1:$METRICS_PORT:$METRICS_PORT")
  if [ "$net" = host ]; then host=127.0.0.1; netopts=(--network=host); fi
  local -a health=()
  # Docker runs the HEALTHCHECK only on its schedule; check every second instead of every 10 s
  # (the command itself stays the image's). podman runs it on demand (podman healthcheck run).
  [ "$ENGINE" = docker ] && health=(--health-interval=1s)
  CONTAINERS+=("$name")
  "${E[@]}" run -d --name "$name" "${RUN_FLAGS[@]}" "${netopts[@]}" "${health[@]}" \
    --read-only --tmpfs /tmp:size=64m --cap-drop=ALL --security-opt=no-new-privileges \
    -v "$WEIGHTS:/weights:ro" -e "FUSEDLAYER_ADDRESS=$host:$GRPC_PORT" \
    "$IMAGE" --metrics_address="$host:$METRICS_PORT" --backend=cpu --cpu_threads=2 \
    --weights_manifest=/weights/manifest.json --drain_seconds=2 > "$TMP/run-$name.log" 2>&1 \
    || { cat "$TMP/run-$name.log" >&2; fail "$ENGINE run failed"; }
}

running() { [ "$("${E[@]}" inspect --format '{{.State.Running}}' "$1" 2>/dev/null)" = true ]; }

healthy() {  # the image's own HEALTHCHECK, as the engine runs it
  if [ "$ENGINE" = podman ]; then
    "${E[@]}" healthcheck run "$1" > /dev/null 2>&1
  else
    [ "$(docker inspect --format '{{.State.Health.Status}}' "$1")" = healthy ]
  fi
}

wait_healthy() {  # up to 90 s: loading weights and warming both ops come first
  local _
  for _ in $(seq 1 90); do
    healthy "$1" && return 0
    running "$1" || { "${E[@]}" logs "$1" >&2; fail "container exited during startup"; }
    sleep 1
  done
  "${E[@]}" logs "$1" >&2
  fail "the image HEALTHCHECK did not turn healthy within 90 s (FUSEDLAYER_ADDRESS port $GRPC_PORT)"
}

published_answers() {  # gRPC health through the published port, 10 tries
  local _
  for _ in $(seq 1 10); do
    timeout 5 "$FUSEDCTL" --target="$TARGET" --deadline=2s health > /dev/null 2>&1 && return 0
    sleep 1
  done
  return 1
}

step "start the container (read-only, tmpfs /tmp, caps dropped, FUSEDLAYER_ADDRESS port $GRPC_PORT, metrics $METRICS_PORT)"
C="$RUN_ID-server"
NET=bridge
start_container "$C" bridge
wait_healthy "$C"
ok "image HEALTHCHECK healthy on port $GRPC_PORT (not the default 50051)"
if ! published_answers; then
  # Some hosts cannot forward published ports (no bridge/NAT for containers): host networking.
  echo "  the published port $GRPC_PORT does not answer: falling back to --network=host"
  "${E[@]}" rm -f "$C" > /dev/null 2>&1
  NET=host
  C="$RUN_ID-server-hostnet"
  start_container "$C" host
  wait_healthy "$C"
  ok "image HEALTHCHECK healthy on port $GRPC_PORT (host network)"
  published_answers || { "${E[@]}" logs "$C" >&2; fail "gRPC port $GRPC_PORT does not answer from the host"; }
fi
echo "  network: $NET"

step "non-root, read-only"
ids="$("${E[@]}" exec "$C" sed -n 's/^\(Uid\|Gid\):\t\([0-9]*\).*/\2/p' /proc/1/status | tr '\n' ' ')"
[ "$ids" = "10001 10001 " ] || fail "PID 1 runs as uid/gid '$ids', expected 10001 10001"
comm="$("${E[@]}" exec "$C" cat /proc/1/comm)"
[ "$comm" = fusedlayer_serv ] || fail "PID 1 is '$comm', expected fusedlayer_server (exec'd by the entrypoint)"
ok "PID 1 is fusedlayer_server, uid 10001 gid 10001"
if "${E[@]}" exec "$C" touch /usr/local/bin/probe > /dev/null 2>&1; then fail "root filesystem is writable"; fi
if "${E[@]}" exec "$C" touch /weights/probe > /dev/null 2>&1; then fail "/weights is writable"; fi
"${E[@]}" exec "$C" touch /tmp/probe || fail "/tmp is not writable"
ok "root filesystem and /weights read-only, /tmp writable"

step "the HEALTHCHECK follows FUSEDLAYER_ADDRESS and can fail"
"${E[@]}" exec "$C" "${HEALTHCHECK[@]}" > /dev/null || fail "HEALTHCHECK command failed when run by exec"
# Port 1 on loopback: nothing listens there.
if "${E[@]}" exec -e FUSEDLAYER_ADDRESS=0.0.0.0:1 "$C" "${HEALTHCHECK[@]}" > "$TMP/hc-fail.log" 2>&1; then
  fail "the HEALTHCHECK passed with FUSEDLAYER_ADDRESS naming a port nothing listens on"
fi
ok "with FUSEDLAYER_ADDRESS=0.0.0.0:1 it fails: $(tail -n 1 "$TMP/hc-fail.log")"

step "gRPC through port $GRPC_PORT"
for svc in "" fusedlayer.v1.FusedLayer fusedlayer.mhc fusedlayer.swa; do
  out="$(timeout 10 "$FUSEDCTL" --target="$TARGET" --deadline=5s health --service="$svc" 2>&1)" \
    || fail "health --service='$svc': $out"
  [[ "$out" == *SERVING* ]] || fail "health --service='$svc': $out"
  ok "health '${svc}': $out"
done
timeout 20 "$FUSEDCTL" --target="$TARGET" --deadline=10s list > "$TMP/list.txt" 2>&1 || { cat "$TMP/list.txt" >&2; fail "list failed"; }
if ! grep -q 'image-test/small' "$TMP/list.txt" || ! grep -q 'manifest:/weights/manifest.json' "$TMP/list.txt"; then
  cat "$TMP/list.txt" >&2; fail "weight set image-test/small from manifest:/weights/manifest.json not listed"
fi
ok "weight set image-test/small loaded from manifest:/weights/manifest.json"
# require_fused: the image's CPU backend must run the fused kernels (FAILED_PRECONDITION otherwise).
# Fixed seeds, outputs written, so that the same calls to the reference server below can be compared.
calls() {  # calls TARGET PREFIX: the mHC and SWA calls, outputs in PREFIX-{mhc,swa}.safetensors
  timeout 30 "$FUSEDCTL" --target="$1" --deadline=20s seam --weight_set=image-test/small --tokens=8 --path=require_fused \
    --seed=1101 --output="$2-mhc.safetensors" > "$2-seam.txt" 2>&1 || { cat "$2-seam.txt" >&2; fail "mHC seam call to $1 failed"; }
  timeout 30 "$FUSEDCTL" --target="$1" --deadline=20s swa --weight_set=image-test/small --tokens=8 --path=require_fused \
    --seed=1102 --output="$2-swa.safetensors" > "$2-swa.txt" 2>&1 || { cat "$2-swa.txt" >&2; fail "SWA call to $1 failed"; }
}
calls "$TARGET" "$TMP/image"
ok "mHC seam: $(head -n 1 "$TMP/image-seam.txt")"
ok "SWA: $(head -n 1 "$TMP/image-swa.txt")"

step "the image's outputs are the build tree's: the same calls to $REF_SERVER on port $REF_PORT"
"$REF_SERVER" --backend=cpu --cpu_threads=2 --address="127.0.0.1:$REF_PORT" --metrics_address= \
  --weights_manifest="$WEIGHTS/manifest.json" > "$TMP/ref-server.log" 2>&1 &
REF_PID=$!
for i in $(seq 1 90); do
  timeout 5 "$FUSEDCTL" --target="127.0.0.1:$REF_PORT" --deadline=2s health --service=fusedlayer.swa > /dev/null 2>&1 && break
  kill -0 "$REF_PID" 2>/dev/null || { cat "$TMP/ref-server.log" >&2; fail "the reference server exited during startup"; }
  [ "$i" -lt 90 ] || { cat "$TMP/ref-server.log" >&2; fail "the reference server did not answer within 90 s"; }
  sleep 1
done
calls "127.0.0.1:$REF_PORT" "$TMP/ref"
for out in mhc swa; do
  [ -s "$TMP/image-$out.safetensors" ] || fail "the image's $out call wrote no output file"
  cmp "$TMP/image-$out.safetensors" "$TMP/ref-$out.safetensors" \
    || fail "the image's $out outputs differ from the build tree server's for the same request"
  ok "$out outputs byte for byte equal ($(stat -c %s "$TMP/image-$out.safetensors") bytes)"
done
kill -TERM "$REF_PID"; wait "$REF_PID" || true; REF_PID=""

step "/metrics on port $METRICS_PORT"
curl -fsS --max-time 10 "http://127.0.0.1:$METRICS_PORT/metrics" > "$TMP/metrics.txt" || fail "GET /metrics failed"
for op in mhc swa; do
  n="$(grep -c "^fusedlayer_op_fallbacks_total{.*op=\"$op\"" "$TMP/metrics.txt" || true)"
  [ "$n" -gt 0 ] || fail "/metrics has no fusedlayer_op_fallbacks_total series for op=$op"
  # The call above ran on the fused path (the server's warm-up calls may add more).
  execs="$(awk -v op="$op" '$1 ~ /^fusedlayer_op_executions_total\{/ && index($1, "op=\"" op "\"") && index($1, "path=\"fused\"") {s += $2} END {print s + 0}' "$TMP/metrics.txt")"
  awk -v e="$execs" 'BEGIN {exit !(e >= 1)}' || fail "fusedlayer_op_executions_total{op=$op,path=fused} is $execs after one call"
  ok "op=$op: $n fallback counter series, $execs fused execution(s)"
done

step "stop: SIGTERM drains, exit 0"
# (podman without systemd logs that it cannot manage healthcheck timers: noise, kept out of the log.)
"${E[@]}" stop -t 20 "$C" > "$TMP/stop.log" 2>&1 || { cat "$TMP/stop.log" >&2; fail "$ENGINE stop failed"; }
code="$("${E[@]}" inspect --format '{{.State.ExitCode}}' "$C")"
"${E[@]}" logs "$C" > "$TMP/server.log" 2>&1
[ "$code" = 0 ] || { tail -n 20 "$TMP/server.log" >&2; fail "container exit code $code after stop, expected 0"; }
if ! grep -q 'draining' "$TMP/server.log" || ! grep -q 'shut down cleanly' "$TMP/server.log"; then
  tail -n 20 "$TMP/server.log" >&2; fail "no drain / clean shutdown in the server log"
fi
ok "exit code 0; log: $(grep -o 'received SIGTERM.*' "$TMP/server.log" | head -n 1)"

printf '\nOK: the CPU image %s passed (%s, network %s)\n' "$IMAGE" "$ENGINE" "$NET"
