// Contract suite for the mHC seam (spec/mhc.md), run against every backend present through the
// Backend interface, on both paths wherever the backend's fused path supports the shape.
//
// What is asserted (spec "Equality and tolerance"):
//   - new_residual: bitwise equal to the reference (whose Post is the contract's fp32 FMA chain),
//     hence bitwise equal between paths and backends.
//   - mixes: |got - ref| <= 1e-5 + 1e-4 |ref| against the fp64 reference, on every path.
//   - shifted-mode y (and first/head y, which depend only on R' and given inputs): bitwise fused vs
//     unfused; within 1 bf16 ulp of the reference.
//   - normal-mode y: against the reference, within 1 ulp on >= 99.9% of elements and every element
//     within the spec's element-wise bound 2 ulp(y) + rho |g| (ulp(z) + sum_j (1e-5 + 1e-4 pre'_j)
//     |R'_j|) (the mixes tolerance carried through the collapse, which may cancel); fused vs
//     unfused within twice that bound (CheckNormalModeY in mhc_reference.h).
//   - aux: within 1 ulp of the reference and between paths.
//   - Batch invariance and determinism: bitwise, every output.
//   - Bad input: InvalidArgument (FailedPrecondition for an unsupported fused request) with every
//     output still NaN-poisoned.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "fusedlayer/backend.h"
#include "fusedlayer/numeric.h"
#include "gtest/gtest.h"
#include "mhc_cpu.h"  // SetMhcCpuAvx512ForTesting
#include "mhc_reference.h"
#include "test_util.h"

namespace fusedlayer::testing {
namespace {

// ---------------------------------------------------------------------------------------------
// Problems: hyper-parameters, weights and inputs, drawn fresh for every case.
// ---------------------------------------------------------------------------------------------
struct Case {
  MhcStage stage = MhcStage::kSeam;
  MhcMode mode = MhcMode::kShifted;
  int n = 4;
  int64_t C = 512;
  int64_t T = 3;
  int iters = 20;
  bool pre_mix = true;
  bool norm = true;
  bool aux = false;
  bool non_default_eps = false;  // the vLLM test's hyper-parameters instead of the defaults

  std::string Name() const {
    return absl::StrCat(MhcStageName(stage), "/", MhcModeName(mode), " n=", n, " C=", C, " T=", T,
                        " iters=", iters, pre_mix ? " pre_mix" : " no_pre_mix", norm ? " norm" : " no_norm",
                        aux ? " aux" : "", non_default_eps ? " eps*" : "");
  }
};

struct Problem {
  MhcHyperParams hp;
  MhcRefWeights w;
  MhcRefInputs in;
};

Problem MakeProblem(const Case& k, std::mt19937_64& rng) {
  Problem p;
  p.hp.hc_mult = k.n;
  p.hp.hidden = k.C;
  p.hp.sinkhorn_iters = k.iters;
  if (k.non_default_eps) {
    p.hp.hc_norm_eps = 2e-5f;
    p.hp.hc_pre_eps = 3e-4f;
    p.hp.post_scale = 1.25f;
    p.hp.sinkhorn_eps = 2e-6f;
    p.hp.norm_eps = 7e-6f;
  }
  const int n = k.n;
  const int64_t C = k.C, K = n * C, M = p.hp.num_mixes(), T = k.T;
  p.w.fn.resize(M * K);
  for (auto& f : p.w.fn) f = RandomValue(rng, 1e-2f);
  p.w.scale = RandomFloat(rng, 3, 0.5f, 2.0f);
  p.w.base = RandomFloat(rng, M, -1.0f, 1.0f);
  if (k.norm) p.w.norm_weight = RandomBf16(rng, C);

  p.in.stage = k.stage;
  p.in.mode = k.mode;
  p.in.capture_aux = k.aux;
  p.in.tokens = T;
  p.in.x = RandomBf16(rng, T * C);
  if (k.stage != MhcStage::kFirst) {
    p.in.residual = RandomBf16(rng, T * K);
    p.in.post_mix = RandomFloat(rng, T * n, 0.2f, 2.0f);
    p.in.comb_mix = RandomFloat(rng, T * n * n, 0.05f, 1.0f);
    // Normal mode must ignore a pre_mix it is given: pass one there too.
    if (k.pre_mix) p.in.pre_mix = RandomFloat(rng, T * n, 0.1f, 1.5f);
  }
  return p;
}

// Tokens [start, start + count) of a problem, same weights.
Problem Slice(const Problem& p, int64_t start, int64_t count) {
  Problem s = p;
  const int64_t n = p.hp.hc_mult, C = p.hp.hidden;
  auto cut = [&](const auto& v, int64_t per_token) {
    using V = std::decay_t<decltype(v)>;
    if (v.empty()) return V();
    return V(v.begin() + start * per_token, v.begin() + (start + count) * per_token);
  };
  s.in.tokens = count;
  s.in.x = cut(p.in.x, C);
  s.in.residual = cut(p.in.residual, n * C);
  s.in.post_mix = cut(p.in.post_mix, n);
  s.in.comb_mix = cut(p.in.comb_mix, n * n);
  s.in.pre_mix = cut(p.in.pre_mix, n);
  return s;
}

// ---------------------------------------------------------------------------------------------
// Running a problem on a backend.
// ---------------------------------------------------------------------------------------------
struct Outputs {
  std::vector<uint16_t> new_residual, y, aux;
  std::vector<float> pre, post, comb;
};

std::unique_ptr<DeviceTensor> Tensor(Backend& b, DType dt, std::vector<int64_t> dims) {
  return std::make_unique<DeviceTensor>(b, dt, std::move(dims));
}

absl::StatusOr<std::unique_ptr<PreparedMhcWeights>> Prepare(Backend& b, const Problem& p) {
  const int64_t M = p.hp.num_mixes(), K = p.hp.flat_width();
  MhcWeightsHost wh;
  wh.fn = TensorView::Contiguous(const_cast<float*>(p.w.fn.data()), DType::kFP32, {M, K});
  wh.scale = TensorView::Contiguous(const_cast<float*>(p.w.scale.data()), DType::kFP32, {3});
  wh.base = TensorView::Contiguous(const_cast<float*>(p.w.base.data()), DType::kFP32, {M});
  if (!p.w.norm_weight.empty()) {
    wh.norm_weight =
        TensorView::Contiguous(const_cast<uint16_t*>(p.w.norm_weight.data()), DType::kBF16, {p.hp.hidden});
  }
  return b.PrepareMhc(p.hp, wh);
}

// Device tensors of one call; outputs are poisoned. `args` may be edited (bad-input tests) before Run.
struct Call {
  std::vector<std::unique_ptr<DeviceTensor>> inputs;
  std::unique_ptr<DeviceTensor> new_residual, pre, post, comb, y, aux;
  MhcArgs args;

