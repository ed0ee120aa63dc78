#include "client/weights_source.h"

#include <utility>

#include "weights/manifest.h"

namespace fusedlayer::client {

absl::StatusOr<std::vector<PackedWeights>> PackManifest(const std::string& path) {
  absl::StatusOr<std::vector<server::PackedWeightSet>> sets = server::LoadManifest(path);
  if (!sets.ok()) return sets.status();
  std::vector<PackedWeights> out;
  out.reserve(sets->size());
  for (server::PackedWeightSet& s : *sets) out.push_back({std::move(s.first), std::move(s.second)});
  return out;
}

}  // namespace fusedlayer::client
