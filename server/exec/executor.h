// The per-device executor: one worker thread that owns the Backend (backends are single-threaded,
// backend.h) and runs every device-touching task in FIFO order: compute requests, weight uploads
// (Prepare*), warm-ups. gRPC reactors never block: they validate inline, Submit a task, and the
// task finishes the RPC from the worker.
//
// The queue is bounded (--queue_capacity): Submit on a full queue is RESOURCE_EXHAUSTED at once,
// so overload turns into fast, explicit back-pressure instead of unbounded latency. Control tasks
// (weight uploads, warm-ups) are rare and must not be shed by compute load, so they bypass the
// bound.
//
// Background tasks (shadow verification, server/shadow/) form a second, lower-priority lane: the
// worker takes one only when no compute or control task is waiting, so serving work never queues
// behind background work (a running background task is not pre-empted: the most a serving task can
// wait is one background task already started). The lane itself is unbounded here; its producer
// (ShadowVerifier) bounds it. Stop() drops background tasks that have not started.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <deque>
#include <mutex>
#include <thread>

#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"

namespace fusedlayer::server {

class Executor {
 public:
  // A task gets the seconds it waited in the queue.
  using Task = absl::AnyInvocable<void(double queue_seconds) &&>;

  explicit Executor(size_t capacity);
  ~Executor();  // Stop()
  Executor(const Executor&) = delete;
  Executor& operator=(const Executor&) = delete;

  // Compute tasks: ResourceExhausted when `capacity` tasks are already waiting, Unavailable after
  // Stop(). On error the task is destroyed without running (the caller still owns the RPC).
  absl::Status Submit(Task task);
  // Control tasks: not bounded by the capacity (Unavailable after Stop()).
  absl::Status SubmitControl(Task task);
  // Background tasks: run only when the main queue is empty (Unavailable after Stop()).
  absl::Status SubmitBackground(Task task);
  // Runs every queued compute and control task, drops the background tasks that have not started,
  // then joins the worker. Idempotent.
  void Stop();

  // Test hook: while paused the worker starts no background task (they stay queued); serving and
  // control tasks run as usual.
  void PauseBackgroundForTest(bool paused);
  // Background tasks started so far, and waiting now (tests).
  uint64_t background_started() const;
  size_t background_queued() const;

  size_t capacity() const { return capacity_; }
  size_t queued() const;  // tasks waiting (not counting the running one)
  // True on the worker thread (for assertions and for refusing to block on ourselves).
  bool OnWorker() const { return std::this_thread::get_id() == worker_id_; }

 private:
  struct Item {
    Task task;
    std::chrono::steady_clock::time_point enqueued;
    bool bounded;
  };
  absl::Status Enqueue(Task task, bool bounded);
  void Loop();

  const size_t capacity_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Item> queue_;
  std::deque<Item> background_;
  bool background_paused_ = false;
  uint64_t background_started_ = 0;
  size_t bounded_queued_ = 0;  // compute tasks in queue_
  bool stopping_ = false;
  std::thread worker_;
  std::thread::id worker_id_;
};

}  // namespace fusedlayer::server
