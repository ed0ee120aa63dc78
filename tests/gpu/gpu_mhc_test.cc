// GPU mHC kernels (kernels/gpu/mhc_gpu.h) against spec/mhc.md, driven through LaunchMhcGpu directly:
//   - against the contract suite's fp64 reference (tests/kernels/mhc_reference.h, written from the
//     spec alone): new_residual bitwise, aux within 1 ulp, mixes within 1e-5 + 1e-4|ref|,
//     shifted-mode y within 1 bf16 ulp, normal-mode y within the spec's element-wise bound and
//     1 ulp on >= 99.9% of elements;
//   - between the paths: new_residual, aux, mixes and y (both modes) bitwise (they share the
//     mixes pass and the finalize kernel, stronger than the contract asks);
//   - against the CPU backend: new_residual and aux bitwise, normal-mode y within twice the bound;
//   - batch invariance, determinism, CUDA-graph replay == eager (bitwise);
//   - fused-path support reasons and argument errors.
// Inputs are fresh random draws with outliers; every output is poisoned with NaN before each run.
// Skips cleanly without a GPU.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "fusedlayer/mhc.h"
#include "fusedlayer/numeric.h"
#include "gpu_context.h"
#include "gtest/gtest.h"
#include "mhc_launch.h"
#include "mhc_reference.h"
#include "test_util.h"

namespace fusedlayer::gpu {
namespace {

using ::fusedlayer::testing::Bf16UlpDistance;
using ::fusedlayer::testing::CheckNormalModeY;
using ::fusedlayer::testing::MhcReference;
using ::fusedlayer::testing::MhcRefInputs;
using ::fusedlayer::testing::MhcRefOutputs;
using ::fusedlayer::testing::MhcRefWeights;
using ::fusedlayer::testing::NormalYCheck;
using ::fusedlayer::testing::MakeRng;
using ::fusedlayer::testing::RandomBf16;
using ::fusedlayer::testing::RandomFloat;
using ::fusedlayer::testing::RandomValue;

constexpr int64_t kNoTokenLimit = int64_t{1} << 20;

// ---- device buffers -----------------------------------------------------------------------------
struct Dev {
  GpuMemory mem;
  size_t bytes = 0;
};

Dev Upload(const void* host, size_t bytes, GpuContext& ctx) {
  Dev d;
  d.bytes = bytes;
  if (bytes == 0) return d;
  auto m = GpuUpload(host, bytes, ctx);
  EXPECT_TRUE(m.ok()) << m.status();
  if (m.ok()) d.mem = std::move(*m);
  return d;
}
Dev Alloc(size_t bytes) {
  Dev d;
  d.bytes = bytes;
  if (bytes == 0) return d;
  auto m = GpuAlloc(bytes);
  EXPECT_TRUE(m.ok()) << m.status();
  if (m.ok()) d.mem = std::move(*m);
  return d;
}
void Poison(Dev& d, GpuContext& ctx) {
  if (d.bytes) ASSERT_EQ(gpuMemsetAsync(d.mem.get(), 0xff, d.bytes, ctx.stream), gpuSuccess);
}
template <typename T>
std::vector<T> Download(const Dev& d, GpuContext& ctx) {
  std::vector<T> out(d.bytes / sizeof(T));
  EXPECT_EQ(gpuStreamSynchronize(ctx.stream), gpuSuccess);
  if (d.bytes) EXPECT_EQ(gpuMemcpy(out.data(), d.mem.get(), d.bytes, gpuMemcpyDeviceToHost), gpuSuccess);
  return out;
}
TensorView View(const Dev& d, DType dt, std::initializer_list<int64_t> dims) {
  return TensorView::Contiguous(d.mem.get(), dt, dims);
}

// ---- a problem: host inputs, host weights ---------------------------------------------------------
struct Case {
  int n = 4;
  int64_t C = 256;
  int64_t T = 7;
  MhcStage stage = MhcStage::kSeam;
  MhcMode mode = MhcMode::kShifted;
  bool has_pre = true;
  bool aux = false;
  bool has_g = true;
  int iters = 20;
};

std::string Name(const Case& c) {
  return "n" + std::to_string(c.n) + "_C" + std::to_string(c.C) + "_T" + std::to_string(c.T) + "_" +
         MhcStageName(c.stage) + "_" + MhcModeName(c.mode) + (c.has_pre ? "_pre" : "") + (c.aux ? "_aux" : "") +
         (c.has_g ? "" : "_nog") + "_it" + std::to_string(c.iters);
}

struct Weights {
  MhcHyperParams hp;
  std::vector<float> fn, scale, base;
  std::vector<uint16_t> g;
};

Weights MakeWeights(const Case& c, std::mt19937_64& rng) {
  Weights w;
  w.hp.hc_mult = c.n;
  w.hp.hidden = c.C;
  w.hp.sinkhorn_iters = c.iters;
  const int M = w.hp.num_mixes();
  const int64_t K = w.hp.flat_width();
  w.fn.resize(size_t(M) * K);
  const float sigma = 1.0f / std::sqrt(float(K));
  for (auto& f : w.fn) f = RandomValue(rng, sigma, 8.0f);
  w.scale = RandomFloat(rng, 3, 0.5f, 2.0f);
  w.base = RandomFloat(rng, M, -1.0f, 1.0f);
  if (c.has_g) w.g = RandomBf16(rng, c.C, 1.0f, 4.0f);
  return w;
}

struct Inputs {
  std::vector<uint16_t> x, r;
  std::vector<float> post, comb, pre;
};

Inputs MakeInputs(const Case& c, std::mt19937_64& rng) {
  Inputs in;
  const int n = c.n;
  in.x = RandomBf16(rng, size_t(c.T) * c.C);
  in.r = RandomBf16(rng, size_t(c.T) * n * c.C);
  in.post = RandomFloat(rng, size_t(c.T) * n, 0.05f, 2.0f);
  in.comb = RandomFloat(rng, size_t(c.T) * n * n, 0.01f, 1.0f);
  in.pre = RandomFloat(rng, size_t(c.T) * n, 0.01f, 1.0f);
  return in;
}

// Token subset (rows `idx` of every per-token tensor).
Inputs Gather(const Case& c, const Inputs& in, const std::vector<int64_t>& idx) {
  Inputs o;
  const int n = c.n;
  auto take = [&](const auto& src, auto& dst, size_t per) {
    dst.resize(idx.size() * per);
    for (size_t i = 0; i < idx.size(); ++i)
      std::copy_n(src.begin() + idx[i] * per, per, dst.begin() + i * per);
  };
  take(in.x, o.x, size_t(c.C));
  take(in.r, o.r, size_t(n) * c.C);
  take(in.post, o.post, size_t(n));
  take(in.comb, o.comb, size_t(n) * n);
  take(in.pre, o.pre, size_t(n));
  return o;
}

struct Outputs {
  std::vector<uint16_t> nr, y, aux;
  std::vector<float> pre, post, comb;
};

// ---- the GPU run ----------------------------------------------------------------------------------
class Runner {
 public:
  Runner(const Case& c, const Inputs& in, GpuContext& ctx) : c_(c), ctx_(ctx) {
    const int n = c.n;
    const int64_t T = c.T, C = c.C;
    x_ = Upload(in.x.data(), in.x.size() * 2, ctx);
    r_ = Upload(in.r.data(), in.r.size() * 2, ctx);
    post_ = Upload(in.post.data(), in.post.size() * 4, ctx);
    comb_ = Upload(in.comb.data(), in.comb.size() * 4, ctx);
    pre_ = Upload(in.pre.data(), in.pre.size() * 4, ctx);
    nr_ = Alloc(size_t(T) * n * C * 2);
    y_ = Alloc(size_t(T) * C * 2);
    aux_ = Alloc(c.aux ? size_t(T) * C * 2 : 0);
    npre_ = Alloc(size_t(T) * n * 4);
    npost_ = Alloc(size_t(T) * n * 4);
    ncomb_ = Alloc(size_t(T) * n * n * 4);
    args_.stage = c.stage;
    args_.mode = c.mode;
    args_.capture_aux = c.aux;
    args_.tokens = T;
    args_.x = View(x_, DType::kBF16, {T, C});
    if (c.stage != MhcStage::kFirst) {
      args_.residual = View(r_, DType::kBF16, {T, n, C});
      args_.post_mix = View(post_, DType::kFP32, {T, n});
      args_.comb_mix = View(comb_, DType::kFP32, {T, n, n});
      if (c.has_pre && c.mode == MhcMode::kShifted) args_.pre_mix = View(pre_, DType::kFP32, {T, n});
    }
    args_.new_residual = View(nr_, DType::kBF16, {T, n, C});
    if (c.stage != MhcStage::kHead) {
      args_.new_pre_mix = View(npre_, DType::kFP32, {T, n});
      args_.new_post_mix = View(npost_, DType::kFP32, {T, n});
      args_.new_comb_mix = View(ncomb_, DType::kFP32, {T, n, n});
    }
    args_.y = View(y_, DType::kBF16, {T, C});
    if (c.aux) args_.aux = View(aux_, DType::kBF16, {T, C});
  }

