// numeric.h (the definition of bf16_rne, fp8_rne and the UE8M0 ceiling) against independent fp64
// definitions from swa_reference.cc: every fp8 code, every tie between adjacent codes, saturation,
// NaN; bf16 ties, NaN, overflow; CeilToUe8m0 around powers of two.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>

#include "fusedlayer/numeric.h"
#include "gtest/gtest.h"
#include "swa_reference.h"
#include "test_util.h"

namespace fusedlayer::testing {
namespace {

class Fp8NumericTest : public ::testing::TestWithParam<Fp8Format> {};

uint8_t MaxCode(Fp8Format f) { return f == Fp8Format::kE4M3FN ? 0x7e : 0x7f; }
bool IsNanCode(uint8_t c, Fp8Format f) {
  return f == Fp8Format::kE4M3FN ? (c & 0x7f) == 0x7f : c == 0x80;
}

TEST_P(Fp8NumericTest, DecodeMatchesFp64TableForAllCodes) {
  const Fp8Format f = GetParam();
  for (int c = 0; c < 256; ++c) {
    const double want = RefFp8Decode(uint8_t(c), f);
    const float got = Fp8ToFloat(uint8_t(c), f);
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got)) << "code " << c;
    } else {
      EXPECT_EQ(double(got), want) << "code " << c;
      EXPECT_EQ(std::signbit(got), std::signbit(want)) << "code " << c;
    }
  }
  EXPECT_EQ(RefFp8Decode(MaxCode(f), f), RefFp8Max(f));
  EXPECT_EQ(double(Fp8Max(f)), RefFp8Max(f));
}

TEST_P(Fp8NumericTest, AllCodesRoundTrip) {
  const Fp8Format f = GetParam();
  for (int c = 0; c < 256; ++c) {
    const uint8_t code = uint8_t(c);
    const uint8_t back = FloatToFp8(Fp8ToFloat(code, f), f);
    if (IsNanCode(code, f)) {
      // NaN codes come back as the canonical NaN (e4m3fn keeps the sign).
      const uint8_t canonical = f == Fp8Format::kE4M3FN ? uint8_t((code & 0x80) | 0x7f) : uint8_t(0x80);
      EXPECT_EQ(back, canonical) << "code " << c;
    } else {
      EXPECT_EQ(back, code) << "code " << c;
    }
  }
}

TEST_P(Fp8NumericTest, TiesRoundToEvenAndNeighboursToNearest) {
  const Fp8Format f = GetParam();
  for (int c = 0; c < MaxCode(f); ++c) {
    const double lo = RefFp8Decode(uint8_t(c), f), hi = RefFp8Decode(uint8_t(c + 1), f);
    const double mid = (lo + hi) / 2;  // exact: fp8 values have 4 significant bits
    const uint8_t even = uint8_t((c & 1) ? c + 1 : c);
    for (const double sign : {1.0, -1.0}) {
      const float x = float(sign * mid);
      ASSERT_EQ(double(x), sign * mid);
      const uint8_t want = RefFp8Encode(sign * mid, f);
      // The independent encoder's tie rule, and numeric.h against it.
      EXPECT_EQ(want & 0x7f, (f == Fp8Format::kE4M3FNUZ && even == 0) ? 0 : even) << "mid of " << c;
      EXPECT_EQ(FloatToFp8(x, f), want) << "tie between codes " << c << " and " << c + 1 << " sign " << sign;
      // Just off the tie: to the nearer code.
      const float below = std::nextafter(float(mid), 0.0f), above = std::nextafter(float(mid), 1e9f);
      EXPECT_EQ(FloatToFp8(float(sign) * below, f), RefFp8Encode(sign * double(below), f));
      EXPECT_EQ(FloatToFp8(float(sign) * above, f), RefFp8Encode(sign * double(above), f));
      EXPECT_EQ(FloatToFp8(float(sign) * below, f) & 0x7f, c);
      EXPECT_EQ(FloatToFp8(float(sign) * above, f) & 0x7f, c + 1);
    }
  }
}

TEST_P(Fp8NumericTest, SaturationAndNan) {
  const Fp8Format f = GetParam();
  const float max = Fp8Max(f);
  const uint8_t mc = MaxCode(f);
  for (const float v : {max, std::nextafter(max, 1e9f), max * 1.03125f, max * 1.0625f, max * 2.0f, 1e30f,
                        std::numeric_limits<float>::max(), std::numeric_limits<float>::infinity()}) {
    EXPECT_EQ(FloatToFp8(v, f), mc) << v;
    EXPECT_EQ(FloatToFp8(-v, f), uint8_t(0x80 | mc)) << -v;
    EXPECT_EQ(RefFp8Encode(v, f), mc) << v;
  }
  const float nan = std::numeric_limits<float>::quiet_NaN();
  EXPECT_TRUE(IsNanCode(FloatToFp8(nan, f), f));
  EXPECT_TRUE(IsNanCode(FloatToFp8(-nan, f), f));
  // Zero: e4m3fn keeps the sign, e4m3fnuz has no negative zero.
  EXPECT_EQ(FloatToFp8(0.0f, f), 0);
  EXPECT_EQ(FloatToFp8(-0.0f, f), f == Fp8Format::kE4M3FN ? 0x80 : 0x00);
  EXPECT_EQ(FloatToFp8(-1e-30f, f), f == Fp8Format::kE4M3FN ? 0x80 : 0x00);
}

