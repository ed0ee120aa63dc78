// Measurement build only (never in a production build): wall time of each step of a compute call,
// on the gRPC thread (from the handler's start to the hand-off to the executor: the `decode` stage
// of ExecutionReport.stages) and on the executor's lane path (the `copy_in` and `device` stages).
// decode_steps.patch (next to this file) puts the marks into server/rpc/compute_rpcs.cc,
// server/rpc/wire_messages.cc and server/exec/op_calls.cc. Every kReportEvery calls of an op, the
// median of each step over those calls goes to stderr as one line:
//   [steps] op=swa part=grpc n=2000 setup=0.41 drain=0.05 ... total=43.1   (us)
// Steps a call did not pass through count as 0. Why it exists: session 22's perf profile could
// not split the ~40-47 us decode stage of small calls on the H200 host (no frame pointers).
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <mutex>
#include <vector>

namespace fusedlayer::decode_steps {

enum Part { kGrpc = 0, kLane = 1, kParts };
enum Step {
  // gRPC thread (Part kGrpc)
  kSetup,          // call objects made (the clock starts at ComputeCall's constructor)
  kDrain,          // AdmitDuringDrain
  kDump,           // ReadWireRequest: ByteBuffer::Dump into slices
  kAcquire,        // ReadWireRequest: a pinned block from the pool
  kScan,           // ReadWireRequest: the scan of the wire bytes (skeleton and pieces)
  kSkeleton,       // ReadWireRequest: protobuf parse of the skeleton
  kWireClear,      // ReadWireRequest: gRPC's slices released
  kCopy,           // ReadWireRequest: the tensor bytes copied into the pinned block
  kReadTail,       // ReadWireRequest: the views recorded (or ParseWireRequest on the fallback)
  kWeights,        // CheckPreference, weights_.Get, the part check
  kAdmit,          // ResponseBytes and AdmitComputeBytes
  kTransfer,       // shared-memory transfer, session, shadow sample
  kDecode,         // Rpc::Decode (views, output buffers)
  kSubmit,         // request id, task made, SubmitBatchable
  // executor (Part kLane)
  kLaneStage,      // LaneStaging::Stage (block, device buffer, H2D enqueue)
  kLaneEnqueue,    // the op's kernels enqueued (EnqueueMhc / EnqueueSwa)
  kLaneCopyBack,   // EnqueueCopiesBack
  kLaneFinish,     // Finish: the lane's Wait and the outputs lent or copied
  kSteps
};
inline constexpr const char* kStepNames[kSteps] = {
    "setup", "drain", "dump", "acquire", "scan", "skeleton", "wire_clear", "copy", "read_tail", "weights",
    "admit", "transfer", "decode", "submit", "lane_stage", "lane_enqueue", "lane_copyback", "lane_finish"};
inline constexpr int kReportEvery = 2000;

using Clock = std::chrono::steady_clock;

struct ThreadState {
  Clock::time_point last{};
  int op = 0;
  float us[kSteps] = {};
};
inline thread_local ThreadState tls;

struct Recorder {
  std::mutex mu;
  std::vector<float> samples[2][kParts][kSteps + 1];  // op, part, step (+ the part's total)
  static Recorder& Get() {
    static Recorder* r = new Recorder();
    return *r;
  }
};

// Starts a part: its first step is measured from `start`.
inline void Begin(int op, Clock::time_point start) {
  tls = ThreadState{};
  tls.op = op;
  tls.last = start;
}
inline void Mark(Step s) {
  const auto now = Clock::now();
  tls.us[s] += std::chrono::duration<float, std::micro>(now - tls.last).count();
  tls.last = now;
}
// Ends a part: records this call's steps, and prints the medians every kReportEvery calls.
inline void End(Part part) {
  Recorder& r = Recorder::Get();
  std::lock_guard<std::mutex> lock(r.mu);
  auto& row = r.samples[tls.op][part];
  float total = 0;
  for (int s = 0; s < kSteps; ++s) {
    row[s].push_back(tls.us[s]);
    total += tls.us[s];
  }
  row[kSteps].push_back(total);
  if (row[kSteps].size() < kReportEvery) return;
  auto median = [](std::vector<float>& v) {
    std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
    return v[v.size() / 2];
  };
  std::fprintf(stderr, "[steps] op=%s part=%s n=%zu", tls.op == 0 ? "mhc" : "swa", part == kGrpc ? "grpc" : "lane",
               row[kSteps].size());
  for (int s = 0; s < kSteps; ++s) {
    if ((s >= kLaneStage) != (part == kLane)) continue;
    std::fprintf(stderr, " %s=%.2f", kStepNames[s], median(row[s]));
  }
  std::fprintf(stderr, " total=%.2f\n", median(row[kSteps]));
  for (auto& v : row) v.clear();
}

}  // namespace fusedlayer::decode_steps