  const MhcArgs& args() const { return args_; }

  void PoisonOutputs() {
    for (Dev* d : {&nr_, &y_, &aux_, &npre_, &npost_, &ncomb_}) Poison(*d, ctx_);
  }
  Outputs Read() {
    Outputs o;
    o.nr = Download<uint16_t>(nr_, ctx_);
    o.y = Download<uint16_t>(y_, ctx_);
    o.aux = Download<uint16_t>(aux_, ctx_);
    if (c_.stage != MhcStage::kHead) {
      o.pre = Download<float>(npre_, ctx_);
      o.post = Download<float>(npost_, ctx_);
      o.comb = Download<float>(ncomb_, ctx_);
    }
    return o;
  }
  Outputs Run(const GpuMhcWeights& w, Path path) {
    PoisonOutputs();
    absl::Status s = LaunchMhcGpu(w, args_, path, ctx_, kNoTokenLimit);
    EXPECT_TRUE(s.ok()) << s;
    EXPECT_EQ(gpuStreamSynchronize(ctx_.stream), gpuSuccess);
    return Read();
  }

 private:
  Case c_;
  GpuContext& ctx_;
  Dev x_, r_, post_, comb_, pre_, nr_, y_, aux_, npre_, npost_, ncomb_;
  MhcArgs args_;
};

// ---- fp64 reference: tests/kernels/mhc_reference.h (written from spec/mhc.md alone, shared with
// the contract suite; it shares no code with any backend and rounds to bf16 once, where the
// contract does) -------------------------------------------------------------------------------------
MhcRefWeights RefWeights(const Weights& w) { return MhcRefWeights{w.fn, w.scale, w.base, w.g}; }

MhcRefOutputs Reference(const Case& c, const Weights& w, const Inputs& in) {
  MhcRefInputs r;
  r.stage = c.stage;
  r.mode = c.mode;
  r.capture_aux = c.aux;
  r.tokens = c.T;
  r.x = in.x;
  if (c.stage != MhcStage::kFirst) {
    r.residual = in.r;
    r.post_mix = in.post;
    r.comb_mix = in.comb;
    if (c.has_pre && c.mode == MhcMode::kShifted) r.pre_mix = in.pre;
  }
  return MhcReference(w.hp, RefWeights(w), r);
}

// ---- checks ---------------------------------------------------------------------------------------
void ExpectBitwise(const std::vector<uint16_t>& got, const std::vector<uint16_t>& want, const char* what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  size_t bad = 0, first = 0;
  for (size_t i = 0; i < got.size(); ++i)
    if (got[i] != want[i] && bad++ == 0) first = i;
  EXPECT_EQ(bad, 0u) << what << ": " << bad << " of " << got.size() << " differ; first at " << first << " got 0x"
                     << std::hex << got[first] << " want 0x" << want[first];
}
template <typename T>
void ExpectSameBits(const std::vector<T>& a, const std::vector<T>& b, const char* what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  EXPECT_EQ(a.empty() ? 0 : std::memcmp(a.data(), b.data(), a.size() * sizeof(T)), 0) << what << " differ bitwise";
}
void ExpectMixes(const std::vector<float>& got, const std::vector<double>& ref, const char* what) {
  ASSERT_EQ(got.size(), ref.size()) << what;
  size_t bad = 0;
  double worst = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double err = std::fabs(double(got[i]) - ref[i]);
    const double tol = 1e-5 + 1e-4 * std::fabs(ref[i]);
    if (!(err <= tol)) ++bad;  // NaN fails
    if (err / tol > worst) worst = err / tol;
  }
  EXPECT_EQ(bad, 0u) << what << ": " << bad << " of " << got.size() << " outside 1e-5 + 1e-4|ref| (worst "
                     << worst << " x tol)";
}
// Largest ulp distance and count above `ulp`.
void ExpectUlp(const std::vector<uint16_t>& got, const std::vector<uint16_t>& want, int max_all, int max_most,
               double most_fraction, const char* what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  size_t above_most = 0, above_all = 0;
  int worst = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const bool nan = (got[i] & 0x7fff) > 0x7f80;
    const int d = nan ? 1 << 20 : Bf16UlpDistance(got[i], want[i]);
    worst = std::max(worst, d);
    if (d > max_most) ++above_most;
    if (d > max_all) ++above_all;
  }
  EXPECT_EQ(above_all, 0u) << what << ": worst " << worst << " ulp";
  EXPECT_LE(double(above_most), (1.0 - most_fraction) * double(got.size()))
      << what << ": " << above_most << " of " << got.size() << " above " << max_most << " ulp";
}

