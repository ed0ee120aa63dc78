// A test-only backend that is NOT host-accessible and has real lanes (backend.h), so the server's
// pipelined data path (runtime/op_calls.h: pinned staging, stream-ordered copies, one wait per
// request, several lanes per device) runs in CI without a GPU.
//
//   - "Device" memory is its own heap blocks, filled with a poison pattern when allocated; the
//     server may only reach it through copies. Every copy checks that its device side lies in a
//     live device block and its host side in a live staging block (AllocateHostStaging): a copy
//     from pageable memory, or into freed memory, fails the request at its Wait.
//   - Each lane is a worker thread executing its queue in order (copies, kernels, frees of
//     stream-ordered buffers) some time after they were enqueued, like a stream: a caller that
//     reads staging before Wait() sees stale bytes, one that frees memory early corrupts the run.
//   - Kernels are the CPU backend's (each lane has its own single-threaded CPU backend), on the
//     device blocks: outputs are bitwise the CPU path's.
//   - Control (shared with the test while the server owns the backend): a gate that holds every
//     lane before its next operation, an injected device fault (the next kernel fails at execution
//     time, so the error surfaces at Wait), counters, and the live prepared weight sets.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <type_traits>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "fusedlayer/backend.h"

namespace fusedlayer::testing {

class LaneTestBackend final : public Backend {
 public:
  struct Control {
    // While set, every lane waits before its next queued operation.
    void Hold() {
      std::lock_guard<std::mutex> lock(mu);
      held = true;
    }
    void Release() {
      {
        std::lock_guard<std::mutex> lock(mu);
        held = false;
      }
      cv.notify_all();
    }
    // Blocks until `n` lane operations are waiting at the gate (Hold() first).
    void WaitForHeld(int n) {
      std::unique_lock<std::mutex> lock(mu);
      cv.wait(lock, [&] { return waiting_at_gate >= n; });
    }
    // Blocks until `n` lane kernels have been enqueued in all (not copies or frees, which an earlier
    // call may have left queued): the call a kernel belongs to is past decode, and with the gate held
    // it cannot complete.
    void WaitForKernelsEnqueued(int64_t n) {
      std::unique_lock<std::mutex> lock(mu);
      cv.wait(lock, [&] { return kernels_enqueued >= n; });
    }
    // Lane kernels enqueued so far (a starting point for WaitForKernelsEnqueued).
    int64_t KernelsEnqueued() {
      std::lock_guard<std::mutex> lock(mu);
      return kernels_enqueued;
    }
    void KernelEnqueued() {
      {
        std::lock_guard<std::mutex> lock(mu);
        ++kernels_enqueued;
      }
      cv.notify_all();
    }
    void Gate() {
      std::unique_lock<std::mutex> lock(mu);
      ++waiting_at_gate;
      cv.notify_all();
      cv.wait(lock, [&] { return !held; });
      --waiting_at_gate;
    }

    std::mutex mu;
    std::condition_variable cv;
    bool held = false;
    int waiting_at_gate = 0;
    int64_t kernels_enqueued = 0;  // lane kernels enqueued, all lanes (guarded by mu)

