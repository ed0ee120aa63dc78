#include "client/lib/random_inputs.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "fusedlayer/numeric.h"
#include "client/lib/tensor_messages.h"

namespace fusedlayer::client {

std::vector<uint16_t> RandomActivationsBf16(std::mt19937_64& rng, size_t n, float sigma, float outlier) {
  std::normal_distribution<float> normal(0.0f, sigma);
  std::uniform_real_distribution<float> u01(0.0f, 1.0f);
  std::vector<uint16_t> out(n);
  for (uint16_t& b : out) {
    // Redraw until the *rounded* value is non-zero: a tiny fp32 draw may round to +-0 in bf16.
    do {
      float v = normal(rng);
      if (u01(rng) < 0.01f) v *= outlier;
      b = FloatToBf16(v);
    } while ((b & 0x7fffu) == 0);
  }
  return out;
}

std::vector<float> RandomUniform(std::mt19937_64& rng, size_t n, float lo, float hi) {
  std::uniform_real_distribution<float> u(lo, hi);
  std::vector<float> out(n);
  for (float& f : out) {
    // uniform_real_distribution is [lo, hi); redraw the endpoints so the interval is open.
    do f = u(rng); while (f <= lo || f >= hi || f == 0.0f);
  }
  return out;
}

std::vector<float> RandomCombMix(std::mt19937_64& rng, int64_t rows, int n) {
  std::vector<float> out = RandomUniform(rng, size_t(rows) * n * n, 0.05f, 1.0f);
  for (int64_t t = 0; t < rows; ++t) {
    float* m = out.data() + t * n * n;
    // Sinkhorn sweeps (as Mix does): columns end summing to 1, rows to ~1, every entry stays
    // positive (a sweep only divides by positive sums).
    for (int sweep = 0; sweep < 20; ++sweep) {
      for (int i = 0; i < n; ++i) {
        float s = 0;
        for (int j = 0; j < n; ++j) s += m[i * n + j];
        for (int j = 0; j < n; ++j) m[i * n + j] /= s;
      }
      for (int j = 0; j < n; ++j) {
        float s = 0;
        for (int i = 0; i < n; ++i) s += m[i * n + j];
        for (int i = 0; i < n; ++i) m[i * n + j] /= s;
      }
    }
  }
  return out;
}

namespace {

// Approximate request size for the 2 GiB check (tensor bytes dominate; framing is a few bytes each).
uint64_t MhcRequestBytes(const v1::MhcConfig& c, const MhcRequestSpec& s) {
  const uint64_t t = uint64_t(s.tokens), n = uint64_t(c.hc_mult()), h = uint64_t(c.hidden());
  uint64_t bytes = t * h * 2;  // x
  if (s.stage != v1::MHC_STAGE_FIRST) bytes += t * n * h * 2 + t * n * 4 + t * n * n * 4 + t * n * 4;
  return bytes;
}

}  // namespace

absl::Status ValidateMhcSpec(const v1::MhcConfig& config, const MhcRequestSpec& spec) {
  if (config.hc_mult() < 1 || config.hc_mult() > 8) {
    return absl::InvalidArgumentError(absl::StrCat("weight set has hc_mult = ", config.hc_mult(), ", outside 1..8"));
  }
  if (config.hidden() <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("weight set has hidden = ", config.hidden()));
  }
  if (spec.tokens < 0) return absl::InvalidArgumentError(absl::StrCat("tokens = ", spec.tokens, " is negative"));
  // Keep the products below in range before computing the size.
  if (spec.tokens > (int64_t{1} << 31)) {
    return absl::InvalidArgumentError(absl::StrCat("tokens = ", spec.tokens, " is too large"));
  }
  if (spec.stage == v1::MHC_STAGE_HEAD && spec.mode != v1::MHC_MODE_SHIFTED) {
    return absl::InvalidArgumentError("stage head exists only in shifted mode (V4.1)");
  }
  if (spec.capture_aux && spec.stage != v1::MHC_STAGE_SEAM) {
    return absl::InvalidArgumentError("capture_aux applies to the seam stage only");
  }
  if (const uint64_t b = MhcRequestBytes(config, spec); b > kMaxRequestBytes) {
    return absl::InvalidArgumentError(absl::StrCat("a request of ", spec.tokens, " tokens is ", b,
                                                   " bytes, over protobuf's 2 GiB message limit; use fewer tokens"));
  }
  return absl::OkStatus();
}

