// The process's descriptors (RLIMIT_NOFILE) and the part of them shared-memory regions may hold.
// Each registered system shared-memory region keeps its object's descriptor open; limits per
// identity alone let clients together take every descriptor, and then gRPC's listener fails
// accept4 with EMFILE and never accepts another connection. So regions of all identities share a
// budget: the soft limit less a reserve for everything else (listeners, connections, weight
// files, logs, metrics).
#pragma once

#include <cstdint>
#include <string>

namespace fusedlayer::server {

struct DescriptorBudget {
  int64_t soft_limit = 0;  // RLIMIT_NOFILE's soft limit (RLIM_INFINITY counts as 1 << 20)
  int64_t reserve = 0;     // --descriptor_reserve
  int64_t regions = 0;     // soft_limit - reserve, at least 0: what registered regions may hold
  // "RLIMIT_NOFILE soft limit 384 less --descriptor_reserve=256", for messages and the log.
  std::string Describe() const;
};

// Raises RLIMIT_NOFILE's soft limit to its hard limit (the soft limit is often 1024 while the hard
// one is far higher) and logs what it did. Once, at the start of main.
void RaiseDescriptorLimit();

// The budget under the current soft limit.
DescriptorBudget DescriptorBudgetFor(int64_t reserve);

}  // namespace fusedlayer::server
