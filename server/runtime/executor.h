// The per-device executor: one worker thread per device lane (--device_lanes, runtime/device_lanes.h;
// one on the CPU backend), all taking device-touching tasks from ONE queue in FIFO order: compute
// requests, weight uploads (Prepare*), warm-ups. gRPC reactors never block: they validate inline,
// Submit a task, and the task finishes the RPC from the worker. A compute task runs on its
// worker's lane (worker_index()), so while one lane's kernel runs another copies its request in.
//
// Ordering with several workers: tasks START in queue order; up to `workers` run at once, so a
// later task may finish first. Control and background tasks (they drive the backend's default
// context and the weight manager, backend.h) run one at a time, never two at once, but alongside
// compute tasks on other lanes. What still holds: a request can only name a weight set already
// published (the RPC looks it up before queueing), so an upload finishes before any request that
// uses it starts; an unload takes the set out of the registry at once, and the requests already
// holding it keep it (and its device memory) alive until their responses are built.
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
//
// Dynamic batching: a compute task may be a BatchableTask. When the worker takes one, it also takes
// the compatible compute tasks waiting in the queue (in queue order, skipping incompatible ones,
// never past a control task) while their tokens fit the budget (--max_batch_tokens), and with
// --max_queue_delay_us > 0 it waits up to that long after the first one was queued for more to
// arrive (Triton's max_queue_delay_microseconds; default 0: only what is already waiting, so no
// request is delayed). The wait lasts only while nothing else is queued: any task that cannot join
// ends it, so the delay never holds up other work. The batch runs as one launch
// (BatchableTask::RunBatch).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"

namespace fusedlayer::server {

// A compute task that dynamic batching may run in one launch with compatible queued tasks.
class BatchableTask {
 public:
  virtual ~BatchableTask() = default;
  // Tokens this task adds to a batch; a task that never batches returns false from batchable().
  virtual int64_t tokens() const = 0;
  virtual bool batchable() const = 0;
  // False once the task can no longer run (its call expired or was cancelled while queued): it
  // still goes with a batch, whose RunBatch answers it, but takes none of the batch's token budget.
  virtual bool launchable() const = 0;
  // True when `other` may share this task's launch (same op, weight set, stage, mode, path policy,
  // optional tensors and flags).
  virtual bool CompatibleWith(const BatchableTask& other) const = 0;
  // Runs the batch: batch[0] is this task, the others follow in queue order; queue_seconds[i] is
  // how long batch[i] waited. Called once per batch, on the worker.
  static void Run(std::vector<std::unique_ptr<BatchableTask>>& batch, const std::vector<double>& queue_seconds) {
    batch.front()->RunBatch(batch, queue_seconds);
  }

 private:
  virtual void RunBatch(std::vector<std::unique_ptr<BatchableTask>>& batch, const std::vector<double>& queue_seconds) = 0;
};

struct BatchingOptions {
  int64_t max_batch_tokens = 0;                 // token budget of one launch; <= 1: no batching
  std::chrono::microseconds max_queue_delay{0};  // how long the first task of a batch may wait for more
};

// Idle spinning (--executor_spin_us): a worker that finds the queue empty first polls it for up to
// `idle_spin` before it sleeps on the condition variable, so a task that arrives meanwhile starts
// at once instead of after a futex wake-up (tens of microseconds on a host whose idle cores sit in
// deep sleep states, measured as the queue stage of a small call). One worker spins at a time; the
// others sleep as before (a task the spinning worker takes wakes none of them: Enqueue), and a
// worker spins only after it ran a task or started, so an idle server burns no CPU. 0: never spin.
struct SpinOptions {
  std::chrono::microseconds idle_spin{0};
};

class Executor {
 public:
  // A task gets the seconds it waited in the queue.
  using Task = absl::AnyInvocable<void(double queue_seconds) &&>;

  // `workers` >= 1 threads take from the queue (one per device lane).
  explicit Executor(size_t capacity, BatchingOptions batching = {}, int workers = 1, SpinOptions spin = {});
  ~Executor();  // Stop()
  Executor(const Executor&) = delete;
  Executor& operator=(const Executor&) = delete;

