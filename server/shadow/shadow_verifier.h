// Shadow verification (README "Shadow verification", docs/shadow.md): for a sampled request that
// ran fused, the unfused path runs again on the same inputs after the response has been sent, and
// every output is compared against the contract's fused-vs-unfused tolerance (shadow/compare.h).
//
//   sampling   --shadow_sample_rate in [0, 1] (0: off), per request that ran fused with T > 0.
//   capture    on the executor, before the response is sent: when the shadow queue has room
//              (--shadow_queue_size jobs AND --shadow_queue_max_bytes host bytes, the bytes being
//              those of the request and the fused outputs the job keeps alive), the job takes a
//              reference on the RPC's own request and response messages (shadow/shared_messages.h:
//              FusedLayerService registers a reference-counted gRPC MessageAllocator), so nothing
//              is copied and the sampled response is not delayed; when it has no room, no reference
//              is taken and fusedlayer_shadow_dropped_total{op} counts the request. The messages
//              are freed when both the RPC (gRPC's Release) and the job are done with them; the
//              job only reads them.
//   run        the job goes to the executor's background lane (Executor::SubmitBackground), which
//              the worker serves only when no compute or control task is waiting.
//   record     fusedlayer_shadow_* metrics (metrics/shadow_metrics.h); on a mismatch one WARNING
//              line (request id, op, weight set, outputs and their diffs) and, with
//              --shadow_dump_dir, a dump (shadow/shadow_dump.h).
//
// Verify (request field `verify`): the same comparison, synchronously in the request's own
// executor job, returned in the response's Verification; it is recorded in the same metrics, logs
// and metrics as sampled comparisons; its mismatch dumps go to <dump_dir>/verify under their own
// bounds (verify_dump_max_files / _bytes): a client asks for verify, so its dumps must not use up
// the budget of the sampled dumps an operator relies on. How many verify calls run at once is
// bounded by the service (--max_inflight_verify).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "runtime/executor.h"
#include "fusedlayer/backend.h"
#include "runtime/serving_devices.h"
#include "fusedlayer/v1/fusedlayer.pb.h"
#include "prometheus/registry.h"
#include "shadow/compare.h"
#include "shadow/shadow_dump.h"
#include "metrics/shadow_metrics.h"
#include "shadow/shared_messages.h"
#include "weights/weight_set.h"

namespace fusedlayer::server::shadow {

struct ShadowOptions {
  double sample_rate = 0;                          // --shadow_sample_rate
  int64_t queue_size = 4;                          // --shadow_queue_size (jobs)
  uint64_t queue_max_bytes = uint64_t{256} << 20;  // --shadow_queue_max_bytes
  std::string dump_dir;                            // --shadow_dump_dir (empty: no dumps)
  int64_t dump_max_files = 32;                     // --shadow_dump_max_files
  uint64_t dump_max_bytes = uint64_t{1} << 30;     // --shadow_dump_max_bytes
  int64_t verify_dump_max_files = 8;               // --verify_dump_max_files (in dump_dir/verify)
  uint64_t verify_dump_max_bytes = uint64_t{256} << 20;  // --verify_dump_max_bytes
  std::string backend;                             // written into dumps (with the call's device)
};

// Where the unfused runs of the calls that ran on one device go: that device's backend (its
// default context) and executor (its background lane).
struct ShadowDevice {
  Backend* backend = nullptr;
  Executor* executor = nullptr;
  std::string label;  // the metrics' `device` label ("cuda:1")
};

class ShadowVerifier {
 public:
  class Job;  // a captured request; releases its queue reservation when destroyed

  // InvalidArgument when the dump directory cannot be used. `devices`: by the server's device
  // ordinal; a call's comparison runs on the device the call ran on (the `device` arguments below).
  static absl::StatusOr<std::unique_ptr<ShadowVerifier>> Create(ShadowOptions options, std::vector<ShadowDevice> devices,
                                                                prometheus::Registry& registry);
  static absl::StatusOr<std::unique_ptr<ShadowVerifier>> Create(ShadowOptions options, Backend& backend,
                                                                Executor& executor, prometheus::Registry& registry) {
    return Create(std::move(options), {ShadowDevice{&backend, &executor, DeviceLabel(backend.kind(), DeviceIdOf(backend))}},
                  registry);
  }
  ~ShadowVerifier();

  // Bernoulli(sample_rate); thread-safe.
  bool Sample();

