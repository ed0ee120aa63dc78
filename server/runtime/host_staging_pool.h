// The bounded pool of page-locked host staging memory that lanes copy through (runtime/op_calls.h).
// Pinned memory is expensive to allocate (cudaHostAlloc maps and locks pages: ~ms per MiB) and
// takes physical memory from the whole machine, so blocks are kept for reuse in power-of-two size
// classes and everything the pool holds (in use + kept) stays under --host_staging_bytes.
//
// A request takes ONE block for all of its tensors (inputs and outputs) before it enqueues any
// work and gives it back after its lane's Wait(): a request never holds one block while waiting
// for another, so lanes waiting for the bound cannot deadlock each other. A request larger than
// the whole bound is refused at once (RESOURCE_EXHAUSTED naming the flag), never waits forever.
// When the bound is taken by other lanes' requests, Acquire waits for one of them to finish.
//
// A block may outlive its request: Lend() hands it to the request's response, whose slices gRPC
// is still writing to the socket (runtime/output_buffers.h), and it comes back when gRPC lets go of
// them. Lent blocks count as in use, and at most half of the bound may be lent, so responses that a
// slow client does not read never take the staging the lanes need to run.
// Thread-safe.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "absl/status/statusor.h"
#include "runtime/parallel_copy.h"
#include "fusedlayer/backend.h"
#include "prometheus/counter.h"
#include "prometheus/gauge.h"
#include "prometheus/registry.h"

namespace fusedlayer::server {

// Host memory [begin, end), e.g. a block of this pool or part of one. Empty by default.
struct HostRange {
  const char* begin = nullptr;
  const char* end = nullptr;
  // Memory the CPU must never read (a page-locked shared-memory mapping: transport/shared_memory.h);
  // only the device's copies may. A lane that cannot copy such inputs by DMA fails the call.
  bool device_only = false;
  // True when [p, p + n) lies inside.
  bool Contains(const void* p, size_t n) const {
    const char* c = static_cast<const char*>(p);
    return begin != nullptr && c >= begin && c <= end && n <= static_cast<size_t>(end - c);
  }
};

// Inputs that a lane copies to the device as one span keep their offsets from the lowest one in
// the device block, so each must lie a multiple of this from it: a cache line, 4x the kernels'
// widest vector load. Shared-memory clients are held to it (transport/shared_memory.h); the
// request pool lays inputs out at 256.
inline constexpr size_t kOneCopyAlignment = 64;

// One input's bytes in host memory.
struct HostPiece {
  const char* data;
  size_t bytes;
};

// The span from the lowest to the end of the highest of `pieces` (those of 0 bytes ignored) when
// they can go to the device in one copy at their offsets in it, i.e. each lies a multiple of
// kOneCopyAlignment from the lowest; empty when not, or when there are no bytes. The one rule
// both LaneStaging (runtime/device_staging.h) and the shared-memory transport's in-place check
// (transport/shared_memory.h, UseInputsInPlace) apply, so the transport never admits a layout
// the lane would refuse.
template <typename Pieces>
HostRange OneCopySpan(const Pieces& pieces) {
  const char* first = nullptr;
  const char* last = nullptr;
  for (const HostPiece& p : pieces) {
    if (p.bytes == 0) continue;
    if (first == nullptr || p.data < first) first = p.data;
    if (last == nullptr || p.data + p.bytes > last) last = p.data + p.bytes;
  }
  if (first == nullptr) return {};
  for (const HostPiece& p : pieces) {
    if (p.bytes > 0 && static_cast<size_t>(p.data - first) % kOneCopyAlignment != 0) return {};
  }
  return HostRange{first, last};
}

// What a pool's metrics and messages call it: the lanes' pool (the default) or the pool that
// compute requests are read into (rpc/wire_messages.h, ReadWireRequest).
struct StagingPoolNames {
  std::string metric = "fusedlayer_host_staging";  // {metric}_bytes, {metric}_waits_total, {metric}_misses_total
  std::string what = "Page-locked host staging memory of the device lanes";
  std::string flag = "--host_staging_bytes";
};

class HostStagingPool {
 public:
  // A block handed out by Acquire; gives it back to the pool when destroyed.
  class Lease {
   public:
    Lease() = default;
    Lease(Lease&& o) noexcept { *this = std::move(o); }
    Lease& operator=(Lease&& o) noexcept;
    ~Lease() { Release(); }
    char* data() const { return static_cast<char*>(block_.data()); }
    size_t bytes() const { return block_.bytes(); }
    // The device may still be using the block (its lane's Wait failed): free it instead of
    // keeping it for reuse.
    void Discard() { discard_ = true; }
    void Release();

