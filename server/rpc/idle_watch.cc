#include "rpc/idle_watch.h"

#include <algorithm>

namespace fusedlayer::server {

IdleWatch::IdleWatch(std::chrono::milliseconds timeout) : timeout_(timeout), thread_([this] { Loop(); }) {}

IdleWatch::~IdleWatch() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  wake_.notify_all();
  thread_.join();
}

void IdleWatch::Add(Entry* entry) {
  std::lock_guard<std::mutex> lock(mu_);
  entries_.insert(entry);
}

void IdleWatch::Remove(Entry* entry) {
  std::lock_guard<std::mutex> lock(mu_);
  entries_.erase(entry);
}

void IdleWatch::Loop() {
  // Looks four times per timeout (at most once a second, at least every 10 ms): a stream is
  // ended between 1 and 1.25 timeouts after its last chunk.
  const auto period = std::clamp(timeout_ / 4, std::chrono::milliseconds(10), std::chrono::milliseconds(1000));
  std::unique_lock<std::mutex> lock(mu_);
  while (!wake_.wait_for(lock, period, [this] { return stop_; })) {
    const Clock::rep now = Clock::now().time_since_epoch().count();
    const Clock::rep limit = std::chrono::duration_cast<Clock::duration>(timeout_).count();
    for (Entry* e : entries_) {
      if (!e->armed_.load(std::memory_order_acquire)) continue;
      if (now - e->last_ns_.load(std::memory_order_acquire) <= limit) continue;
      e->armed_.store(false, std::memory_order_release);  // once
      e->expire_();
    }
  }
}

}  // namespace fusedlayer::server
