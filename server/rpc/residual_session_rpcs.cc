// The residual-session RPCs: open, list, close. Each runs inline on the gRPC thread for the
// caller's identity (auth/caller_identity.h): a map lookup under the store's mutex, plus the
// session's one backend allocation at open. The store is server/transport/residual_sessions.h.
#include "auth/caller_identity.h"
#include "rpc/service.h"
#include "rpc/unary_call.h"

namespace fusedlayer::server {

grpc::ServerUnaryReactor* FusedLayerService::OpenResidualSession(grpc::CallbackServerContext* ctx,
                                                                 const v1::OpenResidualSessionRequest* request,
                                                                 v1::OpenResidualSessionResponse* response) {
  return AnswerInline(Method::kOpenResidualSession, WhileDraining::kRefuse, ctx, request, response, [&] {
    // The session's calls run where its state is: the device it names, else the least-loaded
    // (ties in turn, so a client's sessions spread over the devices).
    ServingDevice* device = &devices_.LeastLoaded();
    if (request->has_device_id()) {
      absl::StatusOr<ServingDevice*> named = devices_.Named(request->device_id());
      if (!named.ok()) return named.status();
      device = *named;
    }
    absl::StatusOr<uint64_t> bytes = sessions_.Open(
        CallerIdentity(*ctx), request->name(),
        transport::ResidualSessionShape{request->tokens(), request->hc_mult(), request->hidden()},
        static_cast<size_t>(device->ordinal));
    if (bytes.ok()) {
      response->set_bytes(*bytes);
      response->set_device_id(device->device_id);
    }
    return bytes.status();
  });
}

grpc::ServerUnaryReactor* FusedLayerService::ListResidualSessions(grpc::CallbackServerContext* ctx,
                                                                  const v1::ListResidualSessionsRequest* request,
                                                                  v1::ListResidualSessionsResponse* response) {
  return AnswerInline(Method::kListResidualSessions, WhileDraining::kAnswer, ctx, request, response, [&] {
    for (const transport::ResidualSessionInfo& info : sessions_.List(CallerIdentity(*ctx))) {
      v1::ResidualSessionInfo* out = response->add_sessions();
      out->set_name(info.name);
      out->set_tokens(info.shape.tokens);
      out->set_hc_mult(info.shape.hc_mult);
      out->set_hidden(info.shape.hidden);
      out->set_bytes(info.bytes);
      out->set_has_residual(info.has_residual);
      out->set_has_mixes(info.has_mixes);
      out->set_calls(info.calls);
      out->set_idle_seconds(info.idle_seconds);
      out->set_last_weight_set(info.last_weight_set);
      out->set_device_id(devices_[info.device].device_id);
    }
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* FusedLayerService::CloseResidualSession(grpc::CallbackServerContext* ctx,
                                                                  const v1::CloseResidualSessionRequest* request,
                                                                  v1::CloseResidualSessionResponse* response) {
  return AnswerInline(Method::kCloseResidualSession, WhileDraining::kAnswer, ctx, request, response, [&] {
    absl::StatusOr<std::pair<uint32_t, uint64_t>> closed = sessions_.Close(CallerIdentity(*ctx), request->name());
    if (closed.ok()) {
      response->set_closed(closed->first);
      response->set_freed_bytes(closed->second);
    }
    return closed.status();
  });
}

}  // namespace fusedlayer::server
