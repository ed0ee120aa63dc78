#!/usr/bin/env bash
# scripts/gpu/run_device.sh must fail a GPU run that tested nothing on the GPU. Runs the script in a
# bundle of stub binaries (no GPU needed) and checks its exit status in each case:
#   1. a bundle whose GPU suites all pass                              -> exit 0
#   2. no GPU answers (nvidia-smi fails)                               -> exit 1
#   3. a GPU suite that skips its tests (prints "[  SKIPPED ]")        -> exit 1
#   4. a contract suite without cuda instances (the CUDA backend did not open) -> exit 1
#   5. a suite asked for is missing from the bundle                    -> exit 1
#   6. a smoke step whose fusedctl call fails                          -> exit 1
#   tests/deploy/run_device_verdicts.sh
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
fails=0

# make_bundle DIR: the script and stub suites that pass, a stub nvidia-smi on DIR/bin.
make_bundle() {
  local d=$1 t
  mkdir -p "$d/bin"
  cp "$ROOT/scripts/gpu/run_device.sh" "$d/"
  printf '#!/bin/sh\necho "Stub GPU, 1.0, 1980 MHz, 2619 MHz"\n' > "$d/bin/nvidia-smi"
  for t in mhc_contract_tests swa_contract_tests gpu_swa_tests; do
    cat > "$d/$t" <<'SH'
#!/bin/sh
case "$*" in
  *--gtest_list_tests*) printf 'Backends/SwaPathTest.\n  X/cpu_fused\n  X/cuda_fused\n' ;;
  *) printf '[==========] 2 tests from 1 test suite ran.\n[  PASSED  ] 2 tests.\n' ;;
esac
SH
  done
  chmod +x "$d"/bin/nvidia-smi "$d"/*_tests
}
# expect NAME RC DIR [ENV...]: run the script of DIR with the tests step; its exit status must be RC.
expect() {
  local name=$1 want=$2 d=$3 rc=0; shift 3
  env PATH="$d/bin:$PATH" OUT="$d/out" STEPS="${STEPS_UNDER_TEST:-tests}" \
    SUITES="mhc_contract_tests swa_contract_tests gpu_swa_tests" "$@" \
    bash "$d/run_device.sh" > "$d/console.log" 2>&1 || rc=$?
  if [ "$rc" -eq "$want" ]; then
    echo "ok: $name (exit $rc)"
  else
    echo "FAIL: $name: run_device.sh exited $rc, expected $want"; tail -20 "$d/console.log"; fails=1
  fi
}

make_bundle "$TMP/pass"
expect "every suite passes on the GPU" 0 "$TMP/pass"

make_bundle "$TMP/nogpu"
printf '#!/bin/sh\necho "NVIDIA-SMI has failed" >&2\nexit 9\n' > "$TMP/nogpu/bin/nvidia-smi"
expect "no GPU answers" 1 "$TMP/nogpu"

make_bundle "$TMP/skip"
printf '#!/bin/sh\nprintf "[==========] 2 tests ran.\\n[  PASSED  ] 0 tests.\\n[  SKIPPED ] 2 tests.\\n"\n' > "$TMP/skip/gpu_swa_tests"
expect "a GPU suite skips its tests" 1 "$TMP/skip"

make_bundle "$TMP/nocuda"
cat > "$TMP/nocuda/swa_contract_tests" <<'SH'
#!/bin/sh
case "$*" in
  *--gtest_list_tests*) printf 'Backends/SwaPathTest.\n  X/cpu_fused\n  X/cpu_unfused\n' ;;
  *) printf '[  PASSED  ] 2 tests.\n' ;;
esac
SH
expect "the contract suite runs on the CPU backend only" 1 "$TMP/nocuda"

make_bundle "$TMP/missing"
rm "$TMP/missing/gpu_swa_tests"
expect "a suite asked for is not in the bundle" 1 "$TMP/missing"

make_bundle "$TMP/smoke"
cat > "$TMP/smoke/fusedlayer_server" <<'SH'
#!/bin/sh
trap 'exit 0' TERM
while :; do sleep 0.1; done
SH
cat > "$TMP/smoke/fusedctl" <<'SH'
#!/bin/sh
case "$1" in
  health|info) exit 0 ;;
  *) echo "fusedctl: error: INTERNAL: stub" >&2; exit 1 ;;
esac
SH
printf '#!/bin/sh\necho fusedlayer_op_executions_total 1\n' > "$TMP/smoke/bin/python3"
chmod +x "$TMP/smoke/fusedlayer_server" "$TMP/smoke/fusedctl" "$TMP/smoke/bin/python3"
STEPS_UNDER_TEST=smoke expect "a smoke call fails" 1 "$TMP/smoke"

exit $fails