// Normal-mode y (spec "Equality and tolerance"): against the reference, every element within the
// element-wise bound (CheckNormalModeY) and >= 99.9% within 1 ulp; between two paths (`want` the
// other path's y), twice the bound on every element and, as both paths meet the 99.9% clause
// against the reference, >= 99.8% within 2 ulp of each other.
void ExpectNormalY(const Weights& w, const MhcRefOutputs& ref, const std::vector<uint16_t>& got,
                   const std::vector<uint16_t>& want, bool two_paths, const char* what) {
  const NormalYCheck r = CheckNormalModeY(w.hp, RefWeights(w), ref, got, want, two_paths ? 2.0 : 1.0, two_paths ? 2 : 1);
  EXPECT_EQ(r.beyond_bound, 0) << what << ": " << r.beyond_bound << " of " << r.elements
                               << " beyond the element-wise bound; first at " << r.first_bad;
  // The first element past `ulp`, with the reference's z there: whether it sits where the collapse
  // cancels (|z| small against the terms) tells a rounding flip from a kernel error.
  auto describe = [&](int64_t i) {
    if (i < 0) return std::string();
    const int64_t C = w.hp.hidden, t = i / C, c = i % C;
    return absl::StrCat("; first at token ", t, " column ", c, ": got ", Bf16ToFloat(got[size_t(i)]), ", want ",
                        Bf16ToFloat(want[size_t(i)]), ", ", Bf16UlpDistance(got[size_t(i)], want[size_t(i)]),
                        " ulp, reference z ", Bf16ToFloat(ref.z[size_t(i)]));
  };
  EXPECT_LE(double(r.beyond_ulp), (two_paths ? 2e-3 : 1e-3) * double(r.elements))
      << what << ": " << r.beyond_ulp << " of " << r.elements << " beyond " << (two_paths ? 2 : 1) << " ulp"
      << describe(r.first_beyond_ulp);
  std::printf("[ info ] %s: worst %d ulp, %.4f of the element-wise allowance used, %lld of %lld beyond %d ulp%s\n",
              what, r.worst_ulp, r.worst_use, static_cast<long long>(r.beyond_ulp),
              static_cast<long long>(r.elements), two_paths ? 2 : 1, describe(r.first_beyond_ulp).c_str());
}

// ---- fixture --------------------------------------------------------------------------------------
class GpuMhcTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto ctx = GpuContext::Create(0);
    if (!ctx.ok()) GTEST_SKIP() << "no GPU: " << ctx.status();
    ctx_ = std::move(*ctx);
  }
  std::unique_ptr<GpuMhcWeights> Prepare(const Weights& w) {
    MhcWeightsHost h;
    h.fn = TensorView::Contiguous(const_cast<float*>(w.fn.data()), DType::kFP32,
                                  {w.hp.num_mixes(), w.hp.flat_width()});
    h.scale = TensorView::Contiguous(const_cast<float*>(w.scale.data()), DType::kFP32, {3});
    h.base = TensorView::Contiguous(const_cast<float*>(w.base.data()), DType::kFP32, {w.hp.num_mixes()});
    if (!w.g.empty())
      h.norm_weight = TensorView::Contiguous(const_cast<uint16_t*>(w.g.data()), DType::kBF16, {w.hp.hidden});
    auto p = PrepareMhcGpu(w.hp, h, *ctx_);
    EXPECT_TRUE(p.ok()) << p.status();
    return p.ok() ? std::move(*p) : nullptr;
  }
  bool FusedOk(const GpuMhcWeights& w, const Case& c) {
    MhcShapeQuery q;
    q.stage = c.stage;
    q.mode = c.mode;
    q.capture_aux = c.aux;
    q.tokens = c.T;
    return MhcFusedSupportGpu(w, q, *ctx_, kNoTokenLimit).supported;
  }

  // Runs both paths (fused where supported) and checks every contract clause against the reference.
  void CheckCase(const Case& c) {
    SCOPED_TRACE(Name(c));
    auto rng = MakeRng(uint64_t(c.n * 131 + c.C * 7 + c.T));
    const Weights w = MakeWeights(c, rng);
    const Inputs in = MakeInputs(c, rng);
    auto gw = Prepare(w);
    ASSERT_NE(gw, nullptr);
    const MhcRefOutputs ref = Reference(c, w, in);
    Runner run(c, in, *ctx_);
    std::vector<Path> paths = {Path::kUnfused};
    if (FusedOk(*gw, c)) paths.push_back(Path::kFused);
    std::vector<Outputs> outs;
    for (Path p : paths) {
      SCOPED_TRACE(PathName(p));
      Outputs o = run.Run(*gw, p);
      ExpectBitwise(o.nr, ref.new_residual, "new_residual");
      // aux is not bitwise against the fp64 reference: the contract sums the streams in fp32.
      if (c.aux) ExpectUlp(o.aux, ref.aux, 1, 1, 1.0, "aux vs fp64 reference");
      if (c.stage != MhcStage::kHead) {
        ExpectMixes(o.pre, ref.new_pre_mix, "new_pre_mix");
        ExpectMixes(o.post, ref.new_post_mix, "new_post_mix");
        ExpectMixes(o.comb, ref.new_comb_mix, "new_comb_mix");
      }
      if (c.mode == MhcMode::kShifted) {
        ExpectUlp(o.y, ref.y, 1, 1, 1.0, "shifted y vs fp64 reference");
      } else {
        ExpectNormalY(w, ref, o.y, ref.y, false, "normal y vs fp64 reference");
      }
      // Determinism: a second run gives the same bits.
      Outputs again = run.Run(*gw, p);
      ExpectSameBits(again.nr, o.nr, "rerun new_residual");
      ExpectSameBits(again.y, o.y, "rerun y");
      ExpectSameBits(again.pre, o.pre, "rerun new_pre_mix");
      ExpectSameBits(again.post, o.post, "rerun new_post_mix");
      ExpectSameBits(again.comb, o.comb, "rerun new_comb_mix");
      outs.push_back(std::move(o));
    }
    if (outs.size() == 2) {
      ExpectSameBits(outs[1].nr, outs[0].nr, "fused vs unfused new_residual");
      if (c.aux) ExpectSameBits(outs[1].aux, outs[0].aux, "fused vs unfused aux");
      // Where the fused path exists the unfused path runs the same tensor-core mixes pass and the
      // same finalize kernel, so mixes and y agree bit for bit (stronger than the contract's
      // tolerance for mixes and 1-2 ulp for normal-mode y).
      ExpectSameBits(outs[1].y, outs[0].y, "fused vs unfused y");
      ExpectSameBits(outs[1].pre, outs[0].pre, "fused vs unfused new_pre_mix");
      ExpectSameBits(outs[1].post, outs[0].post, "fused vs unfused new_post_mix");
      ExpectSameBits(outs[1].comb, outs[0].comb, "fused vs unfused new_comb_mix");
    }
  }

  std::unique_ptr<GpuContext> ctx_;
};

