// Contract suite of the SWA op (spec/swa.md), run against every available backend through the
// Backend interface: numerics against the fp64 reference (swa_reference.h) on both paths, exact
// rounding on inputs whose fp32 chain is exact, fused versus unfused, batch invariance,
// determinism, M = 0, fused-path limits, and argument / weight validation.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "fusedlayer/backend.h"
#include "fusedlayer/numeric.h"
#include "gtest/gtest.h"
#include "swa_reference.h"
#include "test_util.h"

namespace fusedlayer::testing {
namespace {

constexpr int64_t kG = 128;


struct SwaCase {
  int64_t M = 1, Q = 256, D = 128;
  Fp8Format fmt = Fp8Format::kE4M3FN;
  ScaleFormat sf = ScaleFormat::kFp32;
  ScaleLayout sl = ScaleLayout::kRowMajor;
  int64_t N = 0;          // wq_b rows (0 = none)
  int64_t row_pad = 0;    // input row stride = Q + D + row_pad
  float eps = 1e-6f;
};

std::string Describe(const SwaCase& c) {
  return "M=" + std::to_string(c.M) + " Q=" + std::to_string(c.Q) + " D=" + std::to_string(c.D) + " " +
         Fp8FormatName(c.fmt) + " " + ScaleFormatName(c.sf) + " " + ScaleLayoutName(c.sl) +
         " N=" + std::to_string(c.N) + " pad=" + std::to_string(c.row_pad);
}

// Host data of one problem.
struct SwaProblem {
  SwaCase c;
  int64_t stride = 0;
  std::vector<uint16_t> x;  // [M, stride]
  std::vector<uint16_t> q_norm, kv_norm;
  std::vector<uint8_t> wq_b;
  std::vector<float> wq_b_scale;

  SwaHyperParams Params() const { return SwaTestParams(c.Q, c.D, c.fmt, c.sf, c.sl, c.N, c.eps); }
  SwaWeightsHost Weights() { return SwaTestWeights(q_norm, kv_norm, wq_b, wq_b_scale, c.N, c.fmt); }
  SwaRefConfig RefConfig() const {
    SwaRefConfig r;
    r.Q = c.Q;
    r.D = c.D;
    r.eps = c.eps;
    r.fmt = c.fmt;
    r.ue8m0 = c.sf == ScaleFormat::kUe8m0;
    return r;
  }
};

std::vector<uint8_t> RandomWeightCodes(std::mt19937_64& rng, size_t n, Fp8Format fmt) {
  std::vector<uint8_t> out(n);
  for (auto& b : out) b = FloatToFp8(RandomValue(rng, 64.0f, 3.0f), fmt);  // saturating: never NaN
  return out;
}

SwaProblem MakeProblem(const SwaCase& c, std::mt19937_64& rng) {
  SwaProblem p;
  p.c = c;
  p.stride = c.Q + c.D + c.row_pad;
  p.x = RandomBf16(rng, size_t(c.M * p.stride));
  p.q_norm = RandomBf16(rng, size_t(c.Q), 1.0f, 4.0f);
  p.kv_norm = RandomBf16(rng, size_t(c.D), 1.0f, 4.0f);
  if (c.N > 0) {
    p.wq_b = RandomWeightCodes(rng, size_t(c.N * c.Q), c.fmt);
    p.wq_b_scale = RandomFloat(rng, size_t((c.N / kG) * (c.Q / kG)), 1e-4f, 1e-3f);
  }
  return p;
}

// Outputs of one run, scales in logical [M, G] order.
struct SwaResult {
  std::vector<uint8_t> q;
  std::vector<float> scale;
  std::vector<float> scale_padding;  // column-major TMA: the values of rows [M, align(M, 4))
  std::vector<uint16_t> kv;
  std::vector<uint16_t> q_proj;
};

// Device tensors of one call; outputs are poisoned with NaN (e4m3fnuz: 0x80, its NaN, since the
// helper's 0xFF poison would be the valid code -240).
class SwaIo {
 public:
  SwaIo(Backend& b, const SwaProblem& p)
      : p_(p),
        x_(b, DType::kBF16, {p.c.M, p.stride}),
        q_(b, Fp8DType(p.c.fmt), {p.c.M, p.c.Q}),
        s_(b, DType::kFP32, ScaleDims(p.c)),
        kv_(b, DType::kBF16, {p.c.M, p.c.D}),
        proj_(b, DType::kBF16, {p.c.M, p.c.N}) {
    x_.Set(p.x);
  }
  static std::vector<int64_t> ScaleDims(const SwaCase& c) {
    const int64_t G = c.Q / kG;
    return c.sl == ScaleLayout::kRowMajor ? std::vector<int64_t>{c.M, G}
                                          : std::vector<int64_t>{G, AlignTo4(c.M)};
  }
  void Poison() {
    if (p_.c.fmt == Fp8Format::kE4M3FNUZ) {
      q_.Set(std::vector<uint8_t>(q_.bytes(), 0x80));
    } else {
      q_.Poison();
    }
    s_.Poison();
    kv_.Poison();
    proj_.Poison();
  }
  SwaArgs Args() const {
    SwaArgs a;
    a.tokens = p_.c.M;
    a.qr_kv = TensorView::Strided2D(x_.data(), DType::kBF16, p_.c.M, p_.c.Q + p_.c.D, p_.stride);
    a.q_fp8 = q_.view();
    a.q_scale = s_.view();
    a.kv = kv_.view();
    if (p_.c.N > 0) a.q_proj = proj_.view();
    return a;
  }
  SwaResult Fetch() {
    SwaResult r;
    const int64_t M = p_.c.M, G = p_.c.Q / kG;
    r.q = q_.Get<uint8_t>();
    const std::vector<float> s = s_.Get<float>();
    r.scale.resize(M * G);
    if (p_.c.sl == ScaleLayout::kRowMajor) {
      r.scale = s;
    } else {
      const int64_t Ma = AlignTo4(M);
      for (int64_t g = 0; g < G; ++g) {
        for (int64_t m = 0; m < Ma; ++m) {
          if (m < M) {
            r.scale[m * G + g] = s[g * Ma + m];
          } else {
            r.scale_padding.push_back(s[g * Ma + m]);
          }
        }
      }
    }
    r.kv = kv_.Get<uint16_t>();
    if (p_.c.N > 0) r.q_proj = proj_.Get<uint16_t>();
    return r;
  }
  // Raw bytes of every output, for "untouched" checks.
  std::vector<uint8_t> RawOutputs() {
    std::vector<uint8_t> all;
    for (DeviceTensor* t : {&q_, &s_, &kv_, &proj_}) {
      const std::vector<uint8_t> b = t->Get<uint8_t>();
      all.insert(all.end(), b.begin(), b.end());
    }
    return all;
  }

