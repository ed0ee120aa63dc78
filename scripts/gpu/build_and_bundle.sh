#!/usr/bin/env bash
# Builds the CUDA tree and bundles everything the GPU host runs into .gpu/ (git-ignored): the
# contract and GPU suites, the GPU benchmarks and torch peers, and the server + fusedctl for the
# end-to-end smoke run. The bundle (~150 MB: every executable carries the kernels' fatbins) is then
# packed into .gpu-pack/gpu_bundle.tar.xz (~14 MB), small enough to copy to a GPU host with the tree.
# On the GPU host, from a copy of the working tree with .gpu-pack:
#   mkdir -p /tmp/b && tar xJf .gpu-pack/gpu_bundle.tar.xz -C /tmp/b && bash /tmp/b/run_device.sh
#
# usage: scripts/gpu/build_and_bundle.sh [BUILD_DIR]     (default build-cuda)
#   GPU_STAGE=.gpu-x GPU_PACK=.gpu-pack-x   stage/pack folders (so several people can bundle at once;
#                                           both must match /.gpu*/ in .gitignore)
#   GPU_TARGETS="gpu_mhc_tests bench_mhc_gpu" a subset of the targets below (faster builds)
#   BASE_SERVER=path/to/old/fusedlayer_server  bundles it as fusedlayer_server_base for run_device.sh's
#                                           "ab" step (old and new binary in one run)
#   BASE_BENCH=path/to/old/bench_mhc_gpu    bundles it as bench_mhc_gpu_base for the "bench" step,
#                                           which then runs old and new interleaved
#   EXTRA_EXES="path:name ..."              bundles more executables under those names (e.g. a
#                                           measurement build of a benchmark with a tuning knob changed)
#   PROFILE_TOOLS=1                         also bundles this host's perf and strace, and keeps the
#                                           executables' symbol tables, for run_device.sh's "profile" step
# The bundle script is the design repository's tools/bundle-runtime.sh (BUNDLE_RUNTIME overrides).
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
build=${1:-$root/build-cuda}
bundle=${BUNDLE_RUNTIME:-$root/../shared/tools/bundle-runtime.sh}
if [ ! -f "$build/build.ninja" ]; then
  cmake -S "$root" -B "$build" -G Ninja -DFUSEDLAYER_CUDA=ON -DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc \
    -DCMAKE_GTEST_DISCOVER_TESTS_DISCOVERY_MODE=PRE_TEST
fi
targets=(mhc_contract_tests swa_contract_tests gpu_mhc_tests gpu_swa_tests gpu_lanes_tests bench_mhc_gpu bench_swa_gpu
         fusedlayer_server fusedctl server_residual_session_tests server_batching_tests gpu_cuda_ipc_tests)
[ -n "${GPU_TARGETS:-}" ] && read -r -a targets <<< "$GPU_TARGETS"
stage=$root/${GPU_STAGE:-.gpu}
pack=$root/${GPU_PACK:-.gpu-pack}
cmake --build "$build" -j2 --target "${targets[@]}"
rm -rf "$stage"
exes=()
for t in "${targets[@]}"; do exes+=("$(find "$build" -type f -name "$t" -perm -u+x | head -1)"); done
# Baselines get a distinct file name before bundling, so the runtime bundler treats each as an
# executable of its own.
base_dir=$(mktemp -d)
for pair in "${BASE_SERVER:-}:fusedlayer_server_base" "${BASE_BENCH:-}:bench_mhc_gpu_base" ${EXTRA_EXES:-}; do
  src=${pair%%:*}
  [ -n "$src" ] || continue
  cp "$src" "$base_dir/${pair##*:}"
  exes+=("$base_dir/${pair##*:}")
done
[ "${PROFILE_TOOLS:-0}" = 1 ] && exes+=(/usr/bin/perf /usr/bin/strace)
"$bundle" "$stage" "${exes[@]}"
# Symbols are most of the size and the device run needs none (sanitizer reports still name the
# kernels: device code keeps -lineinfo). A profile needs the symbol table, not the debug info.
strip_flag=-s; [ "${PROFILE_TOOLS:-0}" = 1 ] && strip_flag=--strip-debug
for e in "${exes[@]}"; do strip $strip_flag "$stage/$(basename "$e")"; done
rm -rf "$base_dir"
cp "$root/bench/gpu/torch_peers.py" "$root/bench/gpu/torch_mhc_peer.py" "$root/bench/gpu/torch_seam_copy_floor.py" \
  "$root/scripts/gpu/run_device.sh" "$stage/"
mkdir -p "$pack"
# xz -9: its 64 MiB dictionary spans several executables, so the kernels' fatbins that each of them
# carries are stored about once (147 MB -> 14 MB; at xz's default -6, an 8 MiB dictionary, 60 MB).
XZ_OPT=${XZ_OPT:--9} tar cJf "$pack/gpu_bundle.tar.xz" -C "$stage" .
du -sh "$stage" "$pack/gpu_bundle.tar.xz"
