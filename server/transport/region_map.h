// What the system and CUDA shared-memory registries (transport/shared_memory.h,
// transport/cuda_shared_memory.h) do alike with their regions: a map keyed by (identity, region
// name), listed, unregistered by name or all of an identity at once, and expired when unused. The
// caller holds the registry's mutex.
#pragma once

#include <chrono>
#include <iterator>
#include <map>
#include <memory>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

namespace fusedlayer::server::transport {

absl::Status CheckRegionName(const std::string& name);  // transport/shared_memory.cc

using RegionKey = std::pair<std::string, std::string>;  // (identity, region name)

// A registered region and when it was registered or last looked up by a request (the reaper's
// clock: ExpireIdleRegions).
template <typename Region>
struct RegionEntry {
  std::shared_ptr<Region> region;
  std::chrono::steady_clock::time_point last_used;
};

template <typename Region>
using RegionMap = std::map<RegionKey, RegionEntry<Region>>;

// The Status RPC: `describe(region, out.add_regions())` for `name` (NOT_FOUND when `identity` has no
// such region) or, with an empty name, for every region of `identity`. `kind` names the regions in
// messages ("shared-memory", "CUDA shared-memory").
template <typename Response, typename Map, typename Describe>
absl::StatusOr<Response> ListRegions(const Map& regions, const std::string& identity, const std::string& name,
                                     const char* kind, Describe describe) {
  Response out;
  for (auto it = regions.lower_bound({identity, ""}); it != regions.end() && it->first.first == identity; ++it) {
    if (name.empty() || it->first.second == name) describe(*it->second.region, out.add_regions());
  }
  if (!name.empty() && out.regions_size() == 0) {
    return absl::NotFoundError(absl::StrCat("no ", kind, " region named '", name, "' is registered"));
  }
  return out;
}

// The Unregister RPC: `erase(it)` for `name` (NOT_FOUND when `identity` has no such region) or, with
// an empty name, for every region of `identity`; the response counts them and their bytes.
template <typename Response, typename Map, typename Erase>
absl::StatusOr<Response> UnregisterRegions(Map& regions, const std::string& identity, const std::string& name,
                                           const char* kind, Erase erase) {
  Response out;
  auto take = [&](typename Map::iterator it) {
    out.set_unregistered(out.unregistered() + 1);
    out.set_freed_bytes(out.freed_bytes() + it->second.region->byte_size());
    erase(it);
  };
  if (name.empty()) {
    for (auto it = regions.lower_bound({identity, ""}); it != regions.end() && it->first.first == identity;) {
      take(it++);
    }
    return out;
  }
  if (absl::Status s = CheckRegionName(name); !s.ok()) return s;
  auto it = regions.find({identity, name});
  if (it == regions.end()) {
    return absl::NotFoundError(absl::StrCat("no ", kind, " region named '", name, "' is registered"));
  }
  take(it);
  return out;
}

// The reaper's step (--shared_memory_idle_seconds, --cuda_shared_memory_idle_seconds):
// `expire(it)` for every region, all identities, last used (registration or the last request's
// lookup) at least `idle_seconds` before `now`; `expire` erases it.
template <typename Map, typename Expire>
void ExpireIdleRegions(Map& regions, std::chrono::steady_clock::time_point now, double idle_seconds, Expire expire) {
  const auto idle = std::chrono::duration<double>(idle_seconds);
  for (auto it = regions.begin(); it != regions.end();) {
    auto next = std::next(it);
    if (now - it->second.last_used >= idle) expire(it);
    it = next;
  }
}

// What a NOT_FOUND for a region adds when regions expire unused: "" when they never do.
inline std::string ExpiryNote(double idle_seconds, const char* flag) {
  if (!(idle_seconds > 0)) return "";
  return absl::StrCat("; regions no request used for ", idle_seconds, " s are unregistered (", flag, ")");
}

}  // namespace fusedlayer::server::transport