 private:
  const SwaProblem& p_;
  DeviceTensor x_, q_, s_, kv_, proj_;
};

std::unique_ptr<PreparedSwaWeights> Prepare(Backend& b, SwaProblem& p) {
  auto w = b.PrepareSwa(p.Params(), p.Weights());
  EXPECT_TRUE(w.ok()) << w.status();
  return w.ok() ? std::move(*w) : nullptr;
}

// Runs the op once on poisoned outputs.
SwaResult RunOnce(Backend& b, const PreparedSwaWeights& w, const SwaProblem& p, Path path) {
  SwaIo io(b, p);
  io.Poison();
  auto st = b.RunSwa(w, io.Args(), path);
  EXPECT_TRUE(st.ok()) << st.status();
  return io.Fetch();
}

float BitsFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}
float Bf16F(uint16_t b) { return BitsFloat(uint32_t(b) << 16); }

void ExpectPaddingZero(const SwaResult& r) {
  for (float v : r.scale_padding) {
    uint32_t u;
    std::memcpy(&u, &v, sizeof(u));
    ASSERT_EQ(u, 0u) << "column-major TMA padding rows must be written as 0";
  }
}

// The spec's "bitwise on >= 99.9%" is a rate, so it is asserted on the totals of a whole test (a
// TallyScope at the top of the test), not per case: in a 1-row case a single legitimate flip (the
// kernel's fp32 sum of squares puts y one fp32 ulp from the reference's, which flips a rounding
// near a tie) would already be 0.07%, and two would fail a sound kernel at random.
struct MismatchTally {
  int64_t kv_values = 0, kv_diff = 0;
  int64_t codes = 0, code_diff = 0;
  int64_t groups = 0, moved_groups = 0;
};

class TallyScope {
 public:
  TallyScope() : previous_(current_) { current_ = &tally_; }
  ~TallyScope() {
    current_ = previous_;
    EXPECT_LE(tally_.kv_diff * 1000, tally_.kv_values) << tally_.kv_diff << " of " << tally_.kv_values
                                                        << " kv values differ from the reference (> 0.1%)";
    EXPECT_LE(tally_.code_diff * 1000, tally_.codes) << tally_.code_diff << " of " << tally_.codes
                                                     << " fp8 codes differ from the reference (> 0.1%)";
    EXPECT_LE(tally_.moved_groups * 1000, std::max<int64_t>(tally_.groups, 1000))
        << tally_.moved_groups << " of " << tally_.groups << " groups moved their scale";
  }
  static MismatchTally* current() { return current_; }

