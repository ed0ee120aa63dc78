// Parameter and argument validation for the mHC op, shared by every backend.
#include <cmath>
#include "absl/strings/str_cat.h"
#include "fusedlayer/mhc.h"

namespace fusedlayer {

const char* MhcModeName(MhcMode m) { return m == MhcMode::kShifted ? "shifted" : "normal"; }

const char* MhcStageName(MhcStage s) {
  switch (s) {
    case MhcStage::kSeam: return "seam";
    case MhcStage::kFirst: return "first";
    case MhcStage::kHead: return "head";
  }
  return "unknown";
}

absl::Status MhcHyperParams::Validate() const {
  if (hc_mult < 1 || hc_mult > 8) {
    return absl::InvalidArgumentError(absl::StrCat("hc_mult must be in 1..8, got ", hc_mult));
  }
  if (hidden <= 0) return absl::InvalidArgumentError(absl::StrCat("hidden size must be > 0, got ", hidden));
  if (sinkhorn_iters < 1) {
    return absl::InvalidArgumentError(absl::StrCat("sinkhorn_iters must be >= 1, got ", sinkhorn_iters));
  }
  for (float e : {hc_norm_eps, norm_eps, hc_pre_eps, sinkhorn_eps}) {
    if (!(e >= 0.0f) || !std::isfinite(e)) {
      return absl::InvalidArgumentError("epsilons must be finite and >= 0");
    }
  }
  if (!std::isfinite(post_scale)) return absl::InvalidArgumentError("post_scale must be finite");
  return absl::OkStatus();
}

absl::Status ValidateMhcArgs(const MhcHyperParams& p, bool has_norm_weight, const MhcArgs& a) {
  (void)has_norm_weight;
  if (a.tokens < 0) return absl::InvalidArgumentError("tokens must be >= 0");
  const int64_t T = a.tokens, n = p.hc_mult, C = p.hidden;
  absl::Status s;
  s = ExpectTensor(a.x, a.stage == MhcStage::kFirst ? "embedding" : "x", DType::kBF16, {T, C});
  if (!s.ok()) return s;
  const bool has_post = a.stage != MhcStage::kFirst;
  if (has_post) {
    if (!(s = ExpectTensor(a.residual, "residual", DType::kBF16, {T, n, C})).ok()) return s;
    if (!(s = ExpectTensor(a.post_mix, "post_mix", DType::kFP32, {T, n})).ok()) return s;
    if (!(s = ExpectTensor(a.comb_mix, "comb_mix", DType::kFP32, {T, n, n})).ok()) return s;
    if (!a.pre_mix.empty_view() && a.mode == MhcMode::kShifted) {
      if (!(s = ExpectTensor(a.pre_mix, "pre_mix", DType::kFP32, {T, n})).ok()) return s;
    }
  }
  if (a.stage == MhcStage::kHead && a.mode != MhcMode::kShifted) {
    return absl::InvalidArgumentError("the head stage exists only in shifted mode (V4.1)");
  }
  if (a.capture_aux && a.stage != MhcStage::kSeam) {
    return absl::InvalidArgumentError("capture_aux is only defined for the seam stage");
  }
  if (!(s = ExpectTensor(a.new_residual, "new_residual", DType::kBF16, {T, n, C})).ok()) return s;
  if (a.stage != MhcStage::kHead) {
    if (!(s = ExpectTensor(a.new_pre_mix, "new_pre_mix", DType::kFP32, {T, n})).ok()) return s;
    if (!(s = ExpectTensor(a.new_post_mix, "new_post_mix", DType::kFP32, {T, n})).ok()) return s;
    if (!(s = ExpectTensor(a.new_comb_mix, "new_comb_mix", DType::kFP32, {T, n, n})).ok()) return s;
  }
  if (!(s = ExpectTensor(a.y, "y", DType::kBF16, {T, C})).ok()) return s;
  if (a.capture_aux) {
    if (!(s = ExpectTensor(a.aux, "aux", DType::kBF16, {T, C})).ok()) return s;
  }
  return absl::OkStatus();
}

}  // namespace fusedlayer
