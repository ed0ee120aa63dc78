// The Prometheus series of the server's components, defined in one place: their names, help texts
// and labels, registered on the service's registry by the component that updates them, which keeps
// the returned handles (updating a handle is an atomic add, no lookup). The request and weight-set
// series are metrics.h; shadow verification's, shadow_metrics.h. docs/operations.md lists them all.
#pragma once

#include <string>

#include "prometheus/counter.h"
#include "prometheus/gauge.h"
#include "prometheus/registry.h"

namespace fusedlayer::server {

// System shared-memory regions (transport/shared_memory.h).
struct SharedMemoryMetrics {
  static SharedMemoryMetrics Register(prometheus::Registry& registry);
  prometheus::Gauge* regions;           // fusedlayer_shared_memory_regions
  prometheus::Gauge* registered_bytes;  // fusedlayer_shared_memory_registered_bytes
  prometheus::Gauge* locked_bytes;      // fusedlayer_shared_memory_locked_bytes
  prometheus::Gauge* region_budget;     // fusedlayer_shared_memory_region_budget
  prometheus::Counter* expired;         // fusedlayer_shared_memory_regions_expired_total
};

// CUDA shared-memory regions (transport/cuda_shared_memory.h).
struct CudaSharedMemoryMetrics {
  static CudaSharedMemoryMetrics Register(prometheus::Registry& registry);
  prometheus::Gauge* regions;           // fusedlayer_cuda_shared_memory_regions
  prometheus::Gauge* registered_bytes;  // fusedlayer_cuda_shared_memory_registered_bytes
  prometheus::Counter* expired;         // fusedlayer_cuda_shared_memory_regions_expired_total
};

// Residual sessions (transport/residual_sessions.h).
struct ResidualSessionMetrics {
  static ResidualSessionMetrics Register(prometheus::Registry& registry);
  prometheus::Gauge* sessions;  // fusedlayer_residual_sessions
  prometheus::Gauge* bytes;     // fusedlayer_residual_session_bytes
};

// A bounded pool of page-locked staging memory (runtime/host_staging_pool.h): one set of series per
// pool, named `<metric>_bytes{state}`, `<metric>_waits_total`, `<metric>_misses_total`; `what` and
// `flag` (the flag that bounds it) go into the help texts.
struct StagingPoolMetrics {
  static StagingPoolMetrics Register(prometheus::Registry& registry, const std::string& metric,
                                     const std::string& what, const std::string& flag);
  prometheus::Gauge* in_use;    // <metric>_bytes{state="in_use"}
  prometheus::Gauge* held;      // {state="held"}
  prometheus::Gauge* limit;     // {state="limit"}
  prometheus::Gauge* lent;      // {state="lent"}
  prometheus::Counter* waits;   // <metric>_waits_total
  prometheus::Counter* misses;  // <metric>_misses_total
};

// Call rings (ring/call_rings.h).
struct CallRingMetrics {
  explicit CallRingMetrics(prometheus::Registry& registry);
  prometheus::Gauge* open;                   // fusedlayer_call_rings_open
  prometheus::Counter* calls[2];             // fusedlayer_call_ring_calls_total{method}: MhcSeam, SwaNormQuant
  prometheus::Counter* poller_busy_seconds;  // fusedlayer_call_ring_poller_busy_seconds_total
};

}  // namespace fusedlayer::server