absl::Status ValidateSwaSpec(const v1::SwaConfig& config, const SwaRequestSpec& spec) {
  if (config.q_rank() <= 0 || config.q_rank() % 128 != 0) {
    return absl::InvalidArgumentError(absl::StrCat("weight set has q_rank = ", config.q_rank(),
                                                   ", not a positive multiple of 128"));
  }
  if (config.head_dim() <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("weight set has head_dim = ", config.head_dim()));
  }
  if (spec.tokens < 0) return absl::InvalidArgumentError(absl::StrCat("tokens = ", spec.tokens, " is negative"));
  if (spec.tokens > (int64_t{1} << 31)) {
    return absl::InvalidArgumentError(absl::StrCat("tokens = ", spec.tokens, " is too large"));
  }
  const int64_t width = config.q_rank() + config.head_dim();
  if (spec.row_stride != 0 && spec.row_stride < width) {
    return absl::InvalidArgumentError(absl::StrCat("row_stride = ", spec.row_stride, " is below Q + D = ", width));
  }
  if (spec.row_stride > (int64_t{1} << 24)) {
    return absl::InvalidArgumentError(absl::StrCat("row_stride = ", spec.row_stride, " is too large"));
  }
  const int64_t stride = spec.row_stride ? spec.row_stride : width;
  if (const uint64_t b = uint64_t(spec.tokens) * uint64_t(stride) * 2; b > kMaxRequestBytes) {
    return absl::InvalidArgumentError(absl::StrCat("a request of ", spec.tokens, " tokens is ", b,
                                                   " bytes, over protobuf's 2 GiB message limit; use fewer tokens"));
  }
  return absl::OkStatus();
}

absl::StatusOr<v1::MhcSeamRequest> RandomMhcRequest(const v1::MhcConfig& config, const MhcRequestSpec& spec,
                                                    std::mt19937_64& rng) {
  if (absl::Status s = ValidateMhcSpec(config, spec); !s.ok()) return s;
  const int64_t t = spec.tokens, n = config.hc_mult(), c = config.hidden();
  v1::MhcSeamRequest req;
  req.set_weight_set(spec.weight_set);
  req.set_stage(spec.stage);
  req.set_mode(spec.mode);
  req.set_capture_aux(spec.capture_aux);
  req.set_path_preference(spec.path);

  auto put = [](v1::Tensor* dst, absl::StatusOr<v1::Tensor> src) -> absl::Status {
    if (!src.ok()) return src.status();
    *dst = *std::move(src);
    return absl::OkStatus();
  };
  absl::Status s = put(req.mutable_x(), MakeBf16Tensor({t, c}, RandomActivationsBf16(rng, size_t(t * c))));
  if (!s.ok()) return s;
  if (spec.stage == v1::MHC_STAGE_FIRST) return req;

  s = put(req.mutable_residual(), MakeBf16Tensor({t, n, c}, RandomActivationsBf16(rng, size_t(t * n * c))));
  if (s.ok()) s = put(req.mutable_post_mix(), MakeFp32Tensor({t, n}, RandomUniform(rng, size_t(t * n), 0.2f, 2.0f)));
  if (s.ok()) s = put(req.mutable_comb_mix(), MakeFp32Tensor({t, n, n}, RandomCombMix(rng, t, int(n))));
  if (s.ok() && spec.mode == v1::MHC_MODE_SHIFTED && spec.include_pre_mix) {
    s = put(req.mutable_pre_mix(), MakeFp32Tensor({t, n}, RandomUniform(rng, size_t(t * n), 0.05f, 1.0f)));
  }
  if (!s.ok()) return s;
  return req;
}

absl::StatusOr<v1::SwaNormQuantRequest> RandomSwaRequest(const v1::SwaConfig& config, const SwaRequestSpec& spec,
                                                         std::mt19937_64& rng) {
  if (absl::Status s = ValidateSwaSpec(config, spec); !s.ok()) return s;
  const int64_t stride = spec.row_stride ? spec.row_stride : config.q_rank() + config.head_dim();
  v1::SwaNormQuantRequest req;
  req.set_weight_set(spec.weight_set);
  req.set_path_preference(spec.path);
  absl::StatusOr<v1::Tensor> t =
      MakeBf16Tensor({spec.tokens, stride}, RandomActivationsBf16(rng, size_t(spec.tokens * stride)));
  if (!t.ok()) return t.status();
  *req.mutable_qr_kv() = *std::move(t);
  return req;
}

uint64_t FreshSeed() {
  std::random_device rd;
  return (uint64_t(rd()) << 32) ^ rd();
}

}  // namespace fusedlayer::client
