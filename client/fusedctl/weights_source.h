// Weight sets to upload with `fusedctl load`: a manifest (JSON naming safetensors files and the op
// configs) turned into (WeightSetHeader, payload) pairs by the server's own weights library, so the
// client and the server's --weights_manifest read manifests identically.
#pragma once

#include <functional>
#include <string>

#include "absl/status/status.h"
#include "fusedlayer/v1/fusedlayer.pb.h"

namespace fusedlayer::client {

struct PackedWeights {
  fusedlayer::v1::WeightSetHeader header;  // tensors, offsets, payload_bytes and sha256 filled in
  std::string payload;
};

// Calls `each` with every weight set of the manifest at `path`, in manifest order, reading one
// set's tensors at a time (server::ManifestReader): a whole checkpoint's manifest is uploaded
// without holding every payload in memory. Stops at the first error, from the manifest or from
// `each`. *count (if given) is the number of sets the manifest lists.
absl::Status ForEachManifestSet(const std::string& path, const std::function<absl::Status(PackedWeights)>& each,
                                size_t* count = nullptr);

}  // namespace fusedlayer::client
