#include "rpc/service.h"

#include <random>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/descriptors.h"
#include "common/log.h"
#include "rpc/proto_convert.h"
#include "rpc/unary_call.h"

namespace fusedlayer::server {

FusedLayerService::FusedLayerService(const ServerConfig& config, ServerIdentity identity, Backend& backend,
                                     Executor& executor, WeightManager& weights, Metrics& metrics,
                                     shadow::ShadowVerifier& shadow, const DeviceLanes& lanes,
                                     const auth::UnixPeerTable* unix_peers)
    : config_(config),
      identity_(std::move(identity)),
      backend_(backend),
      executor_(executor),
      lanes_(lanes),
      unix_peers_(unix_peers),
      weights_(weights),
      metrics_(metrics),
      shadow_(shadow),
      inflight_bytes_(config.EffectiveMaxInflightBytes(), metrics.inflight_bytes()),
      upload_bytes_(config.EffectiveMaxUploadBufferBytes(), metrics.upload_buffered_bytes()),
      verify_slots_(static_cast<uint64_t>(config.max_inflight_verify)),
      shared_memory_(transport::SharedMemoryLimits{config.allow_shared_memory, config.shared_memory_max_regions,
                                                   config.shared_memory_max_bytes, config.shared_memory_locked_bytes,
                                                   config.shared_memory_idle_seconds,
                                                   DescriptorBudgetFor(config.descriptor_reserve).regions,
                                                   DescriptorBudgetFor(config.descriptor_reserve).Describe()},
                     *metrics.registry(),
                     // Page-locked regions are copied from by the lanes only (op_calls.h).
                     lanes.request_staging() != nullptr ? &backend : nullptr),
      cuda_shared_memory_(transport::CudaSharedMemoryLimits{config.allow_cuda_shared_memory,
                                                             config.cuda_shared_memory_max_regions,
                                                             config.cuda_shared_memory_max_bytes,
                                                             config.cuda_shared_memory_idle_seconds},
                          *metrics.registry(), &backend),
      sessions_(transport::ResidualSessionLimits{config.residual_session_max_sessions,
                                                 config.residual_session_max_bytes,
                                                 config.EffectiveResidualSessionTotalBytes(), config.max_tokens,
                                                 config.residual_session_idle_seconds},
                backend, *metrics.registry()),
      upload_idle_(std::chrono::seconds(config.upload_idle_timeout_seconds)),
      request_id_salt_(std::random_device{}() & 0xffffff) {}

std::string FusedLayerService::RequestId(const std::string& given) {
  // Echoed in the response and written into log lines and error messages: escaped and bounded.
  if (!given.empty()) return ClientString(given);
  return absl::StrFormat("srv-%06x-%d", request_id_salt_, next_request_id_.fetch_add(1, std::memory_order_relaxed));
}

void FusedLayerService::FillReport(v1::ExecutionReport* report, const std::string& weight_set) const {
  report->set_backend(identity_.backend);
  report->set_device(identity_.device);
  report->set_weight_set(weight_set);
}

absl::Status FusedLayerService::AdmitDuringDrain() const {
  if (!draining_.load(std::memory_order_acquire)) return absl::OkStatus();
  return absl::UnavailableError("the server is draining (shutting down); retry on another replica");
}

absl::Status FusedLayerService::AdmitComputeBytes(ComputeCall* call, const ResponseSize& response,
                                                  uint64_t staged_bytes) {
  const uint64_t send_limit = static_cast<uint64_t>(config_.max_message_bytes);
  if (response.sent > send_limit) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the response would hold ", response.sent, " bytes of tensors, over the server's send limit of ", send_limit,
        " bytes (--max_message_bytes); refused before running; send fewer tokens per call, or place the outputs "
        "in shared memory"));
  }
  // What the call holds in server memory: its request, its outputs (those the kernels write in the
  // client's CUDA buffers excepted) and its shared-memory inputs read into staging.
  uint64_t need = call->request_bytes() + response.held;
  if (__builtin_add_overflow(need, staged_bytes, &need)) need = UINT64_MAX;
  if (need > inflight_bytes_.limit()) {
    return absl::ResourceExhaustedError(absl::StrCat("this call needs ", need, " bytes (request ",
                                                     call->request_bytes(), " + outputs ", response.held,
                                                     staged_bytes > 0 ? absl::StrCat(" + shared-memory inputs ", staged_bytes) : "",
                                                     "), more than the server admits at once (--max_inflight_bytes = ",
                                                     inflight_bytes_.limit(), "); send fewer tokens per call"));
  }
  std::optional<ByteBudget::Lease> lease = inflight_bytes_.TryAcquire(need);
  if (!lease.has_value()) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "server busy: this call needs ", need, " bytes and the compute calls in flight already hold ",
        inflight_bytes_.in_use(), " of ", inflight_bytes_.limit(), " (--max_inflight_bytes); retry with backoff"));
  }
  call->HoldBytes(std::move(*lease));
  return absl::OkStatus();
}

absl::Status FusedLayerService::AdmitVerify(ComputeCall* call) {
  if (verify_slots_.limit() == 0) {
    return absl::FailedPreconditionError(
        "verify is switched off on this server (--max_inflight_verify=0); send the call without verify");
  }
  std::optional<ByteBudget::Lease> slot = verify_slots_.TryAcquire(1);
  if (!slot.has_value()) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "server busy: ", verify_slots_.limit(), " verify = true calls are already in flight (--max_inflight_verify; "
        "each runs the op twice); retry with backoff or send the call without verify"));
  }
  call->HoldVerifySlot(std::move(*slot));
  return absl::OkStatus();
}

// ---- admin and discovery --------------------------------------------------------------------------

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
    if (freed.ok()) {
      response->set_freed_bytes(*freed);
      // A session's next call through this set would fail anyway; its memory goes now.
      sessions_.CloseUsing(request->name());
    }
    call->Complete(freed.status());
  });
  if (!submitted.ok()) call->Complete(std::move(submitted));
  return call;
}

grpc::ServerUnaryReactor* FusedLayerService::CommitWeightSets(grpc::CallbackServerContext* ctx,
                                                              const v1::CommitWeightSetsRequest* request,
                                                              v1::CommitWeightSetsResponse* response) {
  auto* call = new UnaryCall(metrics_, Method::kCommitWeightSets, config_.max_message_bytes, ctx, request, response);
  // A discard is let through while draining: it only frees memory.
  if (!request->discard()) {
    if (absl::Status s = AdmitDuringDrain(); !s.ok()) {
      call->Complete(std::move(s));
      return call;
    }
  }
  // On the executor, like every change of the loaded sets: the staged sets live there, and the
  // replaced ones are freed there.
  absl::Status submitted = executor_.SubmitControl([this, call, request, response](double queue_seconds) {
    metrics_.ObserveQueue(queue_seconds);
    absl::StatusOr<std::vector<v1::WeightSetInfo>> infos =
        weights_.CommitStagedOnWorker(request->stage(), request->discard());
    if (infos.ok()) {
      for (v1::WeightSetInfo& info : *infos) *response->add_weight_sets() = std::move(info);
    }
    call->Complete(infos.status());
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
  response->set_shared_memory_enabled(shared_memory_.enabled());
  response->set_cuda_shared_memory_enabled(cuda_shared_memory_.enabled());
  response->set_device_id(cuda_shared_memory_.device_id());
  call->Complete(absl::OkStatus());
  return call;
}


}  // namespace fusedlayer::server
