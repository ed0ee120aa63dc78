# syntax=docker/dockerfile:1
#
# fusedlayer images.
#
#   docker build -t fusedlayer:0.1.0 .                                   CUDA image (default target)
#   docker build -t fusedlayer:0.1.0 --build-arg CUDA_ARCHS="90a;100a" .  more GPU architectures
#   docker build -t fusedlayer:0.1.0-cpu --target cpu .                  CPU-only image (Debian 12)
#
# Run (GPU): docker run --rm --gpus 1 -p 50051:50051 -p 9464:9464 fusedlayer:0.1.0 --demo_weights
# Test (CPU image, built and started by CI): scripts/test-image.sh
#
# The base images are build arguments, pinned by tag by default; tags of nvidia/cuda are re-pushed
# and old ones removed, so production builds should pin them by digest or use a mirror:
#   --build-arg CUDA_DEVEL_IMAGE=nvidia/cuda:13.0.0-devel-ubuntu24.04@sha256:...
#   --build-arg CUDA_RUNTIME_IMAGE=mirror.example.com/nvidia/cuda:13.0.0-runtime-ubuntu24.04
#   --build-arg DEBIAN_IMAGE=debian:12@sha256:...
# CUDA_VERSION must name the CUDA release of the two CUDA images (the runtime stage checks the
# libcublasLt soname of that major version). Ubuntu 24.04 and Debian 12 ship the same stack (gRPC
# 1.51, protobuf 3.21, Abseil 20220623, prometheus-cpp 1.0); both images build against the
# distribution packages.
#
# Listen address: the environment variable FUSEDLAYER_ADDRESS (default 0.0.0.0:50051), read by
# the entrypoint (scripts/container-entrypoint.sh, which refuses an --address flag) and by the
# HEALTHCHECK, so the health probe follows the port: docker run -e FUSEDLAYER_ADDRESS=0.0.0.0:6000 ...

ARG CUDA_VERSION=13.0.0
ARG DEBIAN_IMAGE=debian:12
ARG CUDA_DEVEL_IMAGE=nvidia/cuda:${CUDA_VERSION}-devel-ubuntu24.04
ARG CUDA_RUNTIME_IMAGE=nvidia/cuda:${CUDA_VERSION}-runtime-ubuntu24.04
# Build dependencies, the same Debian/Ubuntu package names in both build stages (each stage
# re-declares the ARG to see this default). grpc-proto is added by the CPU stage only (see below).
ARG BUILD_PACKAGES="cmake ninja-build g++ pkg-config \
 libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler \
 libabsl-dev prometheus-cpp-dev nlohmann-json3-dev libssl-dev libgoogle-perftools-dev"

# ---------------------------------------------------------------------------------------------
# CPU-only image: Debian 12, -DFUSEDLAYER_CUDA=OFF.
# ---------------------------------------------------------------------------------------------
FROM ${DEBIAN_IMAGE} AS cpu-build
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ARG BUILD_PACKAGES
RUN apt-get update \
 && apt-get install -y --no-install-recommends ${BUILD_PACKAGES} grpc-proto \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
# Tests and benchmarks are built and run by CI (.ci/run), not in the image build.
RUN cmake -S . -B /build -G Ninja \
      -DCMAKE_BUILD_TYPE=Release \
      -DFUSEDLAYER_CUDA=OFF \
      -DFUSEDLAYER_BUILD_TESTS=OFF -DFUSEDLAYER_BUILD_BENCH=OFF \
 && cmake --build /build --target fusedlayer_server fusedctl \
 && install -D -m 0755 /build/server/fusedlayer_server /out/fusedlayer_server \
 && install -D -m 0755 /build/client/fusedctl /out/fusedctl

FROM ${DEBIAN_IMAGE} AS cpu
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# Runtime libraries only (Debian 12 names): gRPC 1.51 (libgrpc++1.51 also carries
# libgrpc++_reflection), protobuf 3.21, prometheus-cpp 1.0 (pull = civetweb exposer), Abseil,
# tcmalloc (the server's allocator).
RUN apt-get update \
 && apt-get install -y --no-install-recommends \
      libgrpc++1.51 libgrpc29 libprotobuf32 \
      libprometheus-cpp-core1.0 libprometheus-cpp-pull1.0 libcivetweb1 \
      libabsl20220623 libssl3 zlib1g libtcmalloc-minimal4 ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --system --gid 10001 fusedlayer \
 && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
      --shell /usr/sbin/nologin fusedlayer
COPY --from=cpu-build /out/fusedlayer_server /out/fusedctl /usr/local/bin/
COPY scripts/container-entrypoint.sh /usr/local/bin/fusedlayer-entrypoint
# Fail the build, not the first start, when a shared library is missing from the list above.
RUN ! ldd /usr/local/bin/fusedlayer_server /usr/local/bin/fusedctl | grep 'not found'
USER 10001:10001
# The gRPC listen address of the entrypoint and the HEALTHCHECK (see the top of this file). The
# HEALTHCHECK probes 127.0.0.1, so keep the host 0.0.0.0, [::] or 127.0.0.1.
ENV FUSEDLAYER_ADDRESS=0.0.0.0:50051
# 50051: gRPC (fusedlayer.v1.FusedLayer, grpc.health.v1, reflection); 9464: Prometheus /metrics.
EXPOSE 50051 9464
# Checks the overall health entry: SERVING from start until the SIGTERM drain begins.
HEALTHCHECK --interval=10s --timeout=3s --start-period=60s --retries=3 \
  CMD ["/bin/sh", "-c", "exec fusedctl health --target=\"127.0.0.1:${FUSEDLAYER_ADDRESS##*:}\" --deadline=2s"]
