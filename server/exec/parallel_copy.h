// Large host memcpys split over a few helper threads: the copies into and out of the pinned
// staging blocks (exec/device_staging.h, LaneStaging) on a backend whose memory the host cannot
// touch. Why: one core moves ~6-8 GB/s here, and on the H200 host staging the 4.4 MiB of an mHC
// seam C = 7168 T = 64 took 792 us of its 2.18 ms server time and copying its outputs back 567 us
// (ExecutionReport.stages, docs/device-runs/2026-12-02-h200-session7-run6-*.log), against 167 us
// for the copies to and from the device and the kernels together.
//
// The caller always copies one share itself and, when the helpers are busy with other lanes'
// copies, takes its own queued shares back and copies them too: a copy never waits for another
// request's work, and with 0 helpers it is a plain memcpy. Thread-safe.
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
  // Copies shorter than this stay on the caller (a hand-off costs a few microseconds).
  static constexpr size_t kMinSplitBytes = size_t{256} << 10;

  // `helper_threads` (>= 0) threads besides the callers.
  explicit ParallelCopy(int helper_threads);
  ~ParallelCopy();
  ParallelCopy(const ParallelCopy&) = delete;
  ParallelCopy& operator=(const ParallelCopy&) = delete;

  // memcpy(dst, src, n) for non-overlapping ranges, split into helper_threads() + 1 shares.
  void Copy(void* dst, const void* src, size_t n);
  // One memcpy of many: e.g. a request's tensor data gathered from gRPC's slices (rpc/wire_messages.h).
  struct Piece {
    char* dst;
    const char* src;
    size_t n;
  };
  // Every piece copied (none may overlap another's destination), in helper_threads() + 1 shares
  // of about equal bytes; a piece larger than a share is split.
  void CopyPieces(const std::vector<Piece>& pieces);

  int helper_threads() const { return static_cast<int>(threads_.size()); }
  // Shares copied by the helpers so far (tests).
  size_t helper_shares() const;

  // The helpers `--host_copy_threads=-1` (auto) gets on a machine with `cores` cores: a quarter
  // of them, at most 3 (4 lanes copying at once then use up to 16 cores), none below 4 cores.
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
  std::vector<std::thread> threads_;
};

}  // namespace fusedlayer::server