  Call(Backend& b, const Problem& p) {
    const int64_t T = p.in.tokens, n = p.hp.hc_mult, C = p.hp.hidden;
    args.stage = p.in.stage;
    args.mode = p.in.mode;
    args.capture_aux = p.in.capture_aux;
    args.tokens = T;
    auto input = [&](const auto& host, DType dt, std::vector<int64_t> dims) {
      auto t = Tensor(b, dt, std::move(dims));
      t->Set(host);
      TensorView v = t->view();
      inputs.push_back(std::move(t));
      return v;
    };
    args.x = input(p.in.x, DType::kBF16, {T, C});
    if (p.in.stage != MhcStage::kFirst) {
      args.residual = input(p.in.residual, DType::kBF16, {T, n, C});
      args.post_mix = input(p.in.post_mix, DType::kFP32, {T, n});
      args.comb_mix = input(p.in.comb_mix, DType::kFP32, {T, n, n});
      if (!p.in.pre_mix.empty()) args.pre_mix = input(p.in.pre_mix, DType::kFP32, {T, n});
    }
    new_residual = Tensor(b, DType::kBF16, {T, n, C});
    args.new_residual = new_residual->view();
    if (p.in.stage != MhcStage::kHead) {
      pre = Tensor(b, DType::kFP32, {T, n});
      post = Tensor(b, DType::kFP32, {T, n});
      comb = Tensor(b, DType::kFP32, {T, n, n});
      args.new_pre_mix = pre->view();
      args.new_post_mix = post->view();
      args.new_comb_mix = comb->view();
    }
    y = Tensor(b, DType::kBF16, {T, C});
    args.y = y->view();
    if (p.in.capture_aux) {
      aux = Tensor(b, DType::kBF16, {T, C});
      args.aux = aux->view();
    }
    Poison();
  }