    std::atomic<int> fail_next_kernels{0};       // the next N lane kernels fail when they execute
    std::atomic<bool> refuse_host_staging{false};  // AllocateHostStaging fails (pinned memory refused)
    std::atomic<int> live_weight_sets{0};         // prepared parts alive (mHC + SWA)
    std::atomic<int64_t> lane_kernels{0};         // kernels executed on lanes
    std::atomic<int64_t> default_kernels{0};      // kernels run on the default context
    std::atomic<int64_t> host_staging_allocations{0};
    std::atomic<bool> refuse_page_lock{false};  // PageLockHostMemory fails
    std::atomic<int64_t> page_locks{0};          // ranges locked by PageLockHostMemory now
    std::atomic<int64_t> max_page_locks{0};      // the most locked at once so far
    std::atomic<int> page_lock_delay_ms{0};      // PageLockHostMemory takes this long (the driver pinning pages)
    std::atomic<int> allocate_delay_ms{0};       // Allocate (the default context's) takes this long
    std::atomic<int64_t> allocated_bytes{0};     // held now from Allocate (the default context's)
    std::atomic<int64_t> max_allocated_bytes{0};  // the most held at once so far
    std::atomic<int64_t> open_ipc_handles{0};    // ImportIpcMemory openings not closed yet
    std::atomic<int64_t> copies_to_device{0};  // EnqueueCopyToDevice calls on lanes
    std::atomic<int64_t> copies_to_host{0};    // EnqueueCopyToHost calls on lanes
    std::atomic<int> max_concurrent_lane_kernels{0};
    std::atomic<int> running_lane_kernels{0};
    // Upper bound of the random delay before each lane operation executes (exposes missing waits).
    std::atomic<int> max_op_delay_us{200};
  };

  explicit LaneTestBackend(int max_lanes = 8, std::shared_ptr<Control> control = std::make_shared<Control>())
      : max_lanes_(max_lanes), control_(std::move(control)), cpu_(CreateCpuBackend(BackendOptions{.num_threads = 1})) {}
  ~LaneTestBackend() override = default;

  const std::shared_ptr<Control>& control() const { return control_; }

  std::string_view kind() const override { return "lane-test"; }
  std::string device_name() const override { return "lane test device (CPU kernels on separate memory)"; }
  std::string arch() const override { return cpu_->arch(); }
  bool host_accessible() const override { return false; }

  // ---- memory ---------------------------------------------------------------------------------
  absl::StatusOr<DeviceBuffer> Allocate(size_t bytes) override {
    if (bytes == 0) return DeviceBuffer();
    char* p = NewBlock(bytes, /*device=*/true);
    RaisePeak(control_->max_allocated_bytes, control_->allocated_bytes += static_cast<int64_t>(bytes));
    std::this_thread::sleep_for(std::chrono::milliseconds(control_->allocate_delay_ms.load()));
    return DeviceBuffer(p, bytes, [this, bytes](void* q) {
      control_->allocated_bytes -= static_cast<int64_t>(bytes);
      FreeBlock(q, /*device=*/true);
    });
  }
  absl::StatusOr<DeviceBuffer> AllocateHostStaging(size_t bytes) override {
    if (control_->refuse_host_staging.load()) return absl::ResourceExhaustedError("page-locked memory refused (test)");
    ++control_->host_staging_allocations;
    char* p = NewBlock(bytes, /*device=*/false);
    return DeviceBuffer(p, bytes, [this](void* q) { FreeBlock(q, /*device=*/false); });
  }
  // Lane copies accept the locked range as staging memory until it is unlocked (the test for
  // "every lane copy's host side is page-locked" then covers shared-memory mappings too).
  absl::StatusOr<DeviceBuffer> PageLockHostMemory(void* p, size_t bytes) override {
    if (control_->refuse_page_lock.load()) return absl::FailedPreconditionError("page-locking refused (test)");
    RaisePeak(control_->max_page_locks, ++control_->page_locks);
    std::this_thread::sleep_for(std::chrono::milliseconds(control_->page_lock_delay_ms.load()));
    {
      std::lock_guard<std::mutex> lock(blocks_mu_);
      blocks_[static_cast<char*>(p)] = Block{bytes, /*device=*/false};
    }
    return DeviceBuffer(p, bytes, [this](void* q) {
      std::lock_guard<std::mutex> lock(blocks_mu_);
      if (blocks_.erase(static_cast<char*>(q)) != 1) std::abort();  // a double unlock
      --control_->page_locks;
    });
  }
  // CUDA IPC, within this process: a handle names a live device block that AllocateIpcExportable
  // made (a magic, then its address and size); anything else is refused as the driver refuses a
  // handle it does not know. The server's code under test cannot tell it from another process's.
  int device_index() const override { return 0; }
  absl::StatusOr<IpcExportedBuffer> AllocateIpcExportable(size_t bytes) override {
    absl::StatusOr<DeviceBuffer> b = Allocate(bytes);
    if (!b.ok()) return b.status();
    std::string handle(kIpcHandleBytes, '\0');
    const uint64_t fields[3] = {kIpcMagic, reinterpret_cast<uint64_t>(b->data()), b->bytes()};
    std::memcpy(handle.data(), fields, sizeof(fields));
    return IpcExportedBuffer{std::move(*b), std::move(handle)};
  }
  absl::StatusOr<DeviceBuffer> ImportIpcMemory(std::string_view handle) override {
    if (handle.size() != kIpcHandleBytes) return absl::InvalidArgumentError("an IPC handle is 64 bytes");
    uint64_t fields[3];
    std::memcpy(fields, handle.data(), sizeof(fields));
    char* p = reinterpret_cast<char*>(fields[1]);
    {
      std::lock_guard<std::mutex> lock(blocks_mu_);
      auto it = blocks_.find(p);
      if (fields[0] != kIpcMagic || it == blocks_.end() || !it->second.device || it->second.bytes != fields[2]) {
        return absl::InvalidArgumentError("the driver refused the IPC handle (test: no such exported block)");
      }
    }
    ++control_->open_ipc_handles;
    return DeviceBuffer(p, fields[2], [c = control_](void*) { --c->open_ipc_handles; });
  }

