// The regions of one shared-memory registry, system (transport/shared_memory.h) or CUDA
// (transport/cuda_shared_memory.h): what both do alike, written once. Regions are keyed by
// (identity, region name), so names live in a per-identity namespace and another identity's region
// is NOT_FOUND exactly as a name never registered. The table counts each identity's regions against
// its limit and its charged bytes, keeps the two gauges (regions, registered bytes) and the expiry
// counter, answers the Status and Unregister RPCs, finds a request's region (its last use, the
// reaper's clock) and expires unused ones. What differs stays with each registry: how a region is
// opened, what an identity is charged for it (a region's bytes, or a CUDA allocation once per
// handle) and the limit on that, and who else may hold the same object.
//
// Not thread-safe: the registry holds its mutex around every call.
#pragma once

#include <chrono>
#include <cstdint>
#include <iterator>
#include <map>
#include <memory>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "prometheus/counter.h"
#include "prometheus/gauge.h"

namespace fusedlayer::server::transport {

// A region name: 1 to 128 characters of [A-Za-z0-9._-] (INVALID_ARGUMENT otherwise). System and
// CUDA shared memory alike (transport/shared_memory.cc).
absl::Status CheckRegionName(const std::string& name);

// What a table says in its messages and counts against.
struct RegionTableSpec {
  const char* kind;              // "shared-memory", "CUDA shared-memory"
  const char* max_regions_flag;  // the per-identity count's flag, e.g. "--shared_memory_max_regions"
  const char* idle_flag;         // the expiry's flag, e.g. "--shared_memory_idle_seconds"
  int64_t max_regions = 0;       // per identity
  double idle_seconds = 0;       // 0: regions never expire
};

// The series a table keeps current (metrics/component_metrics.h).
struct RegionTableMetrics {
  prometheus::Gauge* regions;           // all identities
  prometheus::Gauge* registered_bytes;  // the regions' bytes, all identities
  prometheus::Counter* expired;         // unregistered by ExpireIdle
};

template <typename Region>
class RegionTable {
 public:
  // A registered region and when it was registered or last found for a request (ExpireIdle's clock).
  struct Entry {
    std::shared_ptr<Region> region;
    std::chrono::steady_clock::time_point last_used;
  };
  using Key = std::pair<std::string, std::string>;  // (identity, region name)
  using Map = std::map<Key, Entry>;
  using iterator = typename Map::iterator;
  // What one identity holds: its regions and the bytes the registry charged it for them.
  struct Usage {
    int64_t regions = 0;
    uint64_t bytes = 0;
  };

  RegionTable(RegionTableSpec spec, RegionTableMetrics metrics) : spec_(spec), metrics_(metrics) {}

  const RegionTableSpec& spec() const { return spec_; }
  int64_t regions() const { return static_cast<int64_t>(regions_.size()); }
  Usage usage(const std::string& identity) const {
    auto it = usage_.find(identity);
    return it != usage_.end() ? it->second : Usage{};
  }

  // ALREADY_EXISTS when `identity` has a region named `name`.
  absl::Status CheckNameFree(const std::string& identity, const std::string& name) const {
    if (regions_.count({identity, name}) == 0) return absl::OkStatus();
    return absl::AlreadyExistsError(
        absl::StrCat("a ", spec_.kind, " region named '", name, "' is already registered; unregister it first"));
  }
  // RESOURCE_EXHAUSTED when `identity` holds its most regions. (Its bytes are the registry's to limit.)
  absl::Status CheckRoomForOneMore(const std::string& identity) const {
    const Usage have = usage(identity);
    if (have.regions + 1 <= spec_.max_regions) return absl::OkStatus();
    return absl::ResourceExhaustedError(absl::StrCat("this identity already has ", have.regions, " ", spec_.kind,
                                                     " regions, the most allowed (", spec_.max_regions_flag,
                                                     "); unregister some first"));
  }

  // Registers `region` (both checks above passed under the same lock), charging `identity` `charge` bytes.
  void Add(const std::string& identity, const std::string& name, std::shared_ptr<Region> region, uint64_t charge) {
    Usage& u = usage_[identity];
    u.regions += 1;
    u.bytes += charge;
    total_bytes_ += region->byte_size();
    regions_.emplace(Key{identity, name}, Entry{std::move(region), std::chrono::steady_clock::now()});
    UpdateGauges();
  }

