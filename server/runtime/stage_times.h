// Wall time of the executor-side stages of one compute call (ExecutionReport.stages in the proto
// says what each covers). Filled by the code at the real boundaries (runtime/op_calls.cc,
// runtime/device_staging.cc) with the steady clock; a call that runs twice (a fused failure re-run
// unfused) adds both runs up.
#pragma once

#include <chrono>

namespace fusedlayer::server {

struct StageTimes {
  double copy_in = 0;   // host -> pinned staging memcpy + enqueueing the H2D copies
  double device = 0;    // end of copy_in to the lane's Wait() returning (the whole run on a CPU)
  double copy_out = 0;  // staging -> response tensors memcpy
};

inline double SecondsBetween(std::chrono::steady_clock::time_point a, std::chrono::steady_clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

}  // namespace fusedlayer::server