  absl::Status CopyToDevice(void* dst, const void* src, size_t bytes) override {
    std::lock_guard<std::mutex> lock(default_mu_);
    if (!InBlock(dst, bytes, true)) return absl::InternalError("copy to device: destination is not device memory");
    std::memcpy(dst, src, bytes);
    device_clock_.fetch_add(1, std::memory_order_acq_rel);  // (see device_clock_)
    return absl::OkStatus();
  }
  absl::Status CopyToHost(void* dst, const void* src, size_t bytes) override {
    std::lock_guard<std::mutex> lock(default_mu_);
    if (!InBlock(src, bytes, true)) return absl::InternalError("copy to host: source is not device memory");
    device_clock_.fetch_add(1, std::memory_order_acq_rel);
    std::memcpy(dst, src, bytes);
    return absl::OkStatus();
  }

  // ---- ops on the default context ------------------------------------------------------------
  absl::StatusOr<std::unique_ptr<PreparedMhcWeights>> PrepareMhc(const MhcHyperParams& params,
                                                                 const MhcWeightsHost& weights) override {
    std::lock_guard<std::mutex> lock(default_mu_);
    auto w = cpu_->PrepareMhc(params, weights);
    if (!w.ok()) return w.status();
    return std::unique_ptr<PreparedMhcWeights>(new TrackedMhc(std::move(*w), control_));
  }
  FusedSupport MhcFusedSupport(const PreparedMhcWeights& weights, const MhcShapeQuery& query) const override {
    return cpu_->MhcFusedSupport(Inner(weights), query);
  }
  absl::StatusOr<RunStats> RunMhc(const PreparedMhcWeights& weights, const MhcArgs& args, Path path) override {
    std::lock_guard<std::mutex> lock(default_mu_);
    ++control_->default_kernels;
    return cpu_->RunMhc(Inner(weights), args, path);
  }
  absl::StatusOr<std::unique_ptr<PreparedSwaWeights>> PrepareSwa(const SwaHyperParams& params,
                                                                 const SwaWeightsHost& weights) override {
    std::lock_guard<std::mutex> lock(default_mu_);
    auto w = cpu_->PrepareSwa(params, weights);
    if (!w.ok()) return w.status();
    return std::unique_ptr<PreparedSwaWeights>(new TrackedSwa(std::move(*w), control_));
  }
  FusedSupport SwaFusedSupport(const PreparedSwaWeights& weights, const SwaShapeQuery& query) const override {
    return cpu_->SwaFusedSupport(Inner(weights), query);
  }
  absl::StatusOr<RunStats> RunSwa(const PreparedSwaWeights& weights, const SwaArgs& args, Path path) override {
    std::lock_guard<std::mutex> lock(default_mu_);
    ++control_->default_kernels;
    return cpu_->RunSwa(Inner(weights), args, path);
  }