TEST_F(GpuMhcTest, UnfusedEveryHcMultAndOddHiddenSizes) {
  for (int n : {1, 2, 3, 4, 5, 6, 7, 8})
    for (int64_t C : {int64_t(40), int64_t(1000), int64_t(1037)}) {
      Case c;
      c.n = n;
      c.C = C;
      c.T = 5;
      c.mode = (n % 2) ? MhcMode::kNormal : MhcMode::kShifted;
      c.aux = n == 3;
      CheckCase(c);
    }
}

TEST_F(GpuMhcTest, SeamBothPathsDeepSeekSizes) {
  for (int64_t C : {int64_t(4096), int64_t(7168)})
    for (MhcMode mode : {MhcMode::kShifted, MhcMode::kNormal}) {
      Case c;
      c.C = C;
      c.T = 37;
      c.mode = mode;
      CheckCase(c);
    }
}

// The mixes GEMM runs bf16 MMAs on fn split into hi + lo bf16 parts (16 significant bits): the
// contract tolerance is asserted by every case; this one also prints how much of it is used at the
// DeepSeek sizes (both paths share the pass, so one path suffices), in both modes and the first
// stage, so a change of the split shows up as a number, not only as pass/fail.
TEST_F(GpuMhcTest, MixesToleranceMarginAtDeepSeekSizes) {
  for (int64_t C : {int64_t(4096), int64_t(5120), int64_t(7168)})
    for (MhcStage stage : {MhcStage::kSeam, MhcStage::kFirst})
      for (MhcMode mode : {MhcMode::kShifted, MhcMode::kNormal}) {
        Case c;
        c.C = C;
        c.T = 96;
        c.stage = stage;
        c.mode = mode;
        SCOPED_TRACE(Name(c));
        auto rng = MakeRng(uint64_t(c.C * 11 + c.T + (stage == MhcStage::kFirst ? 5 : 0) + int(mode)));
        const Weights w = MakeWeights(c, rng);
        const Inputs in = MakeInputs(c, rng);
        auto gw = Prepare(w);
        ASSERT_NE(gw, nullptr);
        ASSERT_TRUE(FusedOk(*gw, c));
        const MhcRefOutputs ref = Reference(c, w, in);
        Runner run(c, in, *ctx_);
        const Outputs o = run.Run(*gw, Path::kFused);
        ExpectMixes(o.pre, ref.new_pre_mix, "new_pre_mix");
        ExpectMixes(o.post, ref.new_post_mix, "new_post_mix");
        ExpectMixes(o.comb, ref.new_comb_mix, "new_comb_mix");
        auto worst = [](const std::vector<float>& got, const std::vector<double>& r) {
          double m = 0;
          for (size_t i = 0; i < got.size(); ++i)
            m = std::max(m, std::fabs(double(got[i]) - r[i]) / (1e-5 + 1e-4 * std::fabs(r[i])));
          return m;
        };
        std::printf("mixes margin %s: worst |err|/tol pre %.4f post %.4f comb %.4f\n", Name(c).c_str(),
                    worst(o.pre, ref.new_pre_mix), worst(o.post, ref.new_post_mix), worst(o.comb, ref.new_comb_mix));
      }
}

TEST_F(GpuMhcTest, SeamVariants) {
  std::vector<Case> cases;
  {
    Case c; c.C = 128; c.T = 1; cases.push_back(c);
  }
  {
    Case c; c.C = 1024; c.T = 70; c.has_pre = false; c.aux = true; cases.push_back(c);
  }
  {
    Case c; c.C = 5120; c.T = 33; c.aux = true; c.iters = 10; cases.push_back(c);
  }
  {
    Case c; c.C = 640; c.T = 65; c.mode = MhcMode::kNormal; c.aux = true; c.has_g = false; cases.push_back(c);
  }
  {
    Case c; c.C = 256; c.T = 17; c.has_g = false; c.iters = 1; cases.push_back(c);
  }
  {
    Case c; c.C = 1000; c.T = 9; cases.push_back(c);  // unfused only (C % 128 != 0)
  }
  {
    Case c; c.C = 256; c.T = 1100; c.mode = MhcMode::kNormal; cases.push_back(c);  // 32-token tiles
  }
  {
    Case c; c.C = 384; c.T = 1500; c.aux = true; cases.push_back(c);
  }
  // The persistent staged pass (more staged CTAs than one wave: 9 x 56 and 13 x 40 tile x chunk
  // items) without pre_mix, and in normal mode without a norm weight, both with aux.
  {
    Case c; c.C = 7168; c.T = 130; c.has_pre = false; c.aux = true; cases.push_back(c);
  }
  {
    Case c; c.C = 5120; c.T = 200; c.mode = MhcMode::kNormal; c.aux = true; c.has_g = false; cases.push_back(c);
  }
  for (const Case& c : cases) CheckCase(c);
}