  // Compute tasks: ResourceExhausted when `capacity` tasks are already waiting, Unavailable after
  // Stop(). On error the task is destroyed without running (the caller still owns the RPC).
  absl::Status Submit(Task task);
  // A compute task that may be batched (bounded like Submit).
  absl::Status SubmitBatchable(std::unique_ptr<BatchableTask> task);
  // Control tasks: not bounded by the capacity (Unavailable after Stop()).
  absl::Status SubmitControl(Task task);
  // Background tasks: run only when the main queue is empty (Unavailable after Stop()).
  absl::Status SubmitBackground(Task task);
  // Runs every queued compute and control task, drops the background tasks that have not started,
  // then joins the workers. Idempotent.
  void Stop();
  // Drain: from now on no batch waits out its queue delay (the server takes no new calls, so no
  // request would come to join it); a batch being formed launches at once. Work keeps running
  // until Stop().
  void EndQueueDelays();

  // Test hook: while paused the worker starts no background task (they stay queued); serving and
  // control tasks run as usual.
  void PauseBackgroundForTest(bool paused);
  // Background tasks started so far, and waiting now (tests).
  uint64_t background_started() const;
  size_t background_queued() const;

  size_t capacity() const { return capacity_; }
  size_t queued() const;  // tasks waiting (not counting the running one)
  int workers() const { return static_cast<int>(workers_.size()); }
  // True on one of this executor's workers (for assertions and for refusing to block on ourselves).
  bool OnWorker() const;
  // The index in [0, workers()) of the worker running the calling task (its lane); -1 elsewhere.
  int worker_index() const;
  // Tasks taken by a worker while it was spinning (SpinOptions), i.e. without a wake-up (tests).
  uint64_t taken_while_spinning() const { return taken_while_spinning_.load(std::memory_order_relaxed); }
  bool spinning() const { return spinning_.load(std::memory_order_acquire); }  // a worker polls now (tests)
  std::chrono::microseconds idle_spin() const { return spin_.idle_spin; }

 private:
  struct Item {
    Task task;                                // set unless `batchable` is
    std::unique_ptr<BatchableTask> batchable;
    std::chrono::steady_clock::time_point enqueued;
    bool bounded;
  };
  absl::Status Enqueue(Item item);
  // Moves the compatible batchable tasks waiting in the queue into `batch` while `tokens` (of its
  // launchable tasks) stays within the budget (mu_ held).
  void TakeCompatible(std::vector<Item>& batch, int64_t& tokens);
  // Runs a batchable item together with what dynamic batching adds to it (mu_ held on entry and
  // exit, released while the batch runs).
  void RunBatchable(Item first, std::unique_lock<std::mutex>& lock);
  void Loop(int index);
  // Polls for serving work for up to spin_.idle_spin (mu_ not held); true when some may be there.
  bool SpinForWork();
  // queue_.size() and stopping_, readable without mu_ (written under it) for the spinning worker.
  void PublishQueueState() {
    queue_hint_.store(queue_.size(), std::memory_order_release);
    stopping_hint_.store(stopping_, std::memory_order_release);
  }

  const size_t capacity_;
  const BatchingOptions batching_;
  const SpinOptions spin_;
  std::atomic<size_t> queue_hint_{0};
  std::atomic<bool> stopping_hint_{false};
  std::atomic<bool> spinning_{false};  // one worker spins at a time
  std::atomic<uint64_t> taken_while_spinning_{0};
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Item> queue_;
  std::deque<Item> background_;
  bool background_paused_ = false;
  uint64_t background_started_ = 0;
  size_t bounded_queued_ = 0;  // compute tasks in queue_
  bool stopping_ = false;
  bool queue_delays_ended_ = false;  // EndQueueDelays()
  bool background_running_ = false;  // a background task has started and not finished
  // Workers taking compatible tasks into their batch (RunBatchable): the others leave the queue to
  // them until they launch, so a batch gets what a single worker would have given it.
  int forming_batches_ = 0;
  // Held while a control or background task runs: they drive the backend's default context and
  // the weight manager, which are single-threaded (backend.h).
  std::mutex serial_mu_;
  std::vector<std::thread> workers_;  // filled in the constructor, before any task is accepted
};

}  // namespace fusedlayer::server
