// The shared-memory RPCs, system and CUDA: register, status, unregister. Each runs inline on the
// gRPC thread (AnswerInline; unregister and status also while the server drains) (a shm_open + fstat, or the opening of a CUDA IPC handle, or a map lookup under the
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
  return AnswerInline(Method::kRegisterSystemSharedMemory, WhileDraining::kRefuse, ctx, request, response, [&] {
    // On the server's own unix socket the object must be one the caller could open itself.
    const auth::Caller caller = CallerOf(*ctx);
    if (unix_peers_ != nullptr && !caller.unix_peer) {
      return absl::UnauthenticatedError("the unix-socket connection of this call is no longer known");
    }
    return shared_memory_.Register(caller.identity, *request, caller.unix_peer ? &*caller.unix_peer : nullptr);
  });
}

grpc::ServerUnaryReactor* FusedLayerService::SystemSharedMemoryStatus(grpc::CallbackServerContext* ctx,
                                                                      const v1::SystemSharedMemoryStatusRequest* request,
                                                                      v1::SystemSharedMemoryStatusResponse* response) {
  return AnswerInline(Method::kSystemSharedMemoryStatus, WhileDraining::kAnswer, ctx, request, response,
                      [&] { return Into(shared_memory_.Status(CallerIdentity(*ctx), request->name()), response); });
}

grpc::ServerUnaryReactor* FusedLayerService::UnregisterSystemSharedMemory(
    grpc::CallbackServerContext* ctx, const v1::UnregisterSystemSharedMemoryRequest* request,
    v1::UnregisterSystemSharedMemoryResponse* response) {
  return AnswerInline(Method::kUnregisterSystemSharedMemory, WhileDraining::kAnswer, ctx, request, response,
                      [&] { return Into(shared_memory_.Unregister(CallerIdentity(*ctx), request->name()), response); });
}

grpc::ServerUnaryReactor* FusedLayerService::RegisterCudaSharedMemory(
    grpc::CallbackServerContext* ctx, const v1::RegisterCudaSharedMemoryRequest* request,
    v1::RegisterCudaSharedMemoryResponse* response) {
  return AnswerInline(Method::kRegisterCudaSharedMemory, WhileDraining::kRefuse, ctx, request, response,
                      [&] { return cuda_shared_memory_.Register(CallerIdentity(*ctx), *request); });
}

grpc::ServerUnaryReactor* FusedLayerService::CudaSharedMemoryStatus(grpc::CallbackServerContext* ctx,
                                                                    const v1::CudaSharedMemoryStatusRequest* request,
                                                                    v1::CudaSharedMemoryStatusResponse* response) {
  return AnswerInline(Method::kCudaSharedMemoryStatus, WhileDraining::kAnswer, ctx, request, response,
                      [&] { return Into(cuda_shared_memory_.Status(CallerIdentity(*ctx), request->name()), response); });
}

grpc::ServerUnaryReactor* FusedLayerService::UnregisterCudaSharedMemory(
    grpc::CallbackServerContext* ctx, const v1::UnregisterCudaSharedMemoryRequest* request,
    v1::UnregisterCudaSharedMemoryResponse* response) {
  return AnswerInline(Method::kUnregisterCudaSharedMemory, WhileDraining::kAnswer, ctx, request, response, [&] {
    return Into(cuda_shared_memory_.Unregister(CallerIdentity(*ctx), request->name()), response);
  });
}

}  // namespace fusedlayer::server
