// One op call as the transport that received it holds it: what the compute engine
// (exec/compute_engine.h) asks of the transport and how it hands the result back. gRPC's compute
// reactor implements it (rpc/unary_call.h ComputeCall); a transport without gRPC implements the
// same few methods, so the engine never sees a transport's types.
#pragma once

#include <cstdint>
#include <optional>

#include "absl/status/status.h"
#include "common/byte_budget.h"
#include "runtime/output_buffers.h"
#include "fusedlayer/v1/fusedlayer.pb.h"

namespace fusedlayer::server {

class TransportCall {
 public:
  virtual ~TransportCall() = default;

  // Not OK once the call must not be launched any more (its deadline passed, its caller went away):
  // asked before the call's work starts on the device.
  virtual absl::Status LaunchCheck() const = 0;
  // Seconds since the transport received the call (the decode stage ends, the report's
  // server_seconds is read).
  virtual double elapsed() const = 0;
  // The request's size as received, admitted with the outputs (--max_inflight_bytes).
  virtual uint64_t request_bytes() const = 0;
  // The output tensors the response carries outside its message (runtime/output_buffers.h); the
  // transport sends them after the message.
  virtual OutputBuffers* outputs() = 0;
  // What admission granted the call: its bytes, held until the call is over; a verify call's slot,
  // given back before the status is sent.
  virtual void HoldBytes(ByteBudget::Lease lease) = 0;
  virtual void HoldVerifySlot(ByteBudget::Lease slot) = 0;
  // The completion, exactly once: the status and, with OK, the response message (its execution
  // report included) and outputs(). Returns whether the response went out with OK (false also when
  // the transport dropped it, e.g. over its send limit).
  virtual bool Complete(absl::Status status) = 0;

  // An answer the device stores (call rings: the completion word a client spins on, in page-locked
  // memory). For a call on a device lane whose outputs all lie in device memory the client reads
  // (CUDA shared memory), once its last device work is enqueued, the engine offers the report as
  // far as it is known then (path, fallback, queue and stage times so far; no kernel time). A
  // transport that takes it writes its answer but the one word and returns where that word is:
  // the lane's stream stores `value` into `word` after the work, so the client sees the answer
  // with no server thread in between. Complete() still follows (the call's bookkeeping): with OK
  // it must not answer again, as the client may be on its next call already. Default: not taken.
  struct DeviceAnswer {
    uint32_t* word;
    uint32_t value;
  };
  virtual std::optional<DeviceAnswer> PrepareDeviceAnswer(const v1::ExecutionReport& so_far) {
    (void)so_far;
    return std::nullopt;
  }
  // The prepared answer will not be stored (its store could not be enqueued, or the work before it
  // failed, which stops the stream): Complete() answers as usual.
  virtual void WithdrawDeviceAnswer() {}
};

}  // namespace fusedlayer::server
