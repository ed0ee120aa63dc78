#include "common/periodic_task.h"

#include <utility>

namespace fusedlayer::server {

PeriodicTask::PeriodicTask(std::chrono::duration<double> period, std::function<void()> run)
    : period_(period), run_(std::move(run)) {
  if (period_.count() > 0) thread_ = std::thread([this] { Loop(); });
}

PeriodicTask::~PeriodicTask() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void PeriodicTask::Loop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!cv_.wait_for(lock, period_, [this] { return stopping_; })) {
    lock.unlock();
    run_();
    lock.lock();
  }
}

}  // namespace fusedlayer::server