   private:
    friend class HostStagingPool;
    HostStagingPool* pool_ = nullptr;
    DeviceBuffer block_;
    bool discard_ = false;
    bool lent_ = false;  // held by a response (Lend)
  };

  // `limit_bytes`: the bound on what the pool holds. `registry` (optional): the pool's gauges.
  // `copy_threads`: helper threads of copier() (--host_copy_threads, resolved: >= 0).
  HostStagingPool(Backend& backend, size_t limit_bytes, prometheus::Registry* registry = nullptr,
                  int copy_threads = 0, StagingPoolNames names = {});
  ~HostStagingPool();
  HostStagingPool(const HostStagingPool&) = delete;
  HostStagingPool& operator=(const HostStagingPool&) = delete;

  // A block of at least `bytes` (> 0). ResourceExhausted at once when `bytes` is over the bound,
  // or when the system refuses page-locked memory; otherwise may wait for other requests' blocks.
  absl::StatusOr<Lease> Acquire(size_t bytes);
  // Acquire without waiting: Unavailable when the block would have to wait for other requests'
  // blocks (the caller then does without one; counted in misses()).
  absl::StatusOr<Lease> TryAcquire(size_t bytes);

  // Lends the lease's block to a response (see above): the returned owner gives the block back to
  // the pool when its last copy is destroyed, on whatever thread; after the pool is gone, it
  // frees the block with the block's own free function instead. Null, with the lease
  // untouched, when the lent blocks would then hold more than half of the bound.
  std::shared_ptr<const void> Lend(Lease& lease);

  size_t limit_bytes() const { return limit_; }
  // The host copies into and out of this pool's blocks (LaneStaging), shared by every lane.
  ParallelCopy& copier() { return copier_; }
  size_t in_use_bytes() const;
  size_t held_bytes() const;  // in use + kept for reuse
  size_t lent_bytes() const;  // in use by responses (Lend)
  uint64_t waits() const;     // Acquire calls that had to wait for the bound (tests, metrics)
  uint64_t misses() const;    // TryAcquire calls refused (bound taken, or no page-locked memory)

  // The size class a request of `bytes` gets: the next power of two from 64 KiB, but never more
  // than the bound (a request that fits the bound always fits its class).
  size_t ClassBytes(size_t bytes) const;

 private:
  absl::StatusOr<Lease> Take(size_t bytes, bool wait);
  void Return(DeviceBuffer block, bool discard, bool lent);
  // What a lent block's owner reaches the pool through: null once the pool is destroyed.
  struct LendState {
    explicit LendState(HostStagingPool* p) : pool(p) {}
    std::mutex mu;
    HostStagingPool* pool;
  };
  void UpdateGauges();  // mu_ held

  Backend& backend_;
  const size_t limit_;
  ParallelCopy copier_;
  mutable std::mutex mu_;
  std::condition_variable freed_;
  std::multimap<size_t, DeviceBuffer> kept_;  // free blocks by size
  size_t kept_bytes_ = 0;
  size_t in_use_bytes_ = 0;
  size_t lent_bytes_ = 0;
  uint64_t waits_ = 0;
  uint64_t misses_ = 0;
  const StagingPoolNames names_;
  const std::shared_ptr<LendState> lend_state_;
  prometheus::Gauge* in_use_gauge_ = nullptr;
  prometheus::Gauge* held_gauge_ = nullptr;
  prometheus::Gauge* limit_gauge_ = nullptr;
  prometheus::Gauge* lent_gauge_ = nullptr;
  prometheus::Counter* waits_counter_ = nullptr;
  prometheus::Counter* misses_counter_ = nullptr;
};

}  // namespace fusedlayer::server
