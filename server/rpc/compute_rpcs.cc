// The compute RPCs (MhcSeam, SwaNormQuant): the gRPC transport of the compute engine. Inline on the
// gRPC thread: the drain check, the request read from gRPC's buffers (rpc/wire_messages.h), then
// the call is handed to ComputeEngine::Submit (exec/compute_engine.h), which answers it through
// ComputeCall (rpc/unary_call.h): the response message and its outputs encoded into gRPC's buffer.
#include <memory>
#include <utility>

#include "auth/caller_identity.h"
#include "exec/compute_engine.h"
#include "exec/op_traits.h"
#include "rpc/service.h"
#include "rpc/unary_call.h"
#include "rpc/wire_messages.h"

namespace fusedlayer::server {

grpc::ServerUnaryReactor* FusedLayerService::MhcSeam(grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* request,
                                                     grpc::ByteBuffer* response) {
  return ServeCompute<MhcOp>(ctx, request, response);
}

grpc::ServerUnaryReactor* FusedLayerService::SwaNormQuant(grpc::CallbackServerContext* ctx,
                                                          const grpc::ByteBuffer* request, grpc::ByteBuffer* response) {
  return ServeCompute<SwaOp>(ctx, request, response);
}

template <typename Op>
grpc::ServerUnaryReactor* FusedLayerService::ServeCompute(grpc::CallbackServerContext* ctx,
                                                          const grpc::ByteBuffer* wire_request,
                                                          grpc::ByteBuffer* wire_response) {
  auto* held = new typename Op::Messages();  // the call's reference, dropped in ComputeCall::ReleaseWhenDone
  auto* call = new ComputeCall(metrics_, Op::kMethod, config_.max_message_bytes, ctx, wire_request->Length(),
                               held->response(), wire_response, held);
  auto wire = std::make_unique<WireTensorData>();
  absl::Status s = engine_.AdmitDuringDrain();
  // gRPC hands the request over and never reads it again: reading frees its slices at once.
  if (s.ok()) {
    s = ReadWireRequest(const_cast<grpc::ByteBuffer*>(wire_request), held->request(), engine_.request_staging(),
                        engine_.request_copier(), wire.get());
  }
  if (!s.ok()) {
    call->Complete(std::move(s));
    return call;
  }
  OpCallSubmission<Op> submission;
  submission.transport = call;
  submission.messages = held;
  submission.caller_identity = [this, ctx] { return CallerIdentity(*ctx); };
  submission.tensor_data = std::move(wire);
  engine_.Submit(std::move(submission));
  return call;
}

}  // namespace fusedlayer::server
