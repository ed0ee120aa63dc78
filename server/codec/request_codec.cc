#include "codec/request_codec.h"

#include <new>
#include <stdexcept>
#include <utility>
#include <vector>

#include "common/log.h"
#include "common/status_macros.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "weights/weight_set.h"  // ProtoFallbackReason

namespace fusedlayer::server {
namespace {

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


std::string ShapeString(const v1::Tensor& t) { return absl::StrCat("[", absl::StrJoin(t.shape(), ", "), "]"); }
std::string ShapeString(std::initializer_list<int64_t> dims) {
  return absl::StrCat("[", absl::StrJoin(dims, ", "), "]");
}

const char* ProtoDTypeName(v1::DataType d) {
  switch (d) {
    case v1::DATA_TYPE_BF16: return "bf16";
    case v1::DATA_TYPE_FP32: return "fp32";
    case v1::DATA_TYPE_FP8_E4M3FN: return "fp8_e4m3fn";
    case v1::DATA_TYPE_FP8_E4M3FNUZ: return "fp8_e4m3fnuz";
    case v1::DATA_TYPE_UNSPECIFIED: return "unspecified";
    default: return "unknown";
  }
}

// The tensor is absent or its dtype is wrong.
absl::Status CheckDType(const v1::Tensor& t, const char* name, DType dtype) {
  if (t.dtype() == ToProto(dtype)) return absl::OkStatus();
  if (t.dtype() == v1::DATA_TYPE_UNSPECIFIED && t.shape_size() == 0 && t.data().empty()) {
    return absl::InvalidArgumentError(absl::StrCat("tensor '", name, "' is missing (want ", DTypeName(dtype), ")"));
  }
  return absl::InvalidArgumentError(absl::StrCat("tensor '", name, "': dtype ", ProtoDTypeName(t.dtype()),
                                                 ", want ", DTypeName(dtype)));
}

// The tensor's inline bytes: in its message, or where ReadWireRequest put them.
std::string_view InlineBytes(const v1::Tensor& t, const WireTensorData* wire) {
  const std::string_view* moved = wire == nullptr ? nullptr : wire->Find(t);
  return moved != nullptr ? *moved : std::string_view(t.data());
}

absl::Status CheckBytes(const v1::Tensor& t, const char* name, DType dtype, const WireTensorData* wire) {
  auto want = DenseBytes(dtype, t.shape().data(), t.shape_size(), name);
  if (!want.ok()) return want.status();
  // Its byte_size is checked by the transfer.
  if (t.has_shared_memory() || t.has_cuda_shared_memory()) return absl::OkStatus();
  const size_t got = InlineBytes(t, wire).size();
  if (got != *want) {
    return absl::InvalidArgumentError(absl::StrCat("tensor '", name, "': ", DTypeName(dtype), ShapeString(t),
                                                   " needs ", *want, " bytes, got ", got));
  }
  return absl::OkStatus();
}

// The tensor's bytes: inline, read from shared memory into the transfer's staging, or (CUDA shared
// memory) its device address where it lies.
absl::StatusOr<char*> TensorBytes(const v1::Tensor& t, const char* name, DType dtype,
                                  transport::TensorTransfer* transfer, const WireTensorData* wire) {
  // The view is non-const because TensorView is; inputs are only ever read by the kernels.
  if (!t.has_shared_memory() && !t.has_cuda_shared_memory()) return const_cast<char*>(InlineBytes(t, wire).data());
  absl::StatusOr<uint64_t> want = DenseBytes(dtype, t.shape().data(), t.shape_size(), name);
  if (!want.ok()) return want.status();
  if (transfer == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("tensor '", name, "': shared-memory tensors are not accepted here"));
  }
  if (t.has_cuda_shared_memory()) return transfer->DeviceInput(t.cuda_shared_memory(), *want, name);
  return transfer->ReadInput(t.shared_memory(), *want, name);
}

}  // namespace

DType Fp8DType(Fp8Format f) { return f == Fp8Format::kE4M3FN ? DType::kFP8E4M3FN : DType::kFP8E4M3FNUZ; }

