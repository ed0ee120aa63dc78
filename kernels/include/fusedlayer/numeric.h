// Bit-exact scalar conversions shared by every backend (host and device code):
// bf16 <-> fp32 (round to nearest even), fp8 e4m3fn / e4m3fnuz <-> fp32 (round to nearest even,
// saturating to +-MAX), and the UE8M0 power-of-two scale rounding of spec/swa.md.
//
// These are the definition of "bf16_rne" and "fp8_rne" in the specs. Kernels may use hardware
// conversion instructions instead only where those are bitwise identical (the GPU tests check).
#pragma once

#include <cstdint>
#include <cstring>
#include <cmath>

#include "fusedlayer/portability.h"

namespace fusedlayer {

FL_HOST_DEVICE FL_INLINE uint32_t FloatBits(float f) {
#if FL_GPU_COMPILER && (defined(__CUDA_ARCH__) || defined(__HIP_DEVICE_COMPILE__))
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
#endif
}

FL_HOST_DEVICE FL_INLINE float BitsToFloat(uint32_t u) {
#if FL_GPU_COMPILER && (defined(__CUDA_ARCH__) || defined(__HIP_DEVICE_COMPILE__))
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
#endif
}

// ---------------------------------------------------------------------------------------------
// bf16: stored as the upper 16 bits of an fp32.
// ---------------------------------------------------------------------------------------------
using bf16_bits = uint16_t;

FL_HOST_DEVICE FL_INLINE float Bf16ToFloat(bf16_bits b) { return BitsToFloat(uint32_t(b) << 16); }

// Round to nearest, ties to even. NaN stays NaN (quiet, sign kept); overflow rounds to +-inf as
// IEEE requires.
FL_HOST_DEVICE FL_INLINE bf16_bits FloatToBf16(float f) {
  uint32_t u = FloatBits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bf16_bits(((u >> 16) & 0x8000u) | 0x7fc0u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return bf16_bits(u >> 16);
}

// Float rounded through bf16 and back: float(bf16_rne(f)).
FL_HOST_DEVICE FL_INLINE float RoundToBf16(float f) { return Bf16ToFloat(FloatToBf16(f)); }

// ---------------------------------------------------------------------------------------------
// fp8 e4m3. Two formats:
//   e4m3fn  (OCP):  bias 7, max +-448 (S.1111.110), NaN S.1111.111, no inf, has -0.
//   e4m3fnuz (AMD): bias 8, max +-240 (S.1111.111), NaN 0x80, no inf, no -0.
// ---------------------------------------------------------------------------------------------
using fp8_bits = uint8_t;

enum class Fp8Format : uint8_t { kE4M3FN = 0, kE4M3FNUZ = 1 };

FL_HOST_DEVICE FL_INLINE float Fp8Max(Fp8Format f) { return f == Fp8Format::kE4M3FN ? 448.0f : 240.0f; }

namespace detail {
// Encodes |a| (a finite, non-negative fp32 value) with the given exponent bias and largest code
// (0x7e for fn, 0x7f for fnuz). Round to nearest even; values past the max saturate.
FL_HOST_DEVICE FL_INLINE uint32_t EncodeFp8Magnitude(float a, int bias, uint32_t max_code) {
  // Smallest normal is 2^(1 - bias); below it the value is a multiple of 2^(-bias - 2).
  const float min_normal = bias == 7 ? 0.015625f : 0.0078125f;   // 2^-6, 2^-7
  if (a < min_normal) {
    const float step_inv = bias == 7 ? 512.0f : 1024.0f;         // 1 / 2^-9, 1 / 2^-10
    // a * step_inv is exact (power-of-two scaling of a value far from the fp32 range limits);
    // rintf rounds to nearest even in the default rounding mode on host and device.
    return uint32_t(rintf(a * step_inv));  // 0..8; 8 is the smallest normal's code, as wanted
  }
  uint32_t u = FloatBits(a);
  if (u >= 0x7f800000u) return max_code;  // inf saturates (NaN is handled by the caller)
  // Re-bias the fp32 exponent to fp8's, then round the 23-bit mantissa to 3 bits (RNE); a carry
  // out of the mantissa correctly bumps the exponent.
  const uint32_t rebias = uint32_t(127 - bias) << 23;
  if (u >= rebias + (16u << 23)) return max_code;  // exponent beyond the fp8 range: saturate
  uint32_t r = u - rebias;
  r += 0x7ffffu + ((r >> 20) & 1u);
  uint32_t code = r >> 20;
  return code > max_code ? max_code : code;
}
}  // namespace detail

// fp32 -> e4m3fn, round to nearest even, saturating (like cvt.rn.satfinite.e4m3x2.f32).
FL_HOST_DEVICE FL_INLINE fp8_bits FloatToE4M3FN(float f) {
  uint32_t u = FloatBits(f);
  uint32_t sign = (u >> 24) & 0x80u;
  if ((u & 0x7fffffffu) > 0x7f800000u) return fp8_bits(sign | 0x7fu);
  return fp8_bits(sign | detail::EncodeFp8Magnitude(fabsf(f), 7, 0x7eu));
}

// fp32 -> e4m3fnuz, round to nearest even, saturating. There is no negative zero: a value that
// rounds to zero encodes as 0x00 whatever its sign.
FL_HOST_DEVICE FL_INLINE fp8_bits FloatToE4M3FNUZ(float f) {
  uint32_t u = FloatBits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return fp8_bits(0x80u);
  uint32_t mag = detail::EncodeFp8Magnitude(fabsf(f), 8, 0x7fu);
  if (mag == 0) return 0;
  return fp8_bits(((u >> 24) & 0x80u) | mag);
}

FL_HOST_DEVICE FL_INLINE float E4M3FNToFloat(fp8_bits b) {
  uint32_t sign = uint32_t(b & 0x80u) << 24;
  uint32_t e = (b >> 3) & 0xfu, m = b & 0x7u;
  if (e == 0xf && m == 0x7) return BitsToFloat(sign | 0x7fc00000u);
  if (e == 0) return BitsToFloat(sign | FloatBits(float(m) * 0.001953125f));  // m * 2^-9
  return BitsToFloat(sign | ((e + 127 - 7) << 23) | (m << 20));
}

FL_HOST_DEVICE FL_INLINE float E4M3FNUZToFloat(fp8_bits b) {
  if (b == 0x80u) return BitsToFloat(0x7fc00000u);
  uint32_t sign = uint32_t(b & 0x80u) << 24;
  uint32_t e = (b >> 3) & 0xfu, m = b & 0x7u;
  if (e == 0) return BitsToFloat(sign | FloatBits(float(m) * 0.0009765625f));  // m * 2^-10
  return BitsToFloat(sign | ((e + 127 - 8) << 23) | (m << 20));
}

FL_HOST_DEVICE FL_INLINE fp8_bits FloatToFp8(float f, Fp8Format fmt) {
  return fmt == Fp8Format::kE4M3FN ? FloatToE4M3FN(f) : FloatToE4M3FNUZ(f);
}
FL_HOST_DEVICE FL_INLINE float Fp8ToFloat(fp8_bits b, Fp8Format fmt) {
  return fmt == Fp8Format::kE4M3FN ? E4M3FNToFloat(b) : E4M3FNUZToFloat(b);
}

// UE8M0 scale rounding of spec/swa.md: 2^ceil(log2(s)) for a positive normal fp32 s, by the
// exponent-field bit trick e = exp(s) + (mantissa(s) != 0).
FL_HOST_DEVICE FL_INLINE float CeilToUe8m0(float s) {
  uint32_t u = FloatBits(s);
  uint32_t e = ((u >> 23) & 0xffu) + ((u & 0x7fffffu) != 0 ? 1u : 0u);
  return BitsToFloat(e << 23);
}

}  // namespace fusedlayer
