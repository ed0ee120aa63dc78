// Harness for the end-to-end suites: a real FusedLayerServer on loopback (ports picked by the OS),
// a client stub with large message limits, a /metrics scraper over plain HTTP, health and
// reflection probes over raw gRPC, random weight sets and request builders (random values with
// outliers, never zeros), and helpers to compare response tensors with the library run directly.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "fusedlayer/backend.h"
#include "fusedlayer/v1/fusedlayer.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "server.h"
#include "rpc/proto_convert.h"
#include "exec/dispatcher.h"
#include "rpc/proto_convert.h"
#include "weights/weight_set.h"

namespace fusedlayer::testing {

// A config for tests: loopback, ephemeral ports, 2 CPU threads, defaults otherwise. Start() dials
// config.address itself when it is a unix: or unix-abstract: address.
server::ServerConfig TestConfig();

// A CPU backend configured as the server would configure it from `config`.
std::unique_ptr<Backend> CpuBackendFor(const server::ServerConfig& config);
// One serving device (server/runtime/serving_devices.h) over `backend`: its lanes as the backend
// offers them by default, and an executor with a queue of `queue_capacity`.
std::unique_ptr<server::ServingDevices> SingleDevice(std::unique_ptr<Backend> backend, size_t queue_capacity = 4);

class TestServer {
 public:
  // Starts a server (ASSERT-style: returns null and records a failure when it cannot start).
  static std::unique_ptr<TestServer> Start(server::ServerConfig config, std::unique_ptr<Backend> backend = nullptr,
                                           std::vector<server::PackedWeightSet> initial = {});
  // The same on several devices (server::DeviceCandidate: some may have failed their start-up).
  static std::unique_ptr<TestServer> StartOn(server::ServerConfig config, std::vector<server::DeviceCandidate> devices,
                                             std::vector<server::PackedWeightSet> initial = {});
  ~TestServer();

  v1::FusedLayer::Stub& stub() { return *stub_; }
  const std::shared_ptr<grpc::Channel>& channel() { return channel_; }
  server::FusedLayerServer& server() { return *server_; }
  // GET /metrics from the live Exposer.
  std::string Scrape();
  void Shutdown();

 private:
  std::unique_ptr<server::FusedLayerServer> server_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::FusedLayer::Stub> stub_;
};

// A channel to 127.0.0.1:port whose client-side limits are `max_message_bytes` both ways.
std::shared_ptr<grpc::Channel> MakeChannel(int port, int max_message_bytes = 1 << 30);
// The same to any gRPC target ("unix:/path", "unix-abstract:name", "host:port").
std::shared_ptr<grpc::Channel> MakeChannelTo(const std::string& target, int max_message_bytes = 1 << 30);

// HTTP GET of path on 127.0.0.1:port; returns the body (empty on failure, with a test failure).
std::string HttpGet(int port, const std::string& path);

// The value of the sample `name{labels}` (label order irrelevant) in a text exposition; NaN when
// there is no such sample. Without a "device" label in `labels`, the sum over the devices' samples
// that have `labels` besides their device.
double MetricValue(const std::string& exposition, const std::string& name,
                   const std::map<std::string, std::string>& labels = {});

// Polls the scrape until fusedlayer_inflight_requests is 0 (a reactor's OnDone, which decrements
// it, may run just after the client saw the status) and returns that scrape; fails after ~10 s.
std::string ScrapeWhenIdle(TestServer& ts);

// Polls the scrape until at least `n` calls are inside the server (fusedlayer_inflight_requests);
// fails after ~30 s. A compute call counts itself on the gRPC thread just before its drain check, so a
// drain begun after this returns (a scrape is an HTTP round trip later) finds those calls admitted.
void WaitForInflightRequests(TestServer& ts, int n);

// grpc.health.v1.Health/Check over raw bytes: returns the gRPC status and sets *serving_status
// (1 SERVING, 2 NOT_SERVING) when OK.
grpc::Status HealthCheck(const std::shared_ptr<grpc::Channel>& channel, const std::string& service,
                         int* serving_status);

// grpc.reflection.v1alpha ServerReflectionInfo with list_services: the raw response bytes.
grpc::Status ReflectionListServices(const std::shared_ptr<grpc::Channel>& channel, std::string* response_bytes);

// ---- weight sets ------------------------------------------------------------------------------

struct MhcSetSpec {
  int hc_mult = 4;
  int64_t hidden = 256;
  bool norm_weight = true;
  float norm_eps = 1e-6f;
};
struct SwaSetSpec {
  int64_t q_rank = 256;
  int64_t head_dim = 128;
  v1::Fp8Format fp8 = v1::FP8_FORMAT_E4M3FN;
  v1::ScaleFormat scale = v1::SCALE_FORMAT_FP32;
  v1::ScaleLayout layout = v1::SCALE_LAYOUT_ROW_MAJOR;
  int64_t wq_b_rows = 0;
};
// A random weight set with the given parts (either may be absent).
server::PackedWeightSet MakeWeightSet(std::mt19937_64& rng, const std::string& name,
                                      const std::optional<MhcSetSpec>& mhc, const std::optional<SwaSetSpec>& swa);

// Streams `set` over LoadWeights in chunks of `chunk_bytes` (the header rides with the first).
grpc::Status LoadWeights(v1::FusedLayer::Stub& stub, const server::PackedWeightSet& set, v1::WeightSetInfo* info,
                         size_t chunk_bytes = 1 << 16, bool replace = false);

// ---- requests ---------------------------------------------------------------------------------

v1::Tensor MakeTensor(DType dtype, const std::vector<int64_t>& dims, std::string bytes);
template <typename T>
v1::Tensor MakeTensorOf(DType dtype, const std::vector<int64_t>& dims, const std::vector<T>& values) {
  return MakeTensor(dtype, dims, std::string(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(T)));
}

struct MhcRequestSpec {
  int hc_mult = 4;
  int64_t hidden = 256;
  int64_t tokens = 3;
  v1::MhcStage stage = v1::MHC_STAGE_SEAM;
  v1::MhcMode mode = v1::MHC_MODE_SHIFTED;
  bool pre_mix = true;
  bool capture_aux = false;
};
v1::MhcSeamRequest MakeMhcRequest(std::mt19937_64& rng, const std::string& weight_set, const MhcRequestSpec& spec);

// qr_kv [M, row_stride] with row_stride >= Q + D (padding columns random too: they must be ignored).
v1::SwaNormQuantRequest MakeSwaRequest(std::mt19937_64& rng, const std::string& weight_set, int64_t tokens,
                                       int64_t row_stride);

// The library, run directly: the same packed set prepared on a fresh CPU backend.
class Reference {
 public:
  Reference(const server::PackedWeightSet& set, int64_t fused_max_tokens = int64_t{1} << 20);
  // Runs `path` on the request's inputs with NaN-poisoned outputs; returns the outputs as a
  // response message (tensors only) for comparison.
  v1::MhcSeamResponse RunMhc(const v1::MhcSeamRequest& request, Path path);
  v1::SwaNormQuantResponse RunSwa(const v1::SwaNormQuantRequest& request, Path path);
  // The weight set as the server builds it (hyper-parameters, host copies such as the norm weight).
  const server::WeightSet& set() const { return *set_; }

