#include "rpc/service.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/descriptors.h"
#include "common/log.h"
#include "rpc/proto_convert.h"
#include "rpc/unary_call.h"

namespace fusedlayer::server {

namespace {

std::vector<Backend*> GpuBackends(const ServingDevices& devices) {
  std::vector<Backend*> out;
  for (size_t d = 0; d < devices.size(); ++d) {
    if (devices[d].backend->device_index() >= 0) out.push_back(devices[d].backend.get());
  }
  return out;
}

std::vector<Backend*> AllBackends(const ServingDevices& devices) {
  std::vector<Backend*> out;
  for (size_t d = 0; d < devices.size(); ++d) out.push_back(devices[d].backend.get());
  return out;
}

}  // namespace

FusedLayerService::FusedLayerService(const ServerConfig& config, ServerIdentity identity, ServingDevices& devices,
                                     WeightManager& weights, Metrics& metrics, shadow::ShadowVerifier& shadow,
                                     const auth::UnixPeerTable* unix_peers)
    : config_(config),
      identity_(std::move(identity)),
      devices_(devices),
      executor_(*devices.primary().executor),
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
                     // Page-locked regions are copied from by the lanes only (op_calls.h); the
                     // primary's backend locks them for every device of the process.
                     devices.primary().lanes->request_staging() != nullptr ? devices.primary().backend.get()
                                                                           : nullptr),
      cuda_shared_memory_(transport::CudaSharedMemoryLimits{config.allow_cuda_shared_memory,
                                                             config.cuda_shared_memory_max_regions,
                                                             config.cuda_shared_memory_max_bytes,
                                                             config.cuda_shared_memory_idle_seconds},
                          *metrics.registry(), GpuBackends(devices)),
      sessions_(transport::ResidualSessionLimits{config.residual_session_max_sessions,
                                                 config.residual_session_max_bytes,
                                                 config.EffectiveResidualSessionTotalBytes(), config.max_tokens,
                                                 config.residual_session_idle_seconds},
                AllBackends(devices), *metrics.registry()),
      engine_(config, devices, weights, metrics, shadow, shared_memory_, cuda_shared_memory_, sessions_),
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
    for (size_t d = 0; d < devices_.size(); ++d) {
      const ServingDevice& device = devices_[d];
      v1::DeviceInfo* info = response->add_devices();
      info->set_device_id(device.device_id);
      info->set_label(device.label);
      info->set_name(device.name);
      info->set_arch(device.backend->arch());
      info->set_serving(true);
      info->set_lanes(device.lanes->lanes());
      info->set_resident_bytes(weights_.ResidentBytesOn(d));
      info->set_calls_in_flight(device.calls_in_flight.load(std::memory_order_relaxed));
      for (v1::OpCapability& cap : weights_.CapabilitiesOn(d)) *info->add_ops() = std::move(cap);
    }
    for (const LeftOutDevice& left : devices_.left_out()) {
      v1::DeviceInfo* info = response->add_devices();
      info->set_device_id(left.device_id);
      info->set_label(left.label);
      info->set_serving(false);
      info->set_error(left.error);
    }
    return absl::OkStatus();
  });
}

}  // namespace fusedlayer::server
