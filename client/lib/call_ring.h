// The client side of a call ring (proto OpenCallRing, proto/fusedlayer/wire/call_ring.h): the op
// calls of a process on the server's host without one RPC each. Open the ring once over gRPC with
// the weight sets and shared-memory regions its calls will name (by index); each call is then a
// descriptor written into a slot and a completion read back from it, through memory both
// processes map.
//
//   CallRing::Options o;
//   o.weight_sets = {"v4-pro/demo"};
//   o.regions = {{"inputs", /*cuda=*/false}, {"outputs", false}};   // registered beforehand
//   auto ring = CallRing::Open(client, o);
//   wire::RingCallDescriptor call = RingMhcCall(0, v1::MHC_STAGE_SEAM, v1::MHC_MODE_SHIFTED,
//       {RingInput(wire::RingRole::kX, 0, v1::DATA_TYPE_BF16, {T, C}, x_offset), ...,
//        RingOutput(wire::RingRole::kY, 1, y_offset, y_bytes), ...});
//   RingCallResult r = (*ring)->Call(0, call);      // r.status, r.path, r.kernel_seconds, ...
//
// Thread safety: one slot is one call at a time; distinct threads may use distinct slots of one
// ring at once (Submit/Wait, or Call).
#pragma once

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "client/lib/fusedlayer_client.h"
#include "fusedlayer/v1/fusedlayer.pb.h"
#include "fusedlayer/wire/call_ring.h"

namespace fusedlayer::client {

// What a slot's completion record says.
struct RingCallResult {
  absl::Status status;
  v1::ExecutionPath path = v1::EXECUTION_PATH_UNSPECIFIED;
  v1::FallbackReason fallback_reason = v1::FALLBACK_REASON_NONE;
  std::string fallback_detail;
  uint32_t batch_requests = 0;
  double server_seconds = 0;
  double queue_seconds = 0;
  double kernel_seconds = 0;
  v1::StageSeconds stages;  // where server_seconds went (set on OK calls)
  // The GPU stream wrote the completion after the kernels (wire::kRingCompletedByDevice):
  // server_seconds then ends at the launch, and kernel_seconds and stages.device are 0.
  bool completed_by_device = false;
};

// The execution report a completion stands for (the fields an RPC's report would have; the stages
// only for an OK call), for code that handles ring calls and RPCs alike.
v1::ExecutionReport ReportOf(const RingCallResult& result);

// An input tensor at [offset, offset + bytes of dtype x shape) of bound region `region`.
wire::RingTensorRef RingInput(wire::RingRole role, uint32_t region, v1::DataType dtype,
                              std::initializer_list<int64_t> shape, uint64_t offset);
// An output written to [offset, offset + byte_size) of bound region `region`.
wire::RingTensorRef RingOutput(wire::RingRole role, uint32_t region, uint64_t offset, uint64_t byte_size);
// A call's descriptor. `deadline`: the call is not launched after it (InfiniteDuration: never).
wire::RingCallDescriptor RingMhcCall(uint32_t weight_set, v1::MhcStage stage, v1::MhcMode mode,
                                     std::initializer_list<wire::RingTensorRef> tensors,
                                     v1::PathPreference path = v1::PATH_PREFERENCE_AUTO,
                                     absl::Duration deadline = absl::InfiniteDuration());
wire::RingCallDescriptor RingSwaCall(uint32_t weight_set, std::initializer_list<wire::RingTensorRef> tensors,
                                     v1::PathPreference path = v1::PATH_PREFERENCE_AUTO,
                                     absl::Duration deadline = absl::InfiniteDuration());
// Appends a tensor to a descriptor (InvalidArgument past wire::kRingMaxTensors).
absl::Status AddRingTensor(wire::RingCallDescriptor* call, const wire::RingTensorRef& tensor);

class CallRing;

// The descriptor of a request whose tensors all lie in shared-memory regions (ClientRegion::Prepare
// in client/lib/shared_memory.h makes such a request from an inline one): its weight set and regions
// found in the ring's bindings (`weight_sets`, `regions` as given to CallRing::Open). InvalidArgument
// for an inline tensor, NotFound for a weight set or region the bindings lack.
absl::StatusOr<wire::RingCallDescriptor> RingCallOf(const v1::MhcSeamRequest& request,
                                                    const std::vector<std::string>& weight_sets,
                                                    const std::vector<v1::CallRingRegion>& regions,
                                                    absl::Duration deadline = absl::InfiniteDuration());
absl::StatusOr<wire::RingCallDescriptor> RingCallOf(const v1::SwaNormQuantRequest& request,
                                                    const std::vector<std::string>& weight_sets,
                                                    const std::vector<v1::CallRingRegion>& regions,
                                                    absl::Duration deadline = absl::InfiniteDuration());

class CallRing {
 public:
  struct Options {
    std::vector<std::string> weight_sets;
    std::vector<v1::CallRingRegion> regions;
    uint32_t slots = 8;
    // How long a waiting call spins on its completion word before it sleeps on the futex: a
    // completion within it is seen within a microsecond, a later one costs a wake-up.
    absl::Duration spin = absl::Microseconds(50);
    // The server device every call of the ring runs on (GetServerInfo's devices); none: each call
    // where the server would run it as an RPC.
    std::optional<int> device_id;

    // A ring of `weight_set` with one slot per region of `region_names` (system shared memory, or
    // CUDA shared memory with `cuda`), bound in that order: slot k's call uses region k.
    static Options ForRegions(const std::string& weight_set, const std::vector<std::string>& region_names, bool cuda);
  };

  // OpenCallRing, then the handover on the ring socket (the token, then the ring's memfd and
  // doorbell by SCM_RIGHTS), then the mapping. Errors: the RPC's, or UNAVAILABLE for the socket.
  static absl::StatusOr<std::unique_ptr<CallRing>> Open(const FusedLayerClient& client, const Options& options);
  ~CallRing();  // closes the connection: the server closes the ring
  CallRing(const CallRing&) = delete;
  CallRing& operator=(const CallRing&) = delete;

  // One call in `slot`: Submit writes it and rings the doorbell if the server sleeps; Wait waits
  // for its completion, at most until `timeout` (then DEADLINE_EXCEEDED, and the slot stays busy
  // until the server completes it: Wait again). Call = Submit + Wait.
  absl::Status Submit(uint32_t slot, const wire::RingCallDescriptor& call);
  RingCallResult Wait(uint32_t slot, absl::Duration timeout = absl::Seconds(60));
  RingCallResult Call(uint32_t slot, const wire::RingCallDescriptor& call,
                      absl::Duration timeout = absl::Seconds(60));

  uint32_t slots() const { return slots_; }
  uint64_t ring_id() const { return ring_id_; }

  // Tests: the raw memory, to write what a misbehaving client would.
  wire::RingSlot* raw_slot(uint32_t slot) const { return wire::RingSlotAt(base_, slot); }
  // Tests: the handover connection's descriptor (closing it is what a client's exit does).
  int connection_fd() const { return connection_; }

 private:
  CallRing() = default;

  void* base_ = nullptr;
  uint64_t bytes_ = 0;
  int memfd_ = -1;
  int doorbell_ = -1;
  int connection_ = -1;
  uint32_t slots_ = 0;
  uint64_t ring_id_ = 0;
  int64_t spin_ns_ = 0;
  std::vector<uint32_t> seq_;  // the seq of each slot's last submitted call
};

}  // namespace fusedlayer::client
