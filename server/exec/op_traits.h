// One traits table per compute op: what differs between MhcSeam and SwaNormQuant for the compute
// engine's one lifecycle (exec/compute_engine.h): the messages, the weight-set part, decoding
// (codec/request_codec.h) and the response size it is admitted by, the fused-support query, the
// run (runtime/op_calls.h), dynamic batching, residual sessions, and the shadow verifier's synchronous
// verify and zero-copy capture (server/shadow/).
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "codec/request_codec.h"
#include "config.h"
#include "exec/batch_assembly.h"
#include "runtime/op_calls.h"
#include "fusedlayer/backend.h"
#include "fusedlayer/v1/fusedlayer.pb.h"
#include "metrics/metrics.h"
#include "shadow/shadow_verifier.h"
#include "shadow/shared_messages.h"
#include "transport/residual_sessions.h"
#include "transport/shared_memory.h"
#include "weights/weight_set.h"

namespace fusedlayer::server {

struct MhcOp {
  using Request = v1::MhcSeamRequest;
  using Response = v1::MhcSeamResponse;
  using Messages = shadow::MhcMessages;
  static constexpr Method kMethod = Method::kMhcSeam;
  using Prepared = PreparedMhcWeights;
  using Call = MhcCall;
  static constexpr Op kOp = Op::kMhc;
  static constexpr const char* kPartName = "mHC";
  static constexpr const char* kTokensSymbol = "T";
  static const Prepared* Part(const WeightSet& set, size_t device) { return set.on(device).mhc.get(); }
  static absl::StatusOr<ResponseSize> ResponseBytes(const Request& request, const Prepared& w, int64_t max_tokens) {
    return MhcResponseBytes(request, w, max_tokens);
  }
  static absl::StatusOr<MhcCall> Decode(const Request& request, const Prepared& w, int64_t max_tokens,
                                        Response* response, transport::TensorTransfer* transfer,
                                        OutputBuffers* external, const WireTensorData* wire,
                                        const transport::ResidualSessionStore::Lease* session) {
    return DecodeMhcRequest(request, w, max_tokens, response, transfer, external, wire, session);
  }
  // Residual sessions (transport/residual_sessions.h): the session a request names (empty: none),
  // whether a call leaves mixes in it, and the state copies its response asked for.
  static const std::string& SessionName(const Request& request) { return request.session(); }
  static bool LeavesMixes(const MhcCall& c) { return c.args.stage != MhcStage::kHead; }
  static const std::vector<MhcCall::CopyBack>& CopiesAfterRun(const MhcCall& c) { return c.copies_after_run; }
  static FusedSupport Support(Backend& backend, const Prepared& w, const MhcCall& c) {
    return backend.MhcFusedSupport(w, c.query);
  }
  static absl::StatusOr<RunStats> Run(const ExecTarget& target, const Prepared& w, const MhcCall& c, Path path) {
    return RunMhcCall(target, w, c.args, path);
  }
  static v1::Verification Verify(shadow::ShadowVerifier& shadow, const WeightSet& set, const Request& request,
                                 const Response& response, size_t device) {
    return shadow.VerifyMhc(set, request, response, device);
  }
  static std::unique_ptr<shadow::ShadowVerifier::Job> Capture(shadow::ShadowVerifier& shadow,
                                                              std::shared_ptr<const WeightSet> set, Messages* held,
                                                              size_t device) {
    return shadow.CaptureMhc(std::move(set), held, device);
  }
  // Dynamic batching: requests (of one weight set) that may share a launch. Everything that
  // selects a kernel variant or an optional tensor must match; T may differ.
  static bool SameBatch(const Request& a, const Request& b) {
    return a.stage() == b.stage() && a.mode() == b.mode() && a.capture_aux() == b.capture_aux() &&
           a.has_pre_mix() == b.has_pre_mix() && a.path_preference() == b.path_preference();
  }
  static MhcCall Gather(BatchAssembly& assembly, const std::vector<const MhcCall*>& calls, const Prepared&) {
    std::vector<const MhcArgs*> args;
    for (const MhcCall* c : calls) args.push_back(&c->args);
    MhcCall batched;
    batched.args = assembly.Gather(args);
    batched.query = calls.front()->query;
    batched.query.tokens = batched.args.tokens;
    return batched;
  }
};

struct SwaOp {
  using Request = v1::SwaNormQuantRequest;
  using Response = v1::SwaNormQuantResponse;
  using Messages = shadow::SwaMessages;
  static constexpr Method kMethod = Method::kSwaNormQuant;
  using Prepared = PreparedSwaWeights;
  using Call = SwaCall;
  static constexpr Op kOp = Op::kSwa;
  static constexpr const char* kPartName = "SWA";
  static constexpr const char* kTokensSymbol = "M";
  static const Prepared* Part(const WeightSet& set, size_t device) { return set.on(device).swa.get(); }
  static absl::StatusOr<ResponseSize> ResponseBytes(const Request& request, const Prepared& w, int64_t max_tokens) {
    return SwaResponseBytes(request, w, max_tokens);
  }
  static absl::StatusOr<SwaCall> Decode(const Request& request, const Prepared& w, int64_t max_tokens,
                                        Response* response, transport::TensorTransfer* transfer,
                                        OutputBuffers* external, const WireTensorData* wire,
                                        const transport::ResidualSessionStore::Lease* /*session: never*/) {
    return DecodeSwaRequest(request, w, max_tokens, response, transfer, external, wire);
  }
  // SWA has no state between layers: no residual sessions.
  static const std::string& SessionName(const Request&) {
    static const std::string none;
    return none;
  }
  static bool LeavesMixes(const SwaCall&) { return false; }
  static const std::vector<MhcCall::CopyBack>& CopiesAfterRun(const SwaCall&) {
    static const std::vector<MhcCall::CopyBack> none;
    return none;
  }
  static FusedSupport Support(Backend& backend, const Prepared& w, const SwaCall& c) {
    return backend.SwaFusedSupport(w, c.query);
  }
  static absl::StatusOr<RunStats> Run(const ExecTarget& target, const Prepared& w, const SwaCall& c, Path path) {
    return RunSwaCall(target, w, c.args, path);
  }
  static v1::Verification Verify(shadow::ShadowVerifier& shadow, const WeightSet& set, const Request& request,
                                 const Response& response, size_t device) {
    return shadow.VerifySwa(set, request, response, device);
  }
  static std::unique_ptr<shadow::ShadowVerifier::Job> Capture(shadow::ShadowVerifier& shadow,
                                                              std::shared_ptr<const WeightSet> set, Messages* held,
                                                              size_t device) {
    return shadow.CaptureSwa(std::move(set), held, device);
  }
  static bool SameBatch(const Request& a, const Request& b) { return a.path_preference() == b.path_preference(); }
  static SwaCall Gather(BatchAssembly& assembly, const std::vector<const SwaCall*>& calls, const Prepared& w) {
    std::vector<const SwaArgs*> args;
    for (const SwaCall* c : calls) args.push_back(&c->args);
    SwaCall batched;
    batched.args = assembly.Gather(args, w.params().scale_layout);
    batched.query = SwaShapeQuery{batched.args.tokens};
    return batched;
  }
};

}  // namespace fusedlayer::server
