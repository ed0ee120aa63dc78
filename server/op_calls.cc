#include "op_calls.h"

#include "absl/strings/str_cat.h"
#include "device_staging.h"
#include "tensor_codec.h"

namespace fusedlayer::server {
namespace {

// Assigns *out = decoded view or returns its error from the enclosing function.
#define FL_ASSIGN_VIEW(out, expr)            \
  do {                                       \
    absl::StatusOr<TensorView> _v = (expr);  \
    if (!_v.ok()) return _v.status();        \
    (out) = *_v;                             \
  } while (0)

absl::Status CheckTokens(int64_t tokens, int64_t max_tokens, const char* what) {
  if (tokens > max_tokens) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " has ", tokens, " tokens; this server accepts at most ", max_tokens, " (--max_tokens)"));
  }
  return absl::OkStatus();
}

// A tensor field that must not be set for this stage: silently ignoring it would hide a client bug.
absl::Status ExpectAbsent(bool present, const char* name, const char* why) {
  if (present) return absl::InvalidArgumentError(absl::StrCat("tensor '", name, "' must be absent ", why));
  return absl::OkStatus();
}

DType Fp8DType(Fp8Format f) { return f == Fp8Format::kE4M3FN ? DType::kFP8E4M3FN : DType::kFP8E4M3FNUZ; }

}  // namespace

MhcStage FromProto(v1::MhcStage stage) {
  switch (stage) {
    case v1::MHC_STAGE_FIRST: return MhcStage::kFirst;
    case v1::MHC_STAGE_HEAD: return MhcStage::kHead;
    default: return MhcStage::kSeam;
  }
}
MhcMode FromProto(v1::MhcMode mode) { return mode == v1::MHC_MODE_NORMAL ? MhcMode::kNormal : MhcMode::kShifted; }

absl::StatusOr<MhcCall> DecodeMhcRequest(const v1::MhcSeamRequest& req, const PreparedMhcWeights& weights,
                                         int64_t max_tokens, v1::MhcSeamResponse* resp) {
  if (!v1::MhcStage_IsValid(req.stage())) {
    return absl::InvalidArgumentError(absl::StrCat("unknown stage ", static_cast<int>(req.stage())));
  }
  if (!v1::MhcMode_IsValid(req.mode())) {
    return absl::InvalidArgumentError(absl::StrCat("unknown mode ", static_cast<int>(req.mode())));
  }
  const MhcHyperParams& p = weights.params();
  const int64_t n = p.hc_mult, C = p.hidden;
  MhcCall call;
  MhcArgs& a = call.args;
  a.stage = FromProto(req.stage());
  a.mode = FromProto(req.mode());
  a.capture_aux = req.capture_aux();
  if (a.stage == MhcStage::kHead && a.mode != MhcMode::kShifted) {
    return absl::InvalidArgumentError("the head stage exists only in shifted mode (V4.1)");
  }
  if (a.capture_aux && a.stage != MhcStage::kSeam) {
    return absl::InvalidArgumentError("capture_aux is only defined for the seam stage");
  }

  absl::StatusOr<int64_t> T = LeadingDim(req.x(), "x", 2);
  if (!T.ok()) return T.status();
  if (absl::Status s = CheckTokens(*T, max_tokens, "x"); !s.ok()) return s;
  a.tokens = *T;
  FL_ASSIGN_VIEW(a.x, DecodeTensor(req.x(), "x", DType::kBF16, {*T, C}));

  if (a.stage == MhcStage::kFirst) {
    const char* why = "for stage FIRST (x is the embedding)";
    for (auto [present, name] : {std::pair{req.has_residual(), "residual"}, {req.has_post_mix(), "post_mix"},
                                 {req.has_comb_mix(), "comb_mix"}, {req.has_pre_mix(), "pre_mix"}}) {
      if (absl::Status s = ExpectAbsent(present, name, why); !s.ok()) return s;
    }
  } else {
    FL_ASSIGN_VIEW(a.residual, DecodeTensor(req.residual(), "residual", DType::kBF16, {*T, n, C}));
    FL_ASSIGN_VIEW(a.post_mix, DecodeTensor(req.post_mix(), "post_mix", DType::kFP32, {*T, n}));
    FL_ASSIGN_VIEW(a.comb_mix, DecodeTensor(req.comb_mix(), "comb_mix", DType::kFP32, {*T, n, n}));
    if (req.has_pre_mix()) {
      if (absl::Status s = ExpectAbsent(a.mode == MhcMode::kNormal, "pre_mix", "in NORMAL mode (y uses the new pre mix)");
          !s.ok()) {
        return s;
      }
      FL_ASSIGN_VIEW(a.pre_mix, DecodeTensor(req.pre_mix(), "pre_mix", DType::kFP32, {*T, n}));
    }
  }

  a.new_residual = AllocateOutput(resp->mutable_new_residual(), DType::kBF16, {*T, n, C});
  if (a.stage != MhcStage::kHead) {
    a.new_pre_mix = AllocateOutput(resp->mutable_new_pre_mix(), DType::kFP32, {*T, n});
    a.new_post_mix = AllocateOutput(resp->mutable_new_post_mix(), DType::kFP32, {*T, n});
    a.new_comb_mix = AllocateOutput(resp->mutable_new_comb_mix(), DType::kFP32, {*T, n, n});
  }
  a.y = AllocateOutput(resp->mutable_y(), DType::kBF16, {*T, C});
  if (a.capture_aux) a.aux = AllocateOutput(resp->mutable_aux(), DType::kBF16, {*T, C});

  // The library's own contract check, so nothing invalid reaches the executor.
  if (absl::Status s = ValidateMhcArgs(p, weights.has_norm_weight(), a); !s.ok()) return s;
  call.query = MhcShapeQuery{a.stage, a.mode, a.capture_aux, a.tokens};
  return call;
}