 private:
  MismatchTally tally_;
  MismatchTally* previous_;
  static inline MismatchTally* current_ = nullptr;
};

// spec "Equality and tolerance", against the reference of the same path.
void CheckAgainstReference(const SwaProblem& p, const SwaResult& r, Path path) {
  const SwaCase& c = p.c;
  const int64_t M = c.M, Q = c.Q, D = c.D, G = Q / kG;
  const SwaRefOutput ref = SwaReference(p.RefConfig(), p.x, p.stride, M, p.q_norm, p.kv_norm, path);
  ExpectPaddingZero(r);
  if (c.sl == ScaleLayout::kColumnMajorTma) {
    ASSERT_EQ(int64_t(r.scale_padding.size()), (AlignTo4(M) - M) * G);
  }

  MismatchTally local;
  MismatchTally& tally = TallyScope::current() ? *TallyScope::current() : local;

  // kv: within 1 bf16 ulp everywhere, bitwise on >= 99.9% (over the test: TallyScope).
  for (int64_t i = 0; i < M * D; ++i) {
    const int d = Bf16UlpDistance(r.kv[i], ref.kv[i]);
    ASSERT_LE(d, 1) << "kv[" << i / D << ", " << i % D << "] got " << Bf16F(r.kv[i]) << " want " << Bf16F(ref.kv[i]);
    tally.kv_diff += d != 0;
  }
  tally.kv_values += M * D;

  // Scales, then codes group by group.
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t g = 0; g < G; ++g) {
      const float got = r.scale[m * G + g], want = ref.scale[m * G + g];
      ASSERT_TRUE(std::isfinite(got) && got > 0) << "scale(" << m << ", " << g << ") = " << got;
      ++tally.groups;
      const bool exact = c.sf == ScaleFormat::kFp32
                             ? std::fabs(double(got) - want) / want <= std::ldexp(1.0, -20)
                             : got == want;
      // Two scale differences follow from the contract's other clauses, and no other is allowed:
      // UE8M0 one binade off where amax / MAX is within 1 ulp of a power of two; and on the
      // unfused path, the formula of the bf16 neighbour of amax, where the group's largest value
      // is one of the 1-bf16-ulp flips the kv clause allows in the intermediate this path
      // quantizes (RefUnfusedNeighbourScale). Such a group's codes are then held to the contract's
      // formula with the scale the kernel chose (q = fp8_rne(clamp(v / scale))), so no code goes
      // unchecked, and such groups stay within 0.1% of all (TallyScope).
      bool moved = false;
      if (!exact) {
        const float amax = ref.amax[m * G + g];
        moved = (c.sf == ScaleFormat::kUe8m0 && RefUe8m0Edge(amax, c.fmt) && (got == 2 * want || 2 * got == want)) ||
                (path == Path::kUnfused && RefUnfusedNeighbourScale(amax, got, c.fmt, c.sf == ScaleFormat::kUe8m0));
        ASSERT_TRUE(moved) << ScaleFormatName(c.sf) << " scale(" << m << ", " << g << ") got " << got
                           << " want " << want << " (amax " << amax << ", relative difference "
                           << std::fabs(double(got) - want) / want << ")";
        ++tally.moved_groups;
      }
      const double fmax = RefFp8Max(c.fmt);
      for (int64_t i = m * Q + g * kG; i < m * Q + (g + 1) * kG; ++i) {
        const uint8_t want_code =
            moved ? RefFp8Encode(std::clamp(double(ref.v[i] / got), -fmax, fmax), c.fmt) : ref.q[i];
        const int d = Fp8CodeDistance(r.q[i], want_code);
        ASSERT_LE(d, 1) << "q(" << m << ", " << i % Q << ") got 0x" << std::hex << int(r.q[i]) << " want 0x"
                        << int(want_code);
        tally.code_diff += d != 0;
      }
      tally.codes += kG;
    }
  }
  if (&tally == &local) {
    EXPECT_LE(local.kv_diff, std::max<int64_t>(1, local.kv_values / 1000)) << local.kv_diff << " kv values differ";
    EXPECT_LE(local.code_diff, std::max<int64_t>(1, local.codes / 1000)) << local.code_diff << " fp8 codes differ";
    EXPECT_LE(local.moved_groups, std::max<int64_t>(1, local.groups / 1000));
  }

  // Projection against dequant(q) * dequant(W)^T in fp64, from this run's own q and scales.
  if (c.N > 0) {
    const std::vector<double> want =
        SwaProjectionReference(r.q, r.scale, M, Q, p.wq_b, p.wq_b_scale, c.N, c.fmt);
    for (int64_t i = 0; i < M * c.N; ++i) {
      const double got = Bf16F(r.q_proj[i]);
      ASSERT_LE(std::fabs(got - want[i]), 0.125 + 0.01 * std::fabs(want[i]))
          << "q_proj[" << i / c.N << ", " << i % c.N << "] got " << got << " want " << want[i];
    }
  }
}

void ExpectBitwiseEqual(const SwaResult& a, const SwaResult& b) {
  EXPECT_EQ(a.q, b.q);
  ASSERT_EQ(a.scale.size(), b.scale.size());
  EXPECT_EQ(0, std::memcmp(a.scale.data(), b.scale.data(), a.scale.size() * sizeof(float)));
  EXPECT_EQ(a.kv, b.kv);
  EXPECT_EQ(a.q_proj, b.q_proj);
}

std::string PathTag(Path p) { return p == Path::kFused ? "fused" : "unfused"; }

// ---------------------------------------------------------------------------------------------
// Suites parameterized over (backend, path).
// ---------------------------------------------------------------------------------------------
class SwaPathTest : public ::testing::TestWithParam<std::tuple<std::string, Path>> {
 protected:
  void SetUp() override {
    auto b = CreateBackend(std::get<0>(GetParam()));
    ASSERT_TRUE(b.ok()) << b.status();
    backend_ = std::move(*b);
  }
  Path path() const { return std::get<1>(GetParam()); }
  std::unique_ptr<Backend> backend_;
};

TEST_P(SwaPathTest, MatchesReferenceAcrossShapesAndFormats) {
  TallyScope tally;  // the 99.9% rules apply to the whole test
  using F = Fp8Format;
  using S = ScaleFormat;
  using L = ScaleLayout;
  const std::vector<SwaCase> cases = {
      {1, 1536, 512, F::kE4M3FN, S::kFp32, L::kRowMajor, 0, 0},
      {1, 1536, 512, F::kE4M3FNUZ, S::kUe8m0, L::kColumnMajorTma, 256, 24},
      {2, 256, 128, F::kE4M3FNUZ, S::kUe8m0, L::kColumnMajorTma, 0, 0},
      {3, 512, 192, F::kE4M3FN, S::kUe8m0, L::kColumnMajorTma, 128, 40},
      {64, 1536, 512, F::kE4M3FN, S::kFp32, L::kRowMajor, 256, 0},
      {64, 1024, 512, F::kE4M3FNUZ, S::kFp32, L::kColumnMajorTma, 256, 8},
      {1023, 512, 128, F::kE4M3FN, S::kUe8m0, L::kRowMajor, 0, 8},
      {1024, 256, 64, F::kE4M3FNUZ, S::kUe8m0, L::kColumnMajorTma, 0, 0},
      {1025, 384, 128, F::kE4M3FN, S::kFp32, L::kColumnMajorTma, 128, 0},
      {4096, 1536, 512, F::kE4M3FN, S::kUe8m0, L::kColumnMajorTma, 0, 0},
      {4096, 256, 64, F::kE4M3FNUZ, S::kFp32, L::kRowMajor, 0, 64},
  };
  auto rng = MakeRng(1);
  for (const SwaCase& c : cases) {
    SCOPED_TRACE(Describe(c));
    SwaProblem p = MakeProblem(c, rng);
    auto w = Prepare(*backend_, p);
    ASSERT_NE(w, nullptr);
    const SwaResult r = RunOnce(*backend_, *w, p, path());
    CheckAgainstReference(p, r, path());
    if (HasFatalFailure()) return;
  }
}

