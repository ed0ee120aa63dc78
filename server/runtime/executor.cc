#include "runtime/executor.h"

#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"

namespace fusedlayer::server {
namespace {
double SecondsSince(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// One step of a spin-wait: tells the core (and a hyper-thread sibling) that this thread is polling.
inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#else
  std::this_thread::yield();
#endif
}
}  // namespace

// Which executor and worker the current thread is (set once when a worker starts).
static thread_local const Executor* tls_executor = nullptr;
static thread_local int tls_worker_index = -1;

Executor::Executor(size_t capacity, BatchingOptions batching, int workers, SpinOptions spin)
    : capacity_(capacity), batching_(batching), spin_(spin) {
  const int n = workers < 1 ? 1 : workers;
  workers_.reserve(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) workers_.emplace_back([this, i] { Loop(i); });
}

bool Executor::OnWorker() const { return tls_executor == this; }

int Executor::worker_index() const { return tls_executor == this ? tls_worker_index : -1; }

Executor::~Executor() { Stop(); }

absl::Status Executor::Submit(Task task) {
  return Enqueue(Item{std::move(task), nullptr, std::chrono::steady_clock::now(), /*bounded=*/true});
}
absl::Status Executor::SubmitBatchable(std::unique_ptr<BatchableTask> task) {
  return Enqueue(Item{Task(), std::move(task), std::chrono::steady_clock::now(), /*bounded=*/true});
}
absl::Status Executor::SubmitControl(Task task) {
  return Enqueue(Item{std::move(task), nullptr, std::chrono::steady_clock::now(), /*bounded=*/false});
}

absl::Status Executor::SubmitBackground(Task task) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return absl::UnavailableError("the server is shutting down");
    background_.push_back(Item{std::move(task), nullptr, std::chrono::steady_clock::now(), false});
  }
  cv_.notify_one();
  return absl::OkStatus();
}

void Executor::PauseBackgroundForTest(bool paused) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    background_paused_ = paused;
  }
  cv_.notify_all();
}

uint64_t Executor::background_started() const {
  std::lock_guard<std::mutex> lock(mu_);
  return background_started_;
}

size_t Executor::background_queued() const {
  std::lock_guard<std::mutex> lock(mu_);
  return background_.size();
}

absl::Status Executor::Enqueue(Item item) {
  enum class Wake { kNone, kOne, kAll } wake = Wake::kOne;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return absl::UnavailableError("the server is shutting down");
    if (item.bounded && bounded_queued_ >= capacity_) {
      return absl::ResourceExhaustedError(
          absl::StrCat("device queue full (", capacity_, " requests waiting; --queue_capacity); retry later"));
    }
    if (item.bounded) ++bounded_queued_;
    queue_.push_back(std::move(item));
    PublishQueueState();
    // Whom to wake. A worker forming a batch waits for arrivals beside idle workers that may not
    // take them (Loop): everyone. Else one sleeper is enough, and none when the queue was empty
    // and a worker is polling it (SpinForWork): that worker takes this task, since it clears
    // `spinning_` before it takes the lock and then looks at the queue under it. Why not always
    // everyone: with 4 lanes, waking the 3 sleepers for every task that the spinner takes anyway
    // cost a c1 caller ~3 context switches per call and its executor's cores the CPU of them
    // (bench/experiments/executor_wakeups). A second task queued behind the first still wakes a
    // sleeper, so a burst never waits for the spinner's task to finish.
    if (forming_batches_ > 0) {
      wake = Wake::kAll;
    } else if (queue_.size() == 1 && spinning_.load(std::memory_order_acquire)) {
      wake = Wake::kNone;
    }
  }
  if (wake == Wake::kAll) cv_.notify_all();
  if (wake == Wake::kOne) cv_.notify_one();
  return absl::OkStatus();
}

size_t Executor::queued() const {
  std::lock_guard<std::mutex> lock(mu_);
  return queue_.size();
}

bool Executor::SpinForWork() {
  if (queue_hint_.load(std::memory_order_acquire) > 0 || stopping_hint_.load(std::memory_order_acquire)) return false;
  bool expected = false;
  if (!spinning_.compare_exchange_strong(expected, true, std::memory_order_acq_rel)) return false;
  const auto deadline = std::chrono::steady_clock::now() + spin_.idle_spin;
  bool found = false;
  for (unsigned i = 1;; ++i) {
    if (queue_hint_.load(std::memory_order_acquire) > 0 || stopping_hint_.load(std::memory_order_acquire)) {
      found = true;
      break;
    }
    CpuRelax();
    // The clock is read every 64 polls: ~1-3 us apart, far below any useful spin.
    if (i % 64 == 0 && std::chrono::steady_clock::now() >= deadline) break;
  }
  spinning_.store(false, std::memory_order_release);
  return found;
}