// One-token seams, the per-layer decode call (on the fused path the 16-token-tile register pass and
// the finalize's decode instance with two blocks and its early trigger): every stage and variant (first
// stage, pre mix given or not, aux, with and without norm weight, head stage, normal mode, one
// Sinkhorn iteration) at one chunk, 40 and 56 chunks: bits against the unfused path and the fp64
// reference, each run twice with its outputs poisoned before each run. (Written for a one-kernel
// form of this seam, not kept, which it also passed.)
TEST_F(GpuMhcTest, OneTokenSeams) {
  for (int64_t C : {int64_t(128), int64_t(5120), int64_t(7168)})
    for (int variant = 0; variant < 7; ++variant) {
      Case c;
      c.C = C;
      c.T = 1;
      switch (variant) {
        case 0: break;                                   // pre mix given, norm weight
        case 1: c.has_pre = false; c.aux = true; break;  // stream 0, aux
        case 2: c.has_g = false; c.aux = true; break;    // y is z
        case 3: c.stage = MhcStage::kFirst; break;
        case 4: c.stage = MhcStage::kHead; break;         // no mixes
        case 5: c.mode = MhcMode::kNormal; break;
        case 6: c.iters = 1; c.has_pre = false; break;
      }
      CheckCase(c);
    }
}

// T = 19 runs the fused path's staged pass; at C = 5120, T = 300 (19 tiles x 40 chunks, more than 3
// staged CTAs per SM on any GPU with < 254 SMs) its persistent pass (mhc_launch.cu).
TEST_F(GpuMhcTest, FirstAndHeadStages) {
  for (int64_t C : {int64_t(384), int64_t(5120), int64_t(72)})
    for (int64_t T : {int64_t(19), int64_t(300)})
    for (int variant = 0; variant < 5; ++variant) {
      Case c;
      c.C = C;
      c.T = T;
      if (variant < 2) {
        c.stage = MhcStage::kFirst;
        c.mode = variant == 0 ? MhcMode::kShifted : MhcMode::kNormal;
      } else {
        c.stage = MhcStage::kHead;
        c.has_pre = variant != 2;
        c.has_g = variant != 4;
      }
      CheckCase(c);
    }
}

// A token's outputs do not depend on the batch size or its position in the batch.
TEST_F(GpuMhcTest, BatchInvariance) {
  // The fused path (mhc_launch.cu) runs the register-resident pass for T = 1, the persistent staged
  // pass where the one-tile staged pass would need more than one wave (16-token tiles x chunks > 3 x
  // SMs), the staged pass for the other T <= 1024 and the register-resident pass's 32-token tiles
  // above. So the one-token subset {41} runs the register-resident pass against staged batches (C =
  // 7168, T = 77: 280 tiles x chunks) and 32-token-tile ones (C = 512, T = 1100: 276), and C = 7168,
  // T = 200 (728 tile x chunk items, more than 3 per SM on any GPU with < 243 SMs) the persistent
  // pass against its subsets' staged (67 tokens) and register-resident runs: this test is also the
  // bitwise check of the four kernels. At T = 200 a persistent CTA gets about 728 / (2 x SMs) items
  // in chunk-major order, so several CTAs cross a chunk boundary (new B fragments mid-loop).
  // The unfused path's GEMM-only pass: T = 1100 uses its 32-token tiles for the batch (the tile
  // choice depends on T; the arithmetic must not), and C = 7168, T = 200 its 4-CTA/SM 16-token
  // instance for the batch and the 3-CTA/SM one for the subsets. T = 1100 also runs the finalize
  // kernel with 8 mix warps per block, its subsets with 4.
  const std::vector<std::pair<int64_t, int64_t>> shapes = {{7168, 77}, {1000, 77}, {512, 1100}, {7168, 200}};
  for (MhcMode mode : {MhcMode::kShifted, MhcMode::kNormal})
    for (const auto& [C, T] : shapes) {
      Case c;
      c.C = C;
      c.T = T;
      c.mode = mode;
      c.aux = true;
      SCOPED_TRACE(Name(c));
      auto rng = MakeRng(C);
      const Weights w = MakeWeights(c, rng);
      const Inputs in = MakeInputs(c, rng);
      auto gw = Prepare(w);
      ASSERT_NE(gw, nullptr);
      std::vector<Path> paths = {Path::kUnfused};
      if (FusedOk(*gw, c)) paths.push_back(Path::kFused);
      for (Path p : paths) {
        SCOPED_TRACE(PathName(p));
        Runner full(c, in, *ctx_);
        const Outputs all = full.Run(*gw, p);
        // Subsets: one token alone, and a reversed, strided subset of another size.
        std::vector<std::vector<int64_t>> subsets = {{41}, {}};  // (41 < T for every shape)
        for (int64_t t = c.T - 1; t >= 0; t -= 3) subsets[1].push_back(t);
        for (const auto& idx : subsets) {
          Case cs = c;
          cs.T = int64_t(idx.size());
          Runner sub(cs, Gather(c, in, idx), *ctx_);
          const Outputs o = sub.Run(*gw, p);
          const int n = c.n;
          for (size_t i = 0; i < idx.size(); ++i) {
            const int64_t t = idx[i];
            auto slice = [&](const auto& v, int64_t per, int64_t row) {
              using V = typename std::decay_t<decltype(v)>::value_type;
              return std::vector<V>(v.begin() + row * per, v.begin() + (row + 1) * per);
            };
            ExpectSameBits(slice(o.nr, n * C, i), slice(all.nr, n * C, t), "new_residual");
            ExpectSameBits(slice(o.y, C, i), slice(all.y, C, t), "y");
            ExpectSameBits(slice(o.aux, C, i), slice(all.aux, C, t), "aux");
            ExpectSameBits(slice(o.pre, n, i), slice(all.pre, n, t), "new_pre_mix");
            ExpectSameBits(slice(o.post, n, i), slice(all.post, n, t), "new_post_mix");
            ExpectSameBits(slice(o.comb, n * n, i), slice(all.comb, n * n, t), "new_comb_mix");
          }
        }
      }
    }
}

