#!/usr/bin/env bash
# Installs the Debian 12 packages fusedlayer needs to build, test and run (idempotent).
# Usage: scripts/install-deps.sh            (as root, or with sudo available)
set -euo pipefail

PACKAGES=(
  # toolchain
  build-essential cmake ninja-build pkg-config git ccache
  # gRPC / protobuf / Abseil / metrics / JSON / crypto
  libgrpc++-dev libgrpc-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler grpc-proto
  libabsl-dev prometheus-cpp-dev nlohmann-json3-dev libssl-dev
  # the server's allocator (tcmalloc, CMakeLists.txt FUSEDLAYER_TCMALLOC)
  libgoogle-perftools-dev
  # tests and benchmarks
  libgtest-dev libgmock-dev libbenchmark-dev
  # metrics lint, real Prometheus for the integration test, helpers of the deploy checks
  prometheus curl python3 python3-yaml shellcheck
  # HIP compile check (Debian's ROCm 5.2 hipcc; compile-only, no AMD GPU needed)
  hipcc libamdhip64-dev
  # sanitizer stages of scripts/test.sh: GCC's ASan/UBSan/TSan runtimes (scripts/sanitize.sh; also
  # pulled in by build-essential, listed so the dependency is explicit), clang 14 with its runtimes
  # for libFuzzer + ASan/UBSan (scripts/fuzz.sh; libclang_rt.fuzzer is in libclang-rt-14-dev)
  libasan8 libubsan1 libtsan2 clang-14 clang libclang-rt-14-dev
  # throwaway certificates of the security tests
  openssl
  # Python client (client/python; scripts/test-python.sh): runtime, offline build (setuptools, wheel,
  # venv with its bundled pip; stubs from protoc + grpc_python_plugin above), tests and example;
  # mypy checks the package's annotations; torch (CPU) for the torch-tensor inputs and outputs (an
  # optional extra of the package, never a dependency)
  python3-grpcio python3-protobuf python3-numpy python3-setuptools python3-wheel python3-venv python3-pip
  python3-pytest mypy python3-torch
  # image test (scripts/test-image.sh): podman builds and runs the CPU image when no Docker engine
  # answers; runc for hosts where crun refuses the cgroup layout; mmdebstrap makes the debian:12 base
  # image from Debian packages (no registry needed); uidmap, slirp4netns and fuse-overlayfs for
  # rootless podman
  podman runc mmdebstrap uidmap slirp4netns fuse-overlayfs
)

SUDO=""
if [ "$(id -u)" != 0 ]; then
  command -v sudo >/dev/null || { echo "install-deps: run as root or install sudo" >&2; exit 1; }
  SUDO=sudo
fi

missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#PACKAGES[@]} packages present"
  exit 0
fi
echo "install-deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update
$SUDO apt-get install -y "${missing[@]}"
