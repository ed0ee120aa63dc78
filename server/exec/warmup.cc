#include "exec/warmup.h"

#include <cmath>
#include <cstdint>
#include <vector>

#include "absl/strings/str_cat.h"
#include "fusedlayer/numeric.h"
#include "runtime/op_calls.h"

namespace fusedlayer::server {
namespace {

// Deterministic, non-zero values in [-1, -1/16] U [1/16, 1] (xorshift; no zeros so norms are defined).
class Filler {
 public:
  float Next() {
    state_ ^= state_ << 13;
    state_ ^= state_ >> 7;
    state_ ^= state_ << 17;
    const float mag = 0.0625f + 0.9375f * static_cast<float>(state_ >> 40) / static_cast<float>(1 << 24);
    return (state_ & 1) ? mag : -mag;
  }
  std::vector<uint16_t> Bf16(size_t n) {
    std::vector<uint16_t> v(n);
    for (auto& x : v) x = FloatToBf16(Next());
    return v;
  }
  std::vector<float> Fp32(size_t n, float lo, float hi) {
    std::vector<float> v(n);
    for (auto& x : v) x = lo + (hi - lo) * (0.5f + 0.5f * Next());
    return v;
  }

 private:
  uint64_t state_ = 0x9e3779b97f4a7c15ull;
};

bool AllFiniteBf16(const std::vector<uint16_t>& v) {
  for (uint16_t b : v) {
    if ((b & 0x7f80) == 0x7f80) return false;
  }
  return true;
}
bool AllFinite(const std::vector<float>& v) {
  for (float f : v) {
    if (!std::isfinite(f)) return false;
  }
  return true;
}

std::vector<Path> PathsToWarm(bool fused_supported) {
  if (fused_supported) return {Path::kFused, Path::kUnfused};
  return {Path::kUnfused};
}

}  // namespace

absl::Status WarmUpMhc(Backend& backend, const PreparedMhcWeights& weights) {
  const MhcHyperParams& p = weights.params();
  const int64_t T = 1, n = p.hc_mult, C = p.hidden;
  Filler fill;
  std::vector<uint16_t> x = fill.Bf16(T * C), residual = fill.Bf16(T * n * C);
  std::vector<float> post = fill.Fp32(T * n, 0.1f, 2.0f), comb = fill.Fp32(T * n * n, 0.05f, 1.0f),
                     pre = fill.Fp32(T * n, 0.1f, 1.0f);
  std::vector<uint16_t> new_residual(T * n * C), y(T * C);
  std::vector<float> new_pre(T * n), new_post(T * n), new_comb(T * n * n);

  MhcArgs a;
  a.stage = MhcStage::kSeam;
  a.mode = MhcMode::kShifted;
  a.tokens = T;
  a.x = TensorView::Contiguous(x.data(), DType::kBF16, {T, C});
  a.residual = TensorView::Contiguous(residual.data(), DType::kBF16, {T, n, C});
  a.post_mix = TensorView::Contiguous(post.data(), DType::kFP32, {T, n});
  a.comb_mix = TensorView::Contiguous(comb.data(), DType::kFP32, {T, n, n});
  a.pre_mix = TensorView::Contiguous(pre.data(), DType::kFP32, {T, n});
  a.new_residual = TensorView::Contiguous(new_residual.data(), DType::kBF16, {T, n, C});
  a.new_pre_mix = TensorView::Contiguous(new_pre.data(), DType::kFP32, {T, n});
  a.new_post_mix = TensorView::Contiguous(new_post.data(), DType::kFP32, {T, n});
  a.new_comb_mix = TensorView::Contiguous(new_comb.data(), DType::kFP32, {T, n, n});
  a.y = TensorView::Contiguous(y.data(), DType::kBF16, {T, C});

  const FusedSupport support = backend.MhcFusedSupport(weights, MhcShapeQuery{a.stage, a.mode, false, T});
  for (Path path : PathsToWarm(support.supported)) {
    absl::StatusOr<RunStats> r = RunMhcCall(backend, weights, a, path);
    if (!r.ok()) {
      return absl::InternalError(absl::StrCat("mhc warm-up on the ", PathName(path), " path failed: ", r.status().ToString()));
    }
    if (!AllFiniteBf16(new_residual) || !AllFiniteBf16(y) || !AllFinite(new_pre) || !AllFinite(new_post) ||
        !AllFinite(new_comb)) {
      return absl::InternalError(absl::StrCat("mhc warm-up on the ", PathName(path), " path produced non-finite outputs"));
    }
  }
  return absl::OkStatus();
}

absl::Status WarmUpSwa(Backend& backend, const PreparedSwaWeights& weights) {
  const SwaHyperParams& p = weights.params();
  const int64_t M = 1, Q = p.q_rank, D = p.head_dim, G = p.groups();
  Filler fill;
  std::vector<uint16_t> qr_kv = fill.Bf16(M * (Q + D)), kv(M * D), q_proj(M * p.wq_b_rows);
  std::vector<uint8_t> q_fp8(M * Q);
  const bool row_major = p.scale_layout == ScaleLayout::kRowMajor;
  std::vector<float> q_scale(row_major ? M * G : G * AlignTo4(M));

  SwaArgs a;
  a.tokens = M;
  a.qr_kv = TensorView::Strided2D(qr_kv.data(), DType::kBF16, M, Q + D, Q + D);
  a.q_fp8 = TensorView::Contiguous(q_fp8.data(),
                                   p.fp8_format == Fp8Format::kE4M3FN ? DType::kFP8E4M3FN : DType::kFP8E4M3FNUZ, {M, Q});
  a.q_scale = row_major ? TensorView::Contiguous(q_scale.data(), DType::kFP32, {M, G})
                        : TensorView::Contiguous(q_scale.data(), DType::kFP32, {G, AlignTo4(M)});
  a.kv = TensorView::Contiguous(kv.data(), DType::kBF16, {M, D});
  if (p.has_wq_b()) a.q_proj = TensorView::Contiguous(q_proj.data(), DType::kBF16, {M, p.wq_b_rows});

  const FusedSupport support = backend.SwaFusedSupport(weights, SwaShapeQuery{M});
  for (Path path : PathsToWarm(support.supported)) {
    absl::StatusOr<RunStats> r = RunSwaCall(backend, weights, a, path);
    if (!r.ok()) {
      return absl::InternalError(absl::StrCat("swa warm-up on the ", PathName(path), " path failed: ", r.status().ToString()));
    }
    if (!AllFinite(q_scale) || !AllFiniteBf16(kv) || !AllFiniteBf16(q_proj)) {
      return absl::InternalError(absl::StrCat("swa warm-up on the ", PathName(path), " path produced non-finite outputs"));
    }
  }
  return absl::OkStatus();
}

}  // namespace fusedlayer::server