// Inputs built so that every fp32 step before the fp8 / bf16 conversion is exact under the
// contract's formulas: eps = 0 and each half of a row has constant magnitude 2^k, so ss / n = 4^k,
// rrms = 2^-k exactly and y = sign(x) * w. The weights then place chosen values at the quantizer:
// exact ties between fp8 codes (scale exactly 2^-8), subnormals, UE8M0 edges (amax / MAX exactly,
// just above and just below a power of two), an all-zero group and a single large outlier. Any
// backend that follows the contract must match the reference bit for bit here.
TEST_P(SwaPathTest, ExactRoundingOnExactInputs) {
  auto rng = MakeRng(2);
  for (const Fp8Format fmt : {Fp8Format::kE4M3FN, Fp8Format::kE4M3FNUZ}) {
    for (const ScaleFormat sf : {ScaleFormat::kFp32, ScaleFormat::kUe8m0}) {
      for (const ScaleLayout sl : {ScaleLayout::kRowMajor, ScaleLayout::kColumnMajorTma}) {
        SwaCase c{6, 1024, 128, fmt, sf, sl, 0, 16, 0.0f};
        SCOPED_TRACE(Describe(c));
        SwaProblem p = MakeProblem(c, rng);
        const uint8_t max_code = fmt == Fp8Format::kE4M3FN ? 0x7e : 0x7f;
        const double fmax = RefFp8Max(fmt), S = 1.0 / 256.0;
        auto bf = [](double v) {
          const uint16_t b = RefBf16Encode(v);
          EXPECT_EQ(double(Bf16F(b)), v) << "construction value not representable in bf16";
          return b;
        };
        std::uniform_int_distribution<int> code(0, max_code - 1), pos(1, kG - 1), coin(0, 1);
        std::uniform_real_distribution<double> frac(0.01, 0.9);
        const uint16_t amax_exact = bf(fmax * S);
        const uint16_t amax_above = uint16_t(amax_exact + 1);  // next bf16 up
        const uint16_t amax_below = uint16_t(amax_exact - 1);  // next bf16 down
        std::vector<uint16_t>& w = p.q_norm;
        for (int64_t g = 0; g < 8; ++g) {
          uint16_t* wg = w.data() + g * kG;
          for (int64_t i = 0; i < kG; ++i) {
            const int k = code(rng);
            const double sgn = coin(rng) ? -1.0 : 1.0;
            const double lo = RefFp8Decode(uint8_t(k), fmt), hi = RefFp8Decode(uint8_t(k + 1), fmt);
            switch (g) {
              case 0: wg[i] = bf(sgn * (lo + hi) / 2 * S); break;  // exact ties (incl. subnormal ones)
              case 1: wg[i] = bf(sgn * lo * S); break;             // exact codes
              case 5: wg[i] = FloatToBf16(RandomValue(rng, 0.01f, 4.0f)); break;
              case 6: wg[i] = 0; break;                            // all-zero group
              case 7: wg[i] = FloatToBf16(RandomValue(rng, 0.3f, 4.0f)); break;
              default: wg[i] = FloatToBf16(float(sgn * frac(rng) * fmax * S)); break;  // |w| < amax
            }
          }
        }
        w[0 * kG] = amax_exact;
        w[1 * kG] = amax_exact;
        w[2 * kG + 7] = amax_above;  // amax / MAX just above 2^-8: UE8M0 goes to 2^-7
        w[3 * kG + 9] = amax_exact;  // amax / MAX exactly 2^-8
        w[4 * kG + 3] = amax_below;  // just below: UE8M0 rounds up to 2^-8
        w[5 * kG + pos(rng)] = bf(96.0);  // one large outlier
        for (int64_t m = 0; m < c.M; ++m) {
          const double mag = std::ldexp(1.0, int(m % 5) - 2);
          for (int64_t i = 0; i < c.Q + c.D; ++i) {
            // Group 6's x are positive so that y = +0 there (codes 0x00, not -0).
            const bool pos_only = i >= 6 * kG && i < 7 * kG;
            p.x[m * p.stride + i] = bf((pos_only || coin(rng)) ? mag : -mag);
          }
        }
        auto wts = Prepare(*backend_, p);
        ASSERT_NE(wts, nullptr);
        const SwaResult r = RunOnce(*backend_, *wts, p, path());
        const SwaRefOutput ref = SwaReference(p.RefConfig(), p.x, p.stride, c.M, p.q_norm, p.kv_norm, path());
        ExpectPaddingZero(r);
        for (int64_t i = 0; i < c.M * c.Q; ++i) {
          ASSERT_EQ(r.q[i], ref.q[i]) << "q(" << i / c.Q << ", " << i % c.Q << ")";
        }
        for (int64_t i = 0; i < int64_t(ref.scale.size()); ++i) {
          ASSERT_EQ(r.scale[i], ref.scale[i]) << "scale(" << i / 8 << ", " << i % 8 << ")";
        }
        EXPECT_EQ(r.kv, ref.kv);
        // The constructed groups really sit where intended.
        for (int64_t m = 0; m < c.M; ++m) {
          const float* s = ref.scale.data() + m * 8;
          EXPECT_EQ(s[3], float(S));
          EXPECT_EQ(s[6], sf == ScaleFormat::kFp32 ? float(1e-10f / float(fmax)) : RefCeilPow2(1e-10f / float(fmax)));
          for (int64_t i = 6 * kG; i < 7 * kG; ++i) EXPECT_EQ(r.q[m * c.Q + i], 0);
          if (sf == ScaleFormat::kUe8m0) {
            EXPECT_EQ(s[2], float(2 * S));
            EXPECT_EQ(s[4], float(S));
          } else {
            EXPECT_GT(s[2], float(S));
            EXPECT_LT(s[4], float(S));
          }
        }
      }
    }
  }
}

