// The FusedLayer gRPC service on the callback API. Reactors never block: a compute RPC's request is
// read inline and handed to the compute engine (exec/compute_engine.h), which admits, decodes and
// queues it on the device executor and answers the RPC from there (rpc/compute_rpcs.cc).
// LoadWeights accumulates the stream in its reactor and hands build + warm-up + publish to the
// executor; UnloadWeightSet runs there too (the backend is single-threaded).
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

#include "auth/caller_identity.h"
#include "common/byte_budget.h"
#include "config.h"
#include "exec/compute_engine.h"
#include "runtime/device_lanes.h"
#include "runtime/executor.h"
#include "fusedlayer/backend.h"
#include "fusedlayer/v1/fusedlayer.grpc.pb.h"
#include "metrics/metrics.h"
#include "shadow/shadow_verifier.h"
#include "transport/residual_sessions.h"
#include "transport/cuda_shared_memory.h"
#include "transport/shared_memory.h"
#include "exec/weight_manager.h"
#include "rpc/idle_watch.h"
#include "rpc/proto_convert.h"
#include "rpc/unary_call.h"
#include "rpc/wire_messages.h"

namespace fusedlayer::server::ring {
class CallRingService;  // ring/call_rings.h
}

namespace fusedlayer::server {

class ComputeCall;  // rpc/unary_call.h

// What the service reports about itself (fixed at startup).
struct ServerIdentity {
  std::string version;
  std::string backend;  // kind
  std::string device;
  std::string arch;
};

// The compute methods are raw (ByteBuffer in and out, rpc/wire_messages.h): the service parses
// their requests itself and sends their output tensors from its own memory, without copies.
// LoadWeights is raw too: gRPC reports a chunk it cannot parse as the end of the stream, which
// would read a garbage chunk after the last payload byte as a complete upload.
using FusedLayerCallbackBase =
    v1::FusedLayer::WithRawCallbackMethod_MhcSeam<v1::FusedLayer::WithRawCallbackMethod_SwaNormQuant<
        v1::FusedLayer::WithRawCallbackMethod_LoadWeights<v1::FusedLayer::CallbackService>>>;

class FusedLayerService final : public FusedLayerCallbackBase {
 public:
  FusedLayerService(const ServerConfig& config, ServerIdentity identity, ServingDevices& devices,
                    WeightManager& weights, Metrics& metrics, shadow::ShadowVerifier& shadow,
                    const auth::UnixPeerTable* unix_peers = nullptr);

