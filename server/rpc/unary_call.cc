#include "rpc/unary_call.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "fusedlayer/wire/tsan_annotations.h"
#include "rpc/proto_convert.h"
#include "rpc/wire_messages.h"
#include "shadow/shared_messages.h"

namespace fusedlayer::server {

UnaryCall::UnaryCall(Metrics& metrics, Method method, int64_t max_send_bytes, grpc::CallbackServerContext* ctx,
                     const google::protobuf::Message* request, google::protobuf::Message* response)
    : UnaryCall(metrics, method, max_send_bytes, ctx, request->ByteSizeLong(), response) {}

UnaryCall::UnaryCall(Metrics& metrics, Method method, int64_t max_send_bytes, grpc::CallbackServerContext* ctx,
                     uint64_t request_bytes, google::protobuf::Message* response)
    : response_(response),
      metrics_(metrics),
      method_(method),
      max_send_bytes_(max_send_bytes),
      ctx_(ctx),
      start_(Clock::now()),
      request_bytes_(request_bytes) {
  metrics_.InflightAdd(1);
}

bool UnaryCall::Complete(absl::Status status) {
  uint64_t response_bytes = 0;
  if (status.ok()) {
    response_bytes = ResponseBytes();
    // gRPC would fail the send itself, with a less helpful message; say what happened.
    if (response_bytes > static_cast<uint64_t>(max_send_bytes_)) {
      status = absl::ResourceExhaustedError(
          absl::StrCat("response of ", response_bytes, " bytes exceeds the server's send limit of ", max_send_bytes_,
                       " bytes (--max_message_bytes); send fewer tokens per call"));
      ClearResponse();
      response_bytes = 0;
    }
  }
  if (status.ok()) EncodeResponse();
  metrics_.RecordRequest(method_, static_cast<grpc::StatusCode>(status.code()), SecondsSince(start_), request_bytes_,
                         response_bytes);
  const bool sent = status.ok();
  ReleaseBeforeStatus();
  // This call stays alive until Finish() has returned too: gRPC's inline Finish() still reads
  // the reactor after handing the status over, and OnDone may run on a gRPC thread before that.
  refs_.fetch_add(1, std::memory_order_relaxed);
  wire::TsanReleaseTo(this);  // hand-off to gRPC: OnDone (another gRPC thread) acquires it
  Finish(ToGrpcStatus(status));
  Unref();  // `this` may be gone from here on
  return sent;
}

absl::Status UnaryCall::LaunchCheck() const {
  if (ctx_->deadline() <= std::chrono::system_clock::now()) {
    return absl::DeadlineExceededError(
        absl::StrFormat("deadline passed after %.6f s in the server; the op was not launched", SecondsSince(start_)));
  }
  if (cancelled_.load(std::memory_order_acquire) || ctx_->IsCancelled()) {
    return absl::CancelledError("the call was cancelled before the op was launched");
  }
  return absl::OkStatus();
}

void UnaryCall::OnDone() {
  wire::TsanAcquireCallReferences(this);  // gRPC's own threads' last uses of the reactor (tsan_annotations.h)
  wire::TsanAcquireFrom(this);  // what the thread that called Finish did happens before (tsan_annotations.h)
  // What the call held first: a scrape that sees no call in flight also sees its bytes given back.
  ReleaseWhenDone();
  metrics_.InflightAdd(-1);
  // gRPC's Server::Shutdown returns only after every OnDone has (libgrpc's own counting, which
  // TSan cannot see): what OnDone did with the service's budgets and metrics happens before the
  // server tears them down (FusedLayerServer::Shutdown acquires this after Wait()).
  wire::TsanReleaseTo(&metrics_);
  Unref();
}

void UnaryCall::Unref() {
  // acq_rel: whichever of OnDone and Complete lets go last sees everything the other did.
  if (refs_.fetch_sub(1, std::memory_order_acq_rel) == 1) delete this;
}

uint64_t ComputeCall::ResponseBytes() const { return WireResponseBytes(*response_, outputs_); }

void ComputeCall::ClearResponse() {
  response_->Clear();
  outputs_.Clear();
}

// The response's bytes, for gRPC to send as they are (the outputs by reference, no copy).
void ComputeCall::EncodeResponse() { EncodeWireResponse(*response_, outputs_, wire_); }

void ComputeCall::ReleaseBeforeStatus() {
  // The verify work is over: give its slot back before the status goes out, so a client that
  // sends its next verify call as soon as it has this answer never finds the slot still counted
  // (OnDone runs on a gRPC thread some time after the client already has the status; the same
  // ordering as LoadWeights' upload slot).
  verify_slot_.Release();
}

void ComputeCall::ReleaseWhenDone() {
  bytes_lease_.Release();
  // The call's reference to its messages (a shadow job may hold another).
  messages_->Unref();
}

}  // namespace fusedlayer::server
