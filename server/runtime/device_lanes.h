// The device's lanes (backend.h, Lane) and the pinned staging pool they share: what each executor
// worker runs its compute tasks on. One worker per lane (--device_lanes); a host-accessible
// backend (CPU) has no lanes and one worker that hands the kernels host views (zero copy), its
// parallelism being inside the backend (its thread pool).
#pragma once

#include <cstddef>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "runtime/host_staging_pool.h"
#include "runtime/op_calls.h"
#include "fusedlayer/backend.h"

namespace fusedlayer::server {

// The lanes a GPU gets when --device_lanes is 0 (auto), and the most that may be asked for.
inline constexpr int kDefaultDeviceLanes = 4;
inline constexpr int kMaxDeviceLanes = 16;

class DeviceLanes {
 public:
  // `requested`: 0 = kDefaultDeviceLanes (bounded by backend.max_lanes()); a backend without lanes
  // gets none whatever is asked. `staging_bytes`: the pinned pool's bound (--host_staging_bytes).
  // Unavailable when a lane cannot be created.
  // `copy_threads`: helper threads for the staging copies (--host_copy_threads; -1 = auto,
  // ParallelCopy::AutoHelperThreads). `request_staging_bytes`: the bound of the pinned pool that
  // compute requests are read into (--request_staging_bytes; 0 = none, rpc/wire_messages.h).
  // `shared_staging`: another device's pool to stage in instead of one of its own (a server's
  // devices share one pool, page-locked for all of them: --host_staging_bytes bounds the process).
  static absl::StatusOr<std::unique_ptr<DeviceLanes>> Create(Backend& backend, int requested, size_t staging_bytes,
                                                             prometheus::Registry* registry = nullptr,
                                                             int copy_threads = 0, size_t request_staging_bytes = 0,
                                                             HostStagingPool* shared_staging = nullptr);

  // Executor workers to run: the lanes, or 1 without lanes.
  int workers() const { return lanes_.empty() ? 1 : static_cast<int>(lanes_.size()); }
  int lanes() const { return static_cast<int>(lanes_.size()); }
  // Where the executor's worker `worker_index` runs compute (Executor::worker_index()): its lane,
  // or the backend itself without lanes (or off the workers, index -1).
  ExecTarget For(int worker_index) const;
  HostStagingPool* staging() const { return staging_view_; }
  // Where compute requests' tensor data is read to (ReadWireRequest), or null (no lanes, or off).
  // A pool apart from staging(): a request holds its block from receipt to response, and lanes
  // that wait for staging must never wait for blocks that queued requests hold.
  HostStagingPool* request_staging() const { return request_staging_.get(); }

 private:
  DeviceLanes(Backend& backend) : backend_(backend) {}
  Backend& backend_;
  std::unique_ptr<HostStagingPool> staging_;  // its own pool (null when it shares another's)
  HostStagingPool* staging_view_ = nullptr;   // the pool it stages in
  std::unique_ptr<HostStagingPool> request_staging_;
  std::vector<std::unique_ptr<Lane>> lanes_;
};

}  // namespace fusedlayer::server