  int max_lanes() const override { return max_lanes_; }
  absl::StatusOr<std::unique_ptr<Lane>> CreateLane() override {
    return std::unique_ptr<Lane>(new TestLane(*this, next_lane_seed_++));
  }

  // Device and staging blocks alive now (tests: nothing leaks).
  size_t live_blocks(bool device) const {
    std::lock_guard<std::mutex> lock(blocks_mu_);
    size_t n = 0;
    for (const auto& [p, b] : blocks_) n += b.device == device ? 1 : 0;
    return n;
  }

 private:
  static constexpr uint64_t kAlive = 0x11fe11fe11fe11feULL;
  static constexpr uint64_t kIpcMagic = 0x1bc0ffee1bc0ffeeULL;

  // Prepared weights wrapped to count the live ones and to detect use after release.
  struct TrackedMhc final : PreparedMhcWeights {
    TrackedMhc(std::unique_ptr<PreparedMhcWeights> w, std::shared_ptr<Control> c) : inner(std::move(w)), control(std::move(c)) {
      ++control->live_weight_sets;
    }
    ~TrackedMhc() override {
      magic = 0;
      --control->live_weight_sets;
    }
    const MhcHyperParams& params() const override { return inner->params(); }
    bool has_norm_weight() const override { return inner->has_norm_weight(); }
    size_t resident_bytes() const override { return inner->resident_bytes(); }
    std::unique_ptr<PreparedMhcWeights> inner;
    std::shared_ptr<Control> control;
    uint64_t magic = kAlive;
  };
  struct TrackedSwa final : PreparedSwaWeights {
    TrackedSwa(std::unique_ptr<PreparedSwaWeights> w, std::shared_ptr<Control> c) : inner(std::move(w)), control(std::move(c)) {
      ++control->live_weight_sets;
    }
    ~TrackedSwa() override {
      magic = 0;
      --control->live_weight_sets;
    }
    const SwaHyperParams& params() const override { return inner->params(); }
    size_t resident_bytes() const override { return inner->resident_bytes(); }
    std::string wq_b_implementation() const override { return inner->wq_b_implementation(); }
    std::unique_ptr<PreparedSwaWeights> inner;
    std::shared_ptr<Control> control;
    uint64_t magic = kAlive;
  };
  static const PreparedMhcWeights& Inner(const PreparedMhcWeights& w) {
    return *static_cast<const TrackedMhc&>(w).inner;
  }
  static const PreparedSwaWeights& Inner(const PreparedSwaWeights& w) {
    return *static_cast<const TrackedSwa&>(w).inner;
  }
  static bool Alive(const PreparedMhcWeights& w) { return static_cast<const TrackedMhc&>(w).magic == kAlive; }
  static bool Alive(const PreparedSwaWeights& w) { return static_cast<const TrackedSwa&>(w).magic == kAlive; }

  struct Block {
    size_t bytes;
    bool device;
  };
  // peak = max(peak, now), from any thread.
  static void RaisePeak(std::atomic<int64_t>& peak, int64_t now) {
    for (int64_t seen = peak.load(); now > seen && !peak.compare_exchange_weak(seen, now);) {
    }
  }
  char* NewBlock(size_t bytes, bool device) {
    char* p = new char[bytes];
    std::memset(p, device ? 0xA5 : 0x5A, bytes);  // poison: never the bytes a correct run produces
    std::lock_guard<std::mutex> lock(blocks_mu_);
    blocks_[p] = Block{bytes, device};
    return p;
  }
  void FreeBlock(void* q, bool device) {
    char* p = static_cast<char*>(q);
    {
      std::lock_guard<std::mutex> lock(blocks_mu_);
      auto it = blocks_.find(p);
      if (it == blocks_.end() || it->second.device != device) std::abort();  // a double or foreign free
      blocks_.erase(it);
    }
    delete[] p;
  }
  // True when [p, p + bytes) lies inside one live block of the kind.
  bool InBlock(const void* q, size_t bytes, bool device) const {
    const char* p = static_cast<const char*>(q);
    std::lock_guard<std::mutex> lock(blocks_mu_);
    auto it = blocks_.upper_bound(const_cast<char*>(p));
    if (it == blocks_.begin()) return false;
    --it;
    return it->second.device == device && p >= it->first && p + bytes <= it->first + it->second.bytes;
  }

