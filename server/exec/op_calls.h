// One compute call of each op on the executor: the call (backend arguments over host views of the
// request and response bytes, built by rpc/proto_convert.h's Decode*Request) and its run: stage the
// views on the device when the backend is not host-accessible, launch `path`, copy the outputs back
// into the response bytes. Executor thread (it drives the backend).
#pragma once

#include "absl/status/statusor.h"
#include "fusedlayer/backend.h"

namespace fusedlayer::server {

struct MhcCall {
  MhcArgs args;  // host views: inputs over the request, outputs over the response
  MhcShapeQuery query;
};

struct SwaCall {
  SwaArgs args;
  SwaShapeQuery query;
};

absl::StatusOr<RunStats> RunMhcCall(Backend& backend, const PreparedMhcWeights& weights, const MhcArgs& host_args,
                                    Path path);
absl::StatusOr<RunStats> RunSwaCall(Backend& backend, const PreparedSwaWeights& weights, const SwaArgs& host_args,
                                    Path path);

}  // namespace fusedlayer::server