  std::vector<DeviceTensor*> outputs() const {
    std::vector<DeviceTensor*> o;
    for (auto* t : {new_residual.get(), pre.get(), post.get(), comb.get(), y.get(), aux.get()}) {
      if (t != nullptr) o.push_back(t);
    }
    return o;
  }
  void Poison() {
    for (DeviceTensor* t : outputs()) t->Poison();
  }
  // True when every output byte still holds the 0xFF poison.
  bool Untouched() const {
    for (DeviceTensor* t : outputs()) {
      for (uint8_t v : t->Get<uint8_t>()) {
        if (v != 0xff) return false;
      }
    }
    return true;
  }
  Outputs Fetch() const {
    Outputs o;
    o.new_residual = new_residual->Get<uint16_t>();
    o.y = y->Get<uint16_t>();
    if (aux) o.aux = aux->Get<uint16_t>();
    if (pre) {
      o.pre = pre->Get<float>();
      o.post = post->Get<float>();
      o.comb = comb->Get<float>();
    }
    return o;
  }
};

absl::StatusOr<Outputs> RunProblem(Backend& b, const PreparedMhcWeights& w, const Problem& p, Path path) {
  Call call(b, p);
  auto st = b.RunMhc(w, call.args, path);
  if (!st.ok()) return st.status();
  return call.Fetch();
}

MhcShapeQuery QueryOf(const Problem& p) {
  MhcShapeQuery q;
  q.stage = p.in.stage;
  q.mode = p.in.mode;
  q.capture_aux = p.in.capture_aux;
  q.tokens = p.in.tokens;
  return q;
}

// ---------------------------------------------------------------------------------------------
// Comparisons.
// ---------------------------------------------------------------------------------------------
::testing::AssertionResult BitwiseEqual(const char* what, const std::vector<uint16_t>& got,
                                        const std::vector<uint16_t>& want) {
  if (got.size() != want.size()) return ::testing::AssertionFailure() << what << ": size mismatch";
  size_t bad = 0, first = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (got[i] != want[i] && bad++ == 0) first = i;
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << what << ": " << bad << " of " << got.size() << " differ; first at "
                                       << first << " got 0x" << std::hex << got[first] << " want 0x"
                                       << want[first];
}

::testing::AssertionResult BitwiseEqualF(const char* what, const std::vector<float>& got,
                                         const std::vector<float>& want) {
  if (got.size() != want.size() ||
      (!got.empty() && std::memcmp(got.data(), want.data(), got.size() * sizeof(float)) != 0)) {
    return ::testing::AssertionFailure() << what << ": not bitwise equal";
  }
  return ::testing::AssertionSuccess();
}

::testing::AssertionResult MixesClose(const char* what, const std::vector<float>& got,
                                      const std::vector<double>& ref) {
  if (got.size() != ref.size()) return ::testing::AssertionFailure() << what << ": size mismatch";
  size_t bad = 0, first = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double tol = 1e-5 + 1e-4 * std::fabs(ref[i]);
    if (!(std::fabs(double(got[i]) - ref[i]) <= tol) && bad++ == 0) first = i;
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << what << ": " << bad << " of " << got.size()
                                       << " outside 1e-5 + 1e-4|ref|; first at " << first << " got "
                                       << got[first] << " ref " << ref[first];
}

// Every element within max_ulp; at least `fraction` of them within frac_ulp.
::testing::AssertionResult UlpClose(const char* what, const std::vector<uint16_t>& got,
                                    const std::vector<uint16_t>& want, int max_ulp, int frac_ulp = 0,
                                    double fraction = 1.0) {
  if (got.size() != want.size()) return ::testing::AssertionFailure() << what << ": size mismatch";
  size_t over_max = 0, over_frac = 0, first = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const int d = Bf16UlpDistance(got[i], want[i]);
    if (d > max_ulp && over_max++ == 0) first = i;
    if (d > frac_ulp) ++over_frac;
  }
  if (over_max == 0 && (fraction >= 1.0 || double(over_frac) <= (1.0 - fraction) * double(got.size()))) {
    return ::testing::AssertionSuccess();
  }
  auto f = ::testing::AssertionFailure();
  f << what << ": " << over_max << " of " << got.size() << " beyond " << max_ulp << " ulp";
  if (over_max) f << " (first at " << first << " got 0x" << std::hex << got[first] << " want 0x" << want[first] << std::dec << ")";
  if (fraction < 1.0) f << "; " << over_frac << " beyond " << frac_ulp << " ulp (allowed " << (1.0 - fraction) * got.size() << ")";
  return f;
}

// Normal-mode y (spec "Equality and tolerance"): against the reference, every element within the
// element-wise bound (CheckNormalModeY, factor 1) and >= 99.9% within 1 ulp. Between two paths,
// twice the bound on every element; the fraction clause follows from both paths meeting it
// against the reference: >= 99.8% within 2 ulp of each other.
::testing::AssertionResult NormalModeYWithinContract(const char* what, const Problem& p, const MhcRefOutputs& ref,
                                                     const std::vector<uint16_t>& got,
                                                     const std::vector<uint16_t>& want, bool two_paths) {
  const NormalYCheck r =
      CheckNormalModeY(p.hp, p.w, ref, got, want, two_paths ? 2.0 : 1.0, two_paths ? 2 : 1);
  const double allowed = (two_paths ? 2e-3 : 1e-3) * double(r.elements);
  if (r.beyond_bound == 0 && double(r.beyond_ulp) <= allowed) return ::testing::AssertionSuccess();
  auto f = ::testing::AssertionFailure();
  f << what << ": " << r.beyond_bound << " of " << r.elements << " beyond the element-wise bound";
  if (r.first_bad >= 0 && size_t(r.first_bad) < got.size()) {
    f << " (first at " << r.first_bad << " got " << Bf16ToFloat(got[size_t(r.first_bad)]) << " want "
      << Bf16ToFloat(want[size_t(r.first_bad)]) << ")";
  }
  f << "; " << r.beyond_ulp << " beyond " << (two_paths ? 2 : 1) << " ulp (allowed " << allowed << ")";
  return f;
}

void ExpectMatchesReference(const Problem& p, const MhcRefOutputs& ref, const Outputs& got) {
  EXPECT_TRUE(BitwiseEqual("new_residual", got.new_residual, ref.new_residual));
  if (p.in.stage != MhcStage::kHead) {
    EXPECT_TRUE(MixesClose("new_pre_mix", got.pre, ref.new_pre_mix));
    EXPECT_TRUE(MixesClose("new_post_mix", got.post, ref.new_post_mix));
    EXPECT_TRUE(MixesClose("new_comb_mix", got.comb, ref.new_comb_mix));
  }
  if (p.in.mode == MhcMode::kNormal) {
    EXPECT_TRUE(NormalModeYWithinContract("normal-mode y vs ref", p, ref, got.y, ref.y, false));
  } else {
    EXPECT_TRUE(UlpClose("y", got.y, ref.y, 1));
  }
  if (p.in.capture_aux) EXPECT_TRUE(UlpClose("aux", got.aux, ref.aux, 1));
}

void ExpectPathsAgree(const Problem& p, const MhcRefOutputs& ref, const Outputs& fused, const Outputs& unfused) {
  EXPECT_TRUE(BitwiseEqual("new_residual fused vs unfused", fused.new_residual, unfused.new_residual));
  if (p.in.mode == MhcMode::kNormal) {
    EXPECT_TRUE(NormalModeYWithinContract("normal-mode y fused vs unfused", p, ref, fused.y, unfused.y, true));
  } else {
    EXPECT_TRUE(BitwiseEqual("y fused vs unfused", fused.y, unfused.y));
  }
  if (p.in.capture_aux) EXPECT_TRUE(UlpClose("aux fused vs unfused", fused.aux, unfused.aux, 1));
}

void ExpectIdentical(const Outputs& a, const Outputs& b) {
  EXPECT_TRUE(BitwiseEqual("new_residual", a.new_residual, b.new_residual));
  EXPECT_TRUE(BitwiseEqual("y", a.y, b.y));
  EXPECT_TRUE(BitwiseEqual("aux", a.aux, b.aux));
  EXPECT_TRUE(BitwiseEqualF("new_pre_mix", a.pre, b.pre));
  EXPECT_TRUE(BitwiseEqualF("new_post_mix", a.post, b.post));
  EXPECT_TRUE(BitwiseEqualF("new_comb_mix", a.comb, b.comb));
}

// Outputs of token `t` of a batch.
Outputs TokenOf(const Outputs& o, int64_t t, int n, int64_t C) {
  auto cut = [&](const auto& v, int64_t per) {
    using V = std::decay_t<decltype(v)>;
    if (v.empty()) return V();
    return V(v.begin() + t * per, v.begin() + (t + 1) * per);
  };
  Outputs r;
  r.new_residual = cut(o.new_residual, n * C);
  r.y = cut(o.y, C);
  r.aux = cut(o.aux, C);
  r.pre = cut(o.pre, n);
  r.post = cut(o.post, n);
  r.comb = cut(o.comb, int64_t(n) * n);
  return r;
}

// ---------------------------------------------------------------------------------------------
// The fixture: one backend per parameter.
// ---------------------------------------------------------------------------------------------
class MhcContractTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    auto b = CreateBackend(GetParam());
    ASSERT_TRUE(b.ok()) << b.status();
    backend_ = std::move(*b);
  }
  bool IsCpu() const { return GetParam() == "cpu"; }

  // Runs a case on the unfused path and, where the backend supports it, the fused path; checks
  // both against the reference and each other. Where fused is unsupported, checks that asking for
  // it anyway is FailedPrecondition with every output untouched. Returns the fused support answer.
  FusedSupport CheckCase(const Case& k) {
    SCOPED_TRACE(k.Name());
    auto rng = MakeRng(std::hash<std::string>{}(k.Name()));
    Problem p = MakeProblem(k, rng);
    auto w = Prepare(*backend_, p);
    EXPECT_TRUE(w.ok()) << w.status();
    if (!w.ok()) return {};
    EXPECT_EQ((*w)->has_norm_weight(), k.norm);
    EXPECT_GE((*w)->resident_bytes(), p.w.fn.size() * sizeof(float));
    const MhcRefOutputs ref = MhcReference(p.hp, p.w, p.in);

    auto unfused = RunProblem(*backend_, **w, p, Path::kUnfused);
    EXPECT_TRUE(unfused.ok()) << unfused.status();
    if (!unfused.ok()) return {};
    {
      SCOPED_TRACE("unfused");
      ExpectMatchesReference(p, ref, *unfused);
    }
    const FusedSupport sup = backend_->MhcFusedSupport(**w, QueryOf(p));
    if (sup.supported) {
      auto fused = RunProblem(*backend_, **w, p, Path::kFused);
      EXPECT_TRUE(fused.ok()) << fused.status();
      if (fused.ok()) {
        SCOPED_TRACE("fused");
        ExpectMatchesReference(p, ref, *fused);
        ExpectPathsAgree(p, ref, *fused, *unfused);
      }
    } else {
      EXPECT_FALSE(sup.detail.empty());
      Call call(*backend_, p);
      auto st = backend_->RunMhc(**w, call.args, Path::kFused);
      EXPECT_EQ(st.status().code(), absl::StatusCode::kFailedPrecondition) << st.status();
      EXPECT_TRUE(call.Untouched()) << "a rejected fused call wrote outputs";
    }
    return sup;
  }

  // Inside the CPU fused kernel's envelope (n = 4, C % 64 == 0, T <= fused_max_tokens) the fused
  // path must really be exercised, not silently skipped.
  void ExpectCpuFused(const FusedSupport& sup) const {
    if (IsCpu()) EXPECT_TRUE(sup.supported) << FallbackReasonName(sup.reason) << ": " << sup.detail;
  }

  std::unique_ptr<Backend> backend_;
};