// Random inputs with an all-zero group and a group holding one huge outlier in every row.
TEST_P(SwaPathTest, ZeroGroupsAndOutliers) {
  TallyScope tally;  // the 99.9% rules apply to the whole test
  auto rng = MakeRng(3);
  for (const Fp8Format fmt : {Fp8Format::kE4M3FN, Fp8Format::kE4M3FNUZ}) {
    for (const ScaleFormat sf : {ScaleFormat::kFp32, ScaleFormat::kUe8m0}) {
      SwaCase c{37, 768, 128, fmt, sf, ScaleLayout::kColumnMajorTma, 128, 0};
      SCOPED_TRACE(Describe(c));
      SwaProblem p = MakeProblem(c, rng);
      const int64_t G = c.Q / kG;
      for (int64_t m = 0; m < c.M; ++m) {
        const int64_t zg = m % G, og = (m + 1) % G;
        std::fill_n(p.x.begin() + m * p.stride + zg * kG, kG, uint16_t(0));
        const int64_t at = m * p.stride + og * kG + (m * 37) % kG;
        p.x[at] = FloatToBf16(Bf16F(p.x[at]) * 4096.0f);
      }
      auto w = Prepare(*backend_, p);
      ASSERT_NE(w, nullptr);
      const SwaResult r = RunOnce(*backend_, *w, p, path());
      CheckAgainstReference(p, r, path());
      const float zero_scale = 1e-10f / Fp8Max(fmt);
      for (int64_t m = 0; m < c.M; ++m) {
        const int64_t zg = m % G;
        EXPECT_EQ(r.scale[m * G + zg], sf == ScaleFormat::kFp32 ? zero_scale : RefCeilPow2(zero_scale));
        for (int64_t i = 0; i < kG; ++i) {
          // y = (+0 * rrms) * w is a zero with w's sign; e4m3fn keeps it (-0 = 0x80), e4m3fnuz has
          // no negative zero.
          const bool neg_w = (p.q_norm[zg * kG + i] & 0x8000) != 0;
          ASSERT_EQ(r.q[m * c.Q + zg * kG + i], (neg_w && fmt == Fp8Format::kE4M3FN) ? 0x80 : 0x00);
        }
      }
    }
  }
}

// A token's outputs are bitwise identical alone and at any position of batches of 7, 64 and 1023.
TEST_P(SwaPathTest, BatchInvariance) {
  auto rng = MakeRng(4);
  const std::vector<SwaCase> configs = {
      {1, 512, 128, Fp8Format::kE4M3FN, ScaleFormat::kUe8m0, ScaleLayout::kColumnMajorTma, 256, 8},
      {1, 1536, 512, Fp8Format::kE4M3FNUZ, ScaleFormat::kFp32, ScaleLayout::kRowMajor, 128, 0},
  };
  for (const SwaCase& base : configs) {
    SCOPED_TRACE(Describe(base));
    SwaProblem alone = MakeProblem(base, rng);
    auto w = Prepare(*backend_, alone);
    ASSERT_NE(w, nullptr);
    const SwaResult r1 = RunOnce(*backend_, *w, alone, path());
    const int64_t Q = base.Q, D = base.D, N = base.N, G = Q / kG;
    for (const int64_t B : {7, 64, 1023}) {
      for (const int64_t at : {int64_t{0}, B / 2, B - 1}) {
        SCOPED_TRACE("batch " + std::to_string(B) + " position " + std::to_string(at));
        SwaCase bc = base;
        bc.M = B;
        SwaProblem batch = MakeProblem(bc, rng);
        // Same weights, the lone token's row at `at`.
        batch.q_norm = alone.q_norm;
        batch.kv_norm = alone.kv_norm;
        batch.wq_b = alone.wq_b;
        batch.wq_b_scale = alone.wq_b_scale;
        std::copy_n(alone.x.begin(), alone.stride, batch.x.begin() + at * batch.stride);
        const SwaResult rb = RunOnce(*backend_, *w, batch, path());
        ASSERT_TRUE(std::equal(r1.q.begin(), r1.q.end(), rb.q.begin() + at * Q));
        ASSERT_EQ(0, std::memcmp(r1.scale.data(), rb.scale.data() + at * G, G * sizeof(float)));
        ASSERT_TRUE(std::equal(r1.kv.begin(), r1.kv.end(), rb.kv.begin() + at * D));
        ASSERT_TRUE(std::equal(r1.q_proj.begin(), r1.q_proj.end(), rb.q_proj.begin() + at * N));
      }
    }
  }
}

TEST_P(SwaPathTest, RepeatedRunsAreBitwiseEqual) {
  auto rng = MakeRng(5);
  SwaCase c{1025, 1536, 512, Fp8Format::kE4M3FN, ScaleFormat::kUe8m0, ScaleLayout::kColumnMajorTma, 256, 0};
  SwaProblem p = MakeProblem(c, rng);
  auto w = Prepare(*backend_, p);
  ASSERT_NE(w, nullptr);
  const SwaResult first = RunOnce(*backend_, *w, p, path());
  for (int i = 0; i < 2; ++i) ExpectBitwiseEqual(first, RunOnce(*backend_, *w, p, path()));
}