MhcStage FromProto(v1::MhcStage stage) {
  switch (stage) {
    case v1::MHC_STAGE_FIRST: return MhcStage::kFirst;
    case v1::MHC_STAGE_HEAD: return MhcStage::kHead;
    default: return MhcStage::kSeam;
  }
}
MhcMode FromProto(v1::MhcMode mode) { return mode == v1::MHC_MODE_NORMAL ? MhcMode::kNormal : MhcMode::kShifted; }

v1::FallbackReason ToProto(FallbackReason reason) { return ProtoFallbackReason(reason); }

v1::ExecutionPath ToProto(Path path) {
  return path == Path::kFused ? v1::EXECUTION_PATH_FUSED : v1::EXECUTION_PATH_UNFUSED;
}

v1::DataType ToProto(DType dtype) {
  switch (dtype) {
    case DType::kBF16: return v1::DATA_TYPE_BF16;
    case DType::kFP32: return v1::DATA_TYPE_FP32;
    case DType::kFP8E4M3FN: return v1::DATA_TYPE_FP8_E4M3FN;
    case DType::kFP8E4M3FNUZ: return v1::DATA_TYPE_FP8_E4M3FNUZ;
  }
  return v1::DATA_TYPE_UNSPECIFIED;
}

absl::StatusOr<DType> FromProto(v1::DataType dtype) {
  switch (dtype) {
    case v1::DATA_TYPE_BF16: return DType::kBF16;
    case v1::DATA_TYPE_FP32: return DType::kFP32;
    case v1::DATA_TYPE_FP8_E4M3FN: return DType::kFP8E4M3FN;
    case v1::DATA_TYPE_FP8_E4M3FNUZ: return DType::kFP8E4M3FNUZ;
    default: return absl::InvalidArgumentError(absl::StrCat("unsupported dtype ", ProtoDTypeName(dtype)));
  }
}

absl::StatusOr<uint64_t> DenseBytes(DType dtype, const int64_t* dims, int rank, const char* name) {
  uint64_t bytes = DTypeSize(dtype);
  for (int i = 0; i < rank; ++i) {
    if (dims[i] < 0) {
      return absl::InvalidArgumentError(absl::StrCat("tensor '", name, "': negative dimension ", dims[i]));
    }
    if (__builtin_mul_overflow(bytes, static_cast<uint64_t>(dims[i]), &bytes) || bytes > (uint64_t{1} << 62)) {
      return absl::InvalidArgumentError(absl::StrCat("tensor '", name, "': size overflows"));
    }
  }
  return bytes;
}

absl::StatusOr<int64_t> LeadingDim(const v1::Tensor& t, const char* name, int rank) {
  if (t.shape_size() != rank) {
    if (t.dtype() == v1::DATA_TYPE_UNSPECIFIED && t.shape_size() == 0 && t.data().empty()) {
      return absl::InvalidArgumentError(absl::StrCat("tensor '", name, "' is missing"));
    }
    return absl::InvalidArgumentError(
        absl::StrCat("tensor '", name, "': rank ", t.shape_size(), " (shape ", ShapeString(t), "), want ", rank));
  }
  if (t.shape(0) < 0) {
    return absl::InvalidArgumentError(absl::StrCat("tensor '", name, "': negative dimension ", t.shape(0)));
  }
  return t.shape(0);
}

absl::StatusOr<TensorView> DecodeTensor(const v1::Tensor& t, const char* name, DType dtype,
                                        std::initializer_list<int64_t> dims, transport::TensorTransfer* transfer,
                                        const WireTensorData* wire) {
  if (absl::Status s = CheckDType(t, name, dtype); !s.ok()) return s;
  bool same = t.shape_size() == static_cast<int>(dims.size());
  if (same) {
    int i = 0;
    for (int64_t d : dims) same = same && t.shape(i++) == d;
  }
  if (!same) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor '", name, "': shape ", ShapeString(t), ", want ", ShapeString(dims)));
  }
  if (absl::Status s = CheckBytes(t, name, dtype, wire); !s.ok()) return s;
  absl::StatusOr<char*> bytes = TensorBytes(t, name, dtype, transfer, wire);
  if (!bytes.ok()) return bytes.status();
  return TensorView::Contiguous(*bytes, dtype, dims);
}

