// The SWA kernels' fp8 quantization arithmetic (spec/swa.md "Group quant"), device code shared by
// swa_row_launch.cu and the GPU test's bitwise check of it against the contract's formulas
// (tests/gpu/swa_quant_check.cu). One source for CUDA and HIP. Include after gpu_runtime.h.
#pragma once

#include <cstdint>

#include "fusedlayer/numeric.h"
#include "gpu_runtime.h"

#if !FL_HIP
#include <cuda_fp8.h>
#endif

namespace fusedlayer::gpu::swa_quant {

inline constexpr int kQuantChunk = 8;  // values per EncodeChunk call (one 16-byte bf16 access)

// fp32 -> 4 fp8 codes packed little-endian.
template <Fp8Format kFmt>
__device__ __forceinline__ uint32_t EncodeFp8x4(float a, float b, float c, float d) {
#if !FL_HIP
  if constexpr (kFmt == Fp8Format::kE4M3FN) {
    // cvt.rn.satfinite.e4m3x2.f32 (sm_89+): round to nearest even, saturating at +-448, the
    // definition of FloatToE4M3FN for the finite, pre-clamped inputs given here. The GPU tests
    // compare every code with the CPU backend's software conversion.
    const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, __NV_E4M3);
    const uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(c, d), __NV_SATFINITE, __NV_E4M3);
    return lo | (hi << 16);
  }
#endif
  return uint32_t(FloatToFp8(a, kFmt)) | uint32_t(FloatToFp8(b, kFmt)) << 8 | uint32_t(FloatToFp8(c, kFmt)) << 16 |
         uint32_t(FloatToFp8(d, kFmt)) << 24;
}

// The group scale and its reciprocal from the group amax (spec: scale = amax / MAX, IEEE division;
// UE8M0: 2^ceil(log2(scale))). scale = RN(amax / MAX) by Markstein's theorem: with y = RN(1/MAX)
// and s0 = RN(amax * y) (within an ulp of the quotient), the residual sr = amax - s0 * MAX is exact
// in one FMA and RN(s0 + sr * y) is the correctly rounded quotient. When sr == 0 the FMA returns
// s0 itself (amax >= 1e-10 > 0: no signed-zero case), so no select is needed.
// inv: fp32 scales, RN(1 / scale) (rcp.rn), as the per-value Markstein step below requires; UE8M0,
// the exact reciprocal of the power of two built from the exponent field (no reciprocal
// instruction sequence; rcp.rn only for a scale outside [2^-126, 2^126], i.e. never for finite
// data: scale >= 1e-10 / MAX).
template <Fp8Format kFmt>
__device__ __forceinline__ void GroupScale(float amax, bool ue8m0, float& scale, float& inv) {
  constexpr float fmax = kFmt == Fp8Format::kE4M3FN ? 448.0f : 240.0f;
  constexpr float inv_fmax = 1.0f / fmax;  // RN(1/MAX), folded by the compiler
  amax = fmaxf(amax, 1e-10f);
  const float s0 = amax * inv_fmax;
  const float sr = fmaf(-s0, fmax, amax);
  scale = fmaf(sr, inv_fmax, s0);
  if (ue8m0) {
    scale = CeilToUe8m0(scale);
    const uint32_t e = __float_as_uint(scale) >> 23;  // biased exponent (a sign bit makes it >= 256)
    inv = e - 1u < 253u ? __uint_as_float((254u - e) << 23) : RcpRn(scale);
  } else {
    inv = RcpRn(scale);
  }
}

// Codes of 8 values v of a group with the given scale: q = fp8_rne(clamp(v / scale, -MAX, MAX)),
// the quotient correctly rounded (the contract's IEEE division) without a division sequence:
//  - fp32 scales, Markstein: q0 = RN(v * inv) is within an ulp of v / scale, the residual
//    r = v - q0 * scale is exact in one FMA, and RN(q0 + r * inv) = RN(v / scale). The operands
//    stay far from overflow and underflow (scale >= 1e-10/MAX, |v / scale| <= MAX; a quotient that
//    underflows encodes as fp8 zero either way). The last FMA is evaluated negated,
//    t = RN(-r * inv - q0) = -RN(q0 + r * inv) (round to nearest is symmetric), and negated back
//    for free as an operand of the clamp: this keeps the sign of a zero v, which the plain FMA
//    loses (v = -0: q0 = -0, r = +0, q0 + r * inv = +0, but v / scale = -0 and e4m3fn encodes -0
//    as 0x80; negated: -0 * inv - (-0) = -0 + +0 = +0, negated back -0). For v = +0: r = +0,
//    -0 * inv - (+0) = -0, negated back +0. No instruction is spent on the sign. This relies on
//    the compiler honouring signed zeros (no fast-math / nsz folding of the negations; nvcc's
//    default does, and host GCC with -march=native was seen not to); the contract test
//    ZeroGroupsAndOutliers checks the exact 0x00 / 0x80 bytes on every backend.
//  - UE8M0 (power-of-two) scales: v * inv with the exact reciprocal is the correctly rounded
//    quotient (both round the same exact value once).
// Clamp: on NVIDIA e4m3fn the conversion saturates (satfinite) exactly like min(q, MAX) followed
// by RNE, so only the lower bound is applied; it also maps a NaN quotient to -MAX, as the full clamp
// (fminf(fmaxf(NaN, -MAX), MAX)) always did. The software encoders get both bounds.
// Checked bitwise against IEEE division + clamp + the software encoder by SwaCheckQuantEncoding
// (GPU test QuantEncodingMatchesIeeeDivision).
template <Fp8Format kFmt>
__device__ __forceinline__ uint2 EncodeChunk(const float (&v)[kQuantChunk], float scale, float inv, bool ue8m0) {
  constexpr float fmax = kFmt == Fp8Format::kE4M3FN ? 448.0f : 240.0f;
#if !FL_HIP
  constexpr bool kHwSat = kFmt == Fp8Format::kE4M3FN;
#else
  constexpr bool kHwSat = false;
#endif
  float nq[kQuantChunk];  // -(v / scale), correctly rounded
  if (ue8m0) {
#pragma unroll
    for (int j = 0; j < kQuantChunk; ++j) nq[j] = v[j] * -inv;
  } else {
#pragma unroll
    for (int j = 0; j < kQuantChunk; ++j) {
      const float q0 = v[j] * inv;
      const float r = fmaf(-q0, scale, v[j]);
      nq[j] = fmaf(-r, inv, -q0);
    }
  }
  float q[kQuantChunk];
#pragma unroll
  for (int j = 0; j < kQuantChunk; ++j) q[j] = kHwSat ? fmaxf(-nq[j], -fmax) : fminf(fmaxf(-nq[j], -fmax), fmax);
  return make_uint2(EncodeFp8x4<kFmt>(q[0], q[1], q[2], q[3]), EncodeFp8x4<kFmt>(q[4], q[5], q[6], q[7]));
}

}  // namespace fusedlayer::gpu::swa_quant
