#include "runtime/serving_devices.h"

#include <future>
#include <utility>

#include "absl/strings/str_cat.h"

namespace fusedlayer::server {

ServingDevices::~ServingDevices() {
  while (!devices_.empty()) devices_.pop_back();
}

ServingDevice& ServingDevices::Add(std::unique_ptr<ServingDevice> device) {
  device->ordinal = static_cast<int>(devices_.size());
  devices_.push_back(std::move(device));
  return *devices_.back();
}

ServingDevice* ServingDevices::FindById(int device_id) const {
  for (const auto& d : devices_) {
    if (d->device_id == device_id) return d.get();
  }
  return nullptr;
}

absl::StatusOr<ServingDevice*> ServingDevices::Named(int device_id) const {
  if (ServingDevice* d = FindById(device_id); d != nullptr) return d;
  return absl::InvalidArgumentError(
      absl::StrCat("device_id ", device_id, " is not a device this server serves on (", Describe(), ")"));
}

ServingDevice& ServingDevices::LeastLoaded() {
  const size_t n = devices_.size();
  if (n == 1) return *devices_.front();
  // Loads are read without a lock: two calls that race may pick the same device, which the next
  // call's pick corrects; a lock here would serialise every call's admission.
  const size_t start = static_cast<size_t>(next_.fetch_add(1, std::memory_order_relaxed) % n);
  ServingDevice* best = devices_[start].get();
  int64_t best_load = best->calls_in_flight.load(std::memory_order_relaxed);
  for (size_t i = 1; i < n && best_load > 0; ++i) {
    ServingDevice* d = devices_[(start + i) % n].get();
    const int64_t load = d->calls_in_flight.load(std::memory_order_relaxed);
    if (load < best_load) {
      best = d;
      best_load = load;
    }
  }
  return *best;
}

std::string ServingDevices::Describe() const {
  std::string out = devices_.empty() ? "none" : "";
  for (const auto& d : devices_) {
    absl::StrAppend(&out, out.empty() ? "" : ", ", d->label, " (id ", d->device_id, ")");
  }
  return out;
}

absl::Status ServingDevices::RunOnDevice(ServingDevice& device, absl::AnyInvocable<absl::Status() &&> work) {
  if (device.executor->OnWorker()) return std::move(work)();
  std::promise<absl::Status> done;
  std::future<absl::Status> result = done.get_future();
  absl::Status queued = device.executor->SubmitControl(
      [&done, work = std::move(work)](double) mutable { done.set_value(std::move(work)()); });
  if (!queued.ok()) {
    return absl::UnavailableError(absl::StrCat(device.label, ": ", queued.message()));
  }
  return result.get();
}

void ServingDevices::StopExecutors() {
  for (const auto& d : devices_) {
    if (d->executor) d->executor->Stop();
  }
}

}  // namespace fusedlayer::server