// A captured graph replays to the same bits as the eager launch, on both paths and in both modes.
TEST_F(GpuMhcTest, GraphReplayMatchesEager) {
  for (Path p : {Path::kFused, Path::kUnfused})
    for (MhcMode mode : {MhcMode::kShifted, MhcMode::kNormal})
    for (int64_t T : {int64_t(64), int64_t(300)}) {  // the fused path's staged and persistent passes (C = 5120)
      Case c;
      c.C = 5120;
      c.T = T;
      c.mode = mode;
      SCOPED_TRACE(Name(c) + "_" + PathName(p));
      auto rng = MakeRng(7);
      const Weights w = MakeWeights(c, rng);
      const Inputs in = MakeInputs(c, rng);
      auto gw = Prepare(w);
      ASSERT_NE(gw, nullptr);
      Runner run(c, in, *ctx_);
      const Outputs eager = run.Run(*gw, p);  // also sizes the workspace before capture
      run.PoisonOutputs();
      ASSERT_EQ(gpuStreamSynchronize(ctx_->stream), gpuSuccess);
      gpuGraph_t graph = nullptr;
      gpuGraphExec_t exec = nullptr;
      ASSERT_EQ(gpuStreamBeginCapture(ctx_->stream, gpuStreamCaptureModeThreadLocal), gpuSuccess);
      const absl::Status s = LaunchMhcGpu(*gw, run.args(), p, *ctx_, kNoTokenLimit);
      ASSERT_EQ(gpuStreamEndCapture(ctx_->stream, &graph), gpuSuccess);
      ASSERT_TRUE(s.ok()) << s;
      ASSERT_EQ(gpuGraphInstantiate(&exec, graph), gpuSuccess);
      for (int rep = 0; rep < 3; ++rep) {
        run.PoisonOutputs();
        ASSERT_EQ(gpuGraphLaunch(exec, ctx_->stream), gpuSuccess);
        const Outputs g = run.Read();
        ExpectSameBits(g.nr, eager.nr, "graph new_residual");
        ExpectSameBits(g.y, eager.y, "graph y");
        ExpectSameBits(g.pre, eager.pre, "graph new_pre_mix");
        ExpectSameBits(g.post, eager.post, "graph new_post_mix");
        ExpectSameBits(g.comb, eager.comb, "graph new_comb_mix");
      }
      EXPECT_EQ(gpuGraphExecDestroy(exec), gpuSuccess);
      EXPECT_EQ(gpuGraphDestroy(graph), gpuSuccess);
    }
}

// Layers back to back, as a model runs them: layer l + 1 reads layer l's new_residual and new mixes
// (its pre mix delayed, shifted mode). Every mHC pass is launched with programmatic dependent
// launch and a one-wave finalize lets the next kernel in early, so the next layer's CTAs are
// resident while the previous layer's kernels run: a read of an activation before the pass's
// GridDependencyWait would see the previous layer's poisoned or half-written outputs. The chain is
// run eagerly with a synchronisation after each layer (nothing overlaps), then eagerly back to back
// and as one CUDA graph (replayed 3 times), every output of every layer poisoned before each run and
// compared bit for bit. Sizes: T = 1 (register pass), 64 (staged pass, early trigger), C = 5120
// T = 300 (persistent pass).
TEST_F(GpuMhcTest, ChainedLayersBackToBackMatchLayerByLayer) {
  constexpr int kLayers = 4;
  for (Path path : {Path::kFused, Path::kUnfused})
    for (MhcMode mode : {MhcMode::kShifted, MhcMode::kNormal})
      for (auto [C, T] : {std::pair<int64_t, int64_t>{7168, 1}, {7168, 64}, {5120, 300}}) {
        Case c;
        c.C = C;
        c.T = T;
        c.mode = mode;
        SCOPED_TRACE(Name(c) + "_" + PathName(path));
        const int n = c.n;
        auto rng = MakeRng(uint64_t(C * 31 + T));
        const Weights w = MakeWeights(c, rng);
        auto gw = Prepare(w);
        ASSERT_NE(gw, nullptr);
        const Inputs first = MakeInputs(c, rng);
        Dev r0 = Upload(first.r.data(), first.r.size() * 2, *ctx_);
        Dev post0 = Upload(first.post.data(), first.post.size() * 4, *ctx_);
        Dev comb0 = Upload(first.comb.data(), first.comb.size() * 4, *ctx_);
        Dev pre0 = Upload(first.pre.data(), first.pre.size() * 4, *ctx_);
        struct Layer {
          Dev x, nr, y, npre, npost, ncomb;
          MhcArgs args;
        };
        std::vector<Layer> layers(kLayers);
        for (int l = 0; l < kLayers; ++l) {
          Layer& L = layers[l];
          const std::vector<uint16_t> x = RandomBf16(rng, size_t(T) * C);
          L.x = Upload(x.data(), x.size() * 2, *ctx_);
          L.nr = Alloc(size_t(T) * n * C * 2);
          L.y = Alloc(size_t(T) * C * 2);
          L.npre = Alloc(size_t(T) * n * 4);
          L.npost = Alloc(size_t(T) * n * 4);
          L.ncomb = Alloc(size_t(T) * n * n * 4);
          const Dev& r = l == 0 ? r0 : layers[l - 1].nr;
          const Dev& post = l == 0 ? post0 : layers[l - 1].npost;
          const Dev& comb = l == 0 ? comb0 : layers[l - 1].ncomb;
          const Dev& pre = l == 0 ? pre0 : layers[l - 1].npre;
          MhcArgs& a = L.args;
          a.stage = MhcStage::kSeam;
          a.mode = mode;
          a.tokens = T;
          a.x = View(L.x, DType::kBF16, {T, C});
          a.residual = View(r, DType::kBF16, {T, n, C});
          a.post_mix = View(post, DType::kFP32, {T, n});
          a.comb_mix = View(comb, DType::kFP32, {T, n, n});
          if (mode == MhcMode::kShifted) a.pre_mix = View(pre, DType::kFP32, {T, n});
          a.new_residual = View(L.nr, DType::kBF16, {T, n, C});
          a.new_pre_mix = View(L.npre, DType::kFP32, {T, n});
          a.new_post_mix = View(L.npost, DType::kFP32, {T, n});
          a.new_comb_mix = View(L.ncomb, DType::kFP32, {T, n, n});
          a.y = View(L.y, DType::kBF16, {T, C});
        }
        auto poison_all = [&] {
          for (Layer& L : layers)
            for (Dev* d : {&L.nr, &L.y, &L.npre, &L.npost, &L.ncomb}) Poison(*d, *ctx_);
        };
        auto read_all = [&] {
          std::vector<Outputs> out(kLayers);
          for (int l = 0; l < kLayers; ++l) {
            out[l].nr = Download<uint16_t>(layers[l].nr, *ctx_);
            out[l].y = Download<uint16_t>(layers[l].y, *ctx_);
            out[l].pre = Download<float>(layers[l].npre, *ctx_);
            out[l].post = Download<float>(layers[l].npost, *ctx_);
            out[l].comb = Download<float>(layers[l].ncomb, *ctx_);
          }
          return out;
        };
        auto expect_same = [&](const std::vector<Outputs>& got, const std::vector<Outputs>& want, const char* run) {
          for (int l = 0; l < kLayers; ++l) {
            SCOPED_TRACE(absl::StrCat(run, ", layer ", l));
            ExpectSameBits(got[l].nr, want[l].nr, "new_residual");
            ExpectSameBits(got[l].y, want[l].y, "y");
            ExpectSameBits(got[l].pre, want[l].pre, "new_pre_mix");
            ExpectSameBits(got[l].post, want[l].post, "new_post_mix");
            ExpectSameBits(got[l].comb, want[l].comb, "new_comb_mix");
          }
        };
        auto enqueue_all = [&](bool sync_each) {
          for (const Layer& L : layers) {
            const absl::Status s = LaunchMhcGpu(*gw, L.args, path, *ctx_, kNoTokenLimit);
            ASSERT_TRUE(s.ok()) << s;
            if (sync_each) ASSERT_EQ(gpuStreamSynchronize(ctx_->stream), gpuSuccess);
          }
        };

        poison_all();
        enqueue_all(/*sync_each=*/true);
        const std::vector<Outputs> layer_by_layer = read_all();
        // Every output written (Poison fills 0xff bytes: a NaN that no kernel produces from these inputs).
        auto no_poison = [](const std::vector<float>& v) {
          return std::all_of(v.begin(), v.end(), [](float e) { return std::isfinite(e); });
        };
        for (const Outputs& o : layer_by_layer) {
          ASSERT_TRUE(no_poison(o.pre) && no_poison(o.post) && no_poison(o.comb)) << "a mix was not written";
          ASSERT_TRUE(std::none_of(o.nr.begin(), o.nr.end(), [](uint16_t b) { return b == 0xffff; })) << "R' not written";
          ASSERT_TRUE(std::none_of(o.y.begin(), o.y.end(), [](uint16_t b) { return b == 0xffff; })) << "y not written";
        }

        poison_all();
        enqueue_all(/*sync_each=*/false);
        expect_same(read_all(), layer_by_layer, "eager back to back");

        ASSERT_EQ(gpuStreamSynchronize(ctx_->stream), gpuSuccess);
        gpuGraph_t graph = nullptr;
        gpuGraphExec_t exec = nullptr;
        ASSERT_EQ(gpuStreamBeginCapture(ctx_->stream, gpuStreamCaptureModeThreadLocal), gpuSuccess);
        enqueue_all(/*sync_each=*/false);
        ASSERT_EQ(gpuStreamEndCapture(ctx_->stream, &graph), gpuSuccess);
        ASSERT_EQ(gpuGraphInstantiate(&exec, graph), gpuSuccess);
        for (int rep = 0; rep < 3; ++rep) {
          poison_all();
          ASSERT_EQ(gpuGraphLaunch(exec, ctx_->stream), gpuSuccess);
          expect_same(read_all(), layer_by_layer, "graph replay");
        }
        EXPECT_EQ(gpuGraphExecDestroy(exec), gpuSuccess);
        EXPECT_EQ(gpuGraphDestroy(graph), gpuSuccess);
      }
}

