// One op call as the transport that received it holds it: what the compute engine
// (exec/compute_engine.h) asks of the transport and how it hands the result back. gRPC's compute
// reactor implements it (rpc/unary_call.h ComputeCall); a transport without gRPC implements the
// same few methods, so the engine never sees a transport's types.
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "common/byte_budget.h"
#include "exec/output_buffers.h"

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
  // The output tensors the response carries outside its message (exec/output_buffers.h); the
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
};

}  // namespace fusedlayer::server
