#include "service.h"

#include <algorithm>
#include <chrono>
#include <random>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"
#include "dispatcher.h"
#include "log.h"
#include "op_calls.h"

namespace fusedlayer::server {

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::string(status.message()));
}

namespace {
using Clock = std::chrono::steady_clock;
double SecondsSince(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }
}  // namespace

// A unary RPC in flight: counts itself in the inflight gauge, and on Complete() records the
// request metrics, enforces the send limit and finishes. Complete() is called exactly once, from
// the reactor thread (early errors, cheap RPCs) or from the executor; it returns whether the
// response went out with OK (false also when the response was over the send limit and cleared).
class FusedLayerService::UnaryCall final : public grpc::ServerUnaryReactor {
 public:
  UnaryCall(Metrics& metrics, Method method, int64_t max_send_bytes, grpc::CallbackServerContext* ctx,
            const google::protobuf::Message* request, google::protobuf::Message* response)
      : metrics_(metrics),
        method_(method),
        max_send_bytes_(max_send_bytes),
        ctx_(ctx),
        response_(response),
        start_(Clock::now()),
        request_bytes_(request->ByteSizeLong()) {
    metrics_.InflightAdd(1);
  }

  bool Complete(absl::Status status) {
    uint64_t response_bytes = 0;
    if (status.ok()) {
      response_bytes = response_->ByteSizeLong();
      // gRPC would fail the send itself, with a less helpful message; say what happened.
      if (response_bytes > static_cast<uint64_t>(max_send_bytes_)) {
        status = absl::ResourceExhaustedError(
            absl::StrCat("response of ", response_bytes, " bytes exceeds the server's send limit of ", max_send_bytes_,
                         " bytes (--max_message_bytes); send fewer tokens per call"));
        response_->Clear();
        response_bytes = 0;
      }
    }
    metrics_.RecordRequest(method_, static_cast<grpc::StatusCode>(status.code()), SecondsSince(start_), request_bytes_,
                           response_bytes);
    const bool sent = status.ok();
    Finish(ToGrpcStatus(status));  // `this` may be gone from here on (OnDone)
    return sent;
  }

  // Work that has not been launched yet is dropped when this says so.
  absl::Status LaunchCheck() const {
    if (ctx_->deadline() <= std::chrono::system_clock::now()) {
      return absl::DeadlineExceededError(
          absl::StrFormat("deadline passed after %.6f s in the server; the op was not launched", SecondsSince(start_)));
    }
    if (cancelled_.load(std::memory_order_acquire) || ctx_->IsCancelled()) {
      return absl::CancelledError("the call was cancelled before the op was launched");
    }
    return absl::OkStatus();
  }

  double elapsed() const { return SecondsSince(start_); }

  void OnCancel() override { cancelled_.store(true, std::memory_order_release); }
  void OnDone() override {
    metrics_.InflightAdd(-1);
    delete this;
  }

 private:
  Metrics& metrics_;
  const Method method_;
  const int64_t max_send_bytes_;
  grpc::CallbackServerContext* const ctx_;
  google::protobuf::Message* const response_;
  const Clock::time_point start_;
  const uint64_t request_bytes_;
  std::atomic<bool> cancelled_{false};
};

FusedLayerService::FusedLayerService(const ServerConfig& config, ServerIdentity identity, Backend& backend,
                                     Executor& executor, WeightManager& weights, Metrics& metrics,
                                     shadow::ShadowVerifier& shadow)
    : config_(config),
      identity_(std::move(identity)),
      backend_(backend),
      executor_(executor),
      weights_(weights),
      metrics_(metrics),
      shadow_(shadow),
      request_id_salt_(std::random_device{}() & 0xffffff) {
  SetMessageAllocatorFor_MhcSeam(&mhc_messages_);
  SetMessageAllocatorFor_SwaNormQuant(&swa_messages_);
}

std::string FusedLayerService::RequestId(const std::string& given) {
  if (!given.empty()) return given;
  return absl::StrFormat("srv-%06x-%d", request_id_salt_, next_request_id_.fetch_add(1, std::memory_order_relaxed));
}

void FusedLayerService::FillReport(v1::ExecutionReport* report, const std::string& weight_set) const {
  report->set_backend(identity_.backend);
  report->set_device(identity_.device);
  report->set_weight_set(weight_set);
}

// ---- compute -------------------------------------------------------------------------------------

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

