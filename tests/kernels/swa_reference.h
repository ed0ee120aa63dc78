// Reference of the SWA op (spec/swa.md), written from the spec alone: it shares no code with any
// backend (the only library code it uses is numeric.h's bf16 conversion, which numeric_test.cc checks
// exhaustively against this file's independent definitions).
//
// Rounding points follow the canonical reference of background/swa-sources.md §3.6:
//   ss = sum of x^2 in double, rounded once to fp32; mean = fl32(ss / n);
//   rrms = fl32(1 / sqrt(double(fl32(mean + eps)))), correctly rounded;
//   y = fl32(fl32(x * rrms) * w); kv = bf16_rne(y);
//   fused: v = y; unfused: v = float(bf16_rne(y));
//   amax = max(1e-10, max |v|); scale = fl32(amax / MAX) (IEEE), optional UE8M0 ceiling (computed
//   here with frexp/ldexp, not with the exponent-field trick);
//   q = fp8_rne(clamp(fl32(v / scale), -MAX, MAX)), the fp8 rounding done by a nearest-value search
//   over an fp64 table of all codes (ties to the even code).
// The projection is dequant(q) * dequant(W)^T in fp64.
#pragma once

#include <cstdint>
#include <vector>

#include "fusedlayer/fallback.h"
#include "fusedlayer/numeric.h"

namespace fusedlayer::testing {

// fp64 value of an fp8 code, from the format definition (NaN codes give NaN).
double RefFp8Decode(uint8_t code, Fp8Format fmt);
double RefFp8Max(Fp8Format fmt);
// Round x (any double) to the fp8 format: NaN -> the format's NaN (fn: sign | 0x7f, fnuz: 0x80);
// |x| beyond MAX (inf included) saturates to +-MAX; otherwise the nearest code, ties to the code
// with an even last bit. e4m3fn keeps the sign of a value that rounds to zero (-0 = 0x80); e4m3fnuz
// has no negative zero.
uint8_t RefFp8Encode(double x, Fp8Format fmt);
// Round a double to bf16 (round to nearest even; overflow to inf; NaN -> quiet NaN with the sign).
uint16_t RefBf16Encode(double x);
// 2^ceil(log2(s)) for a positive normal s.
float RefCeilPow2(float s);
// The contract's one exception to exact UE8M0 scales: amax / MAX (the fp32 quotient the ceiling is
// taken of) within 1 fp32 ulp of a power of two P (P itself or one of its two fp32 neighbours). Only
// there can a kernel whose y differs from the reference's in the last fp32 bit put its ceiling one
// binade away.
bool RefUe8m0Edge(float amax, Fp8Format fmt);
// The unfused path quantizes its own bf16 intermediate, and the contract lets each of its values
// differ from the reference's by one bf16 ulp (the kv clause: the same RMSNorm and the same bf16
// rounding; an fp32 row norm summed in another order moves y by an fp32 ulp, which flips the
// rounding of a y that lies that close to a bf16 midpoint). Where the group's largest value is such
// a value, the scale is the contract's formula of the neighbouring bf16 amax: true when `scale` is
// exactly that (fp32 scales within 2^-20 of it; UE8M0 equal to its ceiling). `amax` is the
// reference's (a bf16 value on this path).
bool RefUnfusedNeighbourScale(float amax, float scale, Fp8Format fmt, bool ue8m0);

struct SwaRefConfig {
  int64_t Q = 0, D = 0;
  float eps = 1e-6f;
  Fp8Format fmt = Fp8Format::kE4M3FN;
  bool ue8m0 = false;
};

struct SwaRefOutput {
  std::vector<uint8_t> q;        // [M, Q]
  std::vector<float> scale;      // [M, G] (logical, row-major)
  std::vector<float> amax;       // [M, G] the group amax the scale came from
  std::vector<float> v;          // [M, Q] the quantizer's input (y fused, float(bf16(y)) unfused)
  std::vector<uint16_t> kv;      // [M, D]
};

// x: bf16 [M, row_stride], q = columns [0, Q), kv = [Q, Q + D).
SwaRefOutput SwaReference(const SwaRefConfig& c, const std::vector<uint16_t>& x, int64_t row_stride,
                          int64_t M, const std::vector<uint16_t>& q_norm,
                          const std::vector<uint16_t>& kv_norm, Path path);

// out[m, n] = sum_k dequant(q[m, k]) * dequant(W[n, k]) in fp64. q_scale is [M, G] row-major,
// w_scale [N / 128, Q / 128].
std::vector<double> SwaProjectionReference(const std::vector<uint8_t>& q, const std::vector<float>& q_scale,
                                           int64_t M, int64_t Q, const std::vector<uint8_t>& w,
                                           const std::vector<float>& w_scale, int64_t N, Fp8Format fmt);

}  // namespace fusedlayer::testing