absl::StatusOr<TensorView> DecodeStrided2D(const v1::Tensor& t, const char* name, DType dtype, int64_t cols,
                                           transport::TensorTransfer* transfer, const WireTensorData* wire) {
  if (absl::Status s = CheckDType(t, name, dtype); !s.ok()) return s;
  if (t.shape_size() != 2 || t.shape(0) < 0 || t.shape(1) < cols) {
    return absl::InvalidArgumentError(absl::StrCat("tensor '", name, "': shape ", ShapeString(t), ", want [M, S] with S >= ",
                                                   cols));
  }
  if (absl::Status s = CheckBytes(t, name, dtype, wire); !s.ok()) return s;
  absl::StatusOr<char*> bytes = TensorBytes(t, name, dtype, transfer, wire);
  if (!bytes.ok()) return bytes.status();
  return TensorView::Strided2D(*bytes, dtype, t.shape(0), cols, t.shape(1));
}

TensorView AllocateOutput(v1::Tensor* out, DType dtype, std::initializer_list<int64_t> dims, OutputBuffers* external,
                          int field) {
  out->set_dtype(ToProto(dtype));
  out->clear_shape();
  uint64_t n = DTypeSize(dtype);
  for (int64_t d : dims) {
    out->add_shape(d);
    n *= static_cast<uint64_t>(d);
  }
  if (external != nullptr) return TensorView::Contiguous(external->Add(field, n), dtype, dims);
  out->mutable_data()->resize(n);
  return TensorView::Contiguous(out->mutable_data()->data(), dtype, dims);
}

