// absl::Status -> grpc::Status for the RPCs, over the transport-neutral conversions between the
// proto messages and the library's types (codec/request_codec.h).
#pragma once

#include "absl/status/status.h"
#include "codec/request_codec.h"
#include "grpcpp/support/status.h"

namespace fusedlayer::server {

// The code spaces are identical.
grpc::Status ToGrpcStatus(const absl::Status& status);

}  // namespace fusedlayer::server
