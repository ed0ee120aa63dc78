#!/usr/bin/env bash
# Session 26, run H: main against st (the decode finalize's mix warps stage their token's split
# partials in shared memory with 16-byte loads, then reduce from there; same adds, same order).
# Graph replay, cold L2, medians, three interleaved passes; SASS order of the staging's loads and
# stores; ncu of the finalize in the graph; st's bits (gpu_mhc_tests in full) and memcheck / racecheck.
set -uo pipefail
rm -rf /tmp/h && mkdir -p /tmp/h && tar xJf .gpu-packG/gpu_bundle.tar.xz -C /tmp/h
cd /tmp/h
export LD_LIBRARY_PATH=$PWD/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
echo "columns: binary pass C T fused_us unfused_us floor_us fused_%bw L"
for pass in 1 2 3; do for v in main st; do
  for ct in 7168:1 7168:16 7168:64 7168:128 7168:1024 7168:4096 5120:1 5120:64 5120:128 4096:1 4096:64 4096:128; do
    timeout 60 ./bench_$v --C ${ct%%:*} --T ${ct##*:} | sed -n "s/^ *[0-9]/$v $pass &/p"
  done
  for T in 1 64; do timeout 60 ./bench_$v --C 7168 --T $T --mode normal | sed -n "s/^ *[0-9]/$v-normal $pass &/p"; done
done; done
F='_ZN10fusedlayer3gpu3mhc17MhcFinalizeKernelILi4ELb1ELi2EEEvNS1_14FinalizeParamsE'
for v in main st; do
  /usr/local/cuda/bin/cuobjdump -sass -fun $F ./bench_$v > $OUT/sass_$v.txt 2>&1
  echo "== SASS $v decode finalize: instructions $(grep -c '^ */\*[0-9a-f]*\*/' $OUT/sass_$v.txt); first 30 LDG/STS/LDS/FADD in order:"
  grep -oE '(LDG|STS|LDS|FADD)[.A-Z0-9]*' $OUT/sass_$v.txt | head -110 | tr '\n' ' ' | cut -c1-1500; echo
done
M="smsp__inst_executed.sum,sm__cycles_elapsed.max,smsp__average_warps_issue_stalled_no_instruction_per_issue_active.ratio,smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio,smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio"
for v in main st; do for ct in 7168:1 7168:64; do
  echo "== ncu $v C=${ct%%:*} T=${ct##*:}: the finalize in the graph (launch 447)"
  timeout 90 ncu --clock-control none -k regex:MhcFinalize --launch-skip 223 --launch-count 1 --metrics "$M" \
    ./bench_$v --C ${ct%%:*} --T ${ct##*:} 2>&1 | grep -E "^  void|inst_executed|cycles_elapsed|stalled_"
done; done
echo "== gpu_mhc_tests (st)"
timeout 120 ./gpu_mhc_tests --gtest_brief=1 2>&1 | tail -3
for tool in memcheck racecheck; do
  echo "== $tool gpu_mhc_tests (st: one-token, chained, seam variants, batch invariance, graph replay)"
  timeout 150 compute-sanitizer --tool $tool --error-exitcode 9 ./gpu_mhc_tests --gtest_brief=1 \
    --gtest_filter='*OneToken*:*Chained*:*SeamVariants*:*BatchInvariance*:*Graph*' 2>&1 | grep -E "SUMMARY|PASSED|FAILED|rror"
  echo "rc=$?"
done