  // A lane: a worker thread executing its queue in order, after a random delay per operation.
  class TestLane final : public Lane {
   public:
    TestLane(LaneTestBackend& backend, uint64_t seed)
        : backend_(backend), control_(backend.control_), cpu_(CreateCpuBackend(BackendOptions{.num_threads = 1})),
          rng_(seed), worker_([this] { Loop(); }) {}
    ~TestLane() override {
      {
        std::lock_guard<std::mutex> lock(mu_);
        stopping_ = true;
      }
      cv_.notify_all();
      worker_.join();  // runs what is queued first
    }

    absl::StatusOr<DeviceBuffer> Allocate(size_t bytes) override {
      if (bytes == 0) return DeviceBuffer();
      char* p = backend_.NewBlock(bytes, /*device=*/true);
      // Stream-ordered release: freed by the lane after the work queued before the release.
      return DeviceBuffer(p, bytes, [this](void* q) { Push([this, q] { backend_.FreeBlock(q, true); return absl::OkStatus(); }); });
    }
    absl::Status EnqueueCopyToDevice(void* dst, const void* src, size_t bytes) override {
      control_->copies_to_device.fetch_add(1, std::memory_order_relaxed);
      Push([this, dst, src, bytes] {
        if (!backend_.InBlock(dst, bytes, true)) return absl::InternalError("copy to device: not device memory");
        if (!backend_.InBlock(src, bytes, false)) return absl::InternalError("copy to device: source not staging memory");
        std::memcpy(dst, src, bytes);
        return absl::OkStatus();
      });
      return absl::OkStatus();
    }
    absl::Status EnqueueCopyToHost(void* dst, const void* src, size_t bytes) override {
      control_->copies_to_host.fetch_add(1, std::memory_order_relaxed);
      Push([this, dst, src, bytes] {
        if (!backend_.InBlock(src, bytes, true)) return absl::InternalError("copy to host: not device memory");
        if (!backend_.InBlock(dst, bytes, false)) return absl::InternalError("copy to host: destination not staging memory");
        std::memcpy(dst, src, bytes);
        return absl::OkStatus();
      });
      return absl::OkStatus();
    }
    absl::Status EnqueueMhc(const PreparedMhcWeights& weights, const MhcArgs& args, Path path) override {
      return EnqueueKernel(weights, args, path);
    }
    absl::Status EnqueueSwa(const PreparedSwaWeights& weights, const SwaArgs& args, Path path) override {
      return EnqueueKernel(weights, args, path);
    }
    absl::StatusOr<RunStats> Wait() override {
      std::unique_lock<std::mutex> lock(mu_);
      const uint64_t target = enqueued_;
      cv_.wait(lock, [&] { return executed_ >= target; });
      absl::Status error = std::move(first_error_);
      first_error_ = absl::OkStatus();
      RunStats stats;
      stats.kernel_seconds = kernel_seconds_;
      kernel_seconds_ = 0;
      if (!error.ok()) return absl::InternalError(absl::StrCat("lane work failed: ", error.message()));
      return stats;
    }

