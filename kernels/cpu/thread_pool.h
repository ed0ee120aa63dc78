// A small fixed thread pool for the CPU backend: ParallelFor over token blocks. The calling thread
// takes part, so a pool of N threads uses N-1 workers. Work is split into contiguous blocks whose
// boundaries depend only on (count, block_size): per-token results never depend on the split.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace fusedlayer::cpu {

class ThreadPool {
 public:
  explicit ThreadPool(int num_threads);  // <= 0: std::thread::hardware_concurrency()
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int num_threads() const { return static_cast<int>(workers_.size()) + 1; }

  // Calls fn(begin, end) for consecutive blocks [begin, end) of at most `block` items covering
  // [0, count), on all threads; returns when every block is done. Not re-entrant.
  void ParallelFor(int64_t count, int64_t block, const std::function<void(int64_t, int64_t)>& fn);

 private:
  void WorkerLoop();
  void RunBlocks();

  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable work_cv_, done_cv_;
  const std::function<void(int64_t, int64_t)>* fn_ = nullptr;
  int64_t count_ = 0, block_ = 1;
  int64_t next_ = 0;           // next block start (guarded by mu_)
  int active_ = 0;             // workers still inside the current job
  uint64_t generation_ = 0;    // bumps per job so workers wake once per job
  bool stop_ = false;
};

}  // namespace fusedlayer::cpu
