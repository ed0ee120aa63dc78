#include "exec/executor.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace fusedlayer::server {

Executor::Executor(size_t capacity) : capacity_(capacity) {
  worker_ = std::thread([this] { Loop(); });
  worker_id_ = worker_.get_id();
}

Executor::~Executor() { Stop(); }

absl::Status Executor::Submit(Task task) { return Enqueue(std::move(task), /*bounded=*/true); }
absl::Status Executor::SubmitControl(Task task) { return Enqueue(std::move(task), /*bounded=*/false); }

absl::Status Executor::SubmitBackground(Task task) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return absl::UnavailableError("the server is shutting down");
    background_.push_back(Item{std::move(task), std::chrono::steady_clock::now(), false});
  }
  cv_.notify_one();
  return absl::OkStatus();
}

void Executor::PauseBackgroundForTest(bool paused) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    background_paused_ = paused;
  }
  cv_.notify_all();
}

uint64_t Executor::background_started() const {
  std::lock_guard<std::mutex> lock(mu_);
  return background_started_;
}

size_t Executor::background_queued() const {
  std::lock_guard<std::mutex> lock(mu_);
  return background_.size();
}

absl::Status Executor::Enqueue(Task task, bool bounded) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return absl::UnavailableError("the server is shutting down");
    if (bounded && bounded_queued_ >= capacity_) {
      return absl::ResourceExhaustedError(
          absl::StrCat("device queue full (", capacity_, " requests waiting; --queue_capacity); retry later"));
    }
    queue_.push_back(Item{std::move(task), std::chrono::steady_clock::now(), bounded});
    if (bounded) ++bounded_queued_;
  }
  cv_.notify_one();
  return absl::OkStatus();
}

size_t Executor::queued() const {
  std::lock_guard<std::mutex> lock(mu_);
  return queue_.size();
}

void Executor::Loop() {
  for (;;) {
    Item item;
    {
      std::unique_lock<std::mutex> lock(mu_);
      const auto background_ready = [this] { return !stopping_ && !background_paused_ && !background_.empty(); };
      cv_.wait(lock, [&] { return stopping_ || !queue_.empty() || background_ready(); });
      if (!queue_.empty()) {
        item = std::move(queue_.front());
        queue_.pop_front();
        if (item.bounded) --bounded_queued_;
      } else if (background_ready()) {
        // Only from an empty main queue: serving work never waits behind background work.
        ++background_started_;
        item = std::move(background_.front());
        background_.pop_front();
      } else {
        return;  // stopping and drained (background tasks are dropped by Stop)
      }
    }
    const double waited =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - item.enqueued).count();
    std::move(item.task)(waited);
  }
}

void Executor::Stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_ && !worker_.joinable()) return;
    stopping_ = true;
  }
  cv_.notify_all();
  if (worker_.joinable() && !OnWorker()) worker_.join();
  std::deque<Item> dropped;
  {
    std::lock_guard<std::mutex> lock(mu_);
    dropped.swap(background_);
  }
  // Destroyed outside the lock: a task's destructor may release resources of its producer.
}

}  // namespace fusedlayer::server
