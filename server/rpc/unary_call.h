// A unary RPC in flight: counts itself in the inflight gauge, and on Complete() records the
// request metrics, enforces the send limit and finishes. Complete() is called exactly once, from
// the reactor thread (early errors, cheap RPCs) or from the executor; it returns whether the
// response went out with OK (false also when the response was over the send limit and cleared).
// LaunchCheck() is what the executor asks before starting work for the call. UnaryCall is the
// typed admin calls' reactor; ComputeCall (below) the compute methods'.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>

#include "absl/status/status.h"
#include "common/byte_budget.h"
#include "runtime/output_buffers.h"
#include "exec/transport_call.h"
#include "fusedlayer/wire/tsan_annotations.h"
#include "google/protobuf/message.h"
#include "grpcpp/server_context.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/server_callback.h"
#include "metrics/metrics.h"

namespace fusedlayer::server {

namespace shadow {
class SharedMessagesCount;
}

using Clock = std::chrono::steady_clock;
inline double SecondsSince(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// A typed unary call (the admin RPCs): gRPC serializes `response` itself after Finish().
class UnaryCall : public grpc::ServerUnaryReactor {
 public:
  UnaryCall(Metrics& metrics, Method method, int64_t max_send_bytes, grpc::CallbackServerContext* ctx,
            const google::protobuf::Message* request, google::protobuf::Message* response);

  bool Complete(absl::Status status);
  // Work that has not been launched yet is dropped when this says so (deadline passed, cancelled).
  absl::Status LaunchCheck() const;
  double elapsed() const { return SecondsSince(start_); }
  uint64_t request_bytes() const { return request_bytes_; }
  grpc::CallbackServerContext* context() const { return ctx_; }

  void OnCancel() override {
    wire::TsanAcquireFrom(this);
    cancelled_.store(true, std::memory_order_release);
    metrics_.RecordCancellation(method_);
    wire::TsanReleaseTo(this);  // for OnDone, maybe on another thread (tsan_annotations.h: OnCancel)
  }
  void OnDone() final;

 protected:
  UnaryCall(Metrics& metrics, Method method, int64_t max_send_bytes, grpc::CallbackServerContext* ctx,
            uint64_t request_bytes, google::protobuf::Message* response);
  // What differs for a compute call (ComputeCall below): the response's size on the wire, dropping
  // a response over the send limit, encoding it before Finish(), and what it holds until the status
  // is out (Complete) or the call is over (OnDone).
  virtual uint64_t ResponseBytes() const { return response_->ByteSizeLong(); }
  virtual void ClearResponse() { response_->Clear(); }
  virtual void EncodeResponse() {}
  virtual void ReleaseBeforeStatus() {}
  virtual void ReleaseWhenDone() {}

  google::protobuf::Message* const response_;

 private:
  void Unref();

  Metrics& metrics_;
  const Method method_;
  const int64_t max_send_bytes_;
  grpc::CallbackServerContext* const ctx_;
  const Clock::time_point start_;
  const uint64_t request_bytes_;
  std::atomic<bool> cancelled_{false};
  std::atomic<int> refs_{1};  // gRPC's (dropped in OnDone), and Complete's while it is in Finish()
};

// A compute call (MhcSeam, SwaNormQuant: raw methods, rpc/wire_messages.h): it owns the memory of
// its output tensors that are not in the response message (outputs(), runtime/output_buffers.h) and
// its reference to its messages (shadow/shared_messages.h, dropped in OnDone); Complete() encodes
// the response message and those outputs into gRPC's response ByteBuffer before Finish(). It holds
// its admitted bytes (HoldBytes) until OnDone. To the compute engine it is the call's transport
// (exec/transport_call.h).
class ComputeCall final : public UnaryCall, public TransportCall {
 public:
  // `request_bytes` as received, `response` the message part of what Complete() encodes into
  // `wire`, `messages` the call's reference to them.
  ComputeCall(Metrics& metrics, Method method, int64_t max_send_bytes, grpc::CallbackServerContext* ctx,
              uint64_t request_bytes, google::protobuf::Message* response, grpc::ByteBuffer* wire,
              shadow::SharedMessagesCount* messages)
      : UnaryCall(metrics, method, max_send_bytes, ctx, request_bytes, response), wire_(wire), messages_(messages) {}

  // The output tensors that are not in the response message (runtime/output_buffers.h).
  OutputBuffers* outputs() override { return &outputs_; }
  // The call's admitted bytes (exec/compute_engine.h AdmitComputeBytes): given back in OnDone, once the
  // response has been sent or the call has failed, when its messages are no longer needed.
  void HoldBytes(ByteBudget::Lease lease) override { bytes_lease_ = std::move(lease); }
  // A verify = true call's slot in --max_inflight_verify, given back in Complete() before the
  // status is sent (the bytes stay held until OnDone: the messages live until then).
  void HoldVerifySlot(ByteBudget::Lease slot) override { verify_slot_ = std::move(slot); }
  absl::Status LaunchCheck() const override { return UnaryCall::LaunchCheck(); }
  double elapsed() const override { return UnaryCall::elapsed(); }
  uint64_t request_bytes() const override { return UnaryCall::request_bytes(); }
  bool Complete(absl::Status status) override { return UnaryCall::Complete(std::move(status)); }

 private:
  uint64_t ResponseBytes() const override;
  void ClearResponse() override;
  void EncodeResponse() override;
  void ReleaseBeforeStatus() override;
  void ReleaseWhenDone() override;

  grpc::ByteBuffer* const wire_;                 // the response's bytes
  shadow::SharedMessagesCount* const messages_;  // the call's reference to its messages
  OutputBuffers outputs_;
  ByteBudget::Lease bytes_lease_;
  ByteBudget::Lease verify_slot_;
};

}  // namespace fusedlayer::server
