// One call that arrived by call ring (ring/call_rings.h): its descriptor turned into the compute
// request it stands for, submitted to the compute engine, and answered by writing the slot's
// completion record (RingCall, the engine's TransportCall for the ring).
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "exec/compute_engine.h"
#include "fusedlayer/v1/fusedlayer.pb.h"
#include "fusedlayer/wire/call_ring.h"
#include "metrics/component_metrics.h"
#include "metrics/metrics.h"

namespace fusedlayer::server::ring {

class Ring;

// Where a ring call's completion goes: the ring (held until the completion is written), the slot
// and the seq the client submitted, and the counters it reports to.
struct RingCallTarget {
  std::shared_ptr<Ring> ring;
  uint32_t slot;
  uint32_t seq;
  std::shared_ptr<std::atomic<int64_t>> in_flight;  // the service's count of ring calls in flight
  Metrics* metrics;
  CallRingMetrics* ring_metrics;
};

// Builds the request `call` stands for and submits it; a descriptor that does not make one (an
// unknown op, role or index, a tensor of the wrong op) is answered INVALID_ARGUMENT in the slot.
void SubmitRingCall(ComputeEngine& engine, const RingCallTarget& target, const wire::RingCallDescriptor& call);

// The request a descriptor stands for, for a ring binding `weight_sets` and `regions`
// (exposed for tests: the ring call and the RPC with the same references are the same request).
absl::Status RingMhcRequest(const wire::RingCallDescriptor& call, const std::vector<std::string>& weight_sets,
                            const std::vector<v1::CallRingRegion>& regions, v1::MhcSeamRequest* request);
absl::Status RingSwaRequest(const wire::RingCallDescriptor& call, const std::vector<std::string>& weight_sets,
                            const std::vector<v1::CallRingRegion>& regions, v1::SwaNormQuantRequest* request);

}  // namespace fusedlayer::server::ring
