// The service's request and weight-set series (names fixed in docs/conventions.md and design.md);
// the components' series are component_metrics.h, shadow verification's shadow_metrics.h. Every
// handle used on a request path is created once here and cached: prometheus-cpp's Family::Add
// takes a mutex, Counter/Gauge updates are lock-free atomics. Every op x path and op x reason
// series is pre-created at 0 so dashboards and alerts see a 0 rather than a missing series.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "config.h"
#include "fusedlayer/fallback.h"
#include "grpcpp/support/status.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"

namespace fusedlayer::server {

// The RPCs, as the "method" label (the RPC's short name).
enum class Method : uint8_t {
  kMhcSeam,
  kSwaNormQuant,
  kLoadWeights,
  kListWeightSets,
  kUnloadWeightSet,
  kGetServerInfo,
  kRegisterSystemSharedMemory,
  kSystemSharedMemoryStatus,
  kUnregisterSystemSharedMemory,
  kRegisterCudaSharedMemory,
  kCudaSharedMemoryStatus,
  kUnregisterCudaSharedMemory,
  kOpenResidualSession,
  kListResidualSessions,
  kCloseResidualSession,
  kCommitWeightSets,
  kOpenCallRing,
};
inline constexpr int kNumMethods = 17;
const char* MethodName(Method m);
// gRPC code name as the "code" label: "OK", "INVALID_ARGUMENT", ...
const char* StatusCodeName(grpc::StatusCode code);

// One compute request's stages, seconds (ExecutionReport.stages and queue_seconds).
struct RequestStages {
  double decode, queue, copy_in, device, copy_out, response;
};
inline constexpr int kNumStages = 6;

class Metrics {
 public:
  // `devices`: the serving devices' labels ("cpu:0", "cuda:1"), by ordinal: every op series, the
  // queue histogram and the resident-bytes gauge carry the `device` label of the device it is about.
  Metrics(std::string_view version, std::string_view backend, std::string_view arch,
          const std::vector<std::string>& devices = {});
  // One device.
  Metrics(std::string_view version, std::string_view backend, std::string_view arch, std::string device)
      : Metrics(version, backend, arch, std::vector<std::string>{std::move(device)}) {}
  // Creates the series of one more device (ordinal = the devices so far), every one at 0. Before
  // serving starts only: the series arrays are not guarded.
  int AddDevice(const std::string& label);

  const std::shared_ptr<prometheus::Registry>& registry() const { return registry_; }
  // The text exposition of the registry (what /metrics serves, minus the Exposer's own metrics).
  std::string Serialize() const;

  // `device`: the ordinal of the serving device the op ran (or is about) on.
  void RecordExecution(int device, Op op, Path path, double kernel_seconds);
  void RecordFallback(int device, Op op, FallbackReason reason);
  void SetFusedAvailable(int device, Op op, bool available);
  void RecordRequest(Method method, grpc::StatusCode code, double seconds, uint64_t request_bytes,
                     uint64_t response_bytes);
  void InflightAdd(double delta) { inflight_->Increment(delta); }
  // fusedlayer_cancelled_calls_total{method}: a unary call gRPC reported cancelled while the server
  // held it (the client cancelled or went away, or its deadline passed).
  void RecordCancellation(Method method) { cancelled_[static_cast<int>(method)]->Increment(); }
  // fusedlayer_inflight_bytes: the compute bytes admitted and not yet released (common/byte_budget.h).
  prometheus::Gauge* inflight_bytes() const { return inflight_bytes_; }
  // fusedlayer_upload_buffered_bytes: LoadWeights payload bytes buffered by open streams.
  prometheus::Gauge* upload_buffered_bytes() const { return upload_buffered_bytes_; }
  // A task's wait in `device`'s executor queue.
  void ObserveQueue(int device, double seconds) { devices_[device].queue_duration->Observe(seconds); }
  // One launch of `op` that served `requests` requests with `tokens` tokens in all (dynamic batching).
  void RecordBatch(int device, Op op, size_t requests, int64_t tokens);
  // fusedlayer_request_stage_seconds{op,stage,device} of one OK compute request.
  void RecordStages(int device, Op op, const RequestStages& stages);
  void SetResidentBytes(int device, uint64_t bytes) { devices_[device].resident_bytes->Set(static_cast<double>(bytes)); }

 private:
  static constexpr int kNumCodes = 17;  // grpc::StatusCode 0..16

  // The series of one device, created once.
  struct DeviceSeries {
    std::array<std::array<prometheus::Counter*, 2>, 2> executions{};  // [op][path]
    std::array<std::array<prometheus::Counter*, kNumFallbackReasons>, 2> fallbacks{};
    std::array<prometheus::Gauge*, 2> available{};
    std::array<std::array<prometheus::Histogram*, 2>, 2> op_duration{};
    std::array<prometheus::Histogram*, 2> batch_requests{};  // [op]
    std::array<prometheus::Histogram*, 2> batch_tokens{};    // [op]
    std::array<std::array<prometheus::Histogram*, kNumStages>, 2> stage_duration{};  // [op][stage]
    prometheus::Histogram* queue_duration = nullptr;
    prometheus::Gauge* resident_bytes = nullptr;
  };

  std::shared_ptr<prometheus::Registry> registry_;
  std::vector<DeviceSeries> devices_;  // by device ordinal
  // The per-device families (AddDevice).
  prometheus::Family<prometheus::Counter>* executions_family_;
  prometheus::Family<prometheus::Counter>* fallbacks_family_;
  prometheus::Family<prometheus::Gauge>* available_family_;
  prometheus::Family<prometheus::Histogram>* op_duration_family_;
  prometheus::Family<prometheus::Histogram>* queue_family_;
  prometheus::Family<prometheus::Gauge>* resident_family_;
  prometheus::Family<prometheus::Histogram>* batch_requests_family_;
  prometheus::Family<prometheus::Histogram>* batch_tokens_family_;
  prometheus::Family<prometheus::Histogram>* stage_family_;
  // [method][code]: the codes the server returns are pre-created at 0; others on first use (cached).
  prometheus::Family<prometheus::Counter>* requests_family_;
  std::array<std::array<std::atomic<prometheus::Counter*>, kNumCodes>, kNumMethods> requests_{};
  std::array<prometheus::Histogram*, kNumMethods> request_duration_{};
  std::array<prometheus::Counter*, kNumMethods> request_bytes_{};
  std::array<prometheus::Counter*, kNumMethods> response_bytes_{};
  std::array<prometheus::Counter*, kNumMethods> cancelled_{};
  prometheus::Gauge* inflight_;
  prometheus::Gauge* inflight_bytes_;
  prometheus::Gauge* upload_buffered_bytes_;
};

}  // namespace fusedlayer::server