void Executor::Loop(int index) {
  tls_executor = this;
  tls_worker_index = index;
  for (;;) {
    Item item;
    bool background = false;
    // Before taking the lock: poll for work instead of sleeping on the condition variable at once.
    const bool spun = spin_.idle_spin.count() > 0 && SpinForWork();
    {
      std::unique_lock<std::mutex> lock(mu_);
      // One background task at a time: the other workers stay free for serving work.
      const auto background_ready = [this] {
        return !stopping_ && !background_paused_ && !background_running_ && !background_.empty();
      };
      // While another worker is forming a batch (its queue delay), the queue is its to take from:
      // it ends the wait as soon as something it cannot batch arrives, then wakes us all.
      const auto serving_ready = [this] { return !queue_.empty() && forming_batches_ == 0; };
      cv_.wait(lock, [&] { return stopping_ || serving_ready() || background_ready(); });
      if (serving_ready()) {
        item = std::move(queue_.front());
        queue_.pop_front();
        PublishQueueState();
        if (spun) taken_while_spinning_.fetch_add(1, std::memory_order_relaxed);
        if (item.bounded) --bounded_queued_;
        if (item.batchable) {
          // Without releasing the lock: no other worker takes a task this batch could have had.
          RunBatchable(std::move(item), lock);
          continue;
        }
      } else if (background_ready()) {
        // Only from an empty main queue: serving work never waits behind background work.
        ++background_started_;
        background_running_ = true;
        background = true;
        item = std::move(background_.front());
        background_.pop_front();
      } else if (stopping_) {
        return;  // stopping and drained (background tasks are dropped by Stop)
      } else {
        continue;  // woken for a background task another worker is already running
      }
    }
    if (item.bounded) {
      std::move(item.task)(SecondsSince(item.enqueued));  // a plain compute task: on this worker's lane
    } else {
      std::lock_guard<std::mutex> serial(serial_mu_);
      std::move(item.task)(SecondsSince(item.enqueued));
      item.task = nullptr;  // its captures are released under serial_mu_ too
    }
    if (background) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        background_running_ = false;
      }
      cv_.notify_all();  // another worker may take the next background task
    }
  }
}

namespace {
// What a task takes of a batch's token budget: an expired or cancelled one joins (its answer comes
// with the batch) but takes none.
int64_t BudgetTokens(const BatchableTask& task) { return task.launchable() ? task.tokens() : 0; }
}  // namespace

void Executor::TakeCompatible(std::vector<Item>& batch, int64_t& tokens) {
  const BatchableTask& first = *batch.front().batchable;
  for (auto it = queue_.begin(); it != queue_.end() && tokens < batching_.max_batch_tokens;) {
    if (!it->bounded) break;  // a control task (upload, unload, warm-up) is a barrier
    BatchableTask* candidate = it->batchable.get();
    if (candidate == nullptr || !candidate->batchable() || !first.CompatibleWith(*candidate)) {
      ++it;
      continue;
    }
    const int64_t cost = BudgetTokens(*candidate);
    if (tokens + cost > batching_.max_batch_tokens) {
      ++it;
      continue;
    }
    tokens += cost;
    --bounded_queued_;
    batch.push_back(std::move(*it));
    it = queue_.erase(it);
    PublishQueueState();
  }
}

void Executor::RunBatchable(Item first, std::unique_lock<std::mutex>& lock) {
  std::vector<Item> items;
  const bool batching = first.batchable->batchable() && batching_.max_batch_tokens > 1;
  const auto deadline = first.enqueued + batching_.max_queue_delay;
  items.push_back(std::move(first));
  if (batching) {
    ++forming_batches_;
    for (;;) {
      // Counted anew each time: a member that expired or was cancelled meanwhile gives its share back.
      int64_t tokens = 0;
      for (const Item& item : items) tokens += BudgetTokens(*item.batchable);
      TakeCompatible(items, tokens);
      // The delay is spent only while the device would otherwise idle: other work waiting (a task
      // that cannot join, or over the budget) ends it, so no request waits for another's batch. A
      // batch with nothing left to launch is answered at once.
      if (tokens == 0 || tokens >= batching_.max_batch_tokens || stopping_ || queue_delays_ended_ ||
          !queue_.empty() || std::chrono::steady_clock::now() >= deadline) {
        break;
      }
      // Woken by every Enqueue (and Stop): look again for arrivals until the deadline.
      cv_.wait_until(lock, deadline);
    }
    --forming_batches_;
    cv_.notify_all();  // the other workers may take what is left in the queue
  }
  lock.unlock();
  std::vector<std::unique_ptr<BatchableTask>> batch;
  std::vector<double> waited;
  for (Item& item : items) {
    waited.push_back(SecondsSince(item.enqueued));
    batch.push_back(std::move(item.batchable));
  }
  BatchableTask::Run(batch, waited);
  batch.clear();  // the tasks' destructors run outside the lock
  lock.lock();
}

void Executor::EndQueueDelays() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_delays_ended_ = true;
  }
  cv_.notify_all();  // a worker waiting in RunBatchable looks again, and launches
}

void Executor::Stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    bool joined = stopping_;
    for (const std::thread& t : workers_) joined = joined && !t.joinable();
    if (joined) return;
    stopping_ = true;
    PublishQueueState();
  }
  cv_.notify_all();
  for (std::thread& t : workers_) {
    if (t.joinable() && t.get_id() != std::this_thread::get_id()) t.join();
  }
  std::deque<Item> dropped;
  {
    std::lock_guard<std::mutex> lock(mu_);
    dropped.swap(background_);
  }
  // Destroyed outside the lock: a task's destructor may release resources of its producer.
}

}  // namespace fusedlayer::server
