// Exhaustive check that the correctly rounded reciprocal (__frcp_rn, rcp.rn.f32) returns the same
// bits as the correctly rounded division 1 / x (__fdiv_rn(1.0f, x), div.rn.f32) for every one of the
// 2^32 float inputs (NaNs compared as "both NaN"). IEEE 754 says they must; this checks the device's
// instruction sequences before the gates' Sigmoid (mhc_device_math.cuh) relies on it. A one-off
// device check, not a ctest test: it needs a GPU.
//   nvcc -O3 -arch=sm_90a bench/experiments/rcp_vs_div_check/rcp_vs_div_check.cu -o rcp_vs_div_check && ./rcp_vs_div_check
#include <cstdio>
#include <cstdint>
#include <cuda_runtime.h>

__global__ void Check(uint64_t start, uint64_t count, unsigned long long* mismatches, unsigned* first) {
  for (uint64_t i = blockIdx.x * uint64_t(blockDim.x) + threadIdx.x; i < count; i += uint64_t(gridDim.x) * blockDim.x) {
    const uint32_t bits = uint32_t(start + i);
    const float x = __uint_as_float(bits);
    const float a = __frcp_rn(x), b = __fdiv_rn(1.0f, x);
    const bool same = (a != a && b != b) || __float_as_uint(a) == __float_as_uint(b);
    if (!same && atomicAdd(mismatches, 1ull) == 0) *first = bits;
  }
}

int main() {
  unsigned long long* mism;
  unsigned* first;
  cudaMallocManaged(&mism, sizeof(*mism));
  cudaMallocManaged(&first, sizeof(*first));
  *mism = 0;
  *first = 0;
  Check<<<4096, 256>>>(0, uint64_t(1) << 32, mism, first);
  if (cudaDeviceSynchronize() != cudaSuccess) { std::printf("CUDA error\n"); return 2; }
  std::printf("rcp.rn vs div.rn(1, x) over all 2^32 floats: %llu mismatches%s", *mism, *mism ? "" : "\n");
  if (*mism) std::printf(", first at 0x%08x\n", *first);
  return *mism == 0 ? 0 : 1;
}
