// The compute RPCs (MhcSeam, SwaNormQuant): inline on the gRPC thread, validate and decode the
// request (rpc/proto_convert.h) and queue it; on the executor, the launch checks, the path choice
// and run with fallback (exec/dispatcher.h), verify or shadow sampling, the report, the response.
// What differs between the two ops is in rpc/op_traits.h.
#include <utility>

#include "absl/strings/str_cat.h"
#include "exec/dispatcher.h"
#include "rpc/op_traits.h"
#include "rpc/proto_convert.h"
#include "rpc/service.h"
#include "rpc/unary_call.h"

namespace fusedlayer::server {

namespace {

absl::Status CheckPreference(v1::PathPreference p) {
  if (!v1::PathPreference_IsValid(p)) {
    return absl::InvalidArgumentError(absl::StrCat("unknown path_preference ", static_cast<int>(p)));
  }
  return absl::OkStatus();
}

// The executor-side half shared by both ops: launch checks, path choice, run with fallback,
// metrics and the execution report. `support` and `run` are the op-specific parts. Returns the
// path taken (and why, when unfused).
template <typename SupportFn, typename RunFn>
absl::StatusOr<PathDecision> ExecuteOnWorker(Op op, v1::PathPreference preference, const ServerConfig& config,
                                             Metrics& metrics, const std::string& what, double queue_seconds,
                                             SupportFn&& support, RunFn&& run, v1::ExecutionReport* report) {
  absl::StatusOr<PathDecision> decision = ChoosePath(op, preference, config.fused_disabled(op), support);
  if (!decision.ok()) return decision.status();
  absl::StatusOr<DispatchOutcome> outcome =
      RunWithFallback(op, *decision, preference == v1::PATH_PREFERENCE_REQUIRE_FUSED, what, run);
  if (!outcome.ok()) return outcome.status();
  const PathDecision& d = outcome->decision;
  metrics.RecordExecution(op, d.path, outcome->stats.kernel_seconds);
  if (d.reason.has_value()) metrics.RecordFallback(op, *d.reason);
  report->set_path(ToProto(d.path));
  report->set_fallback_reason(d.reason.has_value() ? ToProto(*d.reason) : v1::FALLBACK_REASON_NONE);
  report->set_fallback_detail(d.detail);
  report->set_kernel_seconds(outcome->stats.kernel_seconds);
  report->set_queue_seconds(queue_seconds);
  return outcome->decision;
}

// verify = true on a request that ran unfused: there is no fused output to compare. The reason is
// the same label the fallback metric uses.
v1::Verification NotComparedUnfused(const PathDecision& decision) {
  v1::Verification v;
  v.set_compared(false);
  v.set_reason(absl::StrCat("ran unfused (",
                            decision.reason.has_value() ? FallbackReasonName(*decision.reason) : "no reason", ")"));
  return v;
}

}  // namespace

grpc::ServerUnaryReactor* FusedLayerService::MhcSeam(grpc::CallbackServerContext* ctx,
                                                     const v1::MhcSeamRequest* request,
                                                     v1::MhcSeamResponse* response) {
  auto* call = new UnaryCall(metrics_, Method::kMhcSeam, config_.max_message_bytes, ctx, request, response);
  absl::Status s = AdmitDuringDrain();
  if (s.ok()) s = StartCompute<MhcRpc>(call, shadow::MhcMessages::Of(ctx), request, response);
  if (!s.ok()) call->Complete(std::move(s));
  return call;
}

grpc::ServerUnaryReactor* FusedLayerService::SwaNormQuant(grpc::CallbackServerContext* ctx,
                                                          const v1::SwaNormQuantRequest* request,
                                                          v1::SwaNormQuantResponse* response) {
  auto* call = new UnaryCall(metrics_, Method::kSwaNormQuant, config_.max_message_bytes, ctx, request, response);
  absl::Status s = AdmitDuringDrain();
  if (s.ok()) s = StartCompute<SwaRpc>(call, shadow::SwaMessages::Of(ctx), request, response);
  if (!s.ok()) call->Complete(std::move(s));
  return call;
}

// Inline (on the gRPC thread): validate and decode. On the executor: launch checks, run, verify or
// sample for shadow verification, report, respond.
template <typename Rpc>
absl::Status FusedLayerService::StartCompute(UnaryCall* call, typename Rpc::Messages* held,
                                             const typename Rpc::Request* request, typename Rpc::Response* response) {
  if (absl::Status s = CheckPreference(request->path_preference()); !s.ok()) return s;
  absl::StatusOr<std::shared_ptr<const WeightSet>> set = weights_.Get(request->weight_set());
  if (!set.ok()) return set.status();
  if (Rpc::Part(**set) == nullptr) {
    return absl::NotFoundError(
        absl::StrCat("weight set '", request->weight_set(), "' has no ", Rpc::kPartName, " part"));
  }
  // Memory admission: the response is sized from the request and admitted by bytes before any of
  // it is allocated (docs/operations.md, "Memory admission").
  absl::StatusOr<uint64_t> response_bytes = Rpc::ResponseBytes(*request, *Rpc::Part(**set), config_.max_tokens);
  if (!response_bytes.ok()) return response_bytes.status();
  if (absl::Status s = AdmitComputeBytes(call, *response_bytes); !s.ok()) return s;
  auto decoded = Rpc::Decode(*request, *Rpc::Part(**set), config_.max_tokens, response);
  if (!decoded.ok()) return decoded.status();
  response->set_request_id(RequestId(request->request_id()));

  return executor_.Submit([this, call, held, request, response, set = std::move(*set),
                           decoded = std::move(*decoded)](double queue_seconds) {
    metrics_.ObserveQueue(queue_seconds);
    if (absl::Status s = call->LaunchCheck(); !s.ok()) {
      call->Complete(std::move(s));
      return;
    }
    const typename Rpc::Prepared& part = *Rpc::Part(*set);
    const std::string what = absl::StrCat("request ", response->request_id(), " (weight set '", set->name, "', ",
                                          Rpc::kTokensSymbol, " = ", decoded.args.tokens, ")");
    v1::ExecutionReport* report = response->mutable_report();
    absl::StatusOr<PathDecision> ran = ExecuteOnWorker(
        Rpc::kOp, request->path_preference(), config_, metrics_, what, queue_seconds,
        [&] { return Rpc::Support(backend_, part, decoded); },
        [&](Path path) { return Rpc::Run(backend_, part, decoded, path); }, report);
    std::unique_ptr<shadow::ShadowVerifier::Job> shadow_job;
    if (ran.ok()) {
      if (request->verify()) {
        // Synchronous: the unfused run and the comparison happen in this job, before the response.
        *response->mutable_verification() = ran->path == Path::kFused
                                                ? Rpc::Verify(shadow_, *set, *request, *response)
                                                : NotComparedUnfused(*ran);
      } else if (ran->path == Path::kFused && decoded.args.tokens > 0 && shadow_.Sample()) {
        // No copy: the job takes a reference to this call's messages (shadow/shared_messages.h).
        // Only the report is written after this, before the response is sent; the job never
        // reads it.
        shadow_job = Rpc::Capture(shadow_, set, held);
      }
      FillReport(report, set->name);
      report->set_server_seconds(call->elapsed());
    }
    // A response over the send limit is cleared and not sent: nothing to shadow-verify.
    if (!call->Complete(ran.status())) shadow_job.reset();
    // After the response: the shadow run waits in the executor's background lane.
    shadow_.Submit(std::move(shadow_job));
  });
}

}  // namespace fusedlayer::server