TEST_P(SwaPathTest, ZeroTokensIsOk) {
  auto rng = MakeRng(6);
  for (const ScaleLayout sl : {ScaleLayout::kRowMajor, ScaleLayout::kColumnMajorTma}) {
    SwaCase c{0, 512, 128, Fp8Format::kE4M3FN, ScaleFormat::kFp32, sl, 128, 0};
    SwaProblem p = MakeProblem(c, rng);
    auto w = Prepare(*backend_, p);
    ASSERT_NE(w, nullptr);
    SwaIo io(*backend_, p);
    auto st = backend_->RunSwa(*w, io.Args(), path());
    EXPECT_TRUE(st.ok()) << st.status();
  }
}

TEST_P(SwaPathTest, InvalidArgumentsLeaveOutputsUntouched) {
  auto rng = MakeRng(7);
  SwaCase c{5, 512, 128, Fp8Format::kE4M3FN, ScaleFormat::kUe8m0, ScaleLayout::kColumnMajorTma, 128, 8};
  SwaProblem p = MakeProblem(c, rng);
  auto w = Prepare(*backend_, p);
  ASSERT_NE(w, nullptr);
  SwaIo io(*backend_, p);
  const int64_t M = c.M, Q = c.Q, D = c.D, G = Q / kG;
  struct Mutation {
    const char* what;
    void (*apply)(SwaArgs&, int64_t M, int64_t Q, int64_t D, int64_t G);
  };
  const std::vector<Mutation> mutations = {
      {"negative tokens", [](SwaArgs& a, int64_t, int64_t, int64_t, int64_t) { a.tokens = -1; }},
      {"tokens disagree with tensors", [](SwaArgs& a, int64_t, int64_t, int64_t, int64_t) { a.tokens += 1; }},
      {"qr_kv dtype", [](SwaArgs& a, int64_t, int64_t, int64_t, int64_t) { a.qr_kv.dtype = DType::kFP32; }},
      {"qr_kv width", [](SwaArgs& a, int64_t, int64_t, int64_t, int64_t) { a.qr_kv.shape[1] += 1; }},
      {"qr_kv row stride < Q + D",
       [](SwaArgs& a, int64_t, int64_t Q, int64_t D, int64_t) { a.qr_kv.stride[0] = Q + D - 1; }},
      {"qr_kv column stride", [](SwaArgs& a, int64_t, int64_t, int64_t, int64_t) { a.qr_kv.stride[1] = 2; }},
      {"qr_kv missing", [](SwaArgs& a, int64_t, int64_t, int64_t, int64_t) { a.qr_kv.data = nullptr; }},
      {"q_fp8 wrong fp8 format",
       [](SwaArgs& a, int64_t, int64_t, int64_t, int64_t) { a.q_fp8.dtype = DType::kFP8E4M3FNUZ; }},
      {"q_fp8 shape", [](SwaArgs& a, int64_t, int64_t, int64_t, int64_t) { a.q_fp8.shape[1] -= 128; }},
      {"q_scale row-major shape for a column-major weight set",
       [](SwaArgs& a, int64_t M, int64_t, int64_t, int64_t G) {
         a.q_scale.shape = {M, G, 0, 0};
         a.q_scale.stride = {G, 1, 0, 0};
       }},
      {"q_scale unpadded column-major", [](SwaArgs& a, int64_t M, int64_t, int64_t, int64_t G) {
         a.q_scale.shape = {G, M, 0, 0};
         a.q_scale.stride = {M, 1, 0, 0};
       }},
      {"q_scale dtype", [](SwaArgs& a, int64_t, int64_t, int64_t, int64_t) { a.q_scale.dtype = DType::kBF16; }},
      {"kv shape", [](SwaArgs& a, int64_t, int64_t, int64_t, int64_t) { a.kv.shape[1] += 1; }},
      {"kv not contiguous", [](SwaArgs& a, int64_t, int64_t, int64_t D, int64_t) { a.kv.stride[0] = D + 8; }},
      {"q_proj missing with wq_b", [](SwaArgs& a, int64_t, int64_t, int64_t, int64_t) { a.q_proj = TensorView(); }},
      {"q_proj shape", [](SwaArgs& a, int64_t, int64_t, int64_t, int64_t) { a.q_proj.shape[1] -= 128; }},
  };
  for (const Mutation& mu : mutations) {
    SCOPED_TRACE(mu.what);
    io.Poison();
    const std::vector<uint8_t> before = io.RawOutputs();
    SwaArgs a = io.Args();
    mu.apply(a, M, Q, D, G);
    auto st = backend_->RunSwa(*w, a, path());
    EXPECT_EQ(st.status().code(), absl::StatusCode::kInvalidArgument) << st.status();
    EXPECT_EQ(io.RawOutputs(), before) << "outputs written despite invalid arguments";
  }

  // q_proj given to a weight set without wq_b.
  SwaCase c2 = c;
  c2.N = 0;
  SwaProblem p2 = MakeProblem(c2, rng);
  auto w2 = Prepare(*backend_, p2);
  ASSERT_NE(w2, nullptr);
  SwaIo io2(*backend_, p2);
  io2.Poison();
  const std::vector<uint8_t> before = io2.RawOutputs();
  SwaArgs a = io2.Args();
  a.q_proj = io.Args().q_proj;
  auto st = backend_->RunSwa(*w2, a, path());
  EXPECT_EQ(st.status().code(), absl::StatusCode::kInvalidArgument) << st.status();
  EXPECT_EQ(io2.RawOutputs(), before);
}