namespace {

absl::Status CheckStageAndMode(const v1::MhcSeamRequest& req) {
  if (!v1::MhcStage_IsValid(req.stage())) {
    return absl::InvalidArgumentError(absl::StrCat("unknown stage ", static_cast<int>(req.stage())));
  }
  if (!v1::MhcMode_IsValid(req.mode())) {
    return absl::InvalidArgumentError(absl::StrCat("unknown mode ", static_cast<int>(req.mode())));
  }
  return absl::OkStatus();
}

// One output a call produces, sized before it is allocated: its name (as output_placements names
// it), dtype and shape.
struct SizedOutput {
  const char* name;
  DType dtype;
  std::initializer_list<int64_t> dims;
};

// The response's tensor bytes from the outputs' dense sizes (overflow-checked) and the request's
// placements: a placed output is not sent, and one placed in CUDA shared memory is not held either
// (the kernels write the client's device buffer). A placement Decode*Request will refuse (no
// reference, a name twice, an output not produced) changes nothing here: it is refused there.
absl::StatusOr<ResponseSize> SizeResponse(const google::protobuf::RepeatedPtrField<v1::OutputPlacement>& placements,
                                          std::initializer_list<SizedOutput> outputs) {
  ResponseSize size;
  for (const SizedOutput& out : outputs) {
    absl::StatusOr<uint64_t> b = DenseBytes(out.dtype, out.dims.begin(), static_cast<int>(out.dims.size()), "response");
    if (!b.ok()) return b.status();
    const v1::OutputPlacement* placed = nullptr;
    for (const v1::OutputPlacement& p : placements) {
      if (p.output() == out.name && (p.has_shared_memory() || p.has_cuda_shared_memory())) placed = &p;
    }
    bool overflow = false;
    if (placed == nullptr) overflow |= __builtin_add_overflow(size.sent, *b, &size.sent);
    if (placed == nullptr || !placed->has_cuda_shared_memory()) overflow |= __builtin_add_overflow(size.held, *b, &size.held);
    if (overflow) return absl::InvalidArgumentError("response size overflows");
  }
  return size;
}

// One output a call produces: its response field's name and number, and its tensor (sized by
// AllocateOutput, its data in `external` when that holds the field, else in the message).
struct ProducedOutput {
  const char* name;
  int field;
  v1::Tensor* tensor;
  TensorView* view;  // what the run writes
};

// Output placements: each names one output this call produces, at most once; the transfer records
// where it goes after the run.
absl::Status PlaceOutputs(const google::protobuf::RepeatedPtrField<v1::OutputPlacement>& placements,
                          const std::vector<ProducedOutput>& produced, transport::TensorTransfer* transfer,
                          OutputBuffers* external) {
  for (int i = 0; i < placements.size(); ++i) {
    const v1::OutputPlacement& p = placements[i];
    for (int j = 0; j < i; ++j) {
      if (placements[j].output() == p.output()) {
        return absl::InvalidArgumentError(
            absl::StrCat("output_placements names output '", ClientString(p.output()), "' twice"));
      }
    }
    const ProducedOutput* found = nullptr;
    for (const auto& out : produced) {
      if (p.output() == out.name) found = &out;
    }
    if (found == nullptr) {
      std::vector<std::string> names;
      for (const auto& out : produced) names.emplace_back(out.name);
      return absl::InvalidArgumentError(absl::StrCat("output_placements names '", ClientString(p.output()),
                                                     "', which this call does not produce (it produces ",
                                                     absl::StrJoin(names, ", "), ")"));
    }
    if (!p.has_shared_memory() && !p.has_cuda_shared_memory()) {
      return absl::InvalidArgumentError(absl::StrCat("output_placements for '", found->name,
                                                     "' has no shared_memory or cuda_shared_memory reference"));
    }
    if (transfer == nullptr) {
      return absl::FailedPreconditionError(
          absl::StrCat("output '", found->name, "': shared-memory tensors are not accepted here"));
    }
    // From the view: an output placed in CUDA shared memory has no buffer and no data here.
    const uint64_t bytes = static_cast<uint64_t>(found->view->numel()) * DTypeSize(found->view->dtype);
    // CUDA shared memory: always where it lies (the kernels write the client's device buffer).
    absl::StatusOr<char*> in_place =
        p.has_cuda_shared_memory()
            ? transfer->PlaceDeviceOutput(p.cuda_shared_memory(), found->tensor, found->name, found->field, bytes)
            : transfer->PlaceOutput(p.shared_memory(), found->tensor, found->name, found->field, bytes);
    if (!in_place.ok()) return in_place.status();
    if (*in_place != nullptr) {
      // The device writes it where it lies in the client's page-locked region: no buffer here.
      found->view->data = *in_place;
      if (external != nullptr) external->Remove(found->field);
      found->tensor->clear_data();
    }
  }
  return absl::OkStatus();
}

// Outputs placed in CUDA shared memory get no buffer in `external`: the kernels write the client's
// device memory, where PlaceOutputs points their views (a large call's buffers cost the decode an
// allocation and an unmap each, for nothing). A placement that names no output of `response`, or
// that PlaceOutputs refuses, changes nothing here: the call is refused there.
void SkipDevicePlacedOutputs(const google::protobuf::RepeatedPtrField<v1::OutputPlacement>& placements,
                             const google::protobuf::Descriptor& response, OutputBuffers* external) {
  if (external == nullptr) return;
  for (const v1::OutputPlacement& p : placements) {
    if (!p.has_cuda_shared_memory()) continue;
    const google::protobuf::FieldDescriptor* f = response.FindFieldByName(p.output());
    if (f != nullptr && f->message_type() == v1::Tensor::descriptor()) external->WrittenElsewhere(f->number());
  }
}

// Where a request's outputs go: `external` when given, except for requests whose outputs are read
// back from the response message (verify's comparison). Outputs placed in shared memory go there
// too: written to their objects from those buffers after the run, never zero-filled in a message.
template <typename Request>
OutputBuffers* OutputsOutsideMessage(const Request& req, OutputBuffers* external) {
  return req.verify() ? nullptr : external;
}

absl::Status CheckVerify(bool verify, bool uses_shared_memory) {
  if (verify && uses_shared_memory) {
    return absl::InvalidArgumentError(
        "verify is not supported with shared-memory tensors (the comparison needs the tensors inline)");
  }
  return absl::OkStatus();
}

// Runs `decode`, turning an allocation failure of the response tensors into RESOURCE_EXHAUSTED.
template <typename Response, typename Decode>
auto CatchAllocationFailure(Response* resp, OutputBuffers* external, Decode&& decode) -> decltype(decode()) {
  const auto clear = [&] {
    resp->Clear();
    if (external != nullptr) external->Clear();
  };
  try {
    return decode();
  } catch (const std::bad_alloc&) {
    clear();
    return absl::ResourceExhaustedError("the server could not allocate the response (out of host memory); retry "
                                        "later or send fewer tokens per call");
  } catch (const std::length_error&) {
    clear();
    return absl::ResourceExhaustedError("the response is too large for the server to allocate");
  }
}

}  // namespace

