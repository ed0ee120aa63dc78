// A background thread that runs one function every `period` until the owner is destroyed: the
// reapers of idle residual sessions and idle shared-memory regions. The function runs outside any
// lock of this class, so it may take the owner's own locks; the destructor waits for a run in
// progress to finish, so the owner must destroy its PeriodicTask before anything the function uses
// (declare it last).
#pragma once

#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>

namespace fusedlayer::server {

class PeriodicTask {
 public:
  // A period of zero or less runs nothing and starts no thread.
  PeriodicTask(std::chrono::duration<double> period, std::function<void()> run);
  ~PeriodicTask();
  PeriodicTask(const PeriodicTask&) = delete;
  PeriodicTask& operator=(const PeriodicTask&) = delete;

 private:
  void Loop();

  const std::chrono::duration<double> period_;
  const std::function<void()> run_;
  // The thread sleeps on its own std::mutex + condition variable (woken to stop).
  std::mutex mu_;
  std::condition_variable cv_;
  bool stopping_ = false;
  std::thread thread_;
};

// The period of a reaper that closes what was idle for `idle_seconds`: a quarter of it, but at most
// a second and at least 50 ms, so a thing goes within one period after its idle time.
inline std::chrono::duration<double> ReaperPeriod(double idle_seconds) {
  const double quarter = idle_seconds / 4;
  return std::chrono::duration<double>(quarter < 0.05 ? 0.05 : (quarter > 1.0 ? 1.0 : quarter));
}

}  // namespace fusedlayer::server
