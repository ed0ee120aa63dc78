#include "weights/weight_set.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <optional>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "weights/packing.h"
#include "weights/sha256.h"

namespace fusedlayer::server {
namespace {

namespace v1 = ::fusedlayer::v1;

// Far above any DeepSeek width (7168), far below where n(n+2) * n * C could overflow.
constexpr int64_t kMaxDim = (int64_t{1} << 31) - 1;

// The serving bounds of weight_set.h, naming the field (the library's own Validate only says
// "epsilons" and has no upper bounds).
absl::Status CheckMhcServingBounds(const MhcHyperParams& p) {
  if (p.sinkhorn_iters < 1 || p.sinkhorn_iters > kMaxSinkhornIters) {
    return absl::InvalidArgumentError(
        absl::StrCat("sinkhorn_iters = ", p.sinkhorn_iters, " is outside [1, ", kMaxSinkhornIters, "]"));
  }
  for (const auto& [name, value] : {std::pair<const char*, float>{"hc_norm_eps", p.hc_norm_eps},
                                    {"norm_eps", p.norm_eps},
                                    {"hc_pre_eps", p.hc_pre_eps},
                                    {"sinkhorn_eps", p.sinkhorn_eps}}) {
    if (!(value >= 0.0f && value <= kMaxEps)) {  // also false for NaN
      return absl::InvalidArgumentError(absl::StrCat(name, " = ", value, " is not a finite value in [0, ", kMaxEps, "]"));
    }
  }
  if (!(p.post_scale > 0.0f && p.post_scale <= kMaxPostScale)) {
    return absl::InvalidArgumentError(
        absl::StrCat("post_scale = ", p.post_scale, " is not a finite value in (0, ", kMaxPostScale, "]"));
  }
  return absl::OkStatus();
}

absl::Status CheckSwaServingBounds(const SwaHyperParams& p) {
  if (!(p.eps >= 0.0f && p.eps <= kMaxEps)) {
    return absl::InvalidArgumentError(absl::StrCat("eps = ", p.eps, " is not a finite value in [0, ", kMaxEps, "]"));
  }
  return absl::OkStatus();
}

std::string ShapeString(DType dtype, const std::vector<int64_t>& shape) {
  return absl::StrCat(DTypeName(dtype), "[", absl::StrJoin(shape, ", "), "]");
}

// One tensor entry of the header, checked against the payload.
struct Entry {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  uint64_t offset;
  uint64_t bytes;
};

const char* const kKnownTensors[] = {"mhc.fn",     "mhc.scale",   "mhc.base", "mhc.norm_weight",
                                     "swa.q_norm", "swa.kv_norm", "swa.wq_b", "swa.wq_b_scale"};

class Builder {
 public:
  Builder(const v1::WeightSetHeader& header, std::string_view payload) : header_(header), payload_(payload) {}

  absl::Status Error(absl::string_view msg) const {
    return absl::InvalidArgumentError(absl::StrCat("weight set \"", header_.name(), "\": ", msg));
  }