INSTANTIATE_TEST_SUITE_P(Backends, SwaPathTest,
                         ::testing::Combine(::testing::ValuesIn(AvailableBackends()),
                                            ::testing::Values(Path::kFused, Path::kUnfused)),
                         [](const auto& info) {
                           return std::get<0>(info.param) + "_" + PathTag(std::get<1>(info.param));
                         });

// ---------------------------------------------------------------------------------------------
// Suites parameterized over the backend only.
// ---------------------------------------------------------------------------------------------
class SwaBackendTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    auto b = CreateBackend(GetParam());
    ASSERT_TRUE(b.ok()) << b.status();
    backend_ = std::move(*b);
  }
  std::unique_ptr<Backend> backend_;
};

// The paths differ by design (single versus double rounding) but only within the contract's bounds.
TEST_P(SwaBackendTest, FusedVersusUnfused) {
  auto rng = MakeRng(8);
  for (const Fp8Format fmt : {Fp8Format::kE4M3FN, Fp8Format::kE4M3FNUZ}) {
    for (const ScaleFormat sf : {ScaleFormat::kFp32, ScaleFormat::kUe8m0}) {
      SwaCase c{1024, 1536, 512, fmt, sf, ScaleLayout::kRowMajor, 0, 0};
      SCOPED_TRACE(Describe(c));
      SwaProblem p = MakeProblem(c, rng);
      auto w = Prepare(*backend_, p);
      ASSERT_NE(w, nullptr);
      const SwaResult f = RunOnce(*backend_, *w, p, Path::kFused);
      const SwaResult u = RunOnce(*backend_, *w, p, Path::kUnfused);
      EXPECT_EQ(f.kv, u.kv) << "kv must be bitwise equal across paths";
      const int64_t M = c.M, Q = c.Q, G = Q / kG;
      int64_t diff = 0;
      for (int64_t m = 0; m < M; ++m) {
        for (int64_t g = 0; g < G; ++g) {
          const float sfu = f.scale[m * G + g], suu = u.scale[m * G + g];
          const bool same_scale = sfu == suu;
          if (sf == ScaleFormat::kUe8m0) {
            ASSERT_TRUE(same_scale || sfu == 2 * suu || 2 * sfu == suu)
                << "scales more than one binade apart: " << sfu << " vs " << suu;
          }
          for (int64_t i = m * Q + g * kG; i < m * Q + (g + 1) * kG; ++i) {
            if (sf == ScaleFormat::kFp32 || same_scale) {
              const int d = Fp8CodeDistance(f.q[i], u.q[i]);
              ASSERT_LE(d, 1) << "token " << m << " column " << i % Q;
              diff += d != 0;
            } else {
              // A group moved one binade: the dequantized values still agree to within the
              // quantization error of the coarser scale.
              const double df = RefFp8Decode(f.q[i], fmt) * sfu, du = RefFp8Decode(u.q[i], fmt) * suu;
              const double bound = 0.125 * std::max(std::fabs(df), std::fabs(du)) + std::max(sfu, suu) / 256.0;
              ASSERT_LE(std::fabs(df - du), bound) << "token " << m << " column " << i % Q;
            }
          }
        }
      }
      if (sf == ScaleFormat::kFp32) {
        EXPECT_LE(double(diff), 0.03 * double(M * Q)) << diff << " codes differ";
      }
    }
  }
}

TEST_P(SwaBackendTest, FusedPathLimits) {
  TallyScope tally;  // the 99.9% rules apply to the whole test
  auto rng = MakeRng(9);
  BackendOptions opts;
  opts.fused_max_tokens = 8;
  auto limited = CreateBackend(GetParam(), opts);
  ASSERT_TRUE(limited.ok()) << limited.status();
  Backend& b = **limited;

  // Token limit.
  {
    SwaCase c{9, 256, 128, Fp8Format::kE4M3FN, ScaleFormat::kFp32, ScaleLayout::kRowMajor, 0, 0};
    SwaProblem p = MakeProblem(c, rng);
    auto w = Prepare(b, p);
    ASSERT_NE(w, nullptr);
    EXPECT_TRUE(b.SwaFusedSupport(*w, SwaShapeQuery{8}).supported);
    const FusedSupport s = b.SwaFusedSupport(*w, SwaShapeQuery{9});
    EXPECT_FALSE(s.supported);
    EXPECT_EQ(s.reason, FallbackReason::kTooManyTokens);
    EXPECT_FALSE(s.detail.empty());
    SwaIo io(b, p);
    io.Poison();
    const std::vector<uint8_t> before = io.RawOutputs();
    auto st = b.RunSwa(*w, io.Args(), Path::kFused);
    EXPECT_EQ(st.status().code(), absl::StatusCode::kFailedPrecondition) << st.status();
    EXPECT_EQ(io.RawOutputs(), before);
    CheckAgainstReference(p, RunOnce(b, *w, p, Path::kUnfused), Path::kUnfused);
  }

  // head_dim off the fused kernel's tile (the CPU kernel's is 64): unfused still serves it.
  {
    SwaCase c{5, 256, 96, Fp8Format::kE4M3FNUZ, ScaleFormat::kUe8m0, ScaleLayout::kColumnMajorTma, 0, 0};
    SwaProblem p = MakeProblem(c, rng);
    auto w = Prepare(b, p);
    ASSERT_NE(w, nullptr);
    const FusedSupport s = b.SwaFusedSupport(*w, SwaShapeQuery{5});
    if (GetParam() == "cpu") {
      EXPECT_FALSE(s.supported) << "the CPU fused kernel needs head_dim % 64 == 0";
    }
    if (!s.supported) {
      EXPECT_EQ(s.reason, FallbackReason::kHiddenSizeUnsupported);
      SwaIo io(b, p);
      io.Poison();
      const std::vector<uint8_t> before = io.RawOutputs();
      auto st = b.RunSwa(*w, io.Args(), Path::kFused);
      EXPECT_EQ(st.status().code(), absl::StatusCode::kFailedPrecondition) << st.status();
      EXPECT_EQ(io.RawOutputs(), before);
    }
    CheckAgainstReference(p, RunOnce(b, *w, p, Path::kUnfused), Path::kUnfused);
  }

  // The DeepSeek shapes are fused-supported.
  for (const int64_t Q : {1536, 1024, 1280}) {
    SwaCase c{1, Q, 512, Fp8Format::kE4M3FN, ScaleFormat::kFp32, ScaleLayout::kRowMajor, 0, 0};
    SwaProblem p = MakeProblem(c, rng);
    auto w = Prepare(*backend_, p);
    ASSERT_NE(w, nullptr);
    EXPECT_TRUE(backend_->SwaFusedSupport(*w, SwaShapeQuery{4096}).supported) << "Q = " << Q;
  }
}

