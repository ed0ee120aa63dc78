// The loaded weight sets, by name. Thread-safe: request handlers Get() concurrently with LoadWeights
// publishing and UnloadWeightSet removing sets.
//
// Sets are handed out as shared_ptr<const WeightSet>: replacing or unloading a name only drops the
// store's reference, so a request that already holds the old set finishes with it, and the old set's
// backend memory is released when the last such request lets go.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "common/annotated_mutex.h"  // absl::Mutex visible to TSan (server/common/annotated_mutex.h)
#include "weights/weight_set.h"

namespace fusedlayer::server {

class WeightStore {
 public:
  // NotFound naming the set and listing the loaded names when `name` is not loaded.
  absl::StatusOr<std::shared_ptr<const WeightSet>> Get(std::string_view name) const;

  // Makes `set` visible under set->name in one step. AlreadyExists if the name is loaded and
  // `replace` is false (the store is unchanged). Returns the set it replaced, or null.
  absl::StatusOr<std::shared_ptr<const WeightSet>> Publish(std::shared_ptr<const WeightSet> set, bool replace);

  // Makes every set of `sets` visible in one step, each replacing its name only where its `replace`
  // is true: all or nothing. AlreadyExists naming the first set whose name is loaded without
  // `replace`, and InvalidArgument for a null set or a name twice in the group; the store is then
  // unchanged. Returns the sets it replaced (so that the caller decides where they are freed).
  struct Staged {
    std::shared_ptr<const WeightSet> set;
    bool replace = false;
  };
  absl::StatusOr<std::vector<std::shared_ptr<const WeightSet>>> PublishGroup(std::vector<Staged> sets);

  // Removes `name`; returns its resident_bytes (freed once no request holds it any more).
  // NotFound as for Get.
  absl::StatusOr<uint64_t> Unload(std::string_view name);

  // All loaded sets, sorted by name.
  std::vector<std::shared_ptr<const WeightSet>> List() const;

  // Sum of resident_bytes over the loaded sets (sets replaced or unloaded but still held by a
  // request are not counted).
  uint64_t resident_bytes() const;
  size_t size() const;

 private:
  absl::Status NotFound(std::string_view name) const ABSL_SHARED_LOCKS_REQUIRED(mu_);

  mutable Mutex mu_;
  std::map<std::string, std::shared_ptr<const WeightSet>, std::less<>> sets_ ABSL_GUARDED_BY(mu_);
  uint64_t resident_bytes_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace fusedlayer::server
