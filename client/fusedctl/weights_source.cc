#include "client/fusedctl/weights_source.h"

#include <utility>

#include "weights/manifest.h"

namespace fusedlayer::client {

absl::Status ForEachManifestSet(const std::string& path, const std::function<absl::Status(PackedWeights)>& each,
                                size_t* count) {
  absl::StatusOr<server::ManifestReader> reader = server::ManifestReader::Open(path);
  if (!reader.ok()) return reader.status();
  if (count != nullptr) *count = reader->size();
  for (size_t i = 0; i < reader->size(); ++i) {
    absl::StatusOr<server::PackedWeightSet> set = reader->Load(i);
    if (!set.ok()) return set.status();
    if (absl::Status s = each({std::move(set->first), std::move(set->second)}); !s.ok()) return s;
  }
  return absl::OkStatus();
}

}  // namespace fusedlayer::client
