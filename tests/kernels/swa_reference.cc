#include "swa_reference.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

namespace fusedlayer::testing {
namespace {

constexpr int64_t kGroup = 128;

// Positive finite magnitudes of a format, indexed by code 0 .. max code (increasing).
const std::vector<double>& MagnitudeTable(Fp8Format fmt) {
  static const std::vector<double> fn = [] {
    std::vector<double> t;
    for (int c = 0; c <= 0x7e; ++c) t.push_back(RefFp8Decode(uint8_t(c), Fp8Format::kE4M3FN));
    return t;
  }();
  static const std::vector<double> fnuz = [] {
    std::vector<double> t;
    for (int c = 0; c <= 0x7f; ++c) t.push_back(RefFp8Decode(uint8_t(c), Fp8Format::kE4M3FNUZ));
    return t;
  }();
  return fmt == Fp8Format::kE4M3FN ? fn : fnuz;
}

float BitsFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}
uint32_t FloatU(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}
float Bf16Value(uint16_t b) { return BitsFloat(uint32_t(b) << 16); }

// rrms of one half, at the §3.6 rounding points.
float RefRrms(const uint16_t* x, int64_t n, float eps) {
  double ss = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double v = Bf16Value(x[i]);
    ss += v * v;
  }
  const float ss32 = static_cast<float>(ss);
  const float mean = ss32 / static_cast<float>(n);
  const float t = mean + eps;
  return static_cast<float>(1.0 / std::sqrt(static_cast<double>(t)));
}

}  // namespace

double RefFp8Max(Fp8Format fmt) { return fmt == Fp8Format::kE4M3FN ? 448.0 : 240.0; }

double RefFp8Decode(uint8_t code, Fp8Format fmt) {
  const bool neg = (code & 0x80) != 0;
  const int e = (code >> 3) & 0xf, m = code & 0x7;
  double mag;
  if (fmt == Fp8Format::kE4M3FN) {
    if (e == 15 && m == 7) return std::numeric_limits<double>::quiet_NaN();
    mag = e == 0 ? std::ldexp(double(m), -9) : std::ldexp(1.0 + m / 8.0, e - 7);
  } else {
    if (code == 0x80) return std::numeric_limits<double>::quiet_NaN();
    mag = e == 0 ? std::ldexp(double(m), -10) : std::ldexp(1.0 + m / 8.0, e - 8);
  }
  return neg ? -mag : mag;
}

uint8_t RefFp8Encode(double x, Fp8Format fmt) {
  const bool fn = fmt == Fp8Format::kE4M3FN;
  if (std::isnan(x)) return fn ? uint8_t((std::signbit(x) ? 0x80 : 0) | 0x7f) : uint8_t(0x80);
  const std::vector<double>& t = MagnitudeTable(fmt);
  const double a = std::fabs(x);
  int c;
  if (a >= t.back()) {
    c = int(t.size()) - 1;
  } else {
    // t[c] <= a < t[c + 1]
    c = int(std::upper_bound(t.begin(), t.end(), a) - t.begin()) - 1;
    const double lo = a - t[c], hi = t[c + 1] - a;
    if (hi < lo || (hi == lo && (c & 1))) ++c;
  }
  if (fn) return uint8_t((std::signbit(x) ? 0x80 : 0) | c);
  return c == 0 ? uint8_t(0) : uint8_t((std::signbit(x) ? 0x80 : 0) | c);
}

uint16_t RefBf16Encode(double x) {
  const uint16_t sign = std::signbit(x) ? 0x8000 : 0;
  if (std::isnan(x)) return sign | 0x7fc0;
  const double a = std::fabs(x);
  if (a == 0) return sign;
  int e;
  std::frexp(a, &e);  // a = f * 2^e, f in [0.5, 1): the bf16 quantum there is 2^(e - 8)
  const int qexp = std::max(e - 8, -133);  // below 2^-126 the subnormal quantum 2^-133
  const double r = std::nearbyint(std::ldexp(a, -qexp));  // ties to even (default rounding mode)
  const double v = std::ldexp(r, qexp);
  const double bf16_max = std::ldexp(255.0, 127 - 7);
  if (v > bf16_max) return sign | 0x7f80;
  return sign | uint16_t(FloatU(static_cast<float>(v)) >> 16);
}

float RefCeilPow2(float s) {
  int e;
  const double f = std::frexp(double(s), &e);  // s = f * 2^e
  return f == 0.5 ? s : static_cast<float>(std::ldexp(1.0, e));
}