 private:
  std::unique_ptr<Backend> backend_;
  std::shared_ptr<const server::WeightSet> set_;
};

// Tensor equality: dtype, shape and every byte.
::testing::AssertionResult TensorsBitwiseEqual(const v1::Tensor& actual, const v1::Tensor& expected);
// Every output tensor of the responses bitwise equal (EXPECT-style, naming the output).
void ExpectMhcEqual(const v1::MhcSeamResponse& got, const v1::MhcSeamResponse& want);
void ExpectSwaEqual(const v1::SwaNormQuantResponse& got, const v1::SwaNormQuantResponse& want);

// The mHC request variants a transport is checked with against TCP: each stage, both modes, with
// and without pre_mix, with aux.
struct MhcVariant {
  v1::MhcStage stage;
  v1::MhcMode mode;
  bool pre_mix, aux;
};
inline constexpr MhcVariant kMhcVariants[] = {{v1::MHC_STAGE_SEAM, v1::MHC_MODE_SHIFTED, true, false},
                                              {v1::MHC_STAGE_SEAM, v1::MHC_MODE_SHIFTED, false, true},
                                              {v1::MHC_STAGE_SEAM, v1::MHC_MODE_NORMAL, false, false},
                                              {v1::MHC_STAGE_FIRST, v1::MHC_MODE_SHIFTED, false, false},
                                              {v1::MHC_STAGE_HEAD, v1::MHC_MODE_SHIFTED, true, false}};

// The SWA weight-set layouts a transport is checked with against TCP (with wq_b, UE8M0 scales in the
// TMA layout, e4m3fnuz), each with the extra qr_kv columns (row stride beyond Q + D) of its requests.
inline const std::pair<SwaSetSpec, int64_t> kSwaLayoutVariants[] = {
    {{.q_rank = 256, .head_dim = 128, .wq_b_rows = 128}, 0},
    {{.q_rank = 384, .head_dim = 64, .scale = v1::SCALE_FORMAT_UE8M0, .layout = v1::SCALE_LAYOUT_COLUMN_MAJOR_TMA},
     37},
    {{.q_rank = 128, .head_dim = 192, .fp8 = v1::FP8_FORMAT_E4M3FNUZ}, 5},
};

// The same output tensors present as over TCP: an output the call does not produce stays absent
// (ExpectMhcEqual / ExpectSwaEqual compare bytes, and an absent tensor's are empty too).
template <typename Response>
void ExpectSameOutputsPresent(const Response& got, const Response& want) {
  const google::protobuf::Descriptor* d = Response::descriptor();
  const google::protobuf::Reflection* r = Response::GetReflection();
  for (int i = 0; i < d->field_count(); ++i) {
    const google::protobuf::FieldDescriptor* f = d->field(i);
    if (f->message_type() != v1::Tensor::descriptor()) continue;
    EXPECT_EQ(r->HasField(got, f), r->HasField(want, f)) << f->name();
  }
}

}  // namespace fusedlayer::testing
