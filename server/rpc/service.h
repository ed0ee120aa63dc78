// The FusedLayer gRPC service on the callback API. Reactors never block: a compute RPC is decoded
// and validated inline (cheap), then queued on the device executor, which checks the deadline and
// cancellation before launching, runs the dispatcher's path, records metrics and finishes the RPC.
// LoadWeights accumulates the stream in its reactor and hands build + warm-up + publish to the
// executor; UnloadWeightSet runs there too (the backend is single-threaded).
#pragma once

#include <atomic>
#include <cstdint>
#include <string>

#include "common/byte_budget.h"
#include "config.h"
#include "exec/device_lanes.h"
#include "exec/executor.h"
#include "fusedlayer/backend.h"
#include "fusedlayer/v1/fusedlayer.grpc.pb.h"
#include "common/metrics.h"
#include "shadow/shadow_verifier.h"
#include "transport/shared_memory.h"
#include "exec/weight_manager.h"
#include "rpc/idle_watch.h"

namespace fusedlayer::server {

class UnaryCall;  // rpc/unary_call.h

// What the service reports about itself (fixed at startup).
struct ServerIdentity {
  std::string version;
  std::string backend;  // kind
  std::string device;
  std::string arch;
};

class FusedLayerService final : public v1::FusedLayer::CallbackService {
 public:
  FusedLayerService(const ServerConfig& config, ServerIdentity identity, Backend& backend, Executor& executor,
                    WeightManager& weights, Metrics& metrics, shadow::ShadowVerifier& shadow, const DeviceLanes& lanes);

  grpc::ServerUnaryReactor* MhcSeam(grpc::CallbackServerContext* ctx, const v1::MhcSeamRequest* request,
                                    v1::MhcSeamResponse* response) override;
  grpc::ServerUnaryReactor* SwaNormQuant(grpc::CallbackServerContext* ctx, const v1::SwaNormQuantRequest* request,
                                         v1::SwaNormQuantResponse* response) override;
  grpc::ServerReadReactor<v1::WeightChunk>* LoadWeights(grpc::CallbackServerContext* ctx,
                                                       v1::WeightSetInfo* response) override;
  grpc::ServerUnaryReactor* ListWeightSets(grpc::CallbackServerContext* ctx, const v1::ListWeightSetsRequest* request,
                                           v1::ListWeightSetsResponse* response) override;
  grpc::ServerUnaryReactor* UnloadWeightSet(grpc::CallbackServerContext* ctx,
                                            const v1::UnloadWeightSetRequest* request,
                                            v1::UnloadWeightSetResponse* response) override;
  grpc::ServerUnaryReactor* GetServerInfo(grpc::CallbackServerContext* ctx, const v1::GetServerInfoRequest* request,
                                          v1::GetServerInfoResponse* response) override;
  // System shared memory (rpc/shared_memory_rpcs.cc, server/transport/shared_memory.h).
  grpc::ServerUnaryReactor* RegisterSystemSharedMemory(grpc::CallbackServerContext* ctx,
                                                       const v1::RegisterSystemSharedMemoryRequest* request,
                                                       v1::RegisterSystemSharedMemoryResponse* response) override;
  grpc::ServerUnaryReactor* SystemSharedMemoryStatus(grpc::CallbackServerContext* ctx,
                                                     const v1::SystemSharedMemoryStatusRequest* request,
                                                     v1::SystemSharedMemoryStatusResponse* response) override;
  grpc::ServerUnaryReactor* UnregisterSystemSharedMemory(grpc::CallbackServerContext* ctx,
                                                         const v1::UnregisterSystemSharedMemoryRequest* request,
                                                         v1::UnregisterSystemSharedMemoryResponse* response) override;

  // Graceful drain (FusedLayerServer::Shutdown): from now on compute and UnloadWeightSet calls that
  // reach the service are refused with UNAVAILABLE instead of being queued. gRPC's own Shutdown
  // still dispatches calls that raced with its GOAWAY, and those must not start new device work.
  void StartDraining() { draining_.store(true, std::memory_order_release); }

 private:
  // UNAVAILABLE while draining, OK otherwise.
  absl::Status AdmitDuringDrain() const;
  // Memory admission of a compute call whose response will hold `response_bytes` of tensor data,
  // before any of it is allocated: RESOURCE_EXHAUSTED when the response alone is over the send
  // limit (--max_message_bytes) or when the call's request + response (+ shared-memory input
  // staging) bytes do not fit in what --max_inflight_bytes leaves; otherwise the call holds the
  // bytes until it is done.
  absl::Status AdmitComputeBytes(UnaryCall* call, uint64_t response_bytes, uint64_t staged_bytes = 0);
  // A verify = true call runs the op twice: FAILED_PRECONDITION when --max_inflight_verify is 0,
  // RESOURCE_EXHAUSTED when that many verify calls are already admitted; otherwise the call holds
  // a slot until it is done.
  absl::Status AdmitVerify(UnaryCall* call);
  class LoadWeightsReactor;
  // One compute request on the executor, alone or in a dynamic batch (rpc/compute_rpcs.cc).
  template <typename Rpc>
  class ComputeTask;

  // Validates and decodes a compute request, then queues its execution on the device executor.
  // `Rpc` is the op's traits (MhcRpc / SwaRpc in service.cc); `held` is the call's reference-counted
  // messages (shadow capture without copies), or null.
  template <typename Rpc>
  absl::Status StartCompute(UnaryCall* call, typename Rpc::Messages* held, const typename Rpc::Request* request,
                            typename Rpc::Response* response);
  std::string RequestId(const std::string& given);
  void FillReport(v1::ExecutionReport* report, const std::string& weight_set) const;

  const ServerConfig& config_;
  const ServerIdentity identity_;
  Backend& backend_;
  Executor& executor_;
  const DeviceLanes& lanes_;  // where each executor worker runs compute
  WeightManager& weights_;
  Metrics& metrics_;
  shadow::ShadowVerifier& shadow_;
  std::atomic<uint64_t> next_request_id_{1};
  std::atomic<bool> draining_{false};
  ByteBudget inflight_bytes_;  // compute request + response bytes admitted (--max_inflight_bytes)
  ByteBudget upload_bytes_;    // payload bytes buffered by LoadWeights streams (--max_upload_buffer_bytes)
  ByteBudget verify_slots_;    // verify = true calls admitted, one unit each (--max_inflight_verify)
  std::atomic<int> open_uploads_{0};  // LoadWeights streams not yet done (--max_concurrent_uploads)
  // Registered system shared-memory regions (--allow_shared_memory); in-flight requests hold
  // references to the regions they use, so it may go before them.
  transport::SharedMemoryRegistry shared_memory_;
  IdleWatch upload_idle_;             // ends LoadWeights streams idle for --upload_idle_timeout_seconds
  const uint64_t request_id_salt_;
  // The compute methods' messages are reference counted (shadow/shared_messages.h) so a sampled
  // request's shadow job can read them after the response without copying them. Registered in the
  // constructor; gRPC requires them to outlive the server, and the service does.
  shadow::SharedMessageAllocator<v1::MhcSeamRequest, v1::MhcSeamResponse> mhc_messages_;
  shadow::SharedMessageAllocator<v1::SwaNormQuantRequest, v1::SwaNormQuantResponse> swa_messages_;
};

}  // namespace fusedlayer::server
