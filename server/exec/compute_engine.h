// The lifecycle of a compute request, the same for every transport. A transport (gRPC: rpc/
// compute_rpcs.cc) receives a call, reads its request message, and hands it to Submit() with a
// TransportCall (exec/transport_call.h) for the answer; from there on everything is here:
//
//   Submit (the transport's thread, never blocks)
//     admission: path preference, verify slots, the weight set and its part, the response's size
//       and the bytes in flight (--max_inflight_bytes), shared-memory staging, the residual session
//     decode (codec/request_codec.h) into the op's call
//     the device it runs on (runtime/serving_devices.h): that of its CUDA shared-memory tensors or
//       of its session, else the one it names (device_id), else the least-loaded; queued on that
//       device's executor
//   on an executor worker of that device (runtime/executor.h)
//     the launch check, dynamic batching with compatible queued requests (exec/batch_assembly.h),
//     path choice and run with fallback (exec/dispatcher.h) on the worker's lane
//     session commit, outputs written to their shared-memory regions, the execution report,
//     verify or shadow sampling, TransportCall::Complete
//
// What differs between the two ops is in exec/op_traits.h.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "codec/request_codec.h"
#include "codec/wire_tensor_data.h"
#include "common/byte_budget.h"
#include "config.h"
#include "runtime/device_lanes.h"
#include "runtime/executor.h"
#include "runtime/serving_devices.h"
#include "exec/transport_call.h"
#include "exec/weight_manager.h"
#include "fusedlayer/backend.h"
#include "fusedlayer/v1/fusedlayer.pb.h"
#include "metrics/metrics.h"
#include "shadow/shadow_verifier.h"
#include "transport/cuda_shared_memory.h"
#include "transport/residual_sessions.h"
#include "transport/shared_memory.h"

namespace fusedlayer::server {

// One op call as a transport submits it. `Op` is MhcOp or SwaOp (exec/op_traits.h).
template <typename Op>
struct OpCallSubmission {
  // Answered exactly once: by Submit when the call is refused, else from the executor.
  TransportCall* transport = nullptr;
  // The call's request (read by the transport) and response (filled here); the transport's
  // reference to them, which the shadow verifier may share (shadow/shared_messages.h).
  typename Op::Messages* messages = nullptr;
  // Who the call acts as, asked only when it names shared-memory regions or a residual session
  // (their owner).
  absl::AnyInvocable<std::string() const> caller_identity;
  // The request's tensor data read outside its message (codec/wire_tensor_data.h); never null.
  std::unique_ptr<WireTensorData> tensor_data;
};

class ComputeEngine {
 public:
  // The registries and the session store belong to the server (their own RPCs manage them); the
  // engine uses them for the calls that name them.
  ComputeEngine(const ServerConfig& config, ServingDevices& devices, WeightManager& weights, Metrics& metrics,
                shadow::ShadowVerifier& shadow, transport::SharedMemoryRegistry& shared_memory,
                transport::CudaSharedMemoryRegistry& cuda_shared_memory, transport::ResidualSessionStore& sessions);

  // The entry point: admits, decodes and queues the call; its transport is answered exactly once
  // (at once when refused). Never blocks.
  template <typename Op>
  void Submit(OpCallSubmission<Op> submission);

  // Graceful drain: from now on new work is refused with UNAVAILABLE (AdmitDuringDrain), also what
  // a transport asks before it reads a request.
  void StartDraining() { draining_.store(true, std::memory_order_release); }
  absl::Status AdmitDuringDrain() const;

  // Where a transport reads request tensors into page-locked memory (null: nowhere), and its
  // copier; the primary device's lanes' staging (runtime/device_lanes.h), page-locked for every
  // device (a request is read before its device is chosen).
  HostStagingPool* request_staging() const { return primary_lanes_.request_staging(); }
  ParallelCopy* request_copier() const {
    return primary_lanes_.request_staging() == nullptr ? nullptr : &primary_lanes_.staging()->copier();
  }

 private:
  // One compute request on the executor, alone or in a dynamic batch (exec/compute_engine.cc).
  template <typename Op>
  class QueuedCall;

  // Submit's work up to the queue; an error is the call's answer.
  template <typename Op>
  absl::Status AdmitAndQueue(OpCallSubmission<Op>& submission);
  // Memory admission of a call with outputs of `response` bytes, before any of them is allocated:
  // RESOURCE_EXHAUSTED when the outputs the response sends are over the send limit
  // (--max_message_bytes) or when the call's request + held outputs (+ shared-memory input staging)
  // bytes do not fit in what --max_inflight_bytes leaves; otherwise the call holds the bytes until
  // it is done.
  absl::Status AdmitComputeBytes(TransportCall* call, const ResponseSize& response, uint64_t staged_bytes);
  // A verify = true call runs the op twice: FAILED_PRECONDITION when --max_inflight_verify is 0,
  // RESOURCE_EXHAUSTED when that many verify calls are already admitted; otherwise the call holds
  // a slot until it is done.
  absl::Status AdmitVerify(TransportCall* call);
  // The device a decoded call runs on: the GPU of its CUDA shared-memory tensors, else its
  // session's device, else the one it names, else the least-loaded. INVALID_ARGUMENT when what it
  // names is not served or disagrees with where its tensors or session are.
  absl::StatusOr<ServingDevice*> ChooseDevice(std::optional<int> named, const transport::TensorTransfer* transfer,
                                              const transport::ResidualSessionStore::Lease& session);
  std::string RequestId(const std::string& given);
  void FillReport(v1::ExecutionReport* report, const std::string& weight_set, const ServingDevice& device) const;

  const ServerConfig& config_;
  ServingDevices& devices_;
  const DeviceLanes& primary_lanes_;  // where requests are read into page-locked memory
  WeightManager& weights_;
  Metrics& metrics_;
  shadow::ShadowVerifier& shadow_;
  transport::SharedMemoryRegistry& shared_memory_;
  transport::CudaSharedMemoryRegistry& cuda_shared_memory_;
  transport::ResidualSessionStore& sessions_;
  std::atomic<bool> draining_{false};
  ByteBudget inflight_bytes_;  // compute request + response bytes admitted (--max_inflight_bytes)
  ByteBudget verify_slots_;    // verify = true calls admitted, one unit each (--max_inflight_verify)
  std::atomic<uint64_t> next_request_id_{1};
  const uint64_t request_id_salt_;
};

}  // namespace fusedlayer::server
