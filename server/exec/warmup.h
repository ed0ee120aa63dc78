// Warm-up of a weight set before it is published: a small real call (one token) of each op part on
// both paths (the fused path only where the backend supports it for this set). It proves the
// kernels load and run on this device with these weights (module loading, first-launch
// allocations) before a client sees the set, and gates the per-op health status. Runs on the
// executor thread.
#pragma once

#include "absl/status/status.h"
#include "fusedlayer/backend.h"

namespace fusedlayer::server {

// INTERNAL naming the op and path when a warm-up run fails or produces non-finite outputs.
absl::Status WarmUpMhc(Backend& backend, const PreparedMhcWeights& weights);
absl::Status WarmUpSwa(Backend& backend, const PreparedSwaWeights& weights);

}  // namespace fusedlayer::server
