#include "mhc_reference.h"

#include <algorithm>
#include <cmath>

#include "fusedlayer/numeric.h"
#include "test_util.h"

namespace fusedlayer::testing {
namespace {

// Correctly rounded double -> bf16 (round to nearest even). Going through float first is exact
// except when the float lands exactly on a bf16 midpoint that the double was not on; then the
// double decides the direction.
uint16_t DoubleToBf16(double d) {
  const float f = static_cast<float>(d);
  const uint32_t u = FloatBits(f);
  if ((u & 0xffffu) == 0x8000u && static_cast<double>(f) != d && std::isfinite(f)) {
    const bool away = std::fabs(d) > std::fabs(static_cast<double>(f));
    return static_cast<uint16_t>((u >> 16) + (away ? 1u : 0u));
  }
  return FloatToBf16(f);
}

double Sigmoid(double v) { return 1.0 / (1.0 + std::exp(-v)); }

struct Mix {
  std::vector<double> pre, post, comb;
};

// Mix_theta on one token's flat R' (bf16 bits, K values), all in double.
Mix MixToken(const MhcHyperParams& hp, const MhcRefWeights& w, const uint16_t* Rp) {
  const int n = hp.hc_mult;
  const int64_t K = hp.flat_width();
  const int M = hp.num_mixes();
  double S = 0;
  for (int64_t k = 0; k < K; ++k) {
    const double v = Bf16ToFloat(Rp[k]);
    S += v * v;
  }
  const double r = 1.0 / std::sqrt(S / double(K) + double(hp.hc_norm_eps));
  std::vector<double> a(M);
  for (int o = 0; o < M; ++o) {
    double d = 0;
    const float* f = w.fn.data() + int64_t(o) * K;
    for (int64_t k = 0; k < K; ++k) d += double(Bf16ToFloat(Rp[k])) * double(f[k]);
    const int g = o < n ? 0 : o < 2 * n ? 1 : 2;
    a[o] = (r * d) * double(w.scale[g]) + double(w.base[o]);
  }
  Mix m;
  m.pre.resize(n);
  m.post.resize(n);
  for (int j = 0; j < n; ++j) {
    m.pre[j] = Sigmoid(a[j]) + double(hp.hc_pre_eps);
    m.post[j] = Sigmoid(a[n + j]) * double(hp.post_scale);
  }
  const double eps = hp.sinkhorn_eps;
  std::vector<double> P(n * n);
  for (int i = 0; i < n; ++i) {
    double mx = -INFINITY;
    for (int j = 0; j < n; ++j) mx = std::max(mx, a[2 * n + n * i + j]);
    double sum = 0;
    for (int j = 0; j < n; ++j) sum += std::exp(a[2 * n + n * i + j] - mx);
    for (int j = 0; j < n; ++j) P[i * n + j] = std::exp(a[2 * n + n * i + j] - mx) / sum + eps;
  }
  auto columns = [&] {
    for (int j = 0; j < n; ++j) {
      double sum = 0;
      for (int i = 0; i < n; ++i) sum += P[i * n + j];
      for (int i = 0; i < n; ++i) P[i * n + j] /= (sum + eps);
    }
  };
  auto rows = [&] {
    for (int i = 0; i < n; ++i) {
      double sum = 0;
      for (int j = 0; j < n; ++j) sum += P[i * n + j];
      for (int j = 0; j < n; ++j) P[i * n + j] /= (sum + eps);
    }
  };
  columns();
  for (int it = 1; it < hp.sinkhorn_iters; ++it) {
    rows();
    columns();
  }
  m.comb = std::move(P);
  return m;
}

// y = RMSNorm_g(Collapse(R', coef)) for one token; coef == nullptr selects stream 0.
// Writes z (bf16) and returns rho (1 without a norm weight).
double CollapseNormToken(const MhcHyperParams& hp, const MhcRefWeights& w, const uint16_t* Rp, const float* coef,
                         uint16_t* y, uint16_t* z) {
  const int n = hp.hc_mult;
  const int64_t C = hp.hidden;
  for (int64_t c = 0; c < C; ++c) {
    if (coef == nullptr) {
      z[c] = Rp[c];
    } else {
      // The contract's collapse: fp32 fma chain over j from 0, one bf16 rounding.
      float acc = 0.0f;
      for (int j = 0; j < n; ++j) acc = std::fma(coef[j], Bf16ToFloat(Rp[j * C + c]), acc);
      z[c] = FloatToBf16(acc);
    }
  }
  if (w.norm_weight.empty()) {
    std::copy(z, z + C, y);
    return 1.0;
  }
  double ss = 0;
  for (int64_t c = 0; c < C; ++c) {
    const double v = Bf16ToFloat(z[c]);
    ss += v * v;
  }
  const double rho = 1.0 / std::sqrt(ss / double(C) + double(hp.norm_eps));
  for (int64_t c = 0; c < C; ++c) {
    y[c] = DoubleToBf16((double(Bf16ToFloat(z[c])) * rho) * double(Bf16ToFloat(w.norm_weight[c])));
  }
  return rho;
}

}  // namespace

MhcRefOutputs MhcReference(const MhcHyperParams& hp, const MhcRefWeights& w, const MhcRefInputs& in) {
  const int n = hp.hc_mult;
  const int64_t C = hp.hidden, K = hp.flat_width(), T = in.tokens;
  MhcRefOutputs out;
  out.new_residual.resize(T * K);
  out.y.resize(T * C);
  out.z.resize(T * C);
  out.rho.resize(T);
  const bool has_mixes = in.stage != MhcStage::kHead;
  if (has_mixes) {
    out.new_pre_mix.resize(T * n);
    out.new_post_mix.resize(T * n);
    out.new_comb_mix.resize(T * n * n);
  }
  if (in.capture_aux) out.aux.resize(T * C);

  for (int64_t t = 0; t < T; ++t) {
    uint16_t* Rp = out.new_residual.data() + t * K;
    const uint16_t* x = in.x.data() + t * C;
    if (in.stage == MhcStage::kFirst) {
      for (int j = 0; j < n; ++j) std::copy(x, x + C, Rp + j * C);
    } else {
      const uint16_t* R = in.residual.data() + t * K;
      const float* post = in.post_mix.data() + t * n;
      const float* comb = in.comb_mix.data() + t * n * n;
      for (int j = 0; j < n; ++j) {
        for (int64_t c = 0; c < C; ++c) {
          float v = Bf16ToFloat(x[c]) * post[j];
          for (int i = 0; i < n; ++i) v = std::fma(Bf16ToFloat(R[i * C + c]), comb[i * n + j], v);
          Rp[j * C + c] = FloatToBf16(v);
        }
      }
    }
    std::vector<float> pre_f(n);
    if (has_mixes) {
      Mix m = MixToken(hp, w, Rp);
      std::copy(m.pre.begin(), m.pre.end(), out.new_pre_mix.begin() + t * n);
      std::copy(m.post.begin(), m.post.end(), out.new_post_mix.begin() + t * n);
      std::copy(m.comb.begin(), m.comb.end(), out.new_comb_mix.begin() + t * n * n);
      // The collapse consumes the fp32 pre' output.
      for (int j = 0; j < n; ++j) pre_f[j] = static_cast<float>(m.pre[j]);
    }
    const float* coef = nullptr;
    if (in.mode == MhcMode::kNormal) {
      coef = pre_f.data();
    } else if (in.stage != MhcStage::kFirst && !in.pre_mix.empty()) {
      coef = in.pre_mix.data() + t * n;
    }
    out.rho[t] = CollapseNormToken(hp, w, Rp, coef, out.y.data() + t * C, out.z.data() + t * C);
    if (in.capture_aux) {
      for (int64_t c = 0; c < C; ++c) {
        double s = 0;
        for (int j = 0; j < n; ++j) s += Bf16ToFloat(Rp[j * C + c]);
        out.aux[t * C + c] = DoubleToBf16(s / n);
      }
    }
  }
  return out;
}

double Bf16Ulp(uint16_t b) {
  const int e = (b >> 7) & 0xff;
  return e == 0 ? std::ldexp(1.0, -133) : std::ldexp(1.0, e - 127 - 7);
}

NormalYCheck CheckNormalModeY(const MhcHyperParams& hp, const MhcRefWeights& w, const MhcRefOutputs& ref,
                              const std::vector<uint16_t>& got, const std::vector<uint16_t>& want, double factor,
                              int ulp) {
  const int n = hp.hc_mult;
  const int64_t C = hp.hidden;
  NormalYCheck r;
  r.elements = int64_t(got.size());
  const int64_t T = C ? int64_t(ref.y.size()) / C : 0;
  if (got.size() != ref.y.size() || want.size() != ref.y.size() || ref.z.size() != ref.y.size() ||
      int64_t(ref.rho.size()) != T || int64_t(ref.new_pre_mix.size()) != T * n) {
    r.beyond_bound = r.elements ? r.elements : 1;  // a shape mismatch never passes
    r.first_bad = 0;
    return r;
  }
  for (int64_t t = 0; t < T; ++t) {
    const uint16_t* Rp = ref.new_residual.data() + t * n * C;
    const double* pre = ref.new_pre_mix.data() + t * n;
    for (int64_t c = 0; c < C; ++c) {
      const size_t i = size_t(t * C + c);
      double carried = 0;  // the mixes tolerance of pre' carried through the collapse
      for (int j = 0; j < n; ++j) carried += (1e-5 + 1e-4 * pre[j]) * std::fabs(double(Bf16ToFloat(Rp[j * C + c])));
      const double g = w.norm_weight.empty() ? 1.0 : std::fabs(double(Bf16ToFloat(w.norm_weight[c])));
      const double bound =
          factor * (2 * Bf16Ulp(ref.y[i]) + ref.rho[t] * g * (Bf16Ulp(ref.z[i]) + carried));
      const double a = Bf16ToFloat(got[i]), b = Bf16ToFloat(want[i]);
      const double diff = std::fabs(a - b);
      const int d = std::isnan(a) ? (1 << 20) : Bf16UlpDistance(got[i], want[i]);
      r.worst_ulp = std::max(r.worst_ulp, d);
      if (d > ulp && r.beyond_ulp++ == 0) r.first_beyond_ulp = int64_t(i);
      if (!(diff <= bound)) {  // NaN fails
        if (r.beyond_bound++ == 0) r.first_bad = int64_t(i);
      } else if (diff / bound > r.worst_use) {
        r.worst_use = diff / bound;
      }
    }
  }
  return r;
}

}  // namespace fusedlayer::testing
