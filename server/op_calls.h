// One compute call of each op, from a request message to backend arguments and back:
//   Decode*  (reactor thread, cheap): validate the request tensors against the weight set and
//            --max_tokens, size the response tensors, and build host views over the request and
//            response bytes (INVALID_ARGUMENT naming the tensor on any mismatch).
//   Run*     (executor thread): stage the views on the device when the backend is not
//            host-accessible, launch `path`, copy the outputs back into the response bytes.
#pragma once

#include <cstdint>

#include "absl/status/statusor.h"
#include "fusedlayer/backend.h"
#include "fusedlayer/v1/fusedlayer.pb.h"

namespace fusedlayer::server {

struct MhcCall {
  MhcArgs args;  // host views: inputs over the request, outputs over the response
  MhcShapeQuery query;
};
absl::StatusOr<MhcCall> DecodeMhcRequest(const v1::MhcSeamRequest& request, const PreparedMhcWeights& weights,
                                         int64_t max_tokens, v1::MhcSeamResponse* response);

struct SwaCall {
  SwaArgs args;
  SwaShapeQuery query;
};
absl::StatusOr<SwaCall> DecodeSwaRequest(const v1::SwaNormQuantRequest& request, const PreparedSwaWeights& weights,
                                         int64_t max_tokens, v1::SwaNormQuantResponse* response);

absl::StatusOr<RunStats> RunMhcCall(Backend& backend, const PreparedMhcWeights& weights, const MhcArgs& host_args,
                                    Path path);
absl::StatusOr<RunStats> RunSwaCall(Backend& backend, const PreparedSwaWeights& weights, const SwaArgs& host_args,
                                    Path path);

MhcStage FromProto(v1::MhcStage stage);
MhcMode FromProto(v1::MhcMode mode);

}  // namespace fusedlayer::server
