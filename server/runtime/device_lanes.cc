#include "runtime/device_lanes.h"

#include <algorithm>
#include <thread>

#include "absl/strings/str_cat.h"

namespace fusedlayer::server {

absl::StatusOr<std::unique_ptr<DeviceLanes>> DeviceLanes::Create(Backend& backend, int requested,
                                                                 size_t staging_bytes,
                                                                 prometheus::Registry* registry, int copy_threads,
                                                                 size_t request_staging_bytes,
                                                                 HostStagingPool* shared_staging) {
  std::unique_ptr<DeviceLanes> lanes(new DeviceLanes(backend));
  const int max = backend.max_lanes();
  if (max <= 0) return lanes;  // host-accessible: no lanes, no staging
  const int count = std::clamp(requested == 0 ? kDefaultDeviceLanes : requested, 1, std::min(max, kMaxDeviceLanes));
  const int helpers =
      copy_threads < 0 ? ParallelCopy::AutoHelperThreads(std::thread::hardware_concurrency()) : copy_threads;
  if (shared_staging != nullptr) {
    lanes->staging_view_ = shared_staging;
  } else {
    lanes->staging_ = std::make_unique<HostStagingPool>(backend, staging_bytes, registry, helpers);
    lanes->staging_view_ = lanes->staging_.get();
  }
  if (request_staging_bytes > 0) {
    lanes->request_staging_ = std::make_unique<HostStagingPool>(
        backend, request_staging_bytes, registry, /*copy_threads=*/0,
        StagingPoolNames{"fusedlayer_request_staging",
                               "Page-locked host memory that compute requests' tensor data is read into",
                               "--request_staging_bytes"});
  }
  for (int i = 0; i < count; ++i) {
    absl::StatusOr<std::unique_ptr<Lane>> lane = backend.CreateLane();
    if (!lane.ok()) {
      return absl::UnavailableError(absl::StrCat("device lane ", i, " of ", count, ": ", lane.status().message()));
    }
    lanes->lanes_.push_back(std::move(*lane));
  }
  return lanes;
}

ExecTarget DeviceLanes::For(int worker_index) const {
  if (worker_index < 0 || worker_index >= static_cast<int>(lanes_.size())) return ExecTarget{backend_};
  return ExecTarget{backend_, lanes_[static_cast<size_t>(worker_index)].get(), staging_view_};
}

}  // namespace fusedlayer::server
