// A budget of bytes shared by concurrent work (compute calls in flight, weight uploads): a caller
// takes a Lease on the bytes it will hold before allocating them, and the lease gives them back
// when it is destroyed. TryAcquire never blocks and never over-commits: admission is a compare-
// and-swap on one counter, so the total of live leases never exceeds the limit.
#pragma once

#include <atomic>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>

#include "prometheus/gauge.h"

namespace fusedlayer::server {

class ByteBudget {
 public:
  class Lease {
   public:
    Lease() = default;
    Lease(Lease&& other) noexcept : budget_(std::exchange(other.budget_, nullptr)), bytes_(other.bytes_) {}
    Lease& operator=(Lease&& other) noexcept {
      if (this != &other) {
        Release();
        budget_ = std::exchange(other.budget_, nullptr);
        bytes_ = other.bytes_;
      }
      return *this;
    }
    Lease(const Lease&) = delete;
    Lease& operator=(const Lease&) = delete;
    ~Lease() { Release(); }

    uint64_t bytes() const { return budget_ != nullptr ? bytes_ : 0; }
    // Gives the bytes back now (idempotent).
    void Release() {
      if (budget_ != nullptr) std::exchange(budget_, nullptr)->Give(bytes_);
    }

   private:
    friend class ByteBudget;
    Lease(ByteBudget* budget, uint64_t bytes) : budget_(budget), bytes_(bytes) {}
    ByteBudget* budget_ = nullptr;
    uint64_t bytes_ = 0;
  };

  // `in_use_gauge` (optional, may be null) mirrors the bytes currently leased, for /metrics.
  explicit ByteBudget(uint64_t limit, prometheus::Gauge* in_use_gauge = nullptr)
      : limit_(limit), gauge_(in_use_gauge) {}

  // A lease on `bytes`, or nullopt when the live leases plus `bytes` would exceed the limit.
  std::optional<Lease> TryAcquire(uint64_t bytes) {
    uint64_t used = used_.load(std::memory_order_relaxed);
    do {
      if (bytes > limit_ || used > limit_ - bytes) return std::nullopt;
    } while (!used_.compare_exchange_weak(used, used + bytes, std::memory_order_acq_rel, std::memory_order_relaxed));
    if (gauge_ != nullptr) gauge_->Increment(static_cast<double>(bytes));
    return Lease(this, bytes);
  }

  // Adds `more` bytes to `lease` (an empty lease becomes one on this budget), or returns false and
  // leaves it as it was when they do not fit.
  bool TryExtend(Lease& lease, uint64_t more) {
    std::optional<Lease> extra = TryAcquire(more);
    if (!extra.has_value()) return false;
    if (lease.budget_ == nullptr) {
      lease = std::move(*extra);
    } else {
      lease.bytes_ += std::exchange(extra->bytes_, 0);
    }
    return true;
  }

  uint64_t limit() const { return limit_; }
  uint64_t in_use() const { return used_.load(std::memory_order_acquire); }

 private:
  void Give(uint64_t bytes) {
    used_.fetch_sub(bytes, std::memory_order_acq_rel);
    if (gauge_ != nullptr) gauge_->Decrement(static_cast<double>(bytes));
  }

  const uint64_t limit_;
  prometheus::Gauge* const gauge_;
  std::atomic<uint64_t> used_{0};
};

// A memory limit and where it was read.
struct MemoryLimit {
  uint64_t bytes = 0;  // 0: none found
  std::string source;  // the file it came from, or "physical memory"
};

// The memory limit of the process's cgroup: `cgroup_root` is where the cgroup file systems are
// mounted (/sys/fs/cgroup) and `proc_self_cgroup` the process's membership file (/proc/self/cgroup).
// A test passes a fake tree. {0, ""} when no limit is set or none can be read.
MemoryLimit CgroupMemoryLimit(const std::string& cgroup_root, const std::string& proc_self_cgroup);

// The memory this process may use: the smaller of physical memory and its cgroup's limit
// (CgroupMemoryLimit), so a pod's limit and not the node's RAM sizes the defaults. 0 when neither
// can be read.
MemoryLimit AvailableMemory();
uint64_t AvailableMemoryBytes();

}  // namespace fusedlayer::server