TEST_P(MhcContractTest, SeamShiftedAcrossTokenCounts) {
  for (int64_t C : {512, 1024}) {
    for (int64_t T : {0, 1, 3, 64, 257}) {
      Case k;
      k.C = C;
      k.T = T;
      FusedSupport sup = CheckCase(k);
      ExpectCpuFused(sup);
    }
  }
}

TEST_P(MhcContractTest, SeamNormalAcrossTokenCounts) {
  for (int64_t T : {1, 64, 257}) {
    Case k;
    k.mode = MhcMode::kNormal;
    k.C = 1024;
    k.T = T;
    FusedSupport sup = CheckCase(k);
    ExpectCpuFused(sup);
  }
}

TEST_P(MhcContractTest, DeepSeekProHiddenSize) {
  for (MhcMode mode : {MhcMode::kShifted, MhcMode::kNormal}) {
    Case k;
    k.mode = mode;
    k.C = 7168;
    k.T = 16;
    k.aux = true;
    FusedSupport sup = CheckCase(k);
    ExpectCpuFused(sup);
  }
}

TEST_P(MhcContractTest, HcMultOneToEightUnfused) {
  for (int n : {1, 2, 3, 5, 8}) {
    for (MhcMode mode : {MhcMode::kShifted, MhcMode::kNormal}) {
      Case k;
      k.n = n;
      k.mode = mode;
      k.T = 64;
      k.aux = true;
      FusedSupport sup = CheckCase(k);
      EXPECT_FALSE(sup.supported);
      EXPECT_EQ(sup.reason, FallbackReason::kHcMultUnsupported) << FallbackReasonName(sup.reason);
    }
  }
}

