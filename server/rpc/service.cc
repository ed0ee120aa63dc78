#include "rpc/service.h"

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
      upload_bytes_(config.EffectiveMaxUploadBufferBytes(), metrics.upload_buffered_bytes()),
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
      engine_(config, ReportIdentity{identity_.backend, identity_.device}, backend, executor, lanes, weights, metrics,
              shadow, shared_memory_, cuda_shared_memory_, sessions_),
      upload_idle_(std::chrono::seconds(config.upload_idle_timeout_seconds)) {}

// ---- admin and discovery --------------------------------------------------------------------------

grpc::ServerUnaryReactor* FusedLayerService::ListWeightSets(grpc::CallbackServerContext* ctx,
                                                            const v1::ListWeightSetsRequest* request,
                                                            v1::ListWeightSetsResponse* response) {
  return AnswerInline(Method::kListWeightSets, WhileDraining::kAnswer, ctx, request, response, [&] {
    for (v1::WeightSetInfo& info : weights_.Infos()) *response->add_weight_sets() = std::move(info);
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* FusedLayerService::UnloadWeightSet(grpc::CallbackServerContext* ctx,
                                                             const v1::UnloadWeightSetRequest* request,
                                                             v1::UnloadWeightSetResponse* response) {
  // On the executor: the last reference to the prepared weights may be dropped there, and the
  // capability refresh asks the backend.
  return AnswerOnExecutor(Method::kUnloadWeightSet, WhileDraining::kRefuse, ctx, request, response, [this, request,
                                                                                                     response] {
    absl::StatusOr<uint64_t> freed = weights_.UnloadOnWorker(request->name());
    if (freed.ok()) {
      response->set_freed_bytes(*freed);
      // A session's next call through this set would fail anyway; its memory goes now.
      sessions_.CloseUsing(request->name());
    }
    return freed.status();
  });
}

grpc::ServerUnaryReactor* FusedLayerService::CommitWeightSets(grpc::CallbackServerContext* ctx,
                                                              const v1::CommitWeightSetsRequest* request,
                                                              v1::CommitWeightSetsResponse* response) {
  // On the executor, like every change of the loaded sets: the staged sets live there, and the
  // replaced ones are freed there. A discard only frees memory: answered while draining.
  const WhileDraining drain = request->discard() ? WhileDraining::kAnswer : WhileDraining::kRefuse;
  return AnswerOnExecutor(Method::kCommitWeightSets, drain, ctx, request, response, [this, request, response] {
    absl::StatusOr<std::vector<v1::WeightSetInfo>> infos =
        weights_.CommitStagedOnWorker(request->stage(), request->discard());
    if (infos.ok()) {
      for (v1::WeightSetInfo& info : *infos) *response->add_weight_sets() = std::move(info);
    }
    return infos.status();
  });
}

grpc::ServerUnaryReactor* FusedLayerService::GetServerInfo(grpc::CallbackServerContext* ctx,
                                                           const v1::GetServerInfoRequest* request,
                                                           v1::GetServerInfoResponse* response) {
  return AnswerInline(Method::kGetServerInfo, WhileDraining::kAnswer, ctx, request, response, [&] {
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
    return absl::OkStatus();
  });
}

}  // namespace fusedlayer::server