absl::StatusOr<ResponseSize> MhcResponseBytes(const v1::MhcSeamRequest& req, const PreparedMhcWeights& weights,
                                              int64_t max_tokens) {
  if (absl::Status s = CheckStageAndMode(req); !s.ok()) return s;
  absl::StatusOr<int64_t> T = LeadingDim(req.x(), "x", 2);
  if (!T.ok()) return T.status();
  if (absl::Status s = CheckTokens(*T, max_tokens, "x"); !s.ok()) return s;
  const int64_t n = weights.params().hc_mult, C = weights.params().hidden;
  // The same tensors DecodeMhcRequest allocates below. A residual session call keeps the new
  // residual and mixes in its session unless it asks for them (return_state).
  const bool state_in_response = req.session().empty() || req.return_state();
  const bool mixes = state_in_response && FromProto(req.stage()) != MhcStage::kHead;
  const int64_t mix_T = mixes ? *T : 0, aux_T = req.capture_aux() ? *T : 0;
  absl::StatusOr<ResponseSize> size =
      SizeResponse(req.output_placements(), {{"new_residual", DType::kBF16, {*T, state_in_response ? n : 0, C}},
                                             {"new_pre_mix", DType::kFP32, {mix_T, n}},
                                             {"new_post_mix", DType::kFP32, {mix_T, n}},
                                             {"new_comb_mix", DType::kFP32, {mix_T, n, n}},
                                             {"y", DType::kBF16, {*T, C}},
                                             {"aux", DType::kBF16, {aux_T, C}}});
  if (!size.ok()) return size;
  // x, residual, post_mix, comb_mix and pre_mix at their decoded shapes (T <= max_tokens: no overflow).
  const uint64_t t = static_cast<uint64_t>(*T), un = static_cast<uint64_t>(n), uc = static_cast<uint64_t>(C);
  const uint64_t bf16 = DTypeSize(DType::kBF16), fp32 = DTypeSize(DType::kFP32);
  size->inputs_at_most = (t * uc + t * un * uc) * bf16 + (2 * t * un + t * un * un) * fp32;
  return size;
}

absl::StatusOr<ResponseSize> SwaResponseBytes(const v1::SwaNormQuantRequest& req, const PreparedSwaWeights& weights,
                                              int64_t max_tokens) {
  absl::StatusOr<int64_t> M = LeadingDim(req.qr_kv(), "qr_kv", 2);
  if (!M.ok()) return M.status();
  if (absl::Status s = CheckTokens(*M, max_tokens, "qr_kv"); !s.ok()) return s;
  const SwaHyperParams& p = weights.params();
  const bool row_major = p.scale_layout == ScaleLayout::kRowMajor;
  // The same tensors DecodeSwaRequest allocates below.
  return SizeResponse(req.output_placements(),
                      {{"q_fp8", Fp8DType(p.fp8_format), {*M, p.q_rank}},
                       {"q_scale", DType::kFP32, {row_major ? *M : AlignTo4(*M), p.groups()}},
                       {"kv", DType::kBF16, {*M, p.head_dim}},
                       {"q_proj", DType::kBF16, {*M, p.has_wq_b() ? p.wq_b_rows : 0}}});
}

