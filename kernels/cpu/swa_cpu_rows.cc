#include "swa_cpu_rows.h"

#include <cmath>
#include <cstring>

#include "swa_cpu_simd.h"

namespace fusedlayer::cpu::swa {
namespace {

constexpr int kGroup = static_cast<int>(kSwaGroup);
// Lanes of the sum-of-squares accumulator. Element i goes to lane i % kLanes, each lane adds in
// index order, and the lanes are combined by a fixed pairwise tree: the order depends only on the
// row width, never on M, the thread split or the ISA clone.
constexpr int kLanes = 16;

FL_FORCE_INLINE float Bf16(uint16_t b) { return BitsToFloat(uint32_t(b) << 16); }

// bf16_rne of numeric.h (FloatToBf16), written without branches so the loops vectorise.
FL_FORCE_INLINE uint16_t ToBf16(float f) {
  const uint32_t u = FloatBits(f);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const uint32_t nan = ((u >> 16) & 0x8000u) | 0x7fc0u;
  return uint16_t((u & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}

FL_FORCE_INLINE float SumSquares(const uint16_t* x, int64_t n) {
  float lane[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int j = 0; j < kLanes; ++j) {
      const float f = Bf16(x[i + j]);
      lane[j] += f * f;
    }
  }
  for (int j = 0; i < n; ++i, ++j) {
    const float f = Bf16(x[i]);
    lane[j] += f * f;
  }
  for (int w = kLanes / 2; w >= 1; w /= 2) {
    for (int j = 0; j < w; ++j) lane[j] += lane[j + w];
  }
  return lane[0];
}

// rrms = 1 / sqrt(ss / n + eps), each step an IEEE fp32 operation.
FL_FORCE_INLINE float Rrms(float ss, int64_t n, float eps) {
  return 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
}

// y = (x * rrms) * w, two fp32 multiplies in this order.
FL_FORCE_INLINE void NormHalf(const uint16_t* x, const uint16_t* w, int64_t n, float rrms, float* y) {
  for (int64_t i = 0; i < n; ++i) y[i] = (Bf16(x[i]) * rrms) * Bf16(w[i]);
}

FL_FORCE_INLINE void NormHalfBf16(const uint16_t* x, const uint16_t* w, int64_t n, float rrms, uint16_t* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = ToBf16((Bf16(x[i]) * rrms) * Bf16(w[i]));
}

FL_FORCE_INLINE float GroupAmax(const float* v) {
  // Compared as magnitude bit patterns, which order like the values they encode (a NaN compares
  // above everything and so propagates into the scale). max is exact, so the lane split only serves
  // vectorisation; 1e-10 seeds every lane (the spec's floor).
  uint32_t lane[kLanes];
  for (int j = 0; j < kLanes; ++j) lane[j] = FloatBits(1e-10f);
  for (int i = 0; i < kGroup; i += kLanes) {
    for (int j = 0; j < kLanes; ++j) {
      const uint32_t a = FloatBits(v[i + j]) & 0x7fffffffu;
      lane[j] = a > lane[j] ? a : lane[j];
    }
  }
  uint32_t m = lane[0];
  for (int j = 1; j < kLanes; ++j) m = lane[j] > m ? lane[j] : m;
  return BitsToFloat(m);
}

// Quantizes one group: q = fp8_rne(clamp(v / scale, -MAX, MAX)) with an IEEE division per value.
// This is numeric.h's FloatToE4M3FN / FloatToE4M3FNUZ applied to the clamped quotient, written
// branch-free so it vectorises; the contract tests check it bit for bit, ties and subnormals
// included, on inputs whose quotients are exact (SwaExact* tests).
template <Fp8Format F, bool kPow2>
FL_FORCE_INLINE void EncodeGroupImpl(const float* v, float scale, uint8_t* out) {
  constexpr bool kFn = F == Fp8Format::kE4M3FN;
  constexpr uint32_t kMaxCode = kFn ? 0x7eu : 0x7fu;
  constexpr uint32_t kRebias = uint32_t(127 - (kFn ? 7 : 8)) << 23;
  constexpr uint32_t kClamp = kFn ? 0x43e00000u : 0x43700000u;          // 448.0f, 240.0f
  constexpr uint32_t kMinNormalBits = kFn ? 0x3c800000u : 0x3c000000u;  // 2^-6, 2^-7
  constexpr float kStepInv = kFn ? 512.0f : 1024.0f;                    // 1 / subnormal step
  constexpr float kMagic = 8388608.0f;                                  // 2^23
  const float inv = 1.0f / scale;  // exact when scale is a power of two (used only then)
  for (int i = 0; i < kGroup; ++i) {
    const float t = kPow2 ? v[i] * inv : v[i] / scale;
    const uint32_t tb = FloatBits(t);
    const uint32_t ab = tb & 0x7fffffffu;  // |t|; non-negative floats order like their bits
    const bool nan = ab > 0x7f800000u;
    const uint32_t cb = ab < kClamp ? ab : kClamp;  // saturate to MAX (inf included; NaN replaced below)
    // Normal range: re-bias the exponent, round the mantissa to 3 bits (RNE); a carry bumps the
    // exponent. Below the smallest normal the subtraction wraps and the subnormal result is used.
    uint32_t r = cb - kRebias;
    r += 0x7ffffu + ((r >> 20) & 1u);
    uint32_t normal = r >> 20;
    normal = normal < kMaxCode ? normal : kMaxCode;
    // Subnormal range: |t| * step_inv is exact and < 8; adding 2^23 rounds it to an integer (RNE)
    // held in the low mantissa bits.
    const uint32_t sub = FloatBits(BitsToFloat(cb) * kStepInv + kMagic) - 0x4b000000u;
    const uint32_t mag = cb < kMinNormalBits ? sub : normal;
    const uint32_t sign = (tb >> 24) & 0x80u;
    uint32_t code;
    if constexpr (kFn) {
      code = nan ? (sign | 0x7fu) : (sign | mag);
    } else {
      code = nan ? 0x80u : (mag == 0 ? 0u : (sign | mag));
    }
    out[i] = uint8_t(code);
  }
}

// With a power-of-two scale (always so with UE8M0) v / scale and v * (1 / scale) are the same
// correctly rounded value (1 / scale is exact, and both round the same exact quotient once), so the
// multiply replaces the much slower vector division.
template <Fp8Format F>
FL_FORCE_INLINE void EncodeGroup(const float* v, float scale, uint8_t* out) {
  if ((FloatBits(scale) & 0x007fffffu) == 0) {
    EncodeGroupImpl<F, true>(v, scale, out);
  } else {
    EncodeGroupImpl<F, false>(v, scale, out);
  }
}

FL_FORCE_INLINE float GroupScale(float amax, float fp8_max, ScaleFormat sf) {
  const float s = amax / fp8_max;  // IEEE division
  return sf == ScaleFormat::kUe8m0 ? CeilToUe8m0(s) : s;
}

template <Fp8Format F>
FL_FORCE_INLINE void QuantGroup(const float* v, ScaleFormat sf, uint8_t* codes, float* scale_out) {
  const float scale = GroupScale(GroupAmax(v), Fp8Max(F), sf);
  *scale_out = scale;
  EncodeGroup<F>(v, scale, codes);
}

template <Fp8Format F>
FL_FORCE_INLINE void FusedRows(const RowParams& p, const uint16_t* x, int64_t x_stride, int64_t m0, int64_t m1,
                               const QuantOut& q, uint16_t* kv) {
  const int64_t Q = p.Q, D = p.D, G = Q / kGroup;
  alignas(64) float y[kGroup];
  for (int64_t m = m0; m < m1; ++m) {
    const uint16_t* xq = x + m * x_stride;
    const uint16_t* xkv = xq + Q;
    const float rq = Rrms(SumSquares(xq, Q), Q, p.eps);
    for (int64_t g = 0; g < G; ++g) {
      NormHalf(xq + g * kGroup, p.q_norm + g * kGroup, kGroup, rq, y);
      QuantGroup<F>(y, p.scale_format, q.codes + m * Q + g * kGroup, q.scale + m * q.scale_row + g * q.scale_col);
    }
    const float rkv = Rrms(SumSquares(xkv, D), D, p.eps);
    NormHalfBf16(xkv, p.kv_norm, D, rkv, kv + m * D);
  }
}

template <Fp8Format F>
FL_FORCE_INLINE void QuantRows(const RowParams& p, const uint16_t* q_bf16, int64_t m0, int64_t m1,
                               const QuantOut& q) {
  const int64_t Q = p.Q, G = Q / kGroup;
  alignas(64) float v[kGroup];
  for (int64_t m = m0; m < m1; ++m) {
    for (int64_t g = 0; g < G; ++g) {
      const uint16_t* src = q_bf16 + m * Q + g * kGroup;
      for (int i = 0; i < kGroup; ++i) v[i] = Bf16(src[i]);
      QuantGroup<F>(v, p.scale_format, q.codes + m * Q + g * kGroup, q.scale + m * q.scale_row + g * q.scale_col);
    }
  }
}

}  // namespace

FL_SWA_MULTIVERSION
void FusedNormQuantRows(const RowParams& p, const uint16_t* x, int64_t x_stride, int64_t m0, int64_t m1,
                        const QuantOut& q, uint16_t* kv) {
  if (p.fp8 == Fp8Format::kE4M3FN) {
    FusedRows<Fp8Format::kE4M3FN>(p, x, x_stride, m0, m1, q, kv);
  } else {
    FusedRows<Fp8Format::kE4M3FNUZ>(p, x, x_stride, m0, m1, q, kv);
  }
}

FL_SWA_MULTIVERSION
void NormRowsBf16(const RowParams& p, const uint16_t* x, int64_t x_stride, int64_t m0, int64_t m1,
                  uint16_t* q_bf16, uint16_t* kv) {
  const int64_t Q = p.Q, D = p.D;
  for (int64_t m = m0; m < m1; ++m) {
    const uint16_t* xq = x + m * x_stride;
    const uint16_t* xkv = xq + Q;
    NormHalfBf16(xq, p.q_norm, Q, Rrms(SumSquares(xq, Q), Q, p.eps), q_bf16 + m * Q);
    NormHalfBf16(xkv, p.kv_norm, D, Rrms(SumSquares(xkv, D), D, p.eps), kv + m * D);
  }
}

FL_SWA_MULTIVERSION
void QuantRowsBf16(const RowParams& p, const uint16_t* q_bf16, int64_t m0, int64_t m1, const QuantOut& q) {
  if (p.fp8 == Fp8Format::kE4M3FN) {
    QuantRows<Fp8Format::kE4M3FN>(p, q_bf16, m0, m1, q);
  } else {
    QuantRows<Fp8Format::kE4M3FNUZ>(p, q_bf16, m0, m1, q);
  }
}

}  // namespace fusedlayer::cpu::swa