  grpc::ServerUnaryReactor* MhcSeam(grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* request,
                                    grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* SwaNormQuant(grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* request,
                                         grpc::ByteBuffer* response) override;
  grpc::ServerReadReactor<grpc::ByteBuffer>* LoadWeights(grpc::CallbackServerContext* ctx,
                                                         grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* ListWeightSets(grpc::CallbackServerContext* ctx, const v1::ListWeightSetsRequest* request,
                                           v1::ListWeightSetsResponse* response) override;
  // Publishes (or discards) the sets staged under a stage id, all in one step, on the executor.
  grpc::ServerUnaryReactor* CommitWeightSets(grpc::CallbackServerContext* ctx,
                                             const v1::CommitWeightSetsRequest* request,
                                             v1::CommitWeightSetsResponse* response) override;
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
  // CUDA shared memory (rpc/shared_memory_rpcs.cc, server/transport/cuda_shared_memory.h).
  grpc::ServerUnaryReactor* RegisterCudaSharedMemory(grpc::CallbackServerContext* ctx,
                                                     const v1::RegisterCudaSharedMemoryRequest* request,
                                                     v1::RegisterCudaSharedMemoryResponse* response) override;
  grpc::ServerUnaryReactor* CudaSharedMemoryStatus(grpc::CallbackServerContext* ctx,
                                                   const v1::CudaSharedMemoryStatusRequest* request,
                                                   v1::CudaSharedMemoryStatusResponse* response) override;
  grpc::ServerUnaryReactor* UnregisterCudaSharedMemory(grpc::CallbackServerContext* ctx,
                                                       const v1::UnregisterCudaSharedMemoryRequest* request,
                                                       v1::UnregisterCudaSharedMemoryResponse* response) override;
  // Residual sessions (rpc/residual_session_rpcs.cc, server/transport/residual_sessions.h).
  grpc::ServerUnaryReactor* OpenResidualSession(grpc::CallbackServerContext* ctx,
                                                const v1::OpenResidualSessionRequest* request,
                                                v1::OpenResidualSessionResponse* response) override;
  grpc::ServerUnaryReactor* ListResidualSessions(grpc::CallbackServerContext* ctx,
                                                 const v1::ListResidualSessionsRequest* request,
                                                 v1::ListResidualSessionsResponse* response) override;
  grpc::ServerUnaryReactor* CloseResidualSession(grpc::CallbackServerContext* ctx,
                                                 const v1::CloseResidualSessionRequest* request,
                                                 v1::CloseResidualSessionResponse* response) override;
  // Call rings (rpc/call_ring_rpcs.cc, server/ring/call_rings.h).
  grpc::ServerUnaryReactor* OpenCallRing(grpc::CallbackServerContext* ctx, const v1::OpenCallRingRequest* request,
                                         v1::OpenCallRingResponse* response) override;
  // The call rings' service, when --allow_call_rings (made after the service: it submits to the
  // engine); null: OpenCallRing is FAILED_PRECONDITION.
  void AttachCallRings(ring::CallRingService* rings) { call_rings_ = rings; }

  // Graceful drain (FusedLayerServer::Shutdown): from now on compute and UnloadWeightSet calls that
  // reach the service are refused with UNAVAILABLE instead of being queued. gRPC's own Shutdown
  // still dispatches calls that raced with its GOAWAY, and those must not start new device work.
  void StartDraining() { engine_.StartDraining(); }
  // The compute engine, which every transport of the compute calls submits them to.
  ComputeEngine& engine() { return engine_; }

 private:
  // The caller's identity, the owner of its shared-memory regions and sessions (auth/caller_identity.h).
  auth::Caller CallerOf(const grpc::ServerContextBase& ctx) const {
    return auth::CallerOf(ctx, !config_.auth_tokens_file.empty(), unix_peers_);
  }
  std::string CallerIdentity(const grpc::ServerContextBase& ctx) const { return CallerOf(ctx).identity; }
  // UNAVAILABLE while draining, OK otherwise.
  absl::Status AdmitDuringDrain() const { return engine_.AdmitDuringDrain(); }

  // Whether an admin RPC is answered while the server drains: what only frees (unregister, close,
  // a discard) is, so that a client cleaning up on its way out can; the rest is UNAVAILABLE.
  enum class WhileDraining { kRefuse, kAnswer };
  // An admin RPC: its call (metrics, send limit) and the drain check, then `answer()`, which fills
  // `response` and returns the status: inline on the gRPC thread (a lookup or a registration under
  // a registry's mutex).
  template <typename Request, typename Response, typename Answer>
  grpc::ServerUnaryReactor* AnswerInline(Method method, WhileDraining drain, grpc::CallbackServerContext* ctx,
                                         const Request* request, Response* response, Answer answer) {
    auto* call = new UnaryCall(metrics_, method, config_.max_message_bytes, ctx, request, response);
    absl::Status s = drain == WhileDraining::kRefuse ? AdmitDuringDrain() : absl::OkStatus();
    if (s.ok()) s = answer();
    call->Complete(std::move(s));
    return call;
  }
  // The same with `answer()` run on the executor, as every change of the loaded
  // weight sets is (the backend's prepared weights are made and freed there).
  template <typename Request, typename Response, typename Answer>
  grpc::ServerUnaryReactor* AnswerOnExecutor(Method method, WhileDraining drain, grpc::CallbackServerContext* ctx,
                                             const Request* request, Response* response, Answer answer) {
    auto* call = new UnaryCall(metrics_, method, config_.max_message_bytes, ctx, request, response);
    absl::Status s = drain == WhileDraining::kRefuse ? AdmitDuringDrain() : absl::OkStatus();
    if (s.ok()) {
      s = executor_.SubmitControl([this, call, answer = std::move(answer)](double queue_seconds) mutable {
        metrics_.ObserveQueue(0, queue_seconds);
        call->Complete(answer());
      });
    }
    if (!s.ok()) call->Complete(std::move(s));
    return call;
  }
  // A registry's answer as the response: moved into `response` when OK.
  template <typename Response>
  static absl::Status Into(absl::StatusOr<Response> got, Response* response) {
    if (got.ok()) *response = std::move(*got);
    return got.status();
  }
  class LoadWeightsReactor;
  // OpenCallRing's bindings, for `identity`: each weight set loaded, each region registered.
  absl::Status CheckCallRingBindings(const std::string& identity, const v1::OpenCallRingRequest& request);
  // A compute call from the wire: its messages (reference counted: shadow capture without
  // copies), the read (ReadWireRequest: tensor data into pinned memory where it can), then the
  // engine's Submit. `Op` is the op's traits (exec/op_traits.h).
  template <typename Op>
  grpc::ServerUnaryReactor* ServeCompute(grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* wire_request,
                                         grpc::ByteBuffer* wire_response);

  const ServerConfig& config_;
  const ServerIdentity identity_;
  ServingDevices& devices_;
  Executor& executor_;  // the primary device's: where weight-set changes run (exec/weight_manager.h)
  // The connections of a plaintext unix socket the server accepts itself (rpc/plaintext_listener.h),
  // with their peers' credentials; null otherwise.
  const auth::UnixPeerTable* const unix_peers_;
  WeightManager& weights_;
  Metrics& metrics_;
  shadow::ShadowVerifier& shadow_;
  ByteBudget upload_bytes_;    // payload bytes buffered by LoadWeights streams (--max_upload_buffer_bytes)
  std::atomic<int> open_uploads_{0};  // LoadWeights streams not yet done (--max_concurrent_uploads)
  // Registered system shared-memory regions (--allow_shared_memory); in-flight requests hold
  // references to the regions they use, so it may go before them.
  transport::SharedMemoryRegistry shared_memory_;
  // Registered CUDA shared-memory regions (--allow_cuda_shared_memory), held the same way.
  transport::CudaSharedMemoryRegistry cuda_shared_memory_;
  // Open residual sessions (MhcSeamRequest.session); in-flight calls hold their session's block.
  transport::ResidualSessionStore sessions_;
  // Admission, batching, path choice, the run and the report of every compute call (after the
  // registries and sessions it uses).
  ComputeEngine engine_;
  IdleWatch upload_idle_;  // ends LoadWeights streams idle for --upload_idle_timeout_seconds
  ring::CallRingService* call_rings_ = nullptr;  // null when call rings are off (--allow_call_rings)
};

}  // namespace fusedlayer::server
