#!/usr/bin/env bash
# Builds fusedlayer and starts the server with the built-in demo weight sets. This is the README's
# "run the server" command.
#
#   scripts/run-server.sh [extra fusedlayer_server flags...]
#
# Installs the Debian 12 packages it needs, builds into build-release/ (with the CUDA backend when
# nvcc is present), then runs fusedlayer_server --demo_weights --backend=auto: the GPU when one is
# present, else the CPU backend. gRPC on 0.0.0.0:50051, Prometheus metrics on 0.0.0.0:9464/metrics.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD="${BUILD_DIR:-$ROOT/build-release}"

"$ROOT/scripts/install-deps.sh"

CUDA_ARGS=(-DFUSEDLAYER_CUDA=OFF)
NVCC="$(command -v nvcc || true)"
[ -z "$NVCC" ] && [ -x /usr/local/cuda/bin/nvcc ] && NVCC=/usr/local/cuda/bin/nvcc
[ -n "$NVCC" ] && CUDA_ARGS=(-DFUSEDLAYER_CUDA=ON -DCMAKE_CUDA_COMPILER="$NVCC")

cmake -S "$ROOT" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release "${CUDA_ARGS[@]}" \
  -DFUSEDLAYER_BUILD_TESTS=OFF -DFUSEDLAYER_BUILD_BENCH=OFF
cmake --build "$BUILD" -j"$(nproc)" --target fusedlayer_server fusedctl

echo "fusedctl: $BUILD/client/fusedctl  (try: $BUILD/client/fusedctl info)"
exec "$BUILD/server/fusedlayer_server" --demo_weights "$@"