  // Parses and bounds-checks every tensor entry (names, dtypes, shapes, payload ranges).
  absl::Status ParseEntries() {
    for (const v1::TensorEntry& t : header_.tensors()) {
      const std::string& name = t.name();
      if (std::find(std::begin(kKnownTensors), std::end(kKnownTensors), name) == std::end(kKnownTensors)) {
        return Error(absl::StrCat("unknown tensor \"", absl::CHexEscape(name.substr(0, 64)),
                                  "\" (known: ", absl::StrJoin(kKnownTensors, ", "), ")"));
      }
      if (entries_.count(name)) return Error(absl::StrCat("tensor ", name, " appears twice"));
      const std::optional<DType> dtype = DTypeFromWire(t.dtype());
      if (!dtype) return Error(absl::StrCat("tensor ", name, ": unsupported dtype ", static_cast<int>(t.dtype())));
      if (t.shape_size() > kMaxRank) return Error(absl::StrCat("tensor ", name, ": rank ", t.shape_size(), " > 4"));
      uint64_t numel = 1;
      bool overflow = false;
      std::vector<int64_t> shape;
      for (int64_t d : t.shape()) {
        if (d < 0) return Error(absl::StrCat("tensor ", name, ": negative dimension ", d));
        shape.push_back(d);
        overflow = overflow || __builtin_mul_overflow(numel, static_cast<uint64_t>(d), &numel);
      }
      uint64_t bytes = 0;
      if (overflow || __builtin_mul_overflow(numel, DTypeSize(*dtype), &bytes)) {
        return Error(absl::StrCat("tensor ", name, ": size overflows"));
      }
      if (t.offset() > payload_.size() || bytes > payload_.size() - t.offset()) {
        return Error(absl::StrCat("tensor ", name, ": bytes [", t.offset(), ", ", t.offset(), " + ", bytes,
                                  ") lie outside the ", payload_.size(), "-byte payload"));
      }
      entries_.emplace(name, Entry{name, *dtype, std::move(shape), t.offset(), bytes});
    }
    // Two tensors sharing bytes is never intended: it would mean one of them is not what its
    // producer wrote.
    std::vector<const Entry*> sorted;
    for (const auto& [n, e] : entries_) {
      if (e.bytes > 0) sorted.push_back(&e);
    }
    std::sort(sorted.begin(), sorted.end(), [](const Entry* a, const Entry* b) { return a->offset < b->offset; });
    for (size_t i = 1; i < sorted.size(); ++i) {
      if (sorted[i]->offset < sorted[i - 1]->offset + sorted[i - 1]->bytes) {
        return Error(absl::StrCat("tensors ", sorted[i - 1]->name, " and ", sorted[i]->name,
                                  " overlap in the payload"));
      }
    }
    return absl::OkStatus();
  }

  const Entry* Find(const std::string& name) const {
    auto it = entries_.find(name);
    return it == entries_.end() ? nullptr : &it->second;
  }

  // A host view of a required (or, if `optional`, possibly absent) tensor with the expected dtype and
  // shape. An absent optional tensor is an empty view.
  absl::StatusOr<TensorView> View(const std::string& name, DType dtype, std::vector<int64_t> shape,
                                  bool optional) {
    const Entry* e = Find(name);
    if (e == nullptr) {
      if (optional) return TensorView{};
      return Error(absl::StrCat("missing tensor ", name, " (", ShapeString(dtype, shape), ")"));
    }
    if (e->dtype != dtype || e->shape != shape) {
      return Error(absl::StrCat("tensor ", name, ": expected ", ShapeString(dtype, shape), " for these hyper-parameters, got ",
                                ShapeString(e->dtype, e->shape)));
    }
    used_.push_back(name);
    // Backends only read weights; TensorView has no const flavour.
    const char* src = payload_.data() + e->offset;
    if (reinterpret_cast<uintptr_t>(src) % DTypeSize(dtype) != 0) {
      // Element loads must be aligned: stage a copy (new[] is aligned for any element type).
      staging_.emplace_back(new char[e->bytes]);
      std::memcpy(staging_.back().get(), src, e->bytes);
      src = staging_.back().get();
    }
    TensorView v;
    v.data = const_cast<char*>(src);
    v.dtype = dtype;
    v.rank = static_cast<int>(shape.size());
    int64_t stride = 1;
    for (int k = v.rank - 1; k >= 0; --k) {
      v.shape[k] = shape[k];
      v.stride[k] = stride;
      stride *= shape[k];
    }
    return v;
  }

  // Names of tensors not consumed by any part (e.g. swa.* in a set without an swa part).
  absl::Status CheckAllUsed() const {
    for (const auto& [name, e] : entries_) {
      if (std::find(used_.begin(), used_.end(), name) == used_.end()) {
        const bool is_mhc = name.rfind("mhc.", 0) == 0;
        if (is_mhc && !header_.has_mhc()) return Error(absl::StrCat("tensor ", name, " given but the set has no mhc part"));
        if (!is_mhc && !header_.has_swa()) return Error(absl::StrCat("tensor ", name, " given but the set has no swa part"));
        return Error(absl::StrCat("tensor ", name, " is not used by this weight set"));
      }
    }
    return absl::OkStatus();
  }

