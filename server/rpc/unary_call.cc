#include "rpc/unary_call.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "rpc/proto_convert.h"

namespace fusedlayer::server {

UnaryCall::UnaryCall(Metrics& metrics, Method method, int64_t max_send_bytes, grpc::CallbackServerContext* ctx,
                     const google::protobuf::Message* request, google::protobuf::Message* response)
    : metrics_(metrics),
      method_(method),
      max_send_bytes_(max_send_bytes),
      ctx_(ctx),
      response_(response),
      start_(Clock::now()),
      request_bytes_(request->ByteSizeLong()) {
  metrics_.InflightAdd(1);
}

bool UnaryCall::Complete(absl::Status status) {
  uint64_t response_bytes = 0;
  if (status.ok()) {
    response_bytes = response_->ByteSizeLong();
    // gRPC would fail the send itself, with a less helpful message; say what happened.
    if (response_bytes > static_cast<uint64_t>(max_send_bytes_)) {
      status = absl::ResourceExhaustedError(
          absl::StrCat("response of ", response_bytes, " bytes exceeds the server's send limit of ", max_send_bytes_,
                       " bytes (--max_message_bytes); send fewer tokens per call"));
      response_->Clear();
      response_bytes = 0;
    }
  }
  metrics_.RecordRequest(method_, static_cast<grpc::StatusCode>(status.code()), SecondsSince(start_), request_bytes_,
                         response_bytes);
  const bool sent = status.ok();
  Finish(ToGrpcStatus(status));  // `this` may be gone from here on (OnDone)
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
  // Bytes first: a scrape that sees no call in flight also sees their bytes given back.
  bytes_lease_.Release();
  metrics_.InflightAdd(-1);
  delete this;
}

}  // namespace fusedlayer::server
