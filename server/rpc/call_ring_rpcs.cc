// OpenCallRing: the control step of the call-ring data plane (server/ring/call_rings.h). Inline on
// the gRPC thread: the bindings are checked for the caller's identity (each weight set loaded, each
// region registered by the caller), then the ring is made and its one-time token returned.
#include "absl/strings/str_cat.h"
#include "auth/caller_identity.h"
#include "ring/call_rings.h"
#include "rpc/service.h"
#include "rpc/unary_call.h"

namespace fusedlayer::server {

absl::Status FusedLayerService::CheckCallRingBindings(const std::string& identity,
                                                      const v1::OpenCallRingRequest& request) {
  if (request.has_device_id()) {
    if (absl::StatusOr<ServingDevice*> d = devices_.Named(request.device_id()); !d.ok()) return d.status();
  }
  for (const std::string& name : request.weight_sets()) {
    if (!weights_.Contains(name)) {
      return absl::NotFoundError(absl::StrCat("weight set '", name, "' is not loaded"));
    }
  }
  for (const v1::CallRingRegion& region : request.regions()) {
    // The registries' own lookups: NOT_FOUND for a region the caller has not registered (another
    // identity's included), FAILED_PRECONDITION when that kind of shared memory is off.
    absl::Status s = region.cuda() ? cuda_shared_memory_.Status(identity, region.name()).status()
                                   : shared_memory_.Status(identity, region.name()).status();
    if (region.name().empty()) s = absl::InvalidArgumentError("a bound region needs a name");
    if (!s.ok()) return absl::Status(s.code(), absl::StrCat("region '", region.name(), "': ", s.message()));
  }
  return absl::OkStatus();
}

grpc::ServerUnaryReactor* FusedLayerService::OpenCallRing(grpc::CallbackServerContext* ctx,
                                                          const v1::OpenCallRingRequest* request,
                                                          v1::OpenCallRingResponse* response) {
  return AnswerInline(Method::kOpenCallRing, WhileDraining::kRefuse, ctx, request, response, [&] {
    if (call_rings_ == nullptr) {
      return absl::FailedPreconditionError("call rings are off on this server (--allow_call_rings)");
    }
    const std::string identity = CallerIdentity(*ctx);
    if (absl::Status s = CheckCallRingBindings(identity, *request); !s.ok()) return s;
    return Into(call_rings_->Open(identity, *request), response);
  });
}

}  // namespace fusedlayer::server
