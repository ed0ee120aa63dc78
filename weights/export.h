// Writes packed weight sets as a manifest directory (one safetensors file per set plus
// manifest.json): how the tests and the e2e tests produce --weights_manifest inputs, and a way to
// turn the demo sets into files for other tools.
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "weights/weight_set.h"

namespace fusedlayer::server {

// Writes `dir`/<name with '/' replaced by '_'>.safetensors for each set (tensors under their
// weight-set names, e.g. "mhc.fn") and `dir`/manifest.json referencing them by relative path, with
// the sets' configs (optional fields only where set). `dir` must exist. Returns the manifest path.
// InvalidArgument for a set whose tensor entries do not lie within its payload.
absl::StatusOr<std::string> ExportWeightSets(const std::string& dir, const std::vector<PackedWeightSet>& sets);

}  // namespace fusedlayer::server