// What differs between the two compute RPCs; FusedLayerService::StartCompute is the rest.
struct MhcRpc {
  using Request = v1::MhcSeamRequest;
  using Response = v1::MhcSeamResponse;
  using Messages = shadow::MhcMessages;
  using Prepared = PreparedMhcWeights;
  static constexpr Op kOp = Op::kMhc;
  static constexpr const char* kPartName = "mHC";
  static constexpr const char* kTokensSymbol = "T";
  static const Prepared* Part(const WeightSet& set) { return set.mhc.get(); }
  static absl::StatusOr<MhcCall> Decode(const Request& request, const Prepared& w, int64_t max_tokens,
                                        Response* response) {
    return DecodeMhcRequest(request, w, max_tokens, response);
  }
  static FusedSupport Support(Backend& backend, const Prepared& w, const MhcCall& c) {
    return backend.MhcFusedSupport(w, c.query);
  }
  static absl::StatusOr<RunStats> Run(Backend& backend, const Prepared& w, const MhcCall& c, Path path) {
    return RunMhcCall(backend, w, c.args, path);
  }
  static v1::Verification Verify(shadow::ShadowVerifier& shadow, const WeightSet& set, const Request& request,
                                 const Response& response) {
    return shadow.VerifyMhc(set, request, response);
  }
  static std::unique_ptr<shadow::ShadowVerifier::Job> Capture(shadow::ShadowVerifier& shadow,
                                                              std::shared_ptr<const WeightSet> set, Messages* held) {
    return shadow.CaptureMhc(std::move(set), held);
  }
};

struct SwaRpc {
  using Request = v1::SwaNormQuantRequest;
  using Response = v1::SwaNormQuantResponse;
  using Messages = shadow::SwaMessages;
  using Prepared = PreparedSwaWeights;
  static constexpr Op kOp = Op::kSwa;
  static constexpr const char* kPartName = "SWA";
  static constexpr const char* kTokensSymbol = "M";
  static const Prepared* Part(const WeightSet& set) { return set.swa.get(); }
  static absl::StatusOr<SwaCall> Decode(const Request& request, const Prepared& w, int64_t max_tokens,
                                        Response* response) {
    return DecodeSwaRequest(request, w, max_tokens, response);
  }
  static FusedSupport Support(Backend& backend, const Prepared& w, const SwaCall& c) {
    return backend.SwaFusedSupport(w, c.query);
  }
  static absl::StatusOr<RunStats> Run(Backend& backend, const Prepared& w, const SwaCall& c, Path path) {
    return RunSwaCall(backend, w, c.args, path);
  }
  static v1::Verification Verify(shadow::ShadowVerifier& shadow, const WeightSet& set, const Request& request,
                                 const Response& response) {
    return shadow.VerifySwa(set, request, response);
  }
  static std::unique_ptr<shadow::ShadowVerifier::Job> Capture(shadow::ShadowVerifier& shadow,
                                                              std::shared_ptr<const WeightSet> set, Messages* held) {
    return shadow.CaptureSwa(std::move(set), held);
  }
};

}  // namespace

absl::Status FusedLayerService::AdmitDuringDrain() const {
  if (!draining_.load(std::memory_order_acquire)) return absl::OkStatus();
  return absl::UnavailableError("the server is draining (shutting down); retry on another replica");
}

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

// ---- weights -------------------------------------------------------------------------------------

// Client-streaming LoadWeights: header first, then data; the payload is accumulated here and only
// an exactly complete stream reaches the executor (build + warm-up + publish, all or nothing).
class FusedLayerService::LoadWeightsReactor final : public grpc::ServerReadReactor<v1::WeightChunk> {
 public:
  LoadWeightsReactor(FusedLayerService& service, grpc::CallbackServerContext* ctx, v1::WeightSetInfo* response)
      : service_(service), ctx_(ctx), response_(response), start_(Clock::now()) {
    service_.metrics_.InflightAdd(1);
    StartRead(&chunk_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) return EndOfStream();
    request_bytes_ += chunk_.ByteSizeLong();
    if (!have_header_) {
      if (!chunk_.has_header()) {
        return Complete(absl::InvalidArgumentError("the first WeightChunk must carry the header"));
      }
      header_ = std::move(*chunk_.mutable_header());
      have_header_ = true;
      if (header_.payload_bytes() > service_.config_.max_weight_payload_bytes) {
        return Complete(absl::ResourceExhaustedError(
            absl::StrCat("weight set '", header_.name(), "': payload_bytes = ", header_.payload_bytes(),
                         " exceeds this server's limit of ", service_.config_.max_weight_payload_bytes, " bytes")));
      }
      // Fail before the upload rather than after it.
      if (!header_.replace() && service_.weights_.Contains(header_.name())) {
        return Complete(absl::AlreadyExistsError(
            absl::StrCat("weight set '", header_.name(), "' is already loaded (set replace to swap it)")));
      }
      // Reserve up front, bounded so a hostile header cannot make us allocate before data arrives.
      payload_.reserve(std::min<uint64_t>(header_.payload_bytes(), uint64_t{256} << 20));
    } else if (chunk_.has_header()) {
      return Complete(absl::InvalidArgumentError("only the first WeightChunk may carry a header"));
    }
    if (payload_.size() + chunk_.data().size() > header_.payload_bytes()) {
      return Complete(absl::InvalidArgumentError(
          absl::StrCat("weight set '", header_.name(), "': the stream carries more than payload_bytes = ",
                       header_.payload_bytes(), " bytes")));
    }
    payload_.append(chunk_.data());
    chunk_.Clear();
    StartRead(&chunk_);
  }

