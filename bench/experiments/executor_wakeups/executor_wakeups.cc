// Wake-ups per task of the executor (server/runtime/executor.h) as a concurrency-1 caller of a GPU
// server with 4 lanes uses it: 4 workers with idle spinning (--executor_spin_us=500), one thread
// submitting a trivial task, waiting for it to run, then spending ~100 us elsewhere (its round
// trip) before the next. Prints wall and CPU time per task, the process's context switches per
// task (getrusage) and the queue wait. Measurement only: never linked into fusedlayer.
//
//   g++ -O2 -std=c++20 -Iserver bench/experiments/executor_wakeups/executor_wakeups.cc \
//       server/runtime/executor.cc -labsl_status -labsl_strings -lpthread -o /tmp/executor_wakeups
//   /tmp/executor_wakeups 4     (workers; 1 for the one-lane baseline)
#include <sys/resource.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

#include "runtime/executor.h"

using fusedlayer::server::Executor;
using fusedlayer::server::SpinOptions;

int main(int argc, char** argv) {
  const int workers = argc > 1 ? std::atoi(argv[1]) : 4;
  constexpr int kTasks = 20000;
  Executor ex(64, {}, workers, SpinOptions{std::chrono::microseconds(500)});
  std::atomic<int> done{0};
  std::vector<double> queued;
  queued.reserve(kTasks);
  const auto elsewhere = [] {  // the caller's round trip between two calls
    const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(100);
    while (std::chrono::steady_clock::now() < until) std::this_thread::yield();
  };
  const auto call = [&](bool record) {
    const int want = done.load() + 1;
    if (!ex.Submit([&, record](double s) {
              if (record) queued.push_back(s);
              ++done;
            }).ok()) {
      std::abort();
    }
    while (done.load() < want) {
    }
    elsewhere();
  };
  for (int i = 0; i < 200; ++i) call(false);  // warm-up
  rusage before, after;
  getrusage(RUSAGE_SELF, &before);
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < kTasks; ++i) call(true);
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  getrusage(RUSAGE_SELF, &after);
  const auto us = [](timeval t) { return double(t.tv_sec) * 1e6 + double(t.tv_usec); };
  const double cpu = us(after.ru_utime) - us(before.ru_utime) + us(after.ru_stime) - us(before.ru_stime);
  std::sort(queued.begin(), queued.end());
  std::printf(
      "workers=%d wall/task %.1f us  cpu/task %.1f us  voluntary ctx/task %.2f  involuntary ctx/task %.2f  "
      "queue p50 %.2f us p90 %.2f us\n",
      workers, wall * 1e6 / kTasks, cpu / kTasks, double(after.ru_nvcsw - before.ru_nvcsw) / kTasks,
      double(after.ru_nivcsw - before.ru_nivcsw) / kTasks, queued[kTasks / 2] * 1e6, queued[kTasks * 9 / 10] * 1e6);
  ex.Stop();
}