// The GPU paths against the CPU backend (the same contract implemented independently):
// new_residual and aux bitwise, mixes within the contract tolerance, shifted y within 1 ulp,
// normal-mode y within twice the contract's element-wise bound (both backends also against the
// fp64 reference).
TEST_F(GpuMhcTest, MatchesCpuBackend) {
  std::unique_ptr<Backend> cpu = CreateCpuBackend();
  std::vector<Case> cases;
  {
    Case c; c.C = 1024; c.T = 9; c.aux = true; cases.push_back(c);
  }
  {
    Case c; c.C = 7168; c.T = 3; c.mode = MhcMode::kNormal; cases.push_back(c);
  }
  {
    Case c; c.n = 3; c.C = 100; c.T = 6; c.has_pre = false; cases.push_back(c);
  }
  {
    Case c; c.C = 512; c.T = 5; c.stage = MhcStage::kFirst; c.mode = MhcMode::kNormal; cases.push_back(c);
  }
  {
    Case c; c.C = 512; c.T = 5; c.stage = MhcStage::kHead; cases.push_back(c);
  }
  for (const Case& c : cases) {
    SCOPED_TRACE(Name(c));
    auto rng = MakeRng(uint64_t(c.C + c.T));
    const Weights w = MakeWeights(c, rng);
    Inputs in = MakeInputs(c, rng);
    auto gw = Prepare(w);
    ASSERT_NE(gw, nullptr);
    // CPU run on host views.
    MhcWeightsHost h;
    h.fn = TensorView::Contiguous(const_cast<float*>(w.fn.data()), DType::kFP32, {w.hp.num_mixes(), w.hp.flat_width()});
    h.scale = TensorView::Contiguous(const_cast<float*>(w.scale.data()), DType::kFP32, {3});
    h.base = TensorView::Contiguous(const_cast<float*>(w.base.data()), DType::kFP32, {w.hp.num_mixes()});
    if (!w.g.empty()) h.norm_weight = TensorView::Contiguous(const_cast<uint16_t*>(w.g.data()), DType::kBF16, {c.C});
    auto cw = cpu->PrepareMhc(w.hp, h);
    ASSERT_TRUE(cw.ok()) << cw.status();
    const int n = c.n;
    const int64_t T = c.T, C = c.C;
    Outputs co;
    co.nr.assign(size_t(T) * n * C, 0xffff);
    co.y.assign(size_t(T) * C, 0xffff);
    if (c.aux) co.aux.assign(size_t(T) * C, 0xffff);
    co.pre.assign(size_t(T) * n, NAN);
    co.post.assign(size_t(T) * n, NAN);
    co.comb.assign(size_t(T) * n * n, NAN);
    MhcArgs a;
    a.stage = c.stage;
    a.mode = c.mode;
    a.capture_aux = c.aux;
    a.tokens = T;
    a.x = TensorView::Contiguous(in.x.data(), DType::kBF16, {T, C});
    if (c.stage != MhcStage::kFirst) {
      a.residual = TensorView::Contiguous(in.r.data(), DType::kBF16, {T, n, C});
      a.post_mix = TensorView::Contiguous(in.post.data(), DType::kFP32, {T, n});
      a.comb_mix = TensorView::Contiguous(in.comb.data(), DType::kFP32, {T, n, n});
      if (c.has_pre && c.mode == MhcMode::kShifted) a.pre_mix = TensorView::Contiguous(in.pre.data(), DType::kFP32, {T, n});
    }
    a.new_residual = TensorView::Contiguous(co.nr.data(), DType::kBF16, {T, n, C});
    if (c.stage != MhcStage::kHead) {
      a.new_pre_mix = TensorView::Contiguous(co.pre.data(), DType::kFP32, {T, n});
      a.new_post_mix = TensorView::Contiguous(co.post.data(), DType::kFP32, {T, n});
      a.new_comb_mix = TensorView::Contiguous(co.comb.data(), DType::kFP32, {T, n, n});
    }
    a.y = TensorView::Contiguous(co.y.data(), DType::kBF16, {T, C});
    if (c.aux) a.aux = TensorView::Contiguous(co.aux.data(), DType::kBF16, {T, C});
    auto st = cpu->RunMhc(**cw, a, Path::kUnfused);
    ASSERT_TRUE(st.ok()) << st.status();
    const MhcRefOutputs ref = Reference(c, w, in);
    if (c.mode == MhcMode::kNormal) ExpectNormalY(w, ref, co.y, ref.y, false, "CPU normal y vs fp64 reference");

    Runner run(c, in, *ctx_);
    std::vector<Path> paths = {Path::kUnfused};
    if (FusedOk(*gw, c)) paths.push_back(Path::kFused);
    for (Path p : paths) {
      SCOPED_TRACE(PathName(p));
      const Outputs o = run.Run(*gw, p);
      ExpectBitwise(o.nr, co.nr, "new_residual vs CPU");
      if (c.aux) ExpectBitwise(o.aux, co.aux, "aux vs CPU");
      if (c.stage != MhcStage::kHead) {
        ExpectMixes(o.pre, std::vector<double>(co.pre.begin(), co.pre.end()), "new_pre_mix vs CPU");
        ExpectMixes(o.post, std::vector<double>(co.post.begin(), co.post.end()), "new_post_mix vs CPU");
        ExpectMixes(o.comb, std::vector<double>(co.comb.begin(), co.comb.end()), "new_comb_mix vs CPU");
      }
      if (c.mode == MhcMode::kShifted) {
        // Same R' and pre_mix bits; only the sum-of-squares order differs between backends.
        ExpectUlp(o.y, co.y, 1, 1, 1.0, "shifted y vs CPU");
      } else {
        // Two backends, each with its own (in-tolerance) pre mixes: twice the contract's bound.
        ExpectNormalY(w, ref, o.y, ref.y, false, "normal y vs fp64 reference");
        ExpectNormalY(w, ref, o.y, co.y, true, "normal y vs CPU");
      }
    }
  }
}