bool RefUe8m0Edge(float amax, Fp8Format fmt) {
  const float s = amax / static_cast<float>(RefFp8Max(fmt));
  int e;
  std::frexp(s, &e);  // s in [2^(e-1), 2^e)
  for (const float p : {std::ldexp(1.0f, e - 1), std::ldexp(1.0f, e)}) {
    if (s == p || s == std::nextafter(p, 0.0f) || s == std::nextafter(p, 2 * p)) return true;
  }
  return false;
}

bool RefUnfusedNeighbourScale(float amax, float scale, Fp8Format fmt, bool ue8m0) {
  uint32_t bits;
  std::memcpy(&bits, &amax, sizeof(bits));
  if ((bits & 0xffffu) != 0 || !(amax > 0)) return false;  // not a positive bf16 value
  for (const int dir : {-1, 1}) {
    const uint32_t nb = ((bits >> 16) + static_cast<uint32_t>(dir)) << 16;
    float neighbour;
    std::memcpy(&neighbour, &nb, sizeof(neighbour));
    if (!(neighbour > 0) || !std::isfinite(neighbour)) continue;
    const float s = neighbour / static_cast<float>(RefFp8Max(fmt));  // IEEE division, as the contract
    const bool same = ue8m0 ? scale == RefCeilPow2(s) : std::fabs(double(scale) - s) <= std::ldexp(double(s), -20);
    if (same) return true;
  }
  return false;
}

SwaRefOutput SwaReference(const SwaRefConfig& c, const std::vector<uint16_t>& x, int64_t row_stride,
                          int64_t M, const std::vector<uint16_t>& q_norm,
                          const std::vector<uint16_t>& kv_norm, Path path) {
  const int64_t Q = c.Q, D = c.D, G = Q / kGroup;
  const float fmax = static_cast<float>(RefFp8Max(c.fmt));
  SwaRefOutput out;
  out.q.resize(M * Q);
  out.scale.resize(M * G);
  out.amax.resize(M * G);
  out.v.resize(M * Q);
  out.kv.resize(M * D);
  std::vector<float> v(Q);
  for (int64_t m = 0; m < M; ++m) {
    const uint16_t* xq = x.data() + m * row_stride;
    const uint16_t* xkv = xq + Q;
    const float rq = RefRrms(xq, Q, c.eps);
    for (int64_t i = 0; i < Q; ++i) {
      const float t = Bf16Value(xq[i]) * rq;
      const float y = t * Bf16Value(q_norm[i]);
      v[i] = path == Path::kFused ? y : Bf16Value(RefBf16Encode(y));
      out.v[m * Q + i] = v[i];
    }
    for (int64_t g = 0; g < G; ++g) {
      float amax = 1e-10f;
      for (int64_t i = g * kGroup; i < (g + 1) * kGroup; ++i) amax = std::max(amax, std::fabs(v[i]));
      float scale = amax / fmax;
      if (c.ue8m0) scale = RefCeilPow2(scale);
      out.amax[m * G + g] = amax;
      out.scale[m * G + g] = scale;
      for (int64_t i = g * kGroup; i < (g + 1) * kGroup; ++i) {
        const float qv = v[i] / scale;
        out.q[m * Q + i] = RefFp8Encode(std::clamp(double(qv), -double(fmax), double(fmax)), c.fmt);
      }
    }
    const float rkv = RefRrms(xkv, D, c.eps);
    for (int64_t i = 0; i < D; ++i) {
      const float t = Bf16Value(xkv[i]) * rkv;
      out.kv[m * D + i] = RefBf16Encode(t * Bf16Value(kv_norm[i]));
    }
  }
  return out;
}

std::vector<double> SwaProjectionReference(const std::vector<uint8_t>& q, const std::vector<float>& q_scale,
                                           int64_t M, int64_t Q, const std::vector<uint8_t>& w,
                                           const std::vector<float>& w_scale, int64_t N, Fp8Format fmt) {
  const int64_t G = Q / kGroup;
  std::vector<double> a(M * Q), b(N * Q), out(M * N);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < Q; ++k) a[m * Q + k] = RefFp8Decode(q[m * Q + k], fmt) * q_scale[m * G + k / kGroup];
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < Q; ++k)
      b[n * Q + k] = RefFp8Decode(w[n * Q + k], fmt) * w_scale[(n / kGroup) * G + k / kGroup];
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t n = 0; n < N; ++n) {
      double s = 0;
      for (int64_t k = 0; k < Q; ++k) s += a[m * Q + k] * b[n * Q + k];
      out[m * N + n] = s;
    }
  }
  return out;
}

}  // namespace fusedlayer::testing