  void OnDone() override {
    service_.metrics_.InflightAdd(-1);
    delete this;
  }

 private:
  void EndOfStream() {
    if (ctx_->IsCancelled()) return Complete(absl::CancelledError("LoadWeights cancelled by the client"));
    if (!have_header_) return Complete(absl::InvalidArgumentError("empty LoadWeights stream: no header"));
    if (payload_.size() < header_.payload_bytes()) {
      return Complete(absl::DataLossError(absl::StrCat("weight set '", header_.name(), "': the stream ended after ",
                                                       payload_.size(), " of ", header_.payload_bytes(),
                                                       " payload bytes")));
    }
    absl::Status submitted = service_.executor_.SubmitControl([this](double queue_seconds) {
      service_.metrics_.ObserveQueue(queue_seconds);
      absl::StatusOr<v1::WeightSetInfo> info = service_.weights_.InstallOnWorker(header_, payload_, "rpc");
      std::string().swap(payload_);  // release the staging copy before the response goes out
      if (!info.ok()) return Complete(info.status());
      *response_ = std::move(*info);
      Complete(absl::OkStatus());
    });
    if (!submitted.ok()) Complete(std::move(submitted));
  }

  void Complete(const absl::Status& status) {
    const uint64_t response_bytes = status.ok() ? response_->ByteSizeLong() : 0;
    service_.metrics_.RecordRequest(Method::kLoadWeights, static_cast<grpc::StatusCode>(status.code()),
                                    SecondsSince(start_), request_bytes_, response_bytes);
    if (!status.ok() && status.code() != absl::StatusCode::kCancelled) {
      LogWarning("LoadWeights", have_header_ ? absl::StrCat(" '", header_.name(), "'") : std::string(),
                 " failed: ", status.ToString());
    }
    Finish(ToGrpcStatus(status));
  }

  FusedLayerService& service_;
  grpc::CallbackServerContext* const ctx_;
  v1::WeightSetInfo* const response_;
  const Clock::time_point start_;
  v1::WeightChunk chunk_;
  v1::WeightSetHeader header_;
  bool have_header_ = false;
  std::string payload_;
  uint64_t request_bytes_ = 0;
};

grpc::ServerReadReactor<v1::WeightChunk>* FusedLayerService::LoadWeights(grpc::CallbackServerContext* ctx,
                                                                        v1::WeightSetInfo* response) {
  return new LoadWeightsReactor(*this, ctx, response);
}

grpc::ServerUnaryReactor* FusedLayerService::ListWeightSets(grpc::CallbackServerContext* ctx,
                                                            const v1::ListWeightSetsRequest* request,
                                                            v1::ListWeightSetsResponse* response) {
  auto* call = new UnaryCall(metrics_, Method::kListWeightSets, config_.max_message_bytes, ctx, request, response);
  for (v1::WeightSetInfo& info : weights_.Infos()) *response->add_weight_sets() = std::move(info);
  call->Complete(absl::OkStatus());
  return call;
}

grpc::ServerUnaryReactor* FusedLayerService::UnloadWeightSet(grpc::CallbackServerContext* ctx,
                                                             const v1::UnloadWeightSetRequest* request,
                                                             v1::UnloadWeightSetResponse* response) {
  auto* call = new UnaryCall(metrics_, Method::kUnloadWeightSet, config_.max_message_bytes, ctx, request, response);
  if (absl::Status s = AdmitDuringDrain(); !s.ok()) {
    call->Complete(std::move(s));
    return call;
  }
  // On the executor: the last reference to the prepared weights may be dropped there, and the
  // capability refresh asks the backend.
  absl::Status submitted = executor_.SubmitControl([this, call, request, response](double queue_seconds) {
    metrics_.ObserveQueue(queue_seconds);
    absl::StatusOr<uint64_t> freed = weights_.UnloadOnWorker(request->name());
    if (freed.ok()) response->set_freed_bytes(*freed);
    call->Complete(freed.status());
  });
  if (!submitted.ok()) call->Complete(std::move(submitted));
  return call;
}

grpc::ServerUnaryReactor* FusedLayerService::GetServerInfo(grpc::CallbackServerContext* ctx,
                                                           const v1::GetServerInfoRequest* request,
                                                           v1::GetServerInfoResponse* response) {
  auto* call = new UnaryCall(metrics_, Method::kGetServerInfo, config_.max_message_bytes, ctx, request, response);
  response->set_version(identity_.version);
  response->set_backend(identity_.backend);
  response->set_device(identity_.device);
  response->set_arch(identity_.arch);
  for (v1::OpCapability& cap : weights_.Capabilities()) *response->add_ops() = std::move(cap);
  response->set_max_receive_message_bytes(config_.max_message_bytes);
  response->set_max_send_message_bytes(config_.max_message_bytes);
  response->set_fused_max_tokens(config_.fused_max_tokens);
  response->set_max_tokens(config_.max_tokens);
  response->set_queue_capacity(config_.queue_capacity);
  call->Complete(absl::OkStatus());
  return call;
}

}  // namespace fusedlayer::server
