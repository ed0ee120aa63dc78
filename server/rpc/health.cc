#include "rpc/health.h"

namespace fusedlayer::server {

const char* HealthServiceName(Op op) { return op == Op::kMhc ? kHealthMhc : kHealthSwa; }

void Health::Attach(grpc::HealthCheckServiceInterface* service) {
  std::lock_guard<std::mutex> lock(mu_);
  service_ = service;
  PublishLocked();
}

void Health::SetOpServing(Op op, bool serving) {
  std::lock_guard<std::mutex> lock(mu_);
  op_serving_[static_cast<int>(op)] = serving;
  PublishLocked();
}

void Health::SetDeviceServing(const std::string& label, bool serving) {
  std::lock_guard<std::mutex> lock(mu_);
  const std::string name = std::string(kHealthDevicePrefix) + label;
  bool found = false;
  for (auto& [n, s] : devices_) {
    if (n == name) s = serving, found = true;
  }
  if (!found) devices_.emplace_back(name, serving);
  PublishLocked();
}

void Health::Shutdown() {
  std::lock_guard<std::mutex> lock(mu_);
  shut_down_ = true;
  // The default service's Shutdown() sets every name NOT_SERVING and ignores later updates.
  if (service_ != nullptr) service_->Shutdown();
}

void Health::PublishLocked() {
  if (service_ == nullptr || shut_down_) return;
  service_->SetServingStatus(kHealthOverall, true);
  service_->SetServingStatus(kHealthApi, true);
  for (Op op : kAllOps) service_->SetServingStatus(HealthServiceName(op), op_serving_[static_cast<int>(op)]);
  for (const auto& [name, serving] : devices_) service_->SetServingStatus(name, serving);
}

}  // namespace fusedlayer::server
