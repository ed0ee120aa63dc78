#include "metrics/component_metrics.h"

#include "absl/strings/str_cat.h"
#include "metrics/metrics.h"

namespace fusedlayer::server {

namespace {

prometheus::Gauge* Gauge(prometheus::Registry& registry, const std::string& name, const std::string& help) {
  return &prometheus::BuildGauge().Name(name).Help(help).Register(registry).Add({});
}
prometheus::Counter* Counter(prometheus::Registry& registry, const std::string& name, const std::string& help) {
  return &prometheus::BuildCounter().Name(name).Help(help).Register(registry).Add({});
}

}  // namespace

SharedMemoryMetrics SharedMemoryMetrics::Register(prometheus::Registry& registry) {
  SharedMemoryMetrics m;
  m.regions = Gauge(registry, "fusedlayer_shared_memory_regions",
                    "System shared-memory regions registered (all identities)");
  m.registered_bytes = Gauge(registry, "fusedlayer_shared_memory_registered_bytes",
                             "Bytes of the registered system shared-memory regions (all identities)");
  m.locked_bytes = Gauge(registry, "fusedlayer_shared_memory_locked_bytes",
                         "Bytes of shared-memory regions that are mapped and page-locked, so the device copies their "
                         "inputs where they lie (--shared_memory_locked_bytes); an unregistered region counts until "
                         "the last request using it is done");
  m.region_budget = Gauge(registry, "fusedlayer_shared_memory_region_budget",
                          "System shared-memory regions all identities may hold registered together, one open "
                          "descriptor each: RLIMIT_NOFILE's soft limit less --descriptor_reserve (0: no bound)");
  m.expired = Counter(registry, "fusedlayer_shared_memory_regions_expired_total",
                      "System shared-memory regions unregistered because no request used them for "
                      "--shared_memory_idle_seconds");
  return m;
}

CudaSharedMemoryMetrics CudaSharedMemoryMetrics::Register(prometheus::Registry& registry) {
  CudaSharedMemoryMetrics m;
  m.regions = Gauge(registry, "fusedlayer_cuda_shared_memory_regions",
                    "CUDA shared-memory regions registered (all identities)");
  m.registered_bytes = Gauge(registry, "fusedlayer_cuda_shared_memory_registered_bytes",
                             "Bytes of the registered CUDA shared-memory regions (all identities)");
  m.expired = Counter(registry, "fusedlayer_cuda_shared_memory_regions_expired_total",
                      "CUDA shared-memory regions unregistered because no request used them for "
                      "--cuda_shared_memory_idle_seconds");
  return m;
}

ResidualSessionMetrics ResidualSessionMetrics::Register(prometheus::Registry& registry) {
  ResidualSessionMetrics m;
  m.sessions = Gauge(registry, "fusedlayer_residual_sessions", "Residual sessions open (all identities)");
  m.bytes = Gauge(registry, "fusedlayer_residual_session_bytes",
                  "Backend (device) memory held by the open residual sessions (all identities)");
  return m;
}

StagingPoolMetrics StagingPoolMetrics::Register(prometheus::Registry& registry, const std::string& metric,
                                                const std::string& what, const std::string& flag) {
  StagingPoolMetrics m;
  auto& bytes = prometheus::BuildGauge()
                    .Name(metric + "_bytes")
                    .Help(absl::StrCat(what,
                                       ": in_use (held by running requests and responses being sent), lent (of "
                                       "in_use, held by responses being sent), held (in use + kept for reuse), limit (",
                                       flag, ")"))
                    .Register(registry);
  m.in_use = &bytes.Add({{"state", "in_use"}});
  m.held = &bytes.Add({{"state", "held"}});
  m.limit = &bytes.Add({{"state", "limit"}});
  m.lent = &bytes.Add({{"state", "lent"}});
  m.waits = Counter(registry, metric + "_waits_total",
                    absl::StrCat("Requests that waited for this memory held by other requests (raise ", flag,
                                 " if this grows with load)"));
  m.misses = Counter(registry, metric + "_misses_total",
                     absl::StrCat("Requests that did without this memory because the bound was taken or the system "
                                  "refused page-locked memory (raise ",
                                  flag, " if this grows with load)"));
  return m;
}

CallRingMetrics::CallRingMetrics(prometheus::Registry& registry) {
  open = Gauge(registry, "fusedlayer_call_rings_open", "Call rings open (handed over to their client and not yet closed)");
  auto& calls_family = prometheus::BuildCounter()
                           .Name("fusedlayer_call_ring_calls_total")
                           .Help("Compute calls that arrived by call ring (they are also counted in "
                                 "fusedlayer_requests_total under their method)")
                           .Register(registry);
  calls[0] = &calls_family.Add({{"method", MethodName(Method::kMhcSeam)}});
  calls[1] = &calls_family.Add({{"method", MethodName(Method::kSwaNormQuant)}});
  poller_busy_seconds = Counter(registry, "fusedlayer_call_ring_poller_busy_seconds_total",
                                "Time the call-ring poller spent awake (scanning slots and submitting calls), seconds");
}

}  // namespace fusedlayer::server
