#include "weights/demo_weights.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numbers>
#include <random>
#include <string>

#include "fusedlayer/numeric.h"
#include "weights/packing.h"

namespace fusedlayer::server {
namespace {

namespace v1 = ::fusedlayer::v1;

// Portable random numbers: std::*_distribution differ between standard libraries, mt19937_64's raw
// sequence does not.
class DemoRng {
 public:
  explicit DemoRng(uint64_t seed) : gen_(seed) {}
  double Uniform() { return static_cast<double>(gen_() >> 11) * 0x1.0p-53; }  // [0, 1)
  double Uniform(double lo, double hi) { return lo + (hi - lo) * Uniform(); }
  double Normal(double sigma) {  // Box-Muller
    const double u1 = 1.0 - Uniform();  // (0, 1]
    const double u2 = Uniform();
    return sigma * std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * std::numbers::pi * u2);
  }

 private:
  std::mt19937_64 gen_;
};

template <typename T>
std::string_view Bytes(const std::vector<T>& v) {
  return std::string_view(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(T));
}

std::vector<float> NormalF32(DemoRng& rng, size_t n, double sigma) {
  std::vector<float> v(n);
  for (float& x : v) x = static_cast<float>(rng.Normal(sigma));
  return v;
}

std::vector<float> UniformF32(DemoRng& rng, size_t n, double lo, double hi) {
  std::vector<float> v(n);
  for (float& x : v) x = static_cast<float>(rng.Uniform(lo, hi));
  return v;
}

std::vector<uint16_t> UniformBf16(DemoRng& rng, size_t n, double lo, double hi) {
  std::vector<uint16_t> v(n);
  for (uint16_t& x : v) x = FloatToBf16(static_cast<float>(rng.Uniform(lo, hi)));
  return v;
}

void AddMhc(WeightSetPacker& p, DemoRng& rng, int n, int64_t C, bool v41) {
  v1::MhcConfig* c = p.header().mutable_mhc();
  c->set_hc_mult(n);
  c->set_hidden(C);
  if (v41) {
    c->set_hc_norm_eps(1e-20f);
    c->set_norm_eps(1e-20f);
  }
  const int64_t M = int64_t{n} * (n + 2), K = int64_t{n} * C;
  p.Add("mhc.fn", DType::kFP32, {M, K}, Bytes(NormalF32(rng, size_t(M * K), 1.0 / std::sqrt(double(K)))));
  p.Add("mhc.scale", DType::kFP32, {3}, Bytes(UniformF32(rng, 3, 0.5, 2.0)));
  p.Add("mhc.base", DType::kFP32, {M}, Bytes(NormalF32(rng, size_t(M), 0.1)));
  p.Add("mhc.norm_weight", DType::kBF16, {C}, Bytes(UniformBf16(rng, size_t(C), 0.5, 1.5)));
}

// DeepSeek-style block-quantised fp8 weight: per 128x128 block a power-of-two scale covering the
// block's amax, codes = fp8(w / scale).
void AddWqB(WeightSetPacker& p, DemoRng& rng, int64_t N, int64_t Q, Fp8Format fmt) {
  const std::vector<float> w = NormalF32(rng, size_t(N * Q), 0.02);
  const int64_t nb = N / 128, kb = Q / 128;
  std::vector<uint8_t> codes(size_t(N * Q));
  std::vector<float> scales(size_t(nb * kb));
  for (int64_t bi = 0; bi < nb; ++bi) {
    for (int64_t bk = 0; bk < kb; ++bk) {
      float amax = 0;
      for (int64_t r = bi * 128; r < (bi + 1) * 128; ++r) {
        for (int64_t k = bk * 128; k < (bk + 1) * 128; ++k) amax = std::max(amax, std::fabs(w[r * Q + k]));
      }
      // An all-zero block (impossible with these draws, but cheap to rule out) keeps scale 1, not 0.
      const float scale = amax > 0 ? CeilToUe8m0(amax / Fp8Max(fmt)) : 1.0f;
      scales[bi * kb + bk] = scale;
      for (int64_t r = bi * 128; r < (bi + 1) * 128; ++r) {
        for (int64_t k = bk * 128; k < (bk + 1) * 128; ++k) codes[r * Q + k] = FloatToFp8(w[r * Q + k] / scale, fmt);
      }
    }
  }
  const DType dt = fmt == Fp8Format::kE4M3FN ? DType::kFP8E4M3FN : DType::kFP8E4M3FNUZ;
  p.Add("swa.wq_b", dt, {N, Q}, Bytes(codes));
  p.Add("swa.wq_b_scale", DType::kFP32, {nb, kb}, Bytes(scales));
}

void AddSwaNorms(WeightSetPacker& p, DemoRng& rng, int64_t Q, int64_t D) {
  p.Add("swa.q_norm", DType::kBF16, {Q}, Bytes(UniformBf16(rng, size_t(Q), 0.5, 1.5)));
  p.Add("swa.kv_norm", DType::kBF16, {D}, Bytes(UniformBf16(rng, size_t(D), 0.5, 1.5)));
}

}  // namespace

absl::StatusOr<std::vector<PackedWeightSet>> MakeDemoWeightSets(uint64_t seed) {
  std::vector<PackedWeightSet> out;
  DemoRng rng(seed);
  {
    WeightSetPacker p(kDemoFlashSetName);
    AddMhc(p, rng, 4, 5120, /*v41=*/true);
    v1::SwaConfig* s = p.header().mutable_swa();
    s->set_q_rank(1280);
    s->set_head_dim(512);
    s->set_eps(1e-6f);
    s->set_fp8_format(v1::FP8_FORMAT_E4M3FN);
    s->set_scale_format(v1::SCALE_FORMAT_FP32);
    s->set_scale_layout(v1::SCALE_LAYOUT_ROW_MAJOR);
    AddSwaNorms(p, rng, 1280, 512);
    AddWqB(p, rng, 1024, 1280, Fp8Format::kE4M3FN);
    absl::StatusOr<PackedWeightSet> set = p.Finish();
    if (!set.ok()) return set.status();
    out.push_back(std::move(*set));
  }
  {
    WeightSetPacker p(kDemoProSetName);
    AddMhc(p, rng, 4, 7168, /*v41=*/false);
    v1::SwaConfig* s = p.header().mutable_swa();
    s->set_q_rank(1536);
    s->set_head_dim(512);
    s->set_eps(1e-6f);
    s->set_fp8_format(v1::FP8_FORMAT_E4M3FN);
    s->set_scale_format(v1::SCALE_FORMAT_UE8M0);
    s->set_scale_layout(v1::SCALE_LAYOUT_COLUMN_MAJOR_TMA);
    AddSwaNorms(p, rng, 1536, 512);
    absl::StatusOr<PackedWeightSet> set = p.Finish();
    if (!set.ok()) return set.status();
    out.push_back(std::move(*set));
  }
  return out;
}

}  // namespace fusedlayer::server
