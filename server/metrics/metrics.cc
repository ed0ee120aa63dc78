#include "metrics/metrics.h"

#include <sstream>

#include "prometheus/text_serializer.h"

namespace fusedlayer::server {
namespace {

using prometheus::Histogram;

// Geometric buckets: `count` bounds from `first`, each `factor` times the previous.
Histogram::BucketBoundaries Geometric(double first, double factor, int count) {
  Histogram::BucketBoundaries b;
  double v = first;
  for (int i = 0; i < count; ++i, v *= factor) b.push_back(v);
  return b;
}

// Op (kernel) time: ~1 us (decode-size launches on a GPU) to ~17 s (CPU at huge T), x4 steps.
Histogram::BucketBoundaries OpBuckets() { return Geometric(1e-6, 4.0, 13); }
// Request time in the server: 10 us to ~42 s, x4 steps.
Histogram::BucketBoundaries RequestBuckets() { return Geometric(1e-5, 4.0, 12); }
// Queue wait: 1 us to ~4 s, x4 steps.
Histogram::BucketBoundaries QueueBuckets() { return Geometric(1e-6, 4.0, 12); }
// Requests per launch 1, 2, 4, ..., 1024; tokens per launch 1, 4, ..., 4^10 (~1M, --max_tokens).
Histogram::BucketBoundaries BatchRequestBuckets() { return Geometric(1, 2.0, 11); }
Histogram::BucketBoundaries BatchTokenBuckets() { return Geometric(1, 4.0, 11); }

}  // namespace

const char* MethodName(Method m) {
  switch (m) {
    case Method::kMhcSeam: return "MhcSeam";
    case Method::kSwaNormQuant: return "SwaNormQuant";
    case Method::kLoadWeights: return "LoadWeights";
    case Method::kListWeightSets: return "ListWeightSets";
    case Method::kUnloadWeightSet: return "UnloadWeightSet";
    case Method::kGetServerInfo: return "GetServerInfo";
    case Method::kRegisterSystemSharedMemory: return "RegisterSystemSharedMemory";
    case Method::kSystemSharedMemoryStatus: return "SystemSharedMemoryStatus";
    case Method::kUnregisterSystemSharedMemory: return "UnregisterSystemSharedMemory";
    case Method::kRegisterCudaSharedMemory: return "RegisterCudaSharedMemory";
    case Method::kCudaSharedMemoryStatus: return "CudaSharedMemoryStatus";
    case Method::kUnregisterCudaSharedMemory: return "UnregisterCudaSharedMemory";
    case Method::kOpenResidualSession: return "OpenResidualSession";
    case Method::kListResidualSessions: return "ListResidualSessions";
    case Method::kCloseResidualSession: return "CloseResidualSession";
    case Method::kCommitWeightSets: return "CommitWeightSets";
    case Method::kOpenCallRing: return "OpenCallRing";
  }
  return "unknown";
}

// The codes the server itself returns (proto/fusedlayer/v1/fusedlayer.proto lists when).
constexpr grpc::StatusCode kServerStatusCodes[] = {
    grpc::StatusCode::OK,                  grpc::StatusCode::CANCELLED,
    grpc::StatusCode::INVALID_ARGUMENT,    grpc::StatusCode::DEADLINE_EXCEEDED,
    grpc::StatusCode::NOT_FOUND,           grpc::StatusCode::ALREADY_EXISTS,
    grpc::StatusCode::RESOURCE_EXHAUSTED,  grpc::StatusCode::FAILED_PRECONDITION,
    grpc::StatusCode::INTERNAL,            grpc::StatusCode::UNAVAILABLE,
    grpc::StatusCode::DATA_LOSS,
};

const char* StatusCodeName(grpc::StatusCode code) {
  switch (code) {
    case grpc::StatusCode::OK: return "OK";
    case grpc::StatusCode::CANCELLED: return "CANCELLED";
    case grpc::StatusCode::UNKNOWN: return "UNKNOWN";
    case grpc::StatusCode::INVALID_ARGUMENT: return "INVALID_ARGUMENT";
    case grpc::StatusCode::DEADLINE_EXCEEDED: return "DEADLINE_EXCEEDED";
    case grpc::StatusCode::NOT_FOUND: return "NOT_FOUND";
    case grpc::StatusCode::ALREADY_EXISTS: return "ALREADY_EXISTS";
    case grpc::StatusCode::PERMISSION_DENIED: return "PERMISSION_DENIED";
    case grpc::StatusCode::RESOURCE_EXHAUSTED: return "RESOURCE_EXHAUSTED";
    case grpc::StatusCode::FAILED_PRECONDITION: return "FAILED_PRECONDITION";
    case grpc::StatusCode::ABORTED: return "ABORTED";
    case grpc::StatusCode::OUT_OF_RANGE: return "OUT_OF_RANGE";
    case grpc::StatusCode::UNIMPLEMENTED: return "UNIMPLEMENTED";
    case grpc::StatusCode::INTERNAL: return "INTERNAL";
    case grpc::StatusCode::UNAVAILABLE: return "UNAVAILABLE";
    case grpc::StatusCode::DATA_LOSS: return "DATA_LOSS";
    case grpc::StatusCode::UNAUTHENTICATED: return "UNAUTHENTICATED";
    default: return "UNKNOWN";
  }
}

Metrics::Metrics(std::string_view version, std::string_view backend, std::string_view arch,
                 const std::vector<std::string>& devices)
    : registry_(std::make_shared<prometheus::Registry>()) {
  auto& reg = *registry_;
  executions_family_ = &prometheus::BuildCounter()
                                .Name("fusedlayer_op_executions_total")
                                .Help("Op executions by path (fused or unfused) and device; hit rate = fused / all")
                                .Register(reg);
  fallbacks_family_ = &prometheus::BuildCounter()
                               .Name("fusedlayer_op_fallbacks_total")
                               .Help("Op executions that ran unfused, by reason and device")
                               .Register(reg);
  available_family_ =
      &prometheus::BuildGauge()
          .Name("fusedlayer_fused_kernel_available")
          .Help("1 if the op's fused path is usable on this device of the server for the loaded weight sets")
          .Register(reg);
  op_duration_family_ = &prometheus::BuildHistogram()
                                 .Name("fusedlayer_op_duration_seconds")
                                 .Help("Kernel time of one op execution, by path and device")
                                 .Register(reg);
  requests_family_ = &prometheus::BuildCounter()
                          .Name("fusedlayer_requests_total")
                          .Help("RPCs completed, by method and gRPC status code")
                          .Register(reg);
  auto& request_duration_family = prometheus::BuildHistogram()
                                      .Name("fusedlayer_request_duration_seconds")
                                      .Help("Server time from receipt to response, by method")
                                      .Register(reg);
  auto& request_bytes_family = prometheus::BuildCounter()
                                   .Name("fusedlayer_request_bytes_total")
                                   .Help("Serialized request bytes received, by method")
                                   .Register(reg);
  auto& response_bytes_family = prometheus::BuildCounter()
                                    .Name("fusedlayer_response_bytes_total")
                                    .Help("Serialized response bytes sent, by method")
                                    .Register(reg);
  auto& cancelled_family = prometheus::BuildCounter()
                              .Name("fusedlayer_cancelled_calls_total")
                              .Help("Unary calls gRPC reported cancelled while the server held them (the client "
                                    "cancelled or went away, or the deadline passed), by method")
                              .Register(reg);
  inflight_ = &prometheus::BuildGauge()
                   .Name("fusedlayer_inflight_requests")
                   .Help("RPCs received and not yet finished")
                   .Register(reg)
                   .Add({});
  inflight_bytes_ = &prometheus::BuildGauge()
                         .Name("fusedlayer_inflight_bytes")
                         .Help("Request + response bytes of the compute calls admitted and not yet finished "
                               "(--max_inflight_bytes bounds it)")
                         .Register(reg)
                         .Add({});
  upload_buffered_bytes_ = &prometheus::BuildGauge()
                                .Name("fusedlayer_upload_buffered_bytes")
                                .Help("LoadWeights payload bytes buffered by the open streams "
                                      "(--max_upload_buffer_bytes bounds it)")
                                .Register(reg)
                                .Add({});
  queue_family_ = &prometheus::BuildHistogram()
                           .Name("fusedlayer_queue_duration_seconds")
                           .Help("Time a task waited in a device executor's queue, by device")
                           .Register(reg);
  resident_family_ = &prometheus::BuildGauge()
                              .Name("fusedlayer_weights_resident_bytes")
                              .Help("Device memory held by loaded weight sets, by device")
                              .Register(reg);
  prometheus::BuildGauge()
      .Name("fusedlayer_build_info")
      .Help("Build and runtime identity; always 1")
      .Register(reg)
      .Add({{"version", std::string(version)}, {"backend", std::string(backend)}, {"arch", std::string(arch)}})
      .Set(1);
  batch_requests_family_ = &prometheus::BuildHistogram()
                                    .Name("fusedlayer_batch_requests")
                                    .Help("Requests served by one op launch (dynamic batching; 1: alone)")
                                    .Register(reg);
  batch_tokens_family_ = &prometheus::BuildHistogram()
                                  .Name("fusedlayer_batch_tokens")
                                  .Help("Tokens computed by one op launch (dynamic batching)")
                                  .Register(reg);
  // The stage a request spent its server time in (ExecutionReport.stages), pre-created at 0.
  stage_family_ = &prometheus::BuildHistogram()
                           .Name("fusedlayer_request_stage_seconds")
                           .Help("Server time of one OK compute request by stage: decode (gRPC thread), queue, "
                                 "copy_in, device, copy_out, response")
                           .Register(reg);
  for (int m = 0; m < kNumMethods; ++m) {
    const char* name = MethodName(static_cast<Method>(m));
    for (auto& c : requests_[m]) c.store(nullptr, std::memory_order_relaxed);
    // Every code this server returns starts at 0, so the first error of a kind shows in rate()
    // and increase() (a series born at 1 is invisible to both). Other codes (gRPC-internal ones)
    // are created on first use.
    for (grpc::StatusCode code : kServerStatusCodes) {
      requests_[m][static_cast<int>(code)].store(&requests_family_->Add({{"method", name}, {"code", StatusCodeName(code)}}),
                                                std::memory_order_release);
    }
    request_duration_[m] = &request_duration_family.Add({{"method", name}}, RequestBuckets());
    request_bytes_[m] = &request_bytes_family.Add({{"method", name}});
    response_bytes_[m] = &response_bytes_family.Add({{"method", name}});
    cancelled_[m] = &cancelled_family.Add({{"method", name}});
  }
  for (const std::string& device : devices) AddDevice(device);
}

int Metrics::AddDevice(const std::string& device) {
  static constexpr const char* kStageNames[kNumStages] = {"decode", "queue", "copy_in", "device", "copy_out",
                                                           "response"};
  DeviceSeries& d = devices_.emplace_back();
  d.queue_duration = &queue_family_->Add({{"device", device}}, QueueBuckets());
  d.resident_bytes = &resident_family_->Add({{"device", device}});
  for (Op op : kAllOps) {
    const int o = static_cast<int>(op);
    for (int st = 0; st < kNumStages; ++st) {
      d.stage_duration[o][st] =
          &stage_family_->Add({{"op", OpName(op)}, {"stage", kStageNames[st]}, {"device", device}}, QueueBuckets());
    }
    d.batch_requests[o] = &batch_requests_family_->Add({{"op", OpName(op)}, {"device", device}}, BatchRequestBuckets());
    d.batch_tokens[o] = &batch_tokens_family_->Add({{"op", OpName(op)}, {"device", device}}, BatchTokenBuckets());
    for (Path path : {Path::kFused, Path::kUnfused}) {
      const int p = static_cast<int>(path);
      d.executions[o][p] = &executions_family_->Add({{"op", OpName(op)}, {"path", PathName(path)}, {"device", device}});
      d.op_duration[o][p] =
          &op_duration_family_->Add({{"op", OpName(op)}, {"path", PathName(path)}, {"device", device}}, OpBuckets());
    }
    for (FallbackReason r : AllFallbackReasons()) {
      d.fallbacks[o][static_cast<int>(r)] =
          &fallbacks_family_->Add({{"op", OpName(op)}, {"reason", FallbackReasonName(r)}, {"device", device}});
    }
    d.available[o] = &available_family_->Add({{"op", OpName(op)}, {"device", device}});
  }
  return static_cast<int>(devices_.size()) - 1;
}

std::string Metrics::Serialize() const {
  std::ostringstream out;
  prometheus::TextSerializer().Serialize(out, registry_->Collect());
  return out.str();
}

void Metrics::RecordExecution(int device, Op op, Path path, double kernel_seconds) {
  const int o = static_cast<int>(op), p = static_cast<int>(path);
  devices_[device].executions[o][p]->Increment();
  devices_[device].op_duration[o][p]->Observe(kernel_seconds);
}

void Metrics::RecordFallback(int device, Op op, FallbackReason reason) {
  devices_[device].fallbacks[static_cast<int>(op)][static_cast<int>(reason)]->Increment();
}

void Metrics::SetFusedAvailable(int device, Op op, bool available) {
  devices_[device].available[static_cast<int>(op)]->Set(available ? 1 : 0);
}

void Metrics::RecordRequest(Method method, grpc::StatusCode code, double seconds, uint64_t request_bytes,
                            uint64_t response_bytes) {
  const int m = static_cast<int>(method);
  int c = static_cast<int>(code);
  if (c < 0 || c >= kNumCodes) c = static_cast<int>(grpc::StatusCode::UNKNOWN);
  prometheus::Counter* counter = requests_[m][c].load(std::memory_order_acquire);
  if (counter == nullptr) {
    // Add returns the existing child for known labels, so a race here creates one series.
    counter = &requests_family_->Add(
        {{"method", MethodName(method)}, {"code", StatusCodeName(static_cast<grpc::StatusCode>(c))}});
    requests_[m][c].store(counter, std::memory_order_release);
  }
  counter->Increment();
  request_duration_[m]->Observe(seconds);
  request_bytes_[m]->Increment(static_cast<double>(request_bytes));
  response_bytes_[m]->Increment(static_cast<double>(response_bytes));
}

void Metrics::RecordBatch(int device, Op op, size_t requests, int64_t tokens) {
  devices_[device].batch_requests[static_cast<int>(op)]->Observe(static_cast<double>(requests));
  devices_[device].batch_tokens[static_cast<int>(op)]->Observe(static_cast<double>(tokens));
}

}  // namespace fusedlayer::server

namespace fusedlayer::server {

void Metrics::RecordStages(int device, Op op, const RequestStages& st) {
  const auto& h = devices_[device].stage_duration[static_cast<int>(op)];
  const double values[kNumStages] = {st.decode, st.queue, st.copy_in, st.device, st.copy_out, st.response};
  for (int s = 0; s < kNumStages; ++s) h[s]->Observe(values[s]);
}

}  // namespace fusedlayer::server
