// Where the weight manager tells whether an op can serve (a warmed-up weight set with its part is
// loaded). The gRPC health service publishes it (rpc/health.h); exec does not know who listens.
#pragma once

#include "config.h"

namespace fusedlayer::server {

class OpServingListener {
 public:
  virtual ~OpServingListener() = default;
  virtual void SetOpServing(Op op, bool serving) = 0;
};

}  // namespace fusedlayer::server
