// Ends streams that stopped sending: one thread, shared by all LoadWeights streams, looks at each
// registered stream's last activity a few times per timeout and calls its `expire` once when it has
// been idle for longer than the timeout. A stream that sent a header and stalls would otherwise
// keep its upload slot (--max_concurrent_uploads) and its buffered bytes until its own deadline,
// which the client chooses and may make infinite.
//
// Locking: `expire` runs on the watch thread with the watch's mutex held, and Remove takes that
// mutex, so once Remove returns `expire` is not running and will not run: the owner may then be
// destroyed. `expire` must therefore never call Add or Remove, and an owner must not call them
// while holding a lock that its `expire` takes.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>
#include <unordered_set>

namespace fusedlayer::server {

class IdleWatch {
 public:
  using Clock = std::chrono::steady_clock;

  class Entry {
   public:
    explicit Entry(std::function<void()> expire) : expire_(std::move(expire)) { Touch(); }
    // Activity: the idle time starts again from now. Any thread, lock-free.
    void Touch() { last_ns_.store(Clock::now().time_since_epoch().count(), std::memory_order_release); }
    // No more expiry for this entry (e.g. the stream ended and its work is queued). Any thread.
    void Disarm() { armed_.store(false, std::memory_order_release); }

   private:
    friend class IdleWatch;
    std::function<void()> expire_;
    std::atomic<Clock::rep> last_ns_{0};
    std::atomic<bool> armed_{true};
  };

  explicit IdleWatch(std::chrono::milliseconds timeout);
  ~IdleWatch();
  IdleWatch(const IdleWatch&) = delete;
  IdleWatch& operator=(const IdleWatch&) = delete;

  void Add(Entry* entry);
  // After it returns, entry's expire is not running and never will.
  void Remove(Entry* entry);

 private:
  void Loop();

  const std::chrono::milliseconds timeout_;
  std::mutex mu_;
  std::condition_variable wake_;
  bool stop_ = false;
  std::unordered_set<Entry*> entries_;
  std::thread thread_;
};

}  // namespace fusedlayer::server
