#!/usr/bin/env bash
# Session 26, run J command 2: (1) an exhaustive device check that rcp.rn(x) == div.rn(1, x) for all
# 2^32 floats; (2) main (0a25971, "new") against rc (the gates' Sigmoid with __frcp_rn instead of
# __fdiv_rn(1, .): the same bits by IEEE), three interleaved passes at decode sizes; (3) main's full
# mHC table (C x T of issue 14), two passes; (4) rc's gpu_mhc_tests.
set -uo pipefail
rm -rf /tmp/j && mkdir -p /tmp/j && tar xJf .gpu-packG/gpu_bundle.tar.xz -C /tmp/j
cd /tmp/j
export LD_LIBRARY_PATH=$PWD/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
echo "== rcp_vs_div_check"; cp "$OLDPWD/.gpu-packG/rcp_vs_div_check" . && chmod +x rcp_vs_div_check && timeout 60 ./rcp_vs_div_check
echo "columns: binary pass C T fused_us unfused_us floor_us fused_%bw L"
for pass in 1 2 3; do for v in new rc; do
  b=./bench_$v; [ $v = new ] && b=./bench_mhc_gpu
  for ct in 7168:1 7168:16 7168:64 7168:128 5120:64 4096:1 4096:64; do
    timeout 60 $b --C ${ct%%:*} --T ${ct##*:} | sed -n "s/^ *[0-9]/$v $pass &/p"
  done
  for T in 1 64; do timeout 60 $b --C 7168 --T $T --mode normal | sed -n "s/^ *[0-9]/$v-normal $pass &/p"; done
done; done
echo "== main's mHC table (shifted, n = 4, norm weight, pre_mix), two passes"
for pass in 1 2; do for C in 4096 5120 7168; do for T in 1 16 64 128 1024 4096 16384; do
  timeout 90 ./bench_mhc_gpu --C $C --T $T | sed -n "s/^ *[0-9]/table $pass &/p"
done; done; done
echo "== gpu_mhc_tests_rc"
timeout 150 ./gpu_mhc_tests_rc --gtest_brief=1 2>&1 | grep -E "margin|PASSED|FAILED|tests from" | tail -16
