// The devices one server serves on (--devices): each has its own backend, lanes and executor, so a
// node's GPUs are served by one process with one address and one set of metrics. Every loaded
// weight set is prepared on every serving device (exec/weight_manager.h); a compute call runs on
// one of them (exec/compute_engine.h: the device of its CUDA shared-memory tensors or of its
// residual session, the one it names, else the least-loaded).
//
// A device that fails its start-up check (its backend or its lanes cannot be created) is logged
// and kept in left_out() for GetServerInfo; the server serves on the others.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "fusedlayer/backend.h"
#include "runtime/device_lanes.h"
#include "runtime/executor.h"

namespace fusedlayer::server {

// A device's label: the metrics' `device` value and the health name's suffix ("cuda:1", "cpu:0").
inline std::string DeviceLabel(std::string_view backend_kind, int device_id) {
  return std::string(backend_kind) + ":" + std::to_string(device_id);
}
// The id a lone backend serves as: its GPU's index, or 0 (the CPU).
inline int DeviceIdOf(const Backend& backend) { return backend.device_index() >= 0 ? backend.device_index() : 0; }

struct ServingDevice {
  // Position among the serving devices: the index of the device's prepared weights in a weight set
  // (WeightSet::devices) and of its metric series.
  int ordinal = 0;
  // What clients name it by: the GPU's index in this process, or the CPU device's number.
  int device_id = 0;
  std::string label;  // the metrics' `device` label: "cuda:1", "cpu:0"
  // The backend's kind and device name, read once (every call's report carries them).
  std::string kind, name;
  // Declared in the order they are built; destroyed in reverse: the executor's workers stop before
  // the lanes they run on go, the lanes before their backend.
  std::unique_ptr<Backend> backend;
  std::unique_ptr<DeviceLanes> lanes;
  std::unique_ptr<Executor> executor;
  // Compute calls admitted to this device and not yet answered (least-loaded routing, GetServerInfo).
  std::atomic<int64_t> calls_in_flight{0};
};

// A device named in --devices that does not serve, and why.
struct LeftOutDevice {
  int device_id = 0;
  std::string label;
  std::string error;
};

class ServingDevices {
 public:
  ServingDevices() = default;
  // The last device first: the others stage in the primary's pinned pool (DeviceLanes).
  ~ServingDevices();
  ServingDevices(const ServingDevices&) = delete;
  ServingDevices& operator=(const ServingDevices&) = delete;

  // Appends a serving device; its ordinal is its position.
  ServingDevice& Add(std::unique_ptr<ServingDevice> device);
  void AddLeftOut(LeftOutDevice device) { left_out_.push_back(std::move(device)); }

  size_t size() const { return devices_.size(); }
  bool empty() const { return devices_.empty(); }
  ServingDevice& operator[](size_t ordinal) const { return *devices_[ordinal]; }
  // The first serving device: where weight sets are built and the weight manager's work runs.
  ServingDevice& primary() const { return *devices_.front(); }
  const std::vector<LeftOutDevice>& left_out() const { return left_out_; }

  // The serving device with this id, or null.
  ServingDevice* FindById(int device_id) const;
  // INVALID_ARGUMENT naming the serving devices when `device_id` is not one of them.
  absl::StatusOr<ServingDevice*> Named(int device_id) const;
  // The device with the fewest compute calls in flight; ties go round-robin, so equal load spreads.
  ServingDevice& LeastLoaded();
  // "cuda:0 (id 0), cuda:1 (id 1)": for messages.
  std::string Describe() const;

  // Runs `work` where `device`'s backend may be driven outside its lanes (backend.h: one thread at
  // a time): as a control task on its executor, waiting for it; directly when the caller already is
  // one of that executor's workers. UNAVAILABLE when the executor has stopped.
  static absl::Status RunOnDevice(ServingDevice& device, absl::AnyInvocable<absl::Status() &&> work);

  // Stops every executor (each runs its queued compute and control tasks first). Idempotent.
  void StopExecutors();

 private:
  std::vector<std::unique_ptr<ServingDevice>> devices_;
  std::vector<LeftOutDevice> left_out_;
  std::atomic<uint64_t> next_{0};  // round-robin start of LeastLoaded's scan
};

}  // namespace fusedlayer::server
