// Concurrency tests that run under ThreadSanitizer in CI (scripts/sanitize.sh tsan), and in every
// other build as ordinary tests. They drive the server's shared state from many threads using only
// synchronisation TSan can see: std::mutex / std::condition_variable / std::thread (intercepted in
// libc and libstdc++) and absl::Mutex through server/common/annotated_mutex.h. The gRPC transport is not
// part of the TSan run: Debian's libgrpc is not instrumented, so its internal hand-offs between
// threads are invisible to TSan (docs/operations.md, "Sanitizers and fuzzing").
//
// Each test deliberately touches plain (non-atomic) data from more than one thread where the code
// under test promises the ordering: the executor's worker owns task state, the thread pool's blocks
// write disjoint ranges that the caller reads back, WeightStore readers copy what writers publish.
// A missing happens-before edge in that code is a TSan report and fails the run.
#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "runtime/executor.h"
#include "gtest/gtest.h"
#include "thread_pool.h"
#include "exec/weight_store.h"

namespace fusedlayer::server {
namespace {

// Many producers submit compute, control and background tasks while the server stops: every accepted
// compute/control task runs exactly once on the worker, background tasks run or are dropped, and
// state the tasks share is plain data owned by the worker (the executor's contract, executor.h).
TEST(Concurrency, ExecutorManyProducersWhileStopping) {
  Executor ex(/*capacity=*/4);
  struct Owned {
    int64_t runs = 0;       // only the worker touches these
    int64_t off_worker = 0;
    std::vector<int> seen;  // producer ids in run order
  } owned;
  std::atomic<int64_t> accepted{0}, accepted_background{0}, rejected{0}, unavailable{0};
  std::atomic<bool> go{false};
  constexpr int kProducers = 4, kPerProducer = 300;
  std::vector<std::thread> producers;
  for (int p = 0; p < kProducers; ++p) {
    producers.emplace_back([&, p] {
      while (!go.load()) std::this_thread::yield();
      for (int i = 0; i < kPerProducer; ++i) {
        auto task = [&, p](double queue_seconds) {
          owned.runs++;
          if (!ex.OnWorker()) owned.off_worker++;
          owned.seen.push_back(p);
          EXPECT_GE(queue_seconds, 0.0);
        };
        absl::Status s = i % 3 == 0   ? ex.Submit(task)
                         : i % 3 == 1 ? ex.SubmitControl(task)
                                      : ex.SubmitBackground(task);
        if (s.ok()) {
          if (i % 3 != 2) ++accepted; else ++accepted_background;
        } else if (absl::IsResourceExhausted(s)) {
          ++rejected;
        } else {
          EXPECT_TRUE(absl::IsUnavailable(s)) << s;
          ++unavailable;
        }
      }
    });
  }
  go = true;
  // Stop while the producers are still submitting (some of them): Stop drains what was accepted.
  while (accepted.load() < kPerProducer) std::this_thread::yield();
  ex.Stop();
  for (auto& t : producers) t.join();
  // Stop joined the worker: its writes happen-before these reads.
  EXPECT_EQ(owned.runs, accepted.load() + static_cast<int64_t>(ex.background_started()));
  EXPECT_EQ(owned.off_worker, 0);
  EXPECT_EQ(static_cast<int64_t>(owned.seen.size()), owned.runs);
  EXPECT_LE(static_cast<int64_t>(ex.background_started()), accepted_background.load());
  EXPECT_EQ(ex.background_queued(), 0u);  // Stop dropped the background tasks that had not started
  EXPECT_EQ(accepted + accepted_background + rejected + unavailable, kProducers * kPerProducer);
  EXPECT_EQ(ex.queued(), 0u);
}

// The CPU backend's pool: blocks write disjoint ranges of a plain vector, the caller reads them back
// after ParallelFor returns, and inputs the caller wrote before the call are read by the workers.
TEST(Concurrency, ThreadPoolJobsAreOrderedWithTheCaller) {
  cpu::ThreadPool pool(4);
  ASSERT_EQ(pool.num_threads(), 4);
  std::vector<int64_t> in, out;
  for (int job = 0; job < 200; ++job) {
    const int64_t count = 1 + (job * 37) % 1000;
    in.assign(count, 0);
    for (int64_t i = 0; i < count; ++i) in[i] = i * 3 + job;  // written by the caller
    out.assign(count, -1);
    pool.ParallelFor(count, 1 + job % 16, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) out[i] = in[i] + 1;  // read by a worker
    });
    for (int64_t i = 0; i < count; ++i) ASSERT_EQ(out[i], i * 3 + job + 1) << "job " << job << " i " << i;
  }
}

std::shared_ptr<const WeightSet> FakeSet(const std::string& name, uint64_t bytes) {
  auto s = std::make_shared<WeightSet>();
  s->name = name;
  s->source = "test";
  s->sha256 = std::string(64, static_cast<char>('a' + bytes % 6));
  s->resident_bytes = bytes;
  return s;
}

// WeightStore (absl::Mutex through annotated_mutex.h): readers Get / List / resident_bytes / size
// while writers publish, replace and unload. Readers copy every field of the sets they see.
TEST(Concurrency, WeightStoreReadersWhileWritersPublishReplaceUnload) {
  WeightStore store;
  std::atomic<bool> stop{false};
  std::atomic<int64_t> reads{0}, bad{0};
  std::vector<std::thread> threads;
  // Readers 0 and 1 only Get (so nothing else they do orders them with the writers), reader 2 takes
  // the listing calls.
  for (int r = 0; r < 3; ++r) {
    threads.emplace_back([&, r] {
      while (!stop.load()) {
        if (r < 2) {
          if (auto s = store.Get(r ? "a" : "b"); s.ok()) {
            const std::string copy = (*s)->name + (*s)->sha256;
            if (copy.size() != 65 || (*s)->resident_bytes == 0) ++bad;
          }
        } else {
          for (const auto& s : store.List()) {
            if (s->name.size() != 1) ++bad;
          }
          if (store.size() > 2) ++bad;
          (void)store.resident_bytes();
        }
        ++reads;
      }
    });
  }
  for (int w = 0; w < 2; ++w) {
    threads.emplace_back([&, w] {
      const std::string name = w ? "a" : "b";
      for (int i = 1; i <= 3000; ++i) {
        (void)store.Publish(FakeSet(name, i), /*replace=*/i % 2 == 0);
        if (i % 7 == 0) (void)store.Unload(name);
      }
    });
  }
  threads[3].join();
  threads[4].join();
  while (reads.load() < 100) std::this_thread::yield();
  stop = true;
  for (int r = 0; r < 3; ++r) threads[r].join();
  EXPECT_EQ(bad.load(), 0);
  uint64_t sum = 0;
  for (const auto& s : store.List()) sum += s->resident_bytes;
  EXPECT_EQ(store.resident_bytes(), sum);
}

}  // namespace
}  // namespace fusedlayer::server
