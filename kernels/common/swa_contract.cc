// Parameter and argument validation for the SWA op, shared by every backend.
#include <cmath>
#include "absl/strings/str_cat.h"
#include "fusedlayer/swa.h"

namespace fusedlayer {

const char* ScaleFormatName(ScaleFormat f) { return f == ScaleFormat::kFp32 ? "fp32" : "ue8m0"; }
const char* ScaleLayoutName(ScaleLayout l) {
  return l == ScaleLayout::kRowMajor ? "row_major" : "column_major_tma";
}
const char* Fp8FormatName(Fp8Format f) { return f == Fp8Format::kE4M3FN ? "e4m3fn" : "e4m3fnuz"; }

absl::Status SwaHyperParams::Validate() const {
  if (q_rank <= 0 || q_rank % kSwaGroup != 0) {
    return absl::InvalidArgumentError(absl::StrCat("q_rank must be a positive multiple of 128, got ", q_rank));
  }
  if (head_dim <= 0) return absl::InvalidArgumentError(absl::StrCat("head_dim must be > 0, got ", head_dim));
  if (!(eps >= 0.0f) || !std::isfinite(eps)) return absl::InvalidArgumentError("eps must be finite and >= 0");
  if (wq_b_rows < 0 || wq_b_rows % kSwaGroup != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("wq_b rows must be a multiple of 128 (or 0 for no projection), got ", wq_b_rows));
  }
  return absl::OkStatus();
}

absl::Status ValidateSwaArgs(const SwaHyperParams& p, const SwaArgs& a) {
  if (a.tokens < 0) return absl::InvalidArgumentError("tokens must be >= 0");
  const int64_t M = a.tokens, Q = p.q_rank, D = p.head_dim, G = p.groups();
  absl::Status s;
  if (!(s = ExpectRowStridedTensor(a.qr_kv, "qr_kv", DType::kBF16, M, Q + D)).ok()) return s;
  const DType fp8 = p.fp8_format == Fp8Format::kE4M3FN ? DType::kFP8E4M3FN : DType::kFP8E4M3FNUZ;
  if (!(s = ExpectTensor(a.q_fp8, "q_fp8", fp8, {M, Q})).ok()) return s;
  if (p.scale_layout == ScaleLayout::kRowMajor) {
    if (!(s = ExpectTensor(a.q_scale, "q_scale", DType::kFP32, {M, G})).ok()) return s;
  } else {
    if (!(s = ExpectTensor(a.q_scale, "q_scale", DType::kFP32, {G, AlignTo4(M)})).ok()) return s;
  }
  if (!(s = ExpectTensor(a.kv, "kv", DType::kBF16, {M, D})).ok()) return s;
  if (p.has_wq_b()) {
    if (!(s = ExpectTensor(a.q_proj, "q_proj", DType::kBF16, {M, p.wq_b_rows})).ok()) return s;
  } else if (!a.q_proj.empty_view()) {
    return absl::InvalidArgumentError("q_proj given but the weight set has no wq_b");
  }
  return absl::OkStatus();
}

}  // namespace fusedlayer
