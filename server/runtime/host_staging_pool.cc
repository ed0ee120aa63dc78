#include "runtime/host_staging_pool.h"

#include <chrono>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "metrics/component_metrics.h"

namespace fusedlayer::server {
namespace {
constexpr size_t kMinClassBytes = size_t{64} << 10;
}  // namespace

HostStagingPool::Lease& HostStagingPool::Lease::operator=(Lease&& o) noexcept {
  if (this != &o) {
    Release();
    pool_ = o.pool_;
    block_ = std::move(o.block_);
    discard_ = o.discard_;
    lent_ = o.lent_;
    o.pool_ = nullptr;
    o.discard_ = false;
    o.lent_ = false;
  }
  return *this;
}

void HostStagingPool::Lease::Release() {
  if (pool_ != nullptr) pool_->Return(std::move(block_), discard_, lent_);
  pool_ = nullptr;
  discard_ = false;
  lent_ = false;
}

HostStagingPool::HostStagingPool(Backend& backend, size_t limit_bytes, prometheus::Registry* registry,
                                 int copy_threads, StagingPoolNames names)
    : backend_(backend),
      limit_(limit_bytes),
      copier_(copy_threads),
      names_(std::move(names)),
      lend_state_(std::make_shared<LendState>(this)) {
  if (registry == nullptr) return;
  const StagingPoolMetrics m = StagingPoolMetrics::Register(*registry, names_.metric, names_.what, names_.flag);
  in_use_gauge_ = m.in_use;
  held_gauge_ = m.held;
  limit_gauge_ = m.limit;
  lent_gauge_ = m.lent;
  waits_counter_ = m.waits;
  misses_counter_ = m.misses;
  limit_gauge_->Set(static_cast<double>(limit_));
}

HostStagingPool::~HostStagingPool() {
  {
    // Responses still being sent hold lent blocks; gRPC lets go of them as its server shuts down
    // (before the lanes are destroyed, server.cc), possibly a little later on its own threads.
    std::unique_lock<std::mutex> lock(mu_);
    if (!freed_.wait_for(lock, std::chrono::seconds(5), [&] { return lent_bytes_ == 0; })) {
      LogWarning("host staging: ", lent_bytes_, " bytes still lent to responses 5 s after the server stopped; "
                 "they are freed when gRPC lets go of them");
    }
  }
  {
    // Owners that let go later leave their block allocated instead of returning it here.
    std::lock_guard<std::mutex> lock(lend_state_->mu);
    lend_state_->pool = nullptr;
  }
  std::lock_guard<std::mutex> lock(mu_);
  kept_.clear();  // every other lease was returned (its owners are gone): frees the kept blocks
}

std::shared_ptr<const void> HostStagingPool::Lend(Lease& lease) {
  if (lease.pool_ != this || lease.block_.data() == nullptr || lease.lent_) return nullptr;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (lent_bytes_ + lease.bytes() > limit_ / 2) return nullptr;
    lent_bytes_ += lease.bytes();
    UpdateGauges();
  }
  struct Lent {
    std::shared_ptr<LendState> state;
    Lease lease;
  };
  auto* lent = new Lent{lend_state_, std::move(lease)};
  lent->lease.lent_ = true;
  return std::shared_ptr<const void>(lent->lease.data(), [lent](const void*) {
    {
      std::lock_guard<std::mutex> lock(lent->state->mu);
      // The pool is gone (gRPC let go of a response more than 5 s after its server stopped): the
      // block is freed below by its own free function (the backend's page-locked free, which
      // needs no pool) instead of being returned.
      if (lent->state->pool == nullptr) lent->lease.pool_ = nullptr;
      lent->lease.Release();
    }
    delete lent;
  });
}

size_t HostStagingPool::ClassBytes(size_t bytes) const {
  size_t c = kMinClassBytes;
  while (c < bytes && c <= limit_ / 2) c *= 2;
  if (c < bytes) c = bytes;  // above half the bound: the exact size (it still fits the bound)
  return c > limit_ && bytes <= limit_ ? limit_ : c;
}

absl::StatusOr<HostStagingPool::Lease> HostStagingPool::Acquire(size_t bytes) { return Take(bytes, /*wait=*/true); }

