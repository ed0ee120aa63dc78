// Large host memcpys split over a few helper threads: the copies into and out of the pinned
// staging blocks (runtime/device_staging.h, LaneStaging) on a backend whose memory the host cannot
// touch. Why: one core moves ~6-8 GB/s here, and on the H200 host staging the 4.4 MiB of an mHC
// seam C = 7168 T = 64 took 792 us of its 2.18 ms server time and copying its outputs back 567 us
// (ExecutionReport.stages), against 167 us
// for the copies to and from the device and the kernels together.
//
// Only one call is split at a time: a call that starts while another is split is copied by its
// caller alone. Why: under load every caller copies its own call anyway, and helpers would take
// cores from gRPC's threads (every call split: -8% req/s at concurrency 16); the split
// pays when one call's copy is the critical path, as for a per-layer caller (mHC
// C = 7168 T = 64 on the H200 with the auto 7 helpers, one split at a time: server p50 -43 to -48%
// at concurrency 1 and -55 to -61% at 16, req/s at 16 no lower; BENCHMARKS.md). The caller of a split call copies one share itself and, when
// the helpers are busy, takes its own queued shares back and copies them too: a copy never waits
// for another request's work. Thread-safe.
//
// A call into pinned staging (Destination::kPinnedStaging: the device reads it, the CPU does not)
// of kMinStreamingBytes or more is copied with streaming stores (runtime/streaming_copy.h): on the
// H200 host 1.2-1.6x memcpy's rate into pinned memory, but 0.5-0.9x into pageable memory
// (bench/experiments/host_copy_bandwidth).
#pragma once

#include <condition_variable>
#include <cstddef>
#include <deque>
#include <mutex>
#include <thread>
#include <vector>

namespace fusedlayer::server {

class ParallelCopy {
 public:
  // Copies shorter than this stay on the caller. A hand-off costs tens of microseconds on a busy
  // host: splitting an SWA M = 64 call's 256 KiB made its decode 14-16 us slower.
  static constexpr size_t kMinSplitBytes = size_t{1} << 20;

  // Where a call's bytes go: whether the CPU reads them again decides the kind of store.
  enum class Destination {
    kPinnedStaging,  // page-locked memory the device copies from by DMA: streaming stores
    kHostMemory,     // anything else (a response's buffers): plain memcpy
  };

  // `helper_threads` (>= 0) threads besides the callers.
  explicit ParallelCopy(int helper_threads);
  ~ParallelCopy();
  ParallelCopy(const ParallelCopy&) = delete;
  ParallelCopy& operator=(const ParallelCopy&) = delete;

  // memcpy(dst, src, n) for non-overlapping ranges, split into helper_threads() + 1 shares when
  // n >= kMinSplitBytes and no other call is split.
  void Copy(void* dst, const void* src, size_t n, Destination to);
  // One memcpy of many: e.g. a request's tensor data gathered from gRPC's slices (rpc/wire_messages.h).
  struct Piece {
    char* dst;
    const char* src;
    size_t n;
  };
  // Every piece copied (none may overlap another's destination), in helper_threads() + 1 shares
  // of about equal bytes when split (as Copy decides, by the pieces' total); a piece larger than a
  // share is split.
  void CopyPieces(const std::vector<Piece>& pieces, Destination to);

  int helper_threads() const { return static_cast<int>(threads_.size()); }
  // Shares copied by the helpers so far, and calls split (tests).
  size_t helper_shares() const;
  size_t split_calls() const;
  // For tests: while one exists, every call is copied as if another call were being split.
  class SplitInProgressForTest {
   public:
    explicit SplitInProgressForTest(ParallelCopy& copier);
    ~SplitInProgressForTest();

   private:
    ParallelCopy& copier_;
  };

  // The helpers `--host_copy_threads=-1` (auto) gets on a machine with `cores` cores: half of
  // them, at most 7, none below 4 cores. Only one call is split at a time, so at most 8 cores copy
  // one call while the rest serve gRPC. On the H200 host (16 cores) 7 helpers read an mHC
  // C = 7168 T = 64 request in 211-247 us against 282-314 with 3.
  static int AutoHelperThreads(unsigned cores);

 private:
  struct Call;  // one Copy(): its shares still to run
  struct Share {  // pieces [begin, end) of one call
    const Piece* begin;
    const Piece* end;
    Call* call;
  };
  void Work();
  void Run(const Share& s);

  mutable std::mutex mu_;
  std::condition_variable work_;  // a share was queued, or stop_
  std::condition_variable done_;  // a share of some call finished
  std::deque<Share> queue_;
  bool stop_ = false;
  size_t helper_shares_ = 0;
  int splitting_ = 0;  // calls split now (at most one, plus tests' SplitInProgressForTest)
  size_t split_calls_ = 0;
  std::vector<std::thread> threads_;
};

}  // namespace fusedlayer::server