namespace {

// A session call's request against its session (MhcSeamRequest.session): what it may carry and
// whether the session can serve its stage. The shapes are checked by the caller.
absl::Status CheckSessionRequest(const v1::MhcSeamRequest& req, const transport::ResidualSessionStore::Lease& session) {
  if (req.verify()) {
    return absl::InvalidArgumentError(
        "verify is not supported with a residual session (the comparison needs every tensor inline)");
  }
  if (transport::UsesSharedMemory(req)) {
    return absl::InvalidArgumentError("a residual session call takes no shared-memory tensors or output placements");
  }
  if (FromProto(req.stage()) == MhcStage::kFirst) return absl::OkStatus();
  const char* why = "with a residual session (the session holds it)";
  for (auto [present, name] : {std::pair{req.has_residual(), "residual"}, {req.has_post_mix(), "post_mix"},
                               {req.has_comb_mix(), "comb_mix"}, {req.has_pre_mix(), "pre_mix"}}) {
    if (absl::Status s = ExpectAbsent(present, name, why); !s.ok()) return s;
  }
  if (!session.has_residual()) {
    return absl::FailedPreconditionError(absl::StrCat("residual session '", session.session().name(),
                                                      "' has no residual yet: start it with a FIRST-stage call"));
  }
  if (!session.has_mixes()) {
    return absl::FailedPreconditionError(absl::StrCat("residual session '", session.session().name(),
                                                      "' has no mixes: its last call was the HEAD stage; start the "
                                                      "stream again with a FIRST-stage call"));
  }
  return absl::OkStatus();
}

absl::StatusOr<MhcCall> DecodeMhcRequestImpl(const v1::MhcSeamRequest& req, const PreparedMhcWeights& weights,
                                             int64_t max_tokens, v1::MhcSeamResponse* resp,
                                             transport::TensorTransfer* transfer, OutputBuffers* external,
                                             const WireTensorData* wire,
                                             const transport::ResidualSessionStore::Lease* session) {
  if (absl::Status s = CheckStageAndMode(req); !s.ok()) return s;
  if (absl::Status s = CheckVerify(req.verify(), transport::UsesSharedMemory(req)); !s.ok()) return s;
  if (session != nullptr) {
    if (absl::Status s = CheckSessionRequest(req, *session); !s.ok()) return s;
  } else if (req.return_state()) {
    return absl::InvalidArgumentError("return_state needs a residual session (MhcSeamRequest.session)");
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
  if (session != nullptr) {
    const transport::ResidualSessionShape& s = session->session().shape();
    if (s.hc_mult != n || s.hidden != C) {
      return absl::InvalidArgumentError(absl::StrCat("residual session '", session->session().name(), "' holds n = ",
                                                     s.hc_mult, ", C = ", s.hidden, "; weight set '", req.weight_set(),
                                                     "' has n = ", n, ", C = ", C));
    }
    if (*T != s.tokens) {
      return absl::InvalidArgumentError(absl::StrCat("tensor 'x' has ", *T, " tokens; residual session '",
                                                     session->session().name(), "' holds ", s.tokens));
    }
  }
  FL_ASSIGN_OR_RETURN(a.x, DecodeTensor(req.x(), "x", DType::kBF16, {*T, C}, transfer, wire));

  if (session != nullptr) {
    // The state as the session holds it, in backend memory (the lanes pass it through as it is).
    if (a.stage != MhcStage::kFirst) {
      const transport::ResidualState& cur = session->current();
      a.residual = cur.residual;
      a.post_mix = cur.post_mix;
      a.comb_mix = cur.comb_mix;
      if (a.mode == MhcMode::kShifted) a.pre_mix = cur.pre_mix;
    }
  } else if (a.stage == MhcStage::kFirst) {
    const char* why = "for stage FIRST (x is the embedding)";
    for (auto [present, name] : {std::pair{req.has_residual(), "residual"}, {req.has_post_mix(), "post_mix"},
                                 {req.has_comb_mix(), "comb_mix"}, {req.has_pre_mix(), "pre_mix"}}) {
      if (absl::Status s = ExpectAbsent(present, name, why); !s.ok()) return s;
    }
  } else {
    FL_ASSIGN_OR_RETURN(a.residual, DecodeTensor(req.residual(), "residual", DType::kBF16, {*T, n, C}, transfer, wire));
    FL_ASSIGN_OR_RETURN(a.post_mix, DecodeTensor(req.post_mix(), "post_mix", DType::kFP32, {*T, n}, transfer, wire));
    FL_ASSIGN_OR_RETURN(a.comb_mix, DecodeTensor(req.comb_mix(), "comb_mix", DType::kFP32, {*T, n, n}, transfer, wire));
    if (req.has_pre_mix()) {
      if (absl::Status s = ExpectAbsent(a.mode == MhcMode::kNormal, "pre_mix", "in NORMAL mode (y uses the new pre mix)");
          !s.ok()) {
        return s;
      }
      FL_ASSIGN_OR_RETURN(a.pre_mix, DecodeTensor(req.pre_mix(), "pre_mix", DType::kFP32, {*T, n}, transfer, wire));
    }
  }

  using R = v1::MhcSeamResponse;
  external = OutputsOutsideMessage(req, external);
  SkipDevicePlacedOutputs(req.output_placements(), *R::descriptor(), external);
  if (session != nullptr) {
    // The new state goes to the session's other copy, made current when the call succeeds
    // (Lease::Commit). With return_state the response gets a copy of it after the run.
    const transport::ResidualState& next = session->next();
    a.new_residual = next.residual;
    if (a.stage != MhcStage::kHead) {
      a.new_pre_mix = next.pre_mix;
      a.new_post_mix = next.post_mix;
      a.new_comb_mix = next.comb_mix;
    }
    if (req.return_state()) {
      auto copy_back = [&](v1::Tensor* out, const TensorView& dev, std::initializer_list<int64_t> dims, int field) {
        const TensorView host = AllocateOutput(out, dev.dtype, dims, external, field);
        call.copies_after_run.push_back(MhcCall::CopyBack{host.data, dev.data, host.numel() * DTypeSize(dev.dtype)});
      };
      copy_back(resp->mutable_new_residual(), a.new_residual, {*T, n, C}, R::kNewResidualFieldNumber);
      if (a.stage != MhcStage::kHead) {
        copy_back(resp->mutable_new_pre_mix(), a.new_pre_mix, {*T, n}, R::kNewPreMixFieldNumber);
        copy_back(resp->mutable_new_post_mix(), a.new_post_mix, {*T, n}, R::kNewPostMixFieldNumber);
        copy_back(resp->mutable_new_comb_mix(), a.new_comb_mix, {*T, n, n}, R::kNewCombMixFieldNumber);
      }
    }
  } else {
    a.new_residual = AllocateOutput(resp->mutable_new_residual(), DType::kBF16, {*T, n, C}, external,
                                    R::kNewResidualFieldNumber);
    if (a.stage != MhcStage::kHead) {
      a.new_pre_mix =
          AllocateOutput(resp->mutable_new_pre_mix(), DType::kFP32, {*T, n}, external, R::kNewPreMixFieldNumber);
      a.new_post_mix =
          AllocateOutput(resp->mutable_new_post_mix(), DType::kFP32, {*T, n}, external, R::kNewPostMixFieldNumber);
      a.new_comb_mix = AllocateOutput(resp->mutable_new_comb_mix(), DType::kFP32, {*T, n, n}, external,
                                      R::kNewCombMixFieldNumber);
    }
  }
  a.y = AllocateOutput(resp->mutable_y(), DType::kBF16, {*T, C}, external, R::kYFieldNumber);
  if (a.capture_aux) a.aux = AllocateOutput(resp->mutable_aux(), DType::kBF16, {*T, C}, external, R::kAuxFieldNumber);
  if (req.output_placements_size() > 0) {
    // Only the outputs this call produces (mutable_* would add the others to the response).
    std::vector<ProducedOutput> produced = {
        {"new_residual", R::kNewResidualFieldNumber, resp->mutable_new_residual(), &a.new_residual}};
    if (a.stage != MhcStage::kHead) {
      produced.push_back({"new_pre_mix", R::kNewPreMixFieldNumber, resp->mutable_new_pre_mix(), &a.new_pre_mix});
      produced.push_back({"new_post_mix", R::kNewPostMixFieldNumber, resp->mutable_new_post_mix(), &a.new_post_mix});
      produced.push_back({"new_comb_mix", R::kNewCombMixFieldNumber, resp->mutable_new_comb_mix(), &a.new_comb_mix});
    }
    produced.push_back({"y", R::kYFieldNumber, resp->mutable_y(), &a.y});
    if (a.capture_aux) produced.push_back({"aux", R::kAuxFieldNumber, resp->mutable_aux(), &a.aux});
    if (absl::Status s = PlaceOutputs(req.output_placements(), produced, transfer, external); !s.ok()) return s;
  }

  // The library's own contract check, so nothing invalid reaches the executor; the only one on the
  // request path (the backends' launch prologue skips arguments marked checked).
  if (absl::Status s = ValidateMhcArgs(p, weights.has_norm_weight(), a); !s.ok()) return s;
  a.contract_checked = true;
  call.query = MhcShapeQuery{a.stage, a.mode, a.capture_aux, a.tokens};
  return call;
}

absl::StatusOr<SwaCall> DecodeSwaRequestImpl(const v1::SwaNormQuantRequest& req, const PreparedSwaWeights& weights,
                                             int64_t max_tokens, v1::SwaNormQuantResponse* resp,
                                             transport::TensorTransfer* transfer, OutputBuffers* external,
                                             const WireTensorData* wire) {
  if (absl::Status s = CheckVerify(req.verify(), transport::UsesSharedMemory(req)); !s.ok()) return s;
  const SwaHyperParams& p = weights.params();
  const int64_t Q = p.q_rank, D = p.head_dim, G = p.groups();
  SwaCall call;
  SwaArgs& a = call.args;
  absl::StatusOr<int64_t> M = LeadingDim(req.qr_kv(), "qr_kv", 2);
  if (!M.ok()) return M.status();
  if (absl::Status s = CheckTokens(*M, max_tokens, "qr_kv"); !s.ok()) return s;
  a.tokens = *M;
  FL_ASSIGN_OR_RETURN(a.qr_kv, DecodeStrided2D(req.qr_kv(), "qr_kv", DType::kBF16, Q + D, transfer, wire));

  using R = v1::SwaNormQuantResponse;
  external = OutputsOutsideMessage(req, external);
  SkipDevicePlacedOutputs(req.output_placements(), *R::descriptor(), external);
  a.q_fp8 = AllocateOutput(resp->mutable_q_fp8(), Fp8DType(p.fp8_format), {*M, Q}, external, R::kQFp8FieldNumber);
  if (p.scale_layout == ScaleLayout::kRowMajor) {
    a.q_scale = AllocateOutput(resp->mutable_q_scale(), DType::kFP32, {*M, G}, external, R::kQScaleFieldNumber);
  } else {
    a.q_scale =
        AllocateOutput(resp->mutable_q_scale(), DType::kFP32, {G, AlignTo4(*M)}, external, R::kQScaleFieldNumber);
  }
  a.kv = AllocateOutput(resp->mutable_kv(), DType::kBF16, {*M, D}, external, R::kKvFieldNumber);
  if (p.has_wq_b()) {
    a.q_proj = AllocateOutput(resp->mutable_q_proj(), DType::kBF16, {*M, p.wq_b_rows}, external, R::kQProjFieldNumber);
  }
  if (req.output_placements_size() > 0) {
    // Only the outputs this call produces (mutable_* would add the others to the response).
    std::vector<ProducedOutput> produced = {{"q_fp8", R::kQFp8FieldNumber, resp->mutable_q_fp8(), &a.q_fp8},
                                            {"q_scale", R::kQScaleFieldNumber, resp->mutable_q_scale(), &a.q_scale},
                                            {"kv", R::kKvFieldNumber, resp->mutable_kv(), &a.kv}};
    if (p.has_wq_b()) produced.push_back({"q_proj", R::kQProjFieldNumber, resp->mutable_q_proj(), &a.q_proj});
    if (absl::Status s = PlaceOutputs(req.output_placements(), produced, transfer, external); !s.ok()) return s;
  }

  if (absl::Status s = ValidateSwaArgs(p, a); !s.ok()) return s;
  a.contract_checked = true;  // as for mHC above
  call.query = SwaShapeQuery{a.tokens};
  return call;
}

}  // namespace

absl::StatusOr<MhcCall> DecodeMhcRequest(const v1::MhcSeamRequest& req, const PreparedMhcWeights& weights,
                                         int64_t max_tokens, v1::MhcSeamResponse* resp,
                                         transport::TensorTransfer* transfer, OutputBuffers* external,
                                         const WireTensorData* wire,
                                         const transport::ResidualSessionStore::Lease* session) {
  return CatchAllocationFailure(resp, external, [&] {
    return DecodeMhcRequestImpl(req, weights, max_tokens, resp, transfer, external, wire, session);
  });
}

absl::StatusOr<SwaCall> DecodeSwaRequest(const v1::SwaNormQuantRequest& req, const PreparedSwaWeights& weights,
                                         int64_t max_tokens, v1::SwaNormQuantResponse* resp,
                                         transport::TensorTransfer* transfer, OutputBuffers* external,
                                         const WireTensorData* wire) {
  return CatchAllocationFailure(
      resp, external, [&] { return DecodeSwaRequestImpl(req, weights, max_tokens, resp, transfer, external, wire); });
}

}  // namespace fusedlayer::server
