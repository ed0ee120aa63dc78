#include "exec/parallel_copy.h"

#include <algorithm>
#include <cstring>

namespace fusedlayer::server {

struct ParallelCopy::Call {
  int pending = 0;  // shares handed to the queue and not finished (mu_)
};

ParallelCopy::ParallelCopy(int helper_threads) {
  for (int i = 0; i < helper_threads; ++i) threads_.emplace_back([this] { Work(); });
}

ParallelCopy::~ParallelCopy() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  work_.notify_all();
  for (std::thread& t : threads_) t.join();
}

int ParallelCopy::AutoHelperThreads(unsigned cores) { return cores < 4 ? 0 : static_cast<int>(std::min(3u, cores / 4)); }

size_t ParallelCopy::helper_shares() const {
  std::lock_guard<std::mutex> lock(mu_);
  return helper_shares_;
}

void ParallelCopy::Run(const Share& s) { std::memcpy(s.dst, s.src, s.n); }

void ParallelCopy::Work() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    work_.wait(lock, [this] { return stop_ || !queue_.empty(); });
    if (queue_.empty()) return;  // stop_ and nothing left
    const Share s = queue_.front();
    queue_.pop_front();
    lock.unlock();
    Run(s);
    lock.lock();
    ++helper_shares_;
    --s.call->pending;
    done_.notify_all();
  }
}

void ParallelCopy::Copy(void* dst, const void* src, size_t n) {
  const size_t parts = threads_.size() + 1;
  if (threads_.empty() || n < kMinSplitBytes) {
    std::memcpy(dst, src, n);
    return;
  }
  // Shares on 4 KiB boundaries (whole pages and cache lines); the caller's is the first.
  constexpr size_t kAlign = 4096;
  const size_t share = (n / parts + kAlign - 1) / kAlign * kAlign;
  char* const d = static_cast<char*>(dst);
  const char* const s = static_cast<const char*>(src);
  Call call;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (size_t off = share; off < n; off += share) {
      queue_.push_back(Share{d + off, s + off, std::min(share, n - off), &call});
      ++call.pending;
    }
  }
  work_.notify_all();
  Run(Share{d, s, std::min(share, n), &call});
  std::unique_lock<std::mutex> lock(mu_);
  // Shares of this call that no helper has taken yet: copy them here rather than wait.
  for (auto it = queue_.begin(); it != queue_.end();) {
    if (it->call != &call) {
      ++it;
      continue;
    }
    const Share mine = *it;
    it = queue_.erase(it);
    lock.unlock();
    Run(mine);
    lock.lock();
    --call.pending;
    it = queue_.begin();  // the queue may have changed while unlocked
  }
  done_.wait(lock, [&call] { return call.pending == 0; });
}

}  // namespace fusedlayer::server