TEST_P(SwaBackendTest, PrepareRejectsBadWeights) {
  auto rng = MakeRng(10);
  SwaCase c{1, 256, 128, Fp8Format::kE4M3FN, ScaleFormat::kFp32, ScaleLayout::kRowMajor, 128, 0};
  SwaProblem p = MakeProblem(c, rng);
  struct Bad {
    const char* what;
    SwaHyperParams params;
    SwaWeightsHost weights;
  };
  std::vector<Bad> bads;
  auto add = [&](const char* what, auto mutate) {
    Bad b{what, p.Params(), p.Weights()};
    mutate(b.params, b.weights);
    bads.push_back(b);
  };
  add("q_rank not a multiple of 128", [](SwaHyperParams& pr, SwaWeightsHost&) { pr.q_rank = 200; });
  add("head_dim 0", [](SwaHyperParams& pr, SwaWeightsHost&) { pr.head_dim = 0; });
  add("negative eps", [](SwaHyperParams& pr, SwaWeightsHost&) { pr.eps = -1e-6f; });
  add("wq_b rows not a multiple of 128", [](SwaHyperParams& pr, SwaWeightsHost&) { pr.wq_b_rows = 100; });
  add("q_norm size", [](SwaHyperParams&, SwaWeightsHost& w) { w.q_norm.shape[0] = 255; });
  add("q_norm dtype", [](SwaHyperParams&, SwaWeightsHost& w) { w.q_norm.dtype = DType::kFP32; });
  add("q_norm missing", [](SwaHyperParams&, SwaWeightsHost& w) { w.q_norm = TensorView(); });
  add("kv_norm size", [](SwaHyperParams&, SwaWeightsHost& w) { w.kv_norm.shape[0] = 64; });
  add("wq_b missing", [](SwaHyperParams&, SwaWeightsHost& w) { w.wq_b = TensorView(); });
  add("wq_b fp8 format differs from the weight set's",
      [](SwaHyperParams&, SwaWeightsHost& w) { w.wq_b.dtype = DType::kFP8E4M3FNUZ; });
  add("wq_b shape", [](SwaHyperParams&, SwaWeightsHost& w) { w.wq_b.shape[1] = 128; w.wq_b.stride[0] = 128; });
  add("wq_b_scale shape", [](SwaHyperParams&, SwaWeightsHost& w) { w.wq_b_scale.shape[1] = 1; });
  add("wq_b_scale missing", [](SwaHyperParams&, SwaWeightsHost& w) { w.wq_b_scale = TensorView(); });
  add("wq_b given without wq_b_rows", [](SwaHyperParams& pr, SwaWeightsHost&) { pr.wq_b_rows = 0; });
  add("wq_b_scale given without wq_b", [](SwaHyperParams& pr, SwaWeightsHost& w) {
    pr.wq_b_rows = 0;
    w.wq_b = TensorView();
  });
  const std::vector<float> bad_values = {0.0f, -1e-3f, std::nanf(""), INFINITY};
  std::vector<std::vector<float>> scale_copies(bad_values.size(), p.wq_b_scale);  // sized once: stable data()
  for (size_t i = 0; i < bad_values.size(); ++i) {
    scale_copies[i][1] = bad_values[i];
    Bad b{"wq_b_scale value not finite and > 0", p.Params(), p.Weights()};
    b.weights.wq_b_scale.data = scale_copies[i].data();
    bads.push_back(b);
  }
  for (Bad& b : bads) {
    SCOPED_TRACE(b.what);
    auto w = backend_->PrepareSwa(b.params, b.weights);
    EXPECT_EQ(w.status().code(), absl::StatusCode::kInvalidArgument) << w.status();
  }
  // And the untouched set is accepted, with its bytes accounted.
  auto ok = backend_->PrepareSwa(p.Params(), p.Weights());
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_GE((*ok)->resident_bytes(), size_t(c.Q * 2 + c.D * 2 + c.N * c.Q + (c.N / kG) * (c.Q / kG) * 4));
  EXPECT_EQ((*ok)->params().wq_b_rows, c.N);
}

INSTANTIATE_TEST_SUITE_P(Backends, SwaBackendTest, ::testing::ValuesIn(AvailableBackends()),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace fusedlayer::testing