# SIGTERM starts the drain (--drain_seconds); give `docker stop -t` / stop_grace_period more than that.
STOPSIGNAL SIGTERM
ENTRYPOINT ["fusedlayer-entrypoint"]
# Defaults, overridden by the arguments of `docker run IMAGE ...`: metrics on all interfaces
# (the container's network namespace), CPU backend. Weights: add
# --demo_weights or --weights_manifest=/path/manifest.json (mount the files read-only).
CMD ["--metrics_address=0.0.0.0:9464", "--backend=cpu"]

# ---------------------------------------------------------------------------------------------
# CUDA image: build in the CUDA devel image, run in the CUDA runtime image (Ubuntu 24.04).
# ---------------------------------------------------------------------------------------------
# fusedctl compiles grpc/health/v1/health.proto from Debian's grpc-proto package, which Ubuntu
# 24.04 does not ship (package listings show it for Debian bullseye/bookworm and Ubuntu jammy
# only). The .proto files are architecture-independent text: take them from Debian 12.
FROM ${DEBIAN_IMAGE} AS grpc-proto
RUN apt-get update \
 && apt-get install -y --no-install-recommends grpc-proto \
 && rm -rf /var/lib/apt/lists/*

FROM ${CUDA_DEVEL_IMAGE} AS cuda-build
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# CMAKE_CUDA_ARCHITECTURES syntax: "90a" (H100/H200, wgmma/TMA kernels), "90a;100a", ...
ARG CUDA_ARCHS="90a"
ARG BUILD_PACKAGES
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends ${BUILD_PACKAGES} \
 && rm -rf /var/lib/apt/lists/*
COPY --from=grpc-proto /usr/share/grpc-proto /usr/share/grpc-proto
WORKDIR /src
COPY . .
RUN cmake -S . -B /build -G Ninja \
      -DCMAKE_BUILD_TYPE=Release \
      -DFUSEDLAYER_CUDA=ON -DFUSEDLAYER_CUDA_ARCHS="${CUDA_ARCHS}" \
      -DFUSEDLAYER_BUILD_TESTS=OFF -DFUSEDLAYER_BUILD_BENCH=OFF \
 && cmake --build /build --target fusedlayer_server fusedctl \
 && install -D -m 0755 /build/server/fusedlayer_server /out/fusedlayer_server \
 && install -D -m 0755 /build/client/fusedctl /out/fusedctl

FROM ${CUDA_RUNTIME_IMAGE} AS cuda
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# Runtime libraries only (Ubuntu 24.04 noble, universe; t64 names after the 64-bit time_t
# transition). libgrpc++1.51t64 pulls libgrpc29t64; libprometheus-cpp-pull1.0 pulls civetweb.
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      libgrpc++1.51t64 libgrpc29t64 libprotobuf32t64 \
      libprometheus-cpp-core1.0 libprometheus-cpp-pull1.0 libcivetweb1 \
      libabsl20220623t64 libssl3t64 zlib1g libtcmalloc-minimal4t64 ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --system --gid 10001 fusedlayer \
 && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
      --shell /usr/sbin/nologin fusedlayer
COPY --from=cuda-build /out/fusedlayer_server /out/fusedctl /usr/local/bin/
COPY scripts/container-entrypoint.sh /usr/local/bin/fusedlayer-entrypoint
# Every shared library must resolve, except the driver (libcuda.so.1), which the NVIDIA
# Container Toolkit mounts at run time.
RUN ! ldd /usr/local/bin/fusedlayer_server /usr/local/bin/fusedctl | grep 'not found' | grep -v 'libcuda\.so\.1'
# cuBLASLt (the wq_b projection) is loaded with dlopen at first use (kernels/gpu/cublaslt_loader.h),
# so ldd does not list it: check that the runtime image has the soname the build expects.
ARG CUDA_VERSION
RUN ldconfig -p | grep -q "libcublasLt\.so\.${CUDA_VERSION%%.*} "
# compute: CUDA; utility: nvidia-smi / NVML inside the container for debugging.
ENV NVIDIA_DRIVER_CAPABILITIES=compute,utility
USER 10001:10001
ENV FUSEDLAYER_ADDRESS=0.0.0.0:50051
EXPOSE 50051 9464
HEALTHCHECK --interval=10s --timeout=3s --start-period=120s --retries=3 \
  CMD ["/bin/sh", "-c", "exec fusedctl health --target=\"127.0.0.1:${FUSEDLAYER_ADDRESS##*:}\" --deadline=2s"]
STOPSIGNAL SIGTERM
ENTRYPOINT ["fusedlayer-entrypoint"]
# --backend=auto: the CUDA backend when a GPU is visible, else the CPU backend (logged loudly,
# and fusedlayer_build_info / fusedlayer_fused_kernel_available show it). Deployments that must
# not run without a GPU pass --backend=cuda (deploy/k8s does).
CMD ["--metrics_address=0.0.0.0:9464", "--backend=auto"]
