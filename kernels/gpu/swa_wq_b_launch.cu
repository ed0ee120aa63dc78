// Launchers of the wq_b projection kernels (device/swa_wq_b_gemm_kernels.cuh): the portable block-scaled
// FP8 GEMM (HIP, e4m3fnuz, and weight sets without a valid cuBLASLt algorithm) and LaunchWqbPack, the
// cuBLASLt path's operand staging. Host code; compiled by nvcc / hipcc because it launches kernels.
#include "gpu_runtime.h"
#include "swa_kernel_launch.h"
#include "device/swa_wq_b_gemm_kernels.cuh"

#include <cstdint>

namespace fusedlayer::gpu {

using namespace swa_wq_b;  // WqbGemmKernel, WqbPackKernel and their tile constants

gpuError_t LaunchWqbPack(const WqbPackParams& p, gpuStream_t stream) {
  const int G = p.k / kKBlock;
  const int64_t total = (p.main_scale != nullptr ? int64_t(G) * p.main_rows : 0) +
                        (p.tail_scale != nullptr ? int64_t(G) * 4 : 0) + (p.tail_a != nullptr ? int64_t(4) * p.k : 0);
  if (total == 0) return gpuSuccess;
  const int64_t blocks = (total + kThreads - 1) / kThreads;
  WqbPackKernel<<<dim3(unsigned(blocks < 1024 ? blocks : 1024)), dim3(kThreads), 0, stream>>>(p);
  return gpuGetLastError();
}

gpuError_t LaunchWqbGemm(const uint8_t* a, const float* a_scale, const SwaScaleLayout& a_layout, const uint8_t* b,
                         const float* b_scale, uint16_t* out, int64_t tokens, int n, int k, Fp8Format fmt,
                         gpuStream_t stream) {
  if (tokens == 0 || n == 0) return gpuSuccess;
  const bool a_vec = reinterpret_cast<uintptr_t>(a) % 8 == 0;  // K % 128 == 0 keeps rows aligned
  const dim3 grid(unsigned(n / kBN), unsigned((tokens + kBM - 1) / kBM));
  WqbGemmKernel<<<grid, dim3(kThreads), 0, stream>>>(a, a_scale, a_layout, b, b_scale, out, tokens, n, k, fmt,
                                                     a_vec);
  return gpuGetLastError();
}

}  // namespace fusedlayer::gpu