TEST_F(GpuMhcTest, FusedSupportReasons) {
  auto rng = MakeRng(3);
  auto support = [&](int n, int64_t C, int64_t T, int64_t limit) {
    Case c;
    c.n = n;
    c.C = C;
    const Weights w = MakeWeights(c, rng);
    auto gw = Prepare(w);
    MhcShapeQuery q;
    q.tokens = T;
    return MhcFusedSupportGpu(*gw, q, *ctx_, limit);
  };
  const bool mma = ctx_->cc_major >= 8 && ctx_->arch.rfind("sm_", 0) == 0;
  if (!mma) {
    EXPECT_EQ(support(4, 256, 1, kNoTokenLimit).reason, FallbackReason::kDeviceArchUnsupported);
    return;
  }
  EXPECT_TRUE(support(4, 256, 1, kNoTokenLimit).supported);
  FusedSupport s = support(3, 256, 1, kNoTokenLimit);
  EXPECT_FALSE(s.supported);
  EXPECT_EQ(s.reason, FallbackReason::kHcMultUnsupported);
  s = support(4, 1000, 1, kNoTokenLimit);
  EXPECT_FALSE(s.supported);
  EXPECT_EQ(s.reason, FallbackReason::kHiddenSizeUnsupported);
  s = support(4, 256, 65, 64);
  EXPECT_FALSE(s.supported);
  EXPECT_EQ(s.reason, FallbackReason::kTooManyTokens);
  EXPECT_TRUE(support(4, 256, 64, 64).supported);
}

TEST_F(GpuMhcTest, ArgumentErrorsAndEmptyBatch) {
  Case c;
  c.n = 3;
  c.C = 200;
  c.T = 4;
  auto rng = MakeRng(11);
  const Weights w = MakeWeights(c, rng);
  const Inputs in = MakeInputs(c, rng);
  auto gw = Prepare(w);
  ASSERT_NE(gw, nullptr);
  Runner run(c, in, *ctx_);
  // Fused requested where unsupported (n = 3): FailedPrecondition, nothing written.
  run.PoisonOutputs();
  absl::Status s = LaunchMhcGpu(*gw, run.args(), Path::kFused, *ctx_, kNoTokenLimit);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  for (uint16_t b : run.Read().nr) ASSERT_EQ(b, 0xffff);
  // Wrong shape: InvalidArgument.
  MhcArgs bad = run.args();
  bad.y.shape[1] = c.C + 1;
  s = LaunchMhcGpu(*gw, bad, Path::kUnfused, *ctx_, kNoTokenLimit);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  // T = 0: OK, nothing launched.
  MhcArgs empty;
  empty.tokens = 0;
  empty.x = TensorView::Contiguous(nullptr, DType::kBF16, {0, c.C});
  empty.residual = TensorView::Contiguous(nullptr, DType::kBF16, {0, c.n, c.C});
  empty.post_mix = TensorView::Contiguous(nullptr, DType::kFP32, {0, c.n});
  empty.comb_mix = TensorView::Contiguous(nullptr, DType::kFP32, {0, c.n, c.n});
  empty.new_residual = TensorView::Contiguous(nullptr, DType::kBF16, {0, c.n, c.C});
  empty.new_pre_mix = TensorView::Contiguous(nullptr, DType::kFP32, {0, c.n});
  empty.new_post_mix = TensorView::Contiguous(nullptr, DType::kFP32, {0, c.n});
  empty.new_comb_mix = TensorView::Contiguous(nullptr, DType::kFP32, {0, c.n, c.n});
  empty.y = TensorView::Contiguous(nullptr, DType::kBF16, {0, c.C});
  s = LaunchMhcGpu(*gw, empty, Path::kUnfused, *ctx_, kNoTokenLimit);
  EXPECT_TRUE(s.ok()) << s;
}

}  // namespace
}  // namespace fusedlayer::gpu
