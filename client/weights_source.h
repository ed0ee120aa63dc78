// Weight sets to upload with `fusedctl load`: a manifest (JSON naming safetensors files and the op
// configs) turned into (WeightSetHeader, payload) pairs by the server's own weights library, so the
// client and the server's --weights_manifest read manifests identically.
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "fusedlayer/v1/fusedlayer.pb.h"

namespace fusedlayer::client {

struct PackedWeights {
  fusedlayer::v1::WeightSetHeader header;  // tensors, offsets, payload_bytes and sha256 filled in
  std::string payload;
};

// Every weight set of the manifest at `path`, in manifest order.
absl::StatusOr<std::vector<PackedWeights>> PackManifest(const std::string& path);

}  // namespace fusedlayer::client