TEST_P(MhcContractTest, SinkhornIterationsAndHyperParameters) {
  for (int iters : {1, 10, 20}) {
    for (bool eps : {false, true}) {
      Case k;
      k.iters = iters;
      k.non_default_eps = eps;
      k.T = 64;
      FusedSupport sup = CheckCase(k);
      ExpectCpuFused(sup);
    }
  }
}

TEST_P(MhcContractTest, OptionalPreMixAndNormWeight) {
  for (MhcMode mode : {MhcMode::kShifted, MhcMode::kNormal}) {
    for (bool pre : {false, true}) {
      for (bool norm : {false, true}) {
        Case k;
        k.mode = mode;
        k.pre_mix = pre;
        k.norm = norm;
        k.T = 64;
        FusedSupport sup = CheckCase(k);
        ExpectCpuFused(sup);
      }
    }
  }
}

TEST_P(MhcContractTest, CaptureAux) {
  for (MhcMode mode : {MhcMode::kShifted, MhcMode::kNormal}) {
    Case k;
    k.mode = mode;
    k.aux = true;
    k.T = 257;
    FusedSupport sup = CheckCase(k);
    // Backends whose fused kernel has no aux output say so with the dedicated reason.
    if (!sup.supported && !IsCpu()) EXPECT_EQ(sup.reason, FallbackReason::kAuxCaptureRequested);
    ExpectCpuFused(sup);
  }
}

TEST_P(MhcContractTest, FirstStage) {
  for (MhcMode mode : {MhcMode::kShifted, MhcMode::kNormal}) {
    for (bool norm : {false, true}) {
      Case k;
      k.stage = MhcStage::kFirst;
      k.mode = mode;
      k.norm = norm;
      k.T = 64;
      FusedSupport sup = CheckCase(k);
      ExpectCpuFused(sup);
    }
  }
}

TEST_P(MhcContractTest, HeadStage) {
  for (bool pre : {false, true}) {
    for (bool norm : {false, true}) {
      Case k;
      k.stage = MhcStage::kHead;
      k.pre_mix = pre;
      k.norm = norm;
      k.T = 64;
      FusedSupport sup = CheckCase(k);
      ExpectCpuFused(sup);
    }
  }
}

