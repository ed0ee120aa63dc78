// The shared-memory RPCs, system and CUDA: register, status, unregister. Each runs inline on the
// gRPC thread (a shm_open + fstat, or the opening of a CUDA IPC handle, or a map lookup under the
// registry's mutex) for the caller's identity (auth/caller_identity.h); the registries are
// server/transport/shared_memory.h and server/transport/cuda_shared_memory.h.
#include "auth/caller_identity.h"
#include "rpc/proto_convert.h"
#include "rpc/service.h"
#include "rpc/unary_call.h"

namespace fusedlayer::server {

grpc::ServerUnaryReactor* FusedLayerService::RegisterSystemSharedMemory(
    grpc::CallbackServerContext* ctx, const v1::RegisterSystemSharedMemoryRequest* request,
    v1::RegisterSystemSharedMemoryResponse* response) {
  auto* call = new UnaryCall(metrics_, Method::kRegisterSystemSharedMemory, config_.max_message_bytes, ctx, request,
                             response);
  absl::Status s = AdmitDuringDrain();
  // On the server's own unix socket the object must be one the caller could open itself.
  const auth::Caller caller = CallerOf(*ctx);
  if (s.ok() && unix_peers_ != nullptr && !caller.unix_peer) {
    s = absl::UnauthenticatedError("the unix-socket connection of this call is no longer known");
  }
  if (s.ok()) s = shared_memory_.Register(caller.identity, *request, caller.unix_peer ? &*caller.unix_peer : nullptr);
  call->Complete(std::move(s));
  return call;
}

grpc::ServerUnaryReactor* FusedLayerService::SystemSharedMemoryStatus(grpc::CallbackServerContext* ctx,
                                                                      const v1::SystemSharedMemoryStatusRequest* request,
                                                                      v1::SystemSharedMemoryStatusResponse* response) {
  auto* call =
      new UnaryCall(metrics_, Method::kSystemSharedMemoryStatus, config_.max_message_bytes, ctx, request, response);
  absl::StatusOr<v1::SystemSharedMemoryStatusResponse> status =
      shared_memory_.Status(CallerIdentity(*ctx), request->name());
  if (status.ok()) *response = std::move(*status);
  call->Complete(status.status());
  return call;
}

grpc::ServerUnaryReactor* FusedLayerService::UnregisterSystemSharedMemory(
    grpc::CallbackServerContext* ctx, const v1::UnregisterSystemSharedMemoryRequest* request,
    v1::UnregisterSystemSharedMemoryResponse* response) {
  auto* call =
      new UnaryCall(metrics_, Method::kUnregisterSystemSharedMemory, config_.max_message_bytes, ctx, request, response);
  // Allowed while draining: a client cleaning up on its way out must be able to.
  absl::StatusOr<v1::UnregisterSystemSharedMemoryResponse> done =
      shared_memory_.Unregister(CallerIdentity(*ctx), request->name());
  if (done.ok()) *response = std::move(*done);
  call->Complete(done.status());
  return call;
}

grpc::ServerUnaryReactor* FusedLayerService::RegisterCudaSharedMemory(
    grpc::CallbackServerContext* ctx, const v1::RegisterCudaSharedMemoryRequest* request,
    v1::RegisterCudaSharedMemoryResponse* response) {
  auto* call =
      new UnaryCall(metrics_, Method::kRegisterCudaSharedMemory, config_.max_message_bytes, ctx, request, response);
  absl::Status s = AdmitDuringDrain();
  if (s.ok()) {
    s = cuda_shared_memory_.Register(CallerIdentity(*ctx), *request);
  }
  call->Complete(std::move(s));
  return call;
}

grpc::ServerUnaryReactor* FusedLayerService::CudaSharedMemoryStatus(grpc::CallbackServerContext* ctx,
                                                                    const v1::CudaSharedMemoryStatusRequest* request,
                                                                    v1::CudaSharedMemoryStatusResponse* response) {
  auto* call =
      new UnaryCall(metrics_, Method::kCudaSharedMemoryStatus, config_.max_message_bytes, ctx, request, response);
  absl::StatusOr<v1::CudaSharedMemoryStatusResponse> status =
      cuda_shared_memory_.Status(CallerIdentity(*ctx), request->name());
  if (status.ok()) *response = std::move(*status);
  call->Complete(status.status());
  return call;
}

grpc::ServerUnaryReactor* FusedLayerService::UnregisterCudaSharedMemory(
    grpc::CallbackServerContext* ctx, const v1::UnregisterCudaSharedMemoryRequest* request,
    v1::UnregisterCudaSharedMemoryResponse* response) {
  auto* call =
      new UnaryCall(metrics_, Method::kUnregisterCudaSharedMemory, config_.max_message_bytes, ctx, request, response);
  // Allowed while draining, as for system shared memory.
  absl::StatusOr<v1::UnregisterCudaSharedMemoryResponse> done =
      cuda_shared_memory_.Unregister(CallerIdentity(*ctx), request->name());
  if (done.ok()) *response = std::move(*done);
  call->Complete(done.status());
  return call;
}

}  // namespace fusedlayer::server