absl::StatusOr<HostStagingPool::Lease> HostStagingPool::TryAcquire(size_t bytes) {
  absl::StatusOr<Lease> lease = Take(bytes, /*wait=*/false);
  if (!lease.ok()) {
    std::lock_guard<std::mutex> lock(mu_);
    ++misses_;
    if (misses_counter_ != nullptr) misses_counter_->Increment();
  }
  return lease;
}

absl::StatusOr<HostStagingPool::Lease> HostStagingPool::Take(size_t bytes, bool wait) {
  if (bytes > limit_) {
    return absl::ResourceExhaustedError(absl::StrCat("the request's tensors need ", bytes,
                                                     " bytes of host staging memory, more than the server's bound of ",
                                                     limit_, " (", names_.flag, ")"));
  }
  const size_t want = ClassBytes(bytes);
  Lease lease;
  std::vector<DeviceBuffer> evicted;  // freed outside the lock (freeing pinned memory is slow)
  {
    std::unique_lock<std::mutex> lock(mu_);
    bool waited = false;
    for (;;) {
      // A kept block of a size that serves this request without wasting more than its class.
      auto it = kept_.lower_bound(bytes);
      if (it != kept_.end() && it->first <= want) {
        lease.block_ = std::move(it->second);
        kept_bytes_ -= it->first;
        kept_.erase(it);
        in_use_bytes_ += lease.block_.bytes();
        break;
      }
      if (in_use_bytes_ + want <= limit_) {
        // Room once kept blocks of other sizes are given back: evict the largest first.
        while (in_use_bytes_ + kept_bytes_ + want > limit_ && !kept_.empty()) {
          auto last = std::prev(kept_.end());
          kept_bytes_ -= last->first;
          evicted.push_back(std::move(last->second));
          kept_.erase(last);
        }
        in_use_bytes_ += want;  // reserved before the allocation, outside the lock
        break;
      }
      if (!wait) return absl::UnavailableError(absl::StrCat(names_.what, " is taken by other requests"));
      if (!waited) {
        waited = true;
        ++waits_;
        if (waits_counter_ != nullptr) waits_counter_->Increment();
      }
      freed_.wait(lock);
    }
    UpdateGauges();
  }
  evicted.clear();
  if (lease.block_.data() == nullptr) {
    absl::StatusOr<DeviceBuffer> block = backend_.AllocateHostStaging(want);
    if (!block.ok()) {
      std::lock_guard<std::mutex> lock(mu_);
      in_use_bytes_ -= want;
      UpdateGauges();
      freed_.notify_all();
      return absl::ResourceExhaustedError(
          absl::StrCat("host staging memory (", want, " bytes): ", block.status().message()));
    }
    lease.block_ = std::move(*block);
  }
  lease.pool_ = this;
  return lease;
}

void HostStagingPool::Return(DeviceBuffer block, bool discard, bool lent) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    in_use_bytes_ -= block.bytes();
    if (lent) lent_bytes_ -= block.bytes();
    if (!discard) {
      kept_bytes_ += block.bytes();
      const size_t bytes = block.bytes();
      kept_.emplace(bytes, std::move(block));
    }
    UpdateGauges();
  }
  freed_.notify_all();
  // A discarded block is freed here, outside the lock, when `block` goes out of scope.
}

void HostStagingPool::UpdateGauges() {
  if (in_use_gauge_ == nullptr) return;
  in_use_gauge_->Set(static_cast<double>(in_use_bytes_));
  held_gauge_->Set(static_cast<double>(in_use_bytes_ + kept_bytes_));
  lent_gauge_->Set(static_cast<double>(lent_bytes_));
}

size_t HostStagingPool::in_use_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return in_use_bytes_;
}

size_t HostStagingPool::held_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return in_use_bytes_ + kept_bytes_;
}

size_t HostStagingPool::lent_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return lent_bytes_;
}

uint64_t HostStagingPool::misses() const {
  std::lock_guard<std::mutex> lock(mu_);
  return misses_;
}

uint64_t HostStagingPool::waits() const {
  std::lock_guard<std::mutex> lock(mu_);
  return waits_;
}

}  // namespace fusedlayer::server