  // On the worker, after a fused run and before the response is sent (so while the RPC's own
  // reference is alive): a job holding a reference to the call's messages `held` (no copy), or
  // null (and the drop counted) when the queue is full or `held` is null (the method has no
  // SharedMessageAllocator). The job only reads them; the caller must not write them after this.
  std::unique_ptr<Job> CaptureMhc(std::shared_ptr<const WeightSet> set, MhcMessages* held, size_t device = 0);
  std::unique_ptr<Job> CaptureSwa(std::shared_ptr<const WeightSet> set, SwaMessages* held, size_t device = 0);
  // After the response was sent: queue the job on the background lane.
  void Submit(std::unique_ptr<Job> job);

  // Synchronous comparison of a fused response (on the worker; verify = true).
  v1::Verification VerifyMhc(const WeightSet& set, const v1::MhcSeamRequest& request,
                             const v1::MhcSeamResponse& fused, size_t device = 0);
  v1::Verification VerifySwa(const WeightSet& set, const v1::SwaNormQuantRequest& request,
                             const v1::SwaNormQuantResponse& fused, size_t device = 0);

  const ShadowOptions& options() const { return options_; }
  size_t queued_jobs() const;

 private:
  ShadowVerifier(ShadowOptions options, std::vector<ShadowDevice> devices, prometheus::Registry& registry);
  bool Reserve(Op op, uint64_t bytes);
  void Release(uint64_t bytes);
  void Run(Job& job);
  // Runs unfused on the request's inputs into *unfused and compares; an error when the unfused run
  // failed (counted, logged; no comparison).
  absl::StatusOr<Comparison> CompareMhcOnWorker(size_t device, const WeightSet& set, const v1::MhcSeamRequest& request,
                                                const v1::MhcSeamResponse& fused, v1::MhcSeamResponse* unfused);
  absl::StatusOr<Comparison> CompareSwaOnWorker(size_t device, const WeightSet& set,
                                                const v1::SwaNormQuantRequest& request,
                                                const v1::SwaNormQuantResponse& fused,
                                                v1::SwaNormQuantResponse* unfused);
  // Metrics, and on a mismatch the log line and the dump (metadata "source" = "verify" picks the
  // verify writer).
  void Record(size_t device, Op op, const WeightSet& set, const std::string& request_id, const Comparison& comparison,
              const google::protobuf::Message& request, const google::protobuf::Message& fused,
              const google::protobuf::Message& unfused, std::map<std::string, std::string> metadata);

  const ShadowOptions options_;
  const std::vector<ShadowDevice> devices_;
  ShadowMetrics metrics_;
  std::unique_ptr<ShadowDumpWriter> dumps_;         // sampled comparisons: dump_dir
  std::unique_ptr<ShadowDumpWriter> verify_dumps_;  // verify = true: dump_dir/verify
  mutable std::mutex mu_;
  std::mt19937_64 rng_;
  size_t jobs_ = 0;       // reserved: captured and not yet destroyed
  uint64_t bytes_ = 0;
};

// A captured request: a reference to the RPC's request and fused response (read only), holding a
// queue reservation that it releases when destroyed (after it ran, or when the executor dropped it
// at shutdown); destroying it also drops its reference to the messages.
class ShadowVerifier::Job {
 public:
  Job(ShadowVerifier& owner, Op op, uint64_t bytes, std::shared_ptr<const WeightSet> set, MhcMessagesRef mhc,
      SwaMessagesRef swa, size_t device = 0)
      : owner_(owner),
        op_(op),
        bytes_(bytes),
        device_(device),
        set_(std::move(set)),
        mhc_(std::move(mhc)),
        swa_(std::move(swa)) {}
  ~Job() { owner_.Release(bytes_); }
  Job(const Job&) = delete;
  Job& operator=(const Job&) = delete;

  Op op() const { return op_; }
  uint64_t bytes() const { return bytes_; }
  size_t device() const { return device_; }  // where the call ran: its comparison runs there too
  const WeightSet& set() const { return *set_; }
  // The RPC's own messages (op kMhc / kSwa respectively).
  const v1::MhcSeamRequest& mhc_request() const { return mhc_.request(); }
  const v1::MhcSeamResponse& mhc_fused() const { return mhc_.response(); }
  const v1::SwaNormQuantRequest& swa_request() const { return swa_.request(); }
  const v1::SwaNormQuantResponse& swa_fused() const { return swa_.response(); }

 private:
  ShadowVerifier& owner_;
  const Op op_;
  const uint64_t bytes_;
  const size_t device_;
  const std::shared_ptr<const WeightSet> set_;
  const MhcMessagesRef mhc_;
  const SwaMessagesRef swa_;
};

}  // namespace fusedlayer::server::shadow