  // Unregisters the region at `it`, giving its identity back `uncharge` bytes. A request still
  // holding the region keeps it (its shared_ptr) until it is done.
  void Erase(iterator it, uint64_t uncharge) {
    Usage& u = usage_[it->first.first];
    u.regions -= 1;
    u.bytes -= uncharge;
    if (u.regions == 0) usage_.erase(it->first.first);
    total_bytes_ -= it->second.region->byte_size();
    regions_.erase(it);
    UpdateGauges();
  }

  // The region `name` of `identity` for a request's tensor `tensor` (its last use is now):
  // NOT_FOUND, saying when regions expire, for a name the identity has not registered.
  absl::StatusOr<iterator> FindForRequest(const std::string& identity, const std::string& name, const char* tensor) {
    auto it = regions_.find({identity, name});
    if (it == regions_.end()) {
      std::string expiry;
      if (spec_.idle_seconds > 0) {
        expiry = absl::StrCat("; regions no request used for ", spec_.idle_seconds, " s are unregistered (",
                              spec_.idle_flag, ")");
      }
      return absl::NotFoundError(absl::StrCat("tensor '", tensor, "': no ", spec_.kind, " region named '", name,
                                              "' is registered (by this identity)", expiry));
    }
    it->second.last_used = std::chrono::steady_clock::now();
    return it;
  }

  // `visit(it)` for every region of `identity`; `visit` may erase the region it is given.
  template <typename Visit>
  void ForEachOf(const std::string& identity, Visit visit) {
    for (auto it = regions_.lower_bound({identity, ""}); it != regions_.end() && it->first.first == identity;) {
      visit(it++);
    }
  }

  // The Status RPC: `describe(region, out.add_regions())` for `name` (NOT_FOUND when `identity` has
  // no such region) or, with an empty name, for every region of `identity`.
  template <typename Response, typename Describe>
  absl::StatusOr<Response> List(const std::string& identity, const std::string& name, Describe describe) const {
    Response out;
    for (auto it = regions_.lower_bound({identity, ""}); it != regions_.end() && it->first.first == identity; ++it) {
      if (name.empty() || it->first.second == name) describe(*it->second.region, out.add_regions());
    }
    if (!name.empty() && out.regions_size() == 0) return NotRegistered(name);
    return out;
  }

  // The Unregister RPC: `erase(it)` (which calls Erase) for `name` (NOT_FOUND when `identity` has no
  // such region) or, with an empty name, for every region of `identity`; the response counts them
  // and their bytes.
  template <typename Response, typename EraseRegion>
  absl::StatusOr<Response> Unregister(const std::string& identity, const std::string& name, EraseRegion erase) {
    Response out;
    auto take = [&](iterator it) {
      out.set_unregistered(out.unregistered() + 1);
      out.set_freed_bytes(out.freed_bytes() + it->second.region->byte_size());
      erase(it);
    };
    if (name.empty()) {
      ForEachOf(identity, take);
      return out;
    }
    if (absl::Status s = CheckRegionName(name); !s.ok()) return s;
    auto it = regions_.find({identity, name});
    if (it == regions_.end()) return NotRegistered(name);
    take(it);
    return out;
  }

  // The reaper's step: `expire(it)` (which logs and calls Erase) for every region, all identities,
  // last used (registration or the last request's lookup) at least idle_seconds before `now`.
  template <typename Expire>
  void ExpireIdle(std::chrono::steady_clock::time_point now, Expire expire) {
    if (!(spec_.idle_seconds > 0)) return;
    const auto idle = std::chrono::duration<double>(spec_.idle_seconds);
    for (auto it = regions_.begin(); it != regions_.end();) {
      auto next = std::next(it);
      if (now - it->second.last_used >= idle) {
        metrics_.expired->Increment();
        expire(it);
      }
      it = next;
    }
  }

 private:
  absl::Status NotRegistered(const std::string& name) const {
    return absl::NotFoundError(absl::StrCat("no ", spec_.kind, " region named '", name, "' is registered"));
  }
  void UpdateGauges() {
    metrics_.regions->Set(static_cast<double>(regions_.size()));
    metrics_.registered_bytes->Set(static_cast<double>(total_bytes_));
  }

  const RegionTableSpec spec_;
  const RegionTableMetrics metrics_;
  Map regions_;
  std::map<std::string, Usage> usage_;
  uint64_t total_bytes_ = 0;
};

}  // namespace fusedlayer::server::transport