TEST_P(MhcContractTest, HiddenSizeNotATileMultipleRunsUnfused) {
  for (int n : {4, 3}) {
    for (MhcMode mode : {MhcMode::kShifted, MhcMode::kNormal}) {
      Case k;
      k.n = n;
      k.mode = mode;
      k.C = 200;
      k.T = 64;
      k.aux = true;
      FusedSupport sup = CheckCase(k);
      EXPECT_FALSE(sup.supported);
      EXPECT_EQ(sup.reason, n == 4 ? FallbackReason::kHiddenSizeUnsupported : FallbackReason::kHcMultUnsupported)
          << FallbackReasonName(sup.reason);
    }
  }
}

TEST_P(MhcContractTest, FusedTokenLimit) {
  BackendOptions opt;
  opt.fused_max_tokens = 16;
  auto b = CreateBackend(GetParam(), opt);
  ASSERT_TRUE(b.ok()) << b.status();
  backend_ = std::move(*b);
  Case k;
  k.T = 16;
  FusedSupport at_limit = CheckCase(k);
  ExpectCpuFused(at_limit);
  k.T = 17;
  FusedSupport over = CheckCase(k);
  EXPECT_FALSE(over.supported);
  EXPECT_EQ(over.reason, FallbackReason::kTooManyTokens) << FallbackReasonName(over.reason);
}

// A token's outputs do not depend on the batch it is in or its position there.
TEST_P(MhcContractTest, BatchInvariance) {
  constexpr int64_t kBig = 1023, C = 256;
  constexpr int n = 4;
  for (MhcMode mode : {MhcMode::kShifted, MhcMode::kNormal}) {
    Case k;
    k.mode = mode;
    k.C = C;
    k.T = kBig;
    k.aux = true;
    SCOPED_TRACE(k.Name());
    auto rng = MakeRng(7);
    Problem p = MakeProblem(k, rng);
    auto w = Prepare(*backend_, p);
    ASSERT_TRUE(w.ok()) << w.status();
    std::vector<Path> paths = {Path::kUnfused};
    if (backend_->MhcFusedSupport(**w, QueryOf(p)).supported) paths.push_back(Path::kFused);
    if (IsCpu()) EXPECT_EQ(paths.size(), 2u);
    for (Path path : paths) {
      SCOPED_TRACE(PathName(path));
      // (batch size, first token of the batch) pairs; probes at its first, middle and last position.
      for (auto [size, start] : {std::pair<int64_t, int64_t>{7, 100}, {64, 500}, {kBig, 0}}) {
        auto batch = RunProblem(*backend_, **w, Slice(p, start, size), path);
        ASSERT_TRUE(batch.ok()) << batch.status();
        for (int64_t pos : {int64_t{0}, size / 2, size - 1}) {
          SCOPED_TRACE(absl::StrCat("batch ", size, " position ", pos));
          auto alone = RunProblem(*backend_, **w, Slice(p, start + pos, 1), path);
          ASSERT_TRUE(alone.ok()) << alone.status();
          ExpectIdentical(*alone, TokenOf(*batch, pos, n, C));
        }
      }
    }
  }
}

TEST_P(MhcContractTest, RepeatedRunsAreBitwiseIdentical) {
  for (MhcMode mode : {MhcMode::kShifted, MhcMode::kNormal}) {
    Case k;
    k.mode = mode;
    k.T = 257;
    k.aux = true;
    SCOPED_TRACE(k.Name());
    auto rng = MakeRng(11);
    Problem p = MakeProblem(k, rng);
    auto w = Prepare(*backend_, p);
    ASSERT_TRUE(w.ok()) << w.status();
    for (Path path : {Path::kUnfused, Path::kFused}) {
      if (!backend_->MhcFusedSupport(**w, QueryOf(p)).supported && path == Path::kFused) continue;
      SCOPED_TRACE(PathName(path));
      auto first = RunProblem(*backend_, **w, p, path);
      ASSERT_TRUE(first.ok()) << first.status();
      for (int rep = 0; rep < 3; ++rep) {
        auto again = RunProblem(*backend_, **w, p, path);
        ASSERT_TRUE(again.ok()) << again.status();
        ExpectIdentical(*first, *again);
      }
    }
  }
}

TEST_P(MhcContractTest, ZeroTokensWritesNothingAndSucceeds) {
  Case k;
  k.T = 0;
  k.aux = true;
  auto rng = MakeRng(13);
  Problem p = MakeProblem(k, rng);
  auto w = Prepare(*backend_, p);
  ASSERT_TRUE(w.ok()) << w.status();
  for (Path path : {Path::kUnfused, Path::kFused}) {
    if (!backend_->MhcFusedSupport(**w, QueryOf(p)).supported && path == Path::kFused) continue;
    Call call(*backend_, p);
    auto st = backend_->RunMhc(**w, call.args, path);
    EXPECT_TRUE(st.ok()) << st.status();
  }
}