   private:
    template <typename Weights, typename Args>
    absl::Status EnqueueKernel(const Weights& weights, const Args& args, Path path) {
      // Validation happens at enqueue, as on a GPU: a bad request enqueues nothing. Only shapes
      // and pointers are checked (the device buffers hold poison until their copies run).
      absl::Status valid;
      if constexpr (std::is_same_v<Args, MhcArgs>) {
        valid = ValidateMhcArgs(weights.params(), weights.has_norm_weight(), args);
      } else {
        valid = ValidateSwaArgs(weights.params(), args);
      }
      if (!valid.ok()) return valid;
      Push([this, &weights, args, path] {
        if (!Alive(weights)) return absl::InternalError("kernel read a released weight set");
        if (control_->fail_next_kernels.load() > 0 && control_->fail_next_kernels.fetch_sub(1) > 0) {
          return absl::InternalError("injected device fault");
        }
        const int running = ++control_->running_lane_kernels;
        int seen = control_->max_concurrent_lane_kernels.load();
        while (running > seen && !control_->max_concurrent_lane_kernels.compare_exchange_weak(seen, running)) {
        }
        absl::StatusOr<RunStats> r;
        if constexpr (std::is_same_v<Args, MhcArgs>) {
          r = cpu_->RunMhc(Inner(weights), args, path);
        } else {
          r = cpu_->RunSwa(Inner(weights), args, path);
        }
        --control_->running_lane_kernels;
        ++control_->lane_kernels;
        if (!r.ok()) return r.status();
        kernel_seconds_ = r->kernel_seconds;  // lane thread; read by Wait under mu_ after executed_
        return absl::OkStatus();
      });
      control_->KernelEnqueued();
      return absl::OkStatus();
    }

    void Push(std::function<absl::Status()> op) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        queue_.push_back(std::move(op));
        ++enqueued_;
      }
      cv_.notify_all();
    }

    void Loop() {
      for (;;) {
        std::function<absl::Status()> op;
        int delay_us = 0;
        {
          std::unique_lock<std::mutex> lock(mu_);
          cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
          if (queue_.empty()) return;
          op = std::move(queue_.front());
          queue_.pop_front();
          const int max_delay = control_->max_op_delay_us.load();
          delay_us = max_delay > 0 ? static_cast<int>(rng_() % static_cast<uint64_t>(max_delay + 1)) : 0;
        }
        control_->Gate();
        if (delay_us > 0) std::this_thread::sleep_for(std::chrono::microseconds(delay_us));
        backend_.device_clock_.fetch_add(1, std::memory_order_acq_rel);
        absl::Status s = op();
        backend_.device_clock_.fetch_add(1, std::memory_order_acq_rel);
        {
          std::lock_guard<std::mutex> lock(mu_);
          if (!s.ok() && first_error_.ok()) first_error_ = std::move(s);
          ++executed_;
        }
        cv_.notify_all();
      }
    }

    LaneTestBackend& backend_;
    const std::shared_ptr<Control> control_;
    const std::unique_ptr<Backend> cpu_;
    std::mt19937_64 rng_;  // worker thread (under mu_)
    std::mutex mu_;
    std::condition_variable cv_;
    std::deque<std::function<absl::Status()>> queue_;
    uint64_t enqueued_ = 0, executed_ = 0;
    absl::Status first_error_;
    double kernel_seconds_ = 0;
    bool stopping_ = false;
    std::thread worker_;  // last: starts after everything above is constructed
  };

  const int max_lanes_;
  const std::shared_ptr<Control> control_;
  const std::unique_ptr<Backend> cpu_;  // the default context's kernels
  std::mutex default_mu_;
  mutable std::mutex blocks_mu_;
  // Device memory is one memory for the default context's synchronous copies and every lane, as on a
  // GPU: a lane op sees what completed copies wrote before it starts, and a copy sees what completed
  // lane ops wrote. A client of CUDA shared memory (the tests, in this process) writes its buffers
  // with CopyToDevice before it sends a request and reads them with CopyToHost after the response;
  // the order between those and the lanes goes through the socket, which TSan cannot see, so it is
  // made visible here (acq_rel read-modify-writes around each copy and lane op).
  std::atomic<uint64_t> device_clock_{0};
  std::map<char*, Block> blocks_;
  std::atomic<uint64_t> next_lane_seed_{1};
};

}  // namespace fusedlayer::testing
