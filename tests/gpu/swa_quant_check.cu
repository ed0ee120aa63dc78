// The equivalence check behind GpuSwa.QuantEncodingMatchesIeeeDivision: test code, compiled into
// gpu_swa_tests only (CUDA: nvcc; HIP: hipcc, see tests/gpu/CMakeLists.txt). It runs the kernels'
// quantization arithmetic (kernels/gpu/device/swa_quant_math.cuh) on device and compares it bitwise with
// the contract's formulas spelled literally.
#include "gpu_runtime.h"
#include "swa_quant_check.h"

#include <algorithm>
#include <cstdint>

#include "fusedlayer/numeric.h"
#include "device/swa_quant_math.cuh"

namespace fusedlayer::gpu {
namespace {

// Equivalence check of the quantization arithmetic (GPU test QuantEncodingMatchesIeeeDivision):
// for n (amax, v) pairs per format x scale format, the kernels' path (GroupScale + EncodeChunk)
// against the contract's formulas spelled literally: scale = __fdiv_rn(amax, MAX) (then UE8M0),
// q = FloatToFp8(fminf(fmaxf(__fdiv_rn(v, scale), -MAX), MAX)) with numeric.h's software encoder.
// Pairs: random amax over many binades, v = amax * u for random u in [-1, 1], v placed on and one
// to three ulps around fp8 rounding midpoints (times the scale), zeros of both signs, v = +-amax,
// quotients in the fp8 subnormal range, and amax at the 1e-10 floor. Counts mismatching codes and
// scales.
__device__ __forceinline__ uint64_t Mix64(uint64_t x) {
  x ^= x >> 33; x *= 0xff51afd7ed558ccdull; x ^= x >> 33; x *= 0xc4ceb9fe1a85ec53ull; x ^= x >> 33;
  return x;
}

template <Fp8Format kFmt>
__global__ void __launch_bounds__(256) SwaQuantCheckKernel(uint64_t seed, int64_t n, bool ue8m0,
                                                           unsigned long long* bad) {
  constexpr float fmax = kFmt == Fp8Format::kE4M3FN ? 448.0f : 240.0f;
  unsigned long long local = 0;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const uint64_t h = Mix64(seed ^ Mix64(uint64_t(i) * 8 + 1));
    const uint64_t h2 = Mix64(h + 0x9e3779b97f4a7c15ull);
    // amax: mantissa random, exponent in [2^-40, 2^40] (and 1e-10-floor cases).
    float amax = __uint_as_float(uint32_t((87 + (h >> 58) % 80) << 23) | uint32_t(h & 0x7fffffu));
    if ((h2 & 63) == 0) amax = 1e-10f * float((h2 >> 6) & 3);  // at or below the floor (0 included)
    float scale, inv;
    swa_quant::GroupScale<kFmt>(amax, ue8m0, scale, inv);
    float ref_scale = DivRn(fmaxf(amax, 1e-10f), fmax);
    if (ue8m0) ref_scale = CeilToUe8m0(ref_scale);
    if (__float_as_uint(scale) != __float_as_uint(ref_scale)) ++local;
    float v[swa_quant::kQuantChunk];
#pragma unroll
    for (int j = 0; j < swa_quant::kQuantChunk; ++j) {
      const uint64_t r = Mix64(h2 + uint64_t(j) * 0x632be59bd9b4e019ull);
      const uint32_t kind = uint32_t(r & 7);
      const float u = float(int32_t(r >> 32)) * 0x1p-31f;  // [-1, 1)
      float val;
      if (kind <= 2) {
        val = amax * u;
      } else if (kind <= 5) {
        // scale * m for an fp8 midpoint (or a code value) m, nudged by -3..3 ulps.
        constexpr uint32_t kMaxCode = kFmt == Fp8Format::kE4M3FN ? 0x7eu : 0x7fu;
        const uint32_t code = min(uint32_t(r >> 8) & 0x7fu, kMaxCode);
        const float lo = Fp8ToFloat(fp8_bits(code), kFmt);
        const float hi = Fp8ToFloat(fp8_bits(min(code + 1, kMaxCode)), kFmt);
        const float m = (r >> 20) & 1 ? 0.5f * (lo + hi) : lo;  // a midpoint (exact in fp32) or a code value
        val = scale * m;
        const int nudge = int((r >> 16) & 7) - 3;
        val = __uint_as_float(__float_as_uint(val) + nudge);
        if ((r >> 24) & 1) val = -val;
      } else if (kind == 6) {
        val = (r >> 8) & 1 ? -0.0f : 0.0f;
        if ((r >> 9) & 3) val = (r >> 11) & 1 ? -amax : amax;
      } else {
        val = amax * u * 0x1p-12f;  // quotients near and below the fp8 subnormal range
      }
      v[j] = val;
    }
    const uint2 got = swa_quant::EncodeChunk<kFmt>(v, scale, inv, ue8m0);
#pragma unroll
    for (int j = 0; j < swa_quant::kQuantChunk; ++j) {
      const float qq = fminf(fmaxf(DivRn(v[j], ref_scale), -fmax), fmax);
      const uint32_t want = FloatToFp8(qq, kFmt);
      const uint32_t g = ((j < 4 ? got.x : got.y) >> (8 * (j % 4))) & 0xffu;
      if (g != want) ++local;
    }
  }
  if (local) atomicAdd(bad, local);
}

}  // namespace

gpuError_t SwaCheckQuantEncoding(uint64_t seed, int64_t n, Fp8Format fmt, bool ue8m0, unsigned long long* bad,
                                 gpuStream_t stream) {
  const int64_t blocks = std::min<int64_t>((n + 255) / 256, 132 * 16);
  if (fmt == Fp8Format::kE4M3FN) {
    SwaQuantCheckKernel<Fp8Format::kE4M3FN><<<dim3(unsigned(blocks)), dim3(256), 0, stream>>>(seed, n, ue8m0, bad);
  } else {
    SwaQuantCheckKernel<Fp8Format::kE4M3FNUZ><<<dim3(unsigned(blocks)), dim3(256), 0, stream>>>(seed, n, ue8m0, bad);
  }
  return gpuGetLastError();
}

}  // namespace fusedlayer::gpu