// Malformed calls: InvalidArgument, nothing written, on both paths.
TEST_P(MhcContractTest, BadInputsAreRejectedWithoutWriting) {
  Case k;
  k.T = 5;
  k.aux = true;
  auto rng = MakeRng(17);
  Problem p = MakeProblem(k, rng);
  auto w = Prepare(*backend_, p);
  ASSERT_TRUE(w.ok()) << w.status();
  const int64_t T = k.T, n = k.n, C = k.C;
  // A spare buffer big enough for any mis-shaped view below.
  DeviceTensor spare(*backend_, DType::kFP32, {T * (n + 1) * (C + 1)});
  struct Mutation {
    const char* name;
    std::function<void(MhcArgs&)> apply;
  };
  const std::vector<Mutation> mutations = {
      {"x wrong dtype", [&](MhcArgs& a) { a.x.dtype = DType::kFP32; }},
      {"x wrong hidden", [&](MhcArgs& a) { a.x = TensorView::Contiguous(spare.data(), DType::kBF16, {T, C + 1}); }},
      {"residual wrong streams",
       [&](MhcArgs& a) { a.residual = TensorView::Contiguous(spare.data(), DType::kBF16, {T, n + 1, C}); }},
      {"residual missing", [&](MhcArgs& a) { a.residual = TensorView(); }},
      {"residual null data", [&](MhcArgs& a) { a.residual.data = nullptr; }},
      {"post_mix wrong dtype", [&](MhcArgs& a) { a.post_mix.dtype = DType::kBF16; }},
      {"comb_mix wrong shape",
       [&](MhcArgs& a) { a.comb_mix = TensorView::Contiguous(spare.data(), DType::kFP32, {T, n, n + 1}); }},
      {"pre_mix wrong tokens",
       [&](MhcArgs& a) { a.pre_mix = TensorView::Contiguous(spare.data(), DType::kFP32, {T + 1, n}); }},
      {"new_residual wrong dtype", [&](MhcArgs& a) { a.new_residual.dtype = DType::kFP32; }},
      {"new_comb_mix missing", [&](MhcArgs& a) { a.new_comb_mix = TensorView(); }},
      {"y missing", [&](MhcArgs& a) { a.y = TensorView(); }},
      {"aux missing with capture_aux", [&](MhcArgs& a) { a.aux = TensorView(); }},
      {"tokens mismatch", [&](MhcArgs& a) { a.tokens = T + 1; }},
      {"negative tokens", [&](MhcArgs& a) { a.tokens = -1; }},
      {"head in normal mode",
       [&](MhcArgs& a) {
         a.stage = MhcStage::kHead;
         a.mode = MhcMode::kNormal;
       }},
      {"aux on the first stage",
       [&](MhcArgs& a) {
         a.stage = MhcStage::kFirst;
         a.residual = a.post_mix = a.comb_mix = a.pre_mix = TensorView();
       }},
  };
  for (Path path : {Path::kUnfused, Path::kFused}) {
    for (const Mutation& m : mutations) {
      SCOPED_TRACE(absl::StrCat(PathName(path), ": ", m.name));
      Call call(*backend_, p);
      m.apply(call.args);
      auto st = backend_->RunMhc(**w, call.args, path);
      EXPECT_EQ(st.status().code(), absl::StatusCode::kInvalidArgument) << st.status();
      EXPECT_TRUE(call.Untouched());
    }
  }
}