TEST_P(Fp8NumericTest, RandomValuesMatchIndependentEncoder) {
  const Fp8Format f = GetParam();
  auto rng = MakeRng(uint64_t(f) + 77);
  std::uniform_real_distribution<double> log_mag(-14.0, 10.0);
  std::uniform_int_distribution<int> coin(0, 1);
  for (int i = 0; i < 200000; ++i) {
    const float x = float((coin(rng) ? -1.0 : 1.0) * std::exp2(log_mag(rng)));
    ASSERT_EQ(FloatToFp8(x, f), RefFp8Encode(double(x), f)) << "x = " << x;
  }
}

INSTANTIATE_TEST_SUITE_P(Formats, Fp8NumericTest, ::testing::Values(Fp8Format::kE4M3FN, Fp8Format::kE4M3FNUZ),
                         [](const auto& info) { return std::string(Fp8FormatName(info.param)); });

float FromBits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

TEST(Bf16NumericTest, TiesRoundToEven) {
  auto rng = MakeRng(5);
  std::uniform_int_distribution<uint32_t> bits(0, 0x7f7e);  // finite, below the largest bf16
  for (int i = 0; i < 100000; ++i) {
    const uint16_t b = uint16_t(bits(rng));
    const uint32_t tie = (uint32_t(b) << 16) | 0x8000u;  // exactly halfway to b + 1
    for (const uint32_t sign : {0u, 0x80000000u}) {
      const float x = FromBits(tie | sign);
      const uint16_t even = (b & 1) ? uint16_t(b + 1) : b;
      ASSERT_EQ(FloatToBf16(x), uint16_t(even | (sign >> 16))) << std::hex << tie;
      ASSERT_EQ(RefBf16Encode(double(x)), uint16_t(even | (sign >> 16)));
      ASSERT_EQ(FloatToBf16(FromBits((tie - 1) | sign)), uint16_t(b | (sign >> 16)));
      ASSERT_EQ(FloatToBf16(FromBits((tie + 1) | sign)), uint16_t((b + 1) | (sign >> 16)));
    }
  }
}

TEST(Bf16NumericTest, RandomValuesMatchIndependentEncoder) {
  auto rng = MakeRng(6);
  std::uniform_int_distribution<uint32_t> bits(0, 0xffffffffu);
  for (int i = 0; i < 200000; ++i) {
    const float x = FromBits(bits(rng));
    if (std::isnan(x)) continue;  // NaN has its own test
    ASSERT_EQ(FloatToBf16(x), RefBf16Encode(double(x))) << "x = " << x;
    ASSERT_EQ(Bf16ToFloat(FloatToBf16(x)), float(Bf16ToFloat(RefBf16Encode(double(x)))));
  }
}

TEST(Bf16NumericTest, NanAndOverflow) {
  for (const uint32_t nan : {0x7fc00000u, 0x7f800001u, 0x7fffffffu, 0xffc00000u, 0xff800001u}) {
    const uint16_t b = FloatToBf16(FromBits(nan));
    EXPECT_TRUE(std::isnan(Bf16ToFloat(b))) << std::hex << nan;
    EXPECT_EQ(b & 0x8000, (nan >> 16) & 0x8000);
    EXPECT_EQ(b & 0x7fff, 0x7fc0);  // quiet
  }
  const float max = std::numeric_limits<float>::max();
  EXPECT_EQ(FloatToBf16(max), 0x7f80);    // rounds up past the largest bf16
  EXPECT_EQ(FloatToBf16(-max), 0xff80);
  EXPECT_EQ(FloatToBf16(FromBits(0x7f7f7fffu)), 0x7f7f);  // just below the tie to inf: largest bf16
  EXPECT_EQ(FloatToBf16(FromBits(0x7f7f8000u)), 0x7f80);  // the tie: to even, which is inf
  EXPECT_EQ(FloatToBf16(std::numeric_limits<float>::infinity()), 0x7f80);
  EXPECT_EQ(RefBf16Encode(double(max)), 0x7f80);
  EXPECT_EQ(RefBf16Encode(double(FromBits(0x7f7f8000u))), 0x7f80);
  EXPECT_EQ(RefBf16Encode(double(FromBits(0x7f7f7fffu))), 0x7f7f);
}

TEST(Ue8m0NumericTest, PowersOfTwoAndNeighbours) {
  for (int e = -126; e <= 126; ++e) {
    const float p = std::ldexp(1.0f, e);
    EXPECT_EQ(CeilToUe8m0(p), p) << e;
    EXPECT_EQ(RefCeilPow2(p), p);
    const float above = std::nextafter(p, 1e38f);
    EXPECT_EQ(CeilToUe8m0(above), 2 * p) << e;
    EXPECT_EQ(RefCeilPow2(above), 2 * p);
    if (e > -126) {
      const float below = std::nextafter(p, 0.0f);
      EXPECT_EQ(CeilToUe8m0(below), p) << e;
      EXPECT_EQ(RefCeilPow2(below), p);
    }
    const float mid = p * 1.5f;
    EXPECT_EQ(CeilToUe8m0(mid), 2 * p);
  }
  // The scale of an all-zero group, 1e-10 / MAX, rounds to a power of two above it.
  for (const Fp8Format f : {Fp8Format::kE4M3FN, Fp8Format::kE4M3FNUZ}) {
    const float s = 1e-10f / Fp8Max(f);
    EXPECT_EQ(CeilToUe8m0(s), RefCeilPow2(s));
    EXPECT_GT(CeilToUe8m0(s), s);
    EXPECT_LT(CeilToUe8m0(s), 2 * s);
  }
}

}  // namespace
}  // namespace fusedlayer::testing