absl::StatusOr<SwaCall> DecodeSwaRequest(const v1::SwaNormQuantRequest& req, const PreparedSwaWeights& weights,
                                         int64_t max_tokens, v1::SwaNormQuantResponse* resp) {
  const SwaHyperParams& p = weights.params();
  const int64_t Q = p.q_rank, D = p.head_dim, G = p.groups();
  SwaCall call;
  SwaArgs& a = call.args;
  absl::StatusOr<int64_t> M = LeadingDim(req.qr_kv(), "qr_kv", 2);
  if (!M.ok()) return M.status();
  if (absl::Status s = CheckTokens(*M, max_tokens, "qr_kv"); !s.ok()) return s;
  a.tokens = *M;
  FL_ASSIGN_VIEW(a.qr_kv, DecodeStrided2D(req.qr_kv(), "qr_kv", DType::kBF16, Q + D));

  a.q_fp8 = AllocateOutput(resp->mutable_q_fp8(), Fp8DType(p.fp8_format), {*M, Q});
  if (p.scale_layout == ScaleLayout::kRowMajor) {
    a.q_scale = AllocateOutput(resp->mutable_q_scale(), DType::kFP32, {*M, G});
  } else {
    a.q_scale = AllocateOutput(resp->mutable_q_scale(), DType::kFP32, {G, AlignTo4(*M)});
  }
  a.kv = AllocateOutput(resp->mutable_kv(), DType::kBF16, {*M, D});
  if (p.has_wq_b()) a.q_proj = AllocateOutput(resp->mutable_q_proj(), DType::kBF16, {*M, p.wq_b_rows});

  if (absl::Status s = ValidateSwaArgs(p, a); !s.ok()) return s;
  call.query = SwaShapeQuery{a.tokens};
  return call;
}

absl::StatusOr<RunStats> RunMhcCall(Backend& backend, const PreparedMhcWeights& weights, const MhcArgs& host,
                                    Path path) {
  DeviceStaging staging(backend);
  MhcArgs dev = host;
  for (auto [dst, src] : {std::pair{&dev.x, &host.x}, {&dev.residual, &host.residual}, {&dev.post_mix, &host.post_mix},
                          {&dev.comb_mix, &host.comb_mix}, {&dev.pre_mix, &host.pre_mix}}) {
    FL_ASSIGN_VIEW(*dst, staging.Input(*src));
  }
  for (auto [dst, src] : {std::pair{&dev.new_residual, &host.new_residual}, {&dev.new_pre_mix, &host.new_pre_mix},
                          {&dev.new_post_mix, &host.new_post_mix}, {&dev.new_comb_mix, &host.new_comb_mix},
                          {&dev.y, &host.y}, {&dev.aux, &host.aux}}) {
    FL_ASSIGN_VIEW(*dst, staging.Output(*src));
  }
  absl::StatusOr<RunStats> stats = backend.RunMhc(weights, dev, path);
  if (!stats.ok()) return stats.status();
  if (absl::Status s = staging.CopyOutputsBack(); !s.ok()) return s;
  return stats;
}

absl::StatusOr<RunStats> RunSwaCall(Backend& backend, const PreparedSwaWeights& weights, const SwaArgs& host,
                                    Path path) {
  DeviceStaging staging(backend);
  SwaArgs dev = host;
  FL_ASSIGN_VIEW(dev.qr_kv, staging.Input(host.qr_kv));
  for (auto [dst, src] : {std::pair{&dev.q_fp8, &host.q_fp8}, {&dev.q_scale, &host.q_scale}, {&dev.kv, &host.kv},
                          {&dev.q_proj, &host.q_proj}}) {
    FL_ASSIGN_VIEW(*dst, staging.Output(*src));
  }
  absl::StatusOr<RunStats> stats = backend.RunSwa(weights, dev, path);
  if (!stats.ok()) return stats.status();
  if (absl::Status s = staging.CopyOutputsBack(); !s.ok()) return s;
  return stats;
}

}  // namespace fusedlayer::server