TEST_P(MhcContractTest, PrepareRejectsBadWeights) {
  Case k;
  k.T = 1;
  auto rng = MakeRng(19);
  Problem p = MakeProblem(k, rng);
  const int64_t M = p.hp.num_mixes(), K = p.hp.flat_width();
  // Views of the drawn weights with their true shapes; the cases below break one thing each.
  auto base_weights = [&] {
    MhcWeightsHost wh;
    wh.fn = TensorView::Contiguous(p.w.fn.data(), DType::kFP32, {M, K});
    wh.scale = TensorView::Contiguous(p.w.scale.data(), DType::kFP32, {3});
    wh.base = TensorView::Contiguous(p.w.base.data(), DType::kFP32, {M});
    wh.norm_weight = TensorView::Contiguous(p.w.norm_weight.data(), DType::kBF16, {k.C});
    return wh;
  };
  ASSERT_TRUE(backend_->PrepareMhc(p.hp, base_weights()).ok());
  {
    MhcHyperParams hp = p.hp;
    hp.hc_mult = 9;
    EXPECT_EQ(backend_->PrepareMhc(hp, base_weights()).status().code(), absl::StatusCode::kInvalidArgument);
  }
  {
    MhcHyperParams hp = p.hp;
    hp.sinkhorn_iters = 0;
    EXPECT_EQ(backend_->PrepareMhc(hp, base_weights()).status().code(), absl::StatusCode::kInvalidArgument);
  }
  {
    MhcHyperParams hp = p.hp;
    hp.hc_norm_eps = -1e-6f;
    EXPECT_EQ(backend_->PrepareMhc(hp, base_weights()).status().code(), absl::StatusCode::kInvalidArgument);
  }
  {
    MhcHyperParams hp = p.hp;
    hp.hidden = k.C + 64;  // fn and the norm weight no longer match the hidden size
    EXPECT_EQ(backend_->PrepareMhc(hp, base_weights()).status().code(), absl::StatusCode::kInvalidArgument);
  }
  {
    MhcHyperParams hp = p.hp;
    hp.hc_mult = 3;  // fn has the n = 4 shape
    EXPECT_EQ(backend_->PrepareMhc(hp, base_weights()).status().code(), absl::StatusCode::kInvalidArgument);
  }
  std::vector<std::pair<const char*, std::function<void(MhcWeightsHost&)>>> bad = {
      {"fn transposed", [&](MhcWeightsHost& w) { w.fn = TensorView::Contiguous(p.w.fn.data(), DType::kFP32, {K, M}); }},
      {"fn bf16", [&](MhcWeightsHost& w) { w.fn.dtype = DType::kBF16; }},
      {"fn missing", [&](MhcWeightsHost& w) { w.fn = TensorView(); }},
      {"scale [2]", [&](MhcWeightsHost& w) { w.scale.shape[0] = 2; }},
      {"base wrong length", [&](MhcWeightsHost& w) { w.base.shape[0] = M - 1; }},
      {"norm weight fp32", [&](MhcWeightsHost& w) { w.norm_weight.dtype = DType::kFP32; }},
      {"norm weight wrong length", [&](MhcWeightsHost& w) { w.norm_weight.shape[0] = k.C - 1; }},
  };
  for (auto& [name, mutate] : bad) {
    SCOPED_TRACE(name);
    MhcWeightsHost wh = base_weights();
    mutate(wh);
    EXPECT_EQ(backend_->PrepareMhc(p.hp, wh).status().code(), absl::StatusCode::kInvalidArgument);
  }
}

// The CPU backend's mixes GEMM has two forms: the generic one (vectorised by the compiler's ISA
// clones) and a register-tiled AVX-512 one picked at run time. They must agree bitwise on every
// output, for every n (fused and unfused), for C with and without a K % 16 tail and a partial last
// k chunk, and for token counts that exercise the 4-token register tiles and their 1-3 token rests.
TEST(MhcCpuGemmForms, Avx512FormMatchesGenericFormBitwise) {
  struct ResetForms {
    ~ResetForms() { cpu::SetMhcCpuAvx512ForTesting(true); }
  } reset;
  if (!cpu::SetMhcCpuAvx512ForTesting(true)) {
    GTEST_SKIP() << "this build or CPU has no AVX-512 form of the mixes GEMM: nothing to compare";
  }
  auto backend = CreateBackend("cpu");
  ASSERT_TRUE(backend.ok()) << backend.status();
  std::vector<Case> cases;
  for (int64_t T : {1, 3, 8, 13}) {
    for (MhcMode mode : {MhcMode::kShifted, MhcMode::kNormal}) {
      Case k;
      k.mode = mode;
      k.n = 4;
      k.C = 5120;  // K = 20480: 40 full 512-wide chunks
      k.T = T;
      k.aux = mode == MhcMode::kShifted;
      cases.push_back(k);
    }
  }
  for (int n : {1, 2, 3, 5, 8}) {
    Case k;
    k.n = n;
    k.C = 200;  // K = 200 n: a partial last chunk and, for odd n, a K % 16 tail
    k.T = 11;
    cases.push_back(k);
  }
  Case first;
  first.stage = MhcStage::kFirst;
  first.C = 1088;
  first.T = 6;
  first.pre_mix = false;
  cases.push_back(first);
  for (const Case& k : cases) {
    SCOPED_TRACE(k.Name());
    auto rng = MakeRng(29);
    Problem p = MakeProblem(k, rng);
    auto w = Prepare(**backend, p);
    ASSERT_TRUE(w.ok()) << w.status();
    std::vector<Path> paths = {Path::kUnfused};
    if ((*backend)->MhcFusedSupport(**w, QueryOf(p)).supported) paths.push_back(Path::kFused);
    EXPECT_EQ(paths.size(), k.n == 4 ? 2u : 1u);
    for (Path path : paths) {
      SCOPED_TRACE(PathName(path));
      cpu::SetMhcCpuAvx512ForTesting(false);
      auto generic = RunProblem(**backend, **w, p, path);
      cpu::SetMhcCpuAvx512ForTesting(true);
      auto avx512 = RunProblem(**backend, **w, p, path);
      ASSERT_TRUE(generic.ok()) << generic.status();
      ASSERT_TRUE(avx512.ok()) << avx512.status();
      ExpectIdentical(*generic, *avx512);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Backends, MhcContractTest, ::testing::ValuesIn(AvailableBackends()),
                         [](const ::testing::TestParamInfo<std::string>& info) { return info.param; });

}  // namespace
}  // namespace fusedlayer::testing