 private:
  const v1::WeightSetHeader& header_;
  std::string_view payload_;
  std::map<std::string, Entry> entries_;
  std::vector<std::string> used_;
  std::vector<std::unique_ptr<char[]>> staging_;
};

void FillMhcConfig(const MhcHyperParams& p, v1::MhcConfig* c) {
  c->set_hc_mult(p.hc_mult);
  c->set_hidden(p.hidden);
  c->set_hc_norm_eps(p.hc_norm_eps);
  c->set_norm_eps(p.norm_eps);
  c->set_hc_pre_eps(p.hc_pre_eps);
  c->set_sinkhorn_eps(p.sinkhorn_eps);
  c->set_post_scale(p.post_scale);
  c->set_sinkhorn_iters(p.sinkhorn_iters);
}

}  // namespace

v1::FallbackReason ProtoFallbackReason(FallbackReason r) {
  switch (r) {
    case FallbackReason::kDisabledByConfig: return v1::FALLBACK_REASON_DISABLED_BY_CONFIG;
    case FallbackReason::kClientForcedUnfused: return v1::FALLBACK_REASON_CLIENT_FORCED_UNFUSED;
    case FallbackReason::kBackendHasNoFusedKernel: return v1::FALLBACK_REASON_BACKEND_HAS_NO_FUSED_KERNEL;
    case FallbackReason::kDeviceArchUnsupported: return v1::FALLBACK_REASON_DEVICE_ARCH_UNSUPPORTED;
    case FallbackReason::kHcMultUnsupported: return v1::FALLBACK_REASON_HC_MULT_UNSUPPORTED;
    case FallbackReason::kHiddenSizeUnsupported: return v1::FALLBACK_REASON_HIDDEN_SIZE_UNSUPPORTED;
    case FallbackReason::kTooManyTokens: return v1::FALLBACK_REASON_TOO_MANY_TOKENS;
    case FallbackReason::kAuxCaptureRequested: return v1::FALLBACK_REASON_AUX_CAPTURE_REQUESTED;
    case FallbackReason::kWorkspaceUnavailable: return v1::FALLBACK_REASON_WORKSPACE_UNAVAILABLE;
    case FallbackReason::kFusedKernelError: return v1::FALLBACK_REASON_FUSED_KERNEL_ERROR;
  }
  return v1::FALLBACK_REASON_NONE;
}

bool IsValidWeightSetName(std::string_view name) {
  if (name.empty() || name.size() > kMaxWeightSetNameLength) return false;
  for (char c : name) {
    if (!(absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '/' || c == '-')) {
      return false;
    }
  }
  return true;
}

MhcHyperParams MhcParamsFromProto(const v1::MhcConfig& c) {
  MhcHyperParams p;
  p.hc_mult = c.hc_mult();
  p.hidden = c.hidden();
  if (c.has_hc_norm_eps()) p.hc_norm_eps = c.hc_norm_eps();
  if (c.has_norm_eps()) p.norm_eps = c.norm_eps();
  if (c.has_hc_pre_eps()) p.hc_pre_eps = c.hc_pre_eps();
  if (c.has_sinkhorn_eps()) p.sinkhorn_eps = c.sinkhorn_eps();
  if (c.has_post_scale()) p.post_scale = c.post_scale();
  if (c.has_sinkhorn_iters()) p.sinkhorn_iters = c.sinkhorn_iters();
  return p;
}

SwaHyperParams SwaParamsFromProto(const v1::SwaConfig& c, int64_t wq_b_rows) {
  SwaHyperParams p;
  p.q_rank = c.q_rank();
  p.head_dim = c.head_dim();
  if (c.has_eps()) p.eps = c.eps();
  p.fp8_format = c.fp8_format() == v1::FP8_FORMAT_E4M3FNUZ ? Fp8Format::kE4M3FNUZ : Fp8Format::kE4M3FN;
  p.scale_format = c.scale_format() == v1::SCALE_FORMAT_UE8M0 ? ScaleFormat::kUe8m0 : ScaleFormat::kFp32;
  p.scale_layout =
      c.scale_layout() == v1::SCALE_LAYOUT_COLUMN_MAJOR_TMA ? ScaleLayout::kColumnMajorTma : ScaleLayout::kRowMajor;
  p.wq_b_rows = wq_b_rows;
  return p;
}

absl::StatusOr<std::shared_ptr<const WeightSet>> BuildWeightSet(Backend& backend, const v1::WeightSetHeader& header,
                                                                std::string_view payload, std::string source,
                                                                std::optional<std::string> payload_sha256) {
  return BuildWeightSetOn({PrepareTarget{&backend, nullptr, nullptr}}, header, payload, std::move(source),
                          std::move(payload_sha256));
}

namespace {

// Prepares one part on every target (each where its backend may be driven) into set->devices[i];
// the first failure is returned with the part's name and, with several devices, the device's.
template <typename Part, typename PrepareFn>
absl::Status PrepareOnEach(const std::vector<PrepareTarget>& targets, WeightSet& set, const std::string& name,
                           const char* part_name, std::shared_ptr<const Part> WeightSet::DeviceParts::*slot,
                           PrepareFn prepare) {
  for (size_t i = 0; i < targets.size(); ++i) {
    const PrepareTarget& t = targets[i];
    std::unique_ptr<Part> made;
    auto work = [&]() -> absl::Status {
      absl::StatusOr<std::unique_ptr<Part>> prepared = prepare(*t.backend);
      if (!prepared.ok()) return prepared.status();
      made = std::move(*prepared);
      return absl::OkStatus();
    };
    absl::Status s = t.run ? t.run(std::move(work)) : work();
    if (!s.ok()) {
      const std::string where =
          targets.size() > 1 ? absl::StrCat(" on ", std::string(t.backend->kind()), " device ", t.backend->device_index() >= 0
                                                                                       ? t.backend->device_index()
                                                                                       : static_cast<int>(i))
                             : std::string();
      return absl::Status(s.code(), absl::StrCat("weight set \"", name, "\": ", part_name, where, ": ", s.message()));
    }
    const Part* raw = made.get();
    std::shared_ptr<const Part> owned(std::move(made));
    set.devices[i].*slot = t.hold ? std::shared_ptr<const Part>(t.hold(std::move(owned)), raw) : std::move(owned);
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::shared_ptr<const WeightSet>> BuildWeightSetOn(const std::vector<PrepareTarget>& targets,
                                                                  const v1::WeightSetHeader& header,
                                                                  std::string_view payload, std::string source,
                                                                  std::optional<std::string> payload_sha256) {
  if (targets.empty()) return absl::InvalidArgumentError("a weight set needs at least one device to be prepared on");
  if (!IsValidWeightSetName(header.name())) {
    return absl::InvalidArgumentError(absl::StrCat("weight set name \"", absl::CHexEscape(header.name().substr(0, 160)),
                                                   "\" is invalid: it must match [A-Za-z0-9._/-]{1,128}"));
  }
  Builder b(header, payload);
  if (!header.has_mhc() && !header.has_swa()) return b.Error("has neither an mhc nor an swa part");
  if (payload.size() != header.payload_bytes()) {
    return absl::DataLossError(absl::StrCat("weight set \"", header.name(), "\": payload is ", payload.size(),
                                            " bytes but the header announces ", header.payload_bytes()));
  }
  // The checksum first: a corrupted payload is reported as such, not as whatever it happens to break.
  absl::StatusOr<std::string> sha =
      payload_sha256.has_value() ? absl::StatusOr<std::string>(*std::move(payload_sha256)) : Sha256Hex(payload);
  if (!sha.ok()) return sha.status();
  if (!header.sha256().empty()) {
    const std::string want = absl::AsciiStrToLower(header.sha256());
    if (!IsSha256Hex(want)) return b.Error("sha256 must be 64 hex digits");
    if (want != *sha) {
      return absl::DataLossError(absl::StrCat("weight set \"", header.name(), "\": payload SHA-256 ", *sha,
                                              " does not match the header's ", want));
    }
  }
  if (absl::Status s = b.ParseEntries(); !s.ok()) return s;

  auto set = std::make_shared<WeightSet>();
  set->name = header.name();
  set->source = std::move(source);
  set->sha256 = *sha;
  set->header = header;
  set->header.set_sha256(*sha);
  set->header.set_replace(false);
  set->devices.resize(targets.size());

  if (header.has_mhc()) {
    const MhcHyperParams p = MhcParamsFromProto(header.mhc());
    // The named serving bounds first: they cover the library's checks with a clearer message.
    if (absl::Status s = CheckMhcServingBounds(p); !s.ok()) return b.Error(absl::StrCat("mhc: ", s.message()));
    if (absl::Status s = p.Validate(); !s.ok()) return b.Error(absl::StrCat("mhc: ", s.message()));
    if (p.hidden > kMaxDim) return b.Error(absl::StrCat("mhc: hidden ", p.hidden, " is too large"));
    const int64_t M = p.num_mixes(), K = p.flat_width(), C = p.hidden;
    MhcWeightsHost w;
    absl::StatusOr<TensorView> v;
    if (!(v = b.View("mhc.fn", DType::kFP32, {M, K}, false)).ok()) return v.status();
    w.fn = *v;
    if (!(v = b.View("mhc.scale", DType::kFP32, {3}, false)).ok()) return v.status();
    w.scale = *v;
    if (!(v = b.View("mhc.base", DType::kFP32, {M}, false)).ok()) return v.status();
    w.base = *v;
    if (!(v = b.View("mhc.norm_weight", DType::kBF16, {C}, true)).ok()) return v.status();
    w.norm_weight = *v;
    if (w.norm_weight.data != nullptr) {
      const auto* g = static_cast<const uint16_t*>(w.norm_weight.data);
      set->mhc_norm_weight.assign(g, g + C);
    }
    if (absl::Status s = PrepareOnEach<PreparedMhcWeights>(targets, *set, header.name(), "mhc",
                                                            &WeightSet::DeviceParts::mhc,
                                                            [&](Backend& backend) { return backend.PrepareMhc(p, w); });
        !s.ok()) {
      return s;
    }
    FillMhcConfig(p, set->header.mutable_mhc());
  }

  if (header.has_swa()) {
    const v1::SwaConfig& c = header.swa();
    if (!v1::Fp8Format_IsValid(c.fp8_format()) || !v1::ScaleFormat_IsValid(c.scale_format()) ||
        !v1::ScaleLayout_IsValid(c.scale_layout())) {
      return b.Error("swa: unknown fp8_format, scale_format or scale_layout value");
    }
    // N comes from the wq_b tensor itself; its own shape check below then pins it.
    int64_t n_rows = 0;
    if (const Entry* wq_b = b.Find("swa.wq_b"); wq_b != nullptr) {
      if (wq_b->shape.size() != 2 || wq_b->shape[0] == 0) {
        return b.Error(absl::StrCat("tensor swa.wq_b: expected fp8[N, ", c.q_rank(), "] with N a positive multiple of 128, got ",
                                    ShapeString(wq_b->dtype, wq_b->shape)));
      }
      n_rows = wq_b->shape[0];
    } else if (b.Find("swa.wq_b_scale") != nullptr) {
      return b.Error("tensor swa.wq_b_scale given without swa.wq_b");
    }
    const SwaHyperParams p = SwaParamsFromProto(c, n_rows);
    if (absl::Status s = CheckSwaServingBounds(p); !s.ok()) return b.Error(absl::StrCat("swa: ", s.message()));
    if (absl::Status s = p.Validate(); !s.ok()) return b.Error(absl::StrCat("swa: ", s.message()));
    if (p.q_rank > kMaxDim || p.head_dim > kMaxDim || p.wq_b_rows > kMaxDim) {
      return b.Error("swa: q_rank, head_dim or wq_b rows too large");
    }
    const DType fp8 = p.fp8_format == Fp8Format::kE4M3FN ? DType::kFP8E4M3FN : DType::kFP8E4M3FNUZ;
    SwaWeightsHost w;
    absl::StatusOr<TensorView> v;
    if (!(v = b.View("swa.q_norm", DType::kBF16, {p.q_rank}, false)).ok()) return v.status();
    w.q_norm = *v;
    if (!(v = b.View("swa.kv_norm", DType::kBF16, {p.head_dim}, false)).ok()) return v.status();
    w.kv_norm = *v;
    if (p.has_wq_b()) {
      if (!(v = b.View("swa.wq_b", fp8, {p.wq_b_rows, p.q_rank}, false)).ok()) return v.status();
      w.wq_b = *v;
      if (!(v = b.View("swa.wq_b_scale", DType::kFP32, {p.wq_b_rows / kSwaGroup, p.groups()}, false)).ok()) {
        return v.status();
      }
      w.wq_b_scale = *v;
      // Per output row n: max_k |dequant(wq_b)[n, k]| (host payload; shadow verification bounds the
      // fused-vs-unfused q_proj difference with it, server/shadow/compare.h).
      set->swa_wq_b_row_abs_max.assign(static_cast<size_t>(p.wq_b_rows), 0.0f);
      const auto* codes = static_cast<const uint8_t*>(w.wq_b.data);
      const auto* scales = static_cast<const float*>(w.wq_b_scale.data);
      for (int64_t n = 0; n < p.wq_b_rows; ++n) {
        float m = 0;
        for (int64_t k = 0; k < p.q_rank; ++k) {
          const float d = std::fabs(Fp8ToFloat(codes[n * p.q_rank + k], p.fp8_format) *
                                    scales[(n / kSwaGroup) * p.groups() + k / kSwaGroup]);
          if (d > m || std::isnan(d)) m = d;
        }
        set->swa_wq_b_row_abs_max[static_cast<size_t>(n)] = m;
      }
    }
    if (absl::Status s = PrepareOnEach<PreparedSwaWeights>(targets, *set, header.name(), "swa",
                                                            &WeightSet::DeviceParts::swa,
                                                            [&](Backend& backend) { return backend.PrepareSwa(p, w); });
        !s.ok()) {
      return s;
    }
    v1::SwaConfig* out = set->header.mutable_swa();
    out->set_eps(p.eps);
  }
  if (absl::Status s = b.CheckAllUsed(); !s.ok()) return s;

  for (const WeightSet::DeviceParts& d : set->devices) {
    set->resident_bytes += (d.mhc ? d.mhc->resident_bytes() : 0) + (d.swa ? d.swa->resident_bytes() : 0);
  }
  return std::shared_ptr<const WeightSet>(std::move(set));
}

v1::WeightSetInfo ToInfo(const WeightSet& set, const Backend& backend, size_t device) {
  const WeightSet::DeviceParts& parts = set.on(device);
  v1::WeightSetInfo info;
  info.set_name(set.name);
  info.set_resident_bytes(set.resident_bytes);
  info.set_source(set.source);
  info.set_sha256(set.sha256);
  auto add_capability = [&info](const char* op, const FusedSupport& s) {
    v1::OpCapability* cap = info.add_capabilities();
    cap->set_op(op);
    cap->set_fused_available(s.supported);
    cap->set_reason(s.supported ? v1::FALLBACK_REASON_NONE : ProtoFallbackReason(s.reason));
    cap->set_detail(s.detail);
  };
  if (parts.mhc) {
    *info.mutable_mhc() = set.header.mhc();
    info.set_has_norm_weight(parts.mhc->has_norm_weight());
    MhcShapeQuery q;
    q.tokens = 1;
    add_capability("mhc", backend.MhcFusedSupport(*parts.mhc, q));
  }
  if (parts.swa) {
    *info.mutable_swa() = set.header.swa();
    info.set_wq_b_rows(parts.swa->params().wq_b_rows);
    info.set_wq_b_implementation(parts.swa->wq_b_implementation());
    SwaShapeQuery q;
    q.tokens = 1;
    add_capability("swa", backend.SwaFusedSupport(*parts.swa, q));
  }
  return info;
}

}  // namespace fusedlayer::server
