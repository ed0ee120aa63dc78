#include "server_test_env.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <sstream>
#include <thread>

#include "fusedlayer/numeric.h"
#include "grpcpp/impl/client_unary_call.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/sync_stream.h"
#include "gtest/gtest.h"
#include "test_util.h"
#include "weights/packing.h"

namespace fusedlayer::testing {

server::ServerConfig TestConfig() {
  server::ServerConfig c;
  c.address = "127.0.0.1:0";
  c.metrics_address = "127.0.0.1:0";
  c.backend = "cpu";
  c.cpu_threads = 2;
  c.drain_seconds = 5;
  return c;
}

std::unique_ptr<Backend> CpuBackendFor(const server::ServerConfig& config) {
  BackendOptions o;
  o.num_threads = config.cpu_threads;
  o.fused_max_tokens = config.fused_max_tokens;
  return CreateCpuBackend(o);
}

std::shared_ptr<grpc::Channel> MakeChannelTo(const std::string& target, int max_message_bytes) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(max_message_bytes);
  args.SetMaxSendMessageSize(max_message_bytes);
  return grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), args);
}

std::shared_ptr<grpc::Channel> MakeChannel(int port, int max_message_bytes) {
  return MakeChannelTo("127.0.0.1:" + std::to_string(port), max_message_bytes);
}

std::unique_ptr<TestServer> TestServer::Start(server::ServerConfig config, std::unique_ptr<Backend> backend,
                                              std::vector<server::PackedWeightSet> initial) {
  if (!backend) backend = CpuBackendFor(config);
  std::vector<server::DeviceCandidate> devices;
  devices.push_back(server::DeviceCandidate::Of(std::move(backend)));
  return StartOn(std::move(config), std::move(devices), std::move(initial));
}

std::unique_ptr<TestServer> TestServer::StartOn(server::ServerConfig config, std::vector<server::DeviceCandidate> devices,
                                                std::vector<server::PackedWeightSet> initial) {
  std::vector<std::pair<server::PackedWeightSet, std::string>> sets;
  for (auto& s : initial) sets.emplace_back(std::move(s), "test");
  auto started = server::FusedLayerServer::Start(std::move(config), std::move(devices), std::move(sets));
  EXPECT_TRUE(started.ok()) << started.status();
  if (!started.ok()) return nullptr;
  auto ts = std::unique_ptr<TestServer>(new TestServer());
  ts->server_ = std::move(*started);
  // A unix socket has no port: the channel dials the listen address itself (gRPC's syntax for both).
  const std::string& address = ts->server_->config().address;
  ts->channel_ = server::ListenKindOf(address) == server::ListenKind::kTcp ? MakeChannel(ts->server_->port())
                                                                           : MakeChannelTo(address);
  ts->stub_ = v1::FusedLayer::NewStub(ts->channel_);
  return ts;
}

TestServer::~TestServer() { Shutdown(); }

void TestServer::Shutdown() {
  if (server_) server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
}

std::string TestServer::Scrape() { return HttpGet(server_->metrics_port(), "/metrics"); }

std::string HttpGet(int port, const std::string& path) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  EXPECT_GE(fd, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    ADD_FAILURE() << "connect to metrics port " << port << ": " << std::strerror(errno);
    ::close(fd);
    return "";
  }
  const std::string req = "GET " + path + " HTTP/1.0\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n";
  size_t sent = 0;
  while (sent < req.size()) {
    const ssize_t n = ::send(fd, req.data() + sent, req.size() - sent, 0);
    if (n <= 0) break;
    sent += static_cast<size_t>(n);
  }
  std::string resp;
  char buf[65536];
  for (;;) {
    const ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
    if (n <= 0) break;
    resp.append(buf, static_cast<size_t>(n));
  }
  ::close(fd);
  const size_t body = resp.find("\r\n\r\n");
  EXPECT_NE(body, std::string::npos) << "bad HTTP response: " << resp.substr(0, 200);
  EXPECT_EQ(resp.rfind("HTTP/1.", 0), 0u);
  EXPECT_NE(resp.find(" 200 "), std::string::npos) << resp.substr(0, 200);
  return body == std::string::npos ? "" : resp.substr(body + 4);
}

std::unique_ptr<server::ServingDevices> SingleDevice(std::unique_ptr<Backend> backend, size_t queue_capacity) {
  auto devices = std::make_unique<server::ServingDevices>();
  auto device = std::make_unique<server::ServingDevice>();
  device->device_id = server::DeviceIdOf(*backend);
  device->label = server::DeviceLabel(backend->kind(), device->device_id);
  device->kind = std::string(backend->kind());
  device->name = backend->device_name();
  device->backend = std::move(backend);
  absl::StatusOr<std::unique_ptr<server::DeviceLanes>> lanes = server::DeviceLanes::Create(*device->backend, 0, 0);
  EXPECT_TRUE(lanes.ok()) << lanes.status();
  device->lanes = *std::move(lanes);
  device->executor = std::make_unique<server::Executor>(queue_capacity, server::BatchingOptions{},
                                                        device->lanes->workers());
  devices->Add(std::move(device));
  return devices;
}

double MetricValue(const std::string& exposition, const std::string& name,
                   const std::map<std::string, std::string>& labels) {
  std::istringstream in(exposition);
  std::string line;
  // A query that names no device sums the series of every device (the op series carry one).
  const bool any_device = labels.count("device") == 0;
  double sum = 0;
  bool found = false;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    const size_t brace = line.find('{');
    const size_t space = line.rfind(' ');
    if (space == std::string::npos) continue;
    const std::string metric = line.substr(0, brace == std::string::npos ? space : brace);
    if (metric != name) continue;
    std::map<std::string, std::string> got;
    if (brace != std::string::npos) {
      const size_t close = line.rfind('}');
      std::string body = line.substr(brace + 1, close - brace - 1);
      size_t pos = 0;
      while (pos < body.size()) {
        const size_t eq = body.find('=', pos);
        const size_t q1 = body.find('"', eq);
        const size_t q2 = body.find('"', q1 + 1);
        got[body.substr(pos, eq - pos)] = body.substr(q1 + 1, q2 - q1 - 1);
        pos = q2 + 1;
        if (pos < body.size() && body[pos] == ',') ++pos;
      }
    }
    if (any_device) got.erase("device");
    if (got == labels) {
      sum += std::stod(line.substr(space + 1));
      found = true;
    }
  }
  return found ? sum : std::numeric_limits<double>::quiet_NaN();
}

std::string ScrapeWhenIdle(TestServer& ts) {
  std::string m;
  for (int i = 0; i < 2000; ++i) {
    m = ts.Scrape();
    if (MetricValue(m, "fusedlayer_inflight_requests") == 0) return m;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  ADD_FAILURE() << "requests still in flight:\n" << m;
  return m;
}

void WaitForInflightRequests(TestServer& ts, int n) {
  std::string m;
  for (int i = 0; i < 6000; ++i) {
    m = ts.Scrape();
    if (MetricValue(m, "fusedlayer_inflight_requests") >= n) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  ADD_FAILURE() << "fewer than " << n << " requests in flight:\n" << m;
}

namespace {

void AppendVarint(std::string& s, uint64_t v) {
  while (v >= 0x80) {
    s.push_back(static_cast<char>((v & 0x7f) | 0x80));
    v >>= 7;
  }
  s.push_back(static_cast<char>(v));
}

std::string ByteBufferToString(const grpc::ByteBuffer& bb) {
  std::vector<grpc::Slice> slices;
  std::string out;
  if (!bb.Dump(&slices).ok()) return out;
  for (const auto& s : slices) out.append(reinterpret_cast<const char*>(s.begin()), s.size());
  return out;
}

grpc::ByteBuffer StringToByteBuffer(const std::string& s) {
  grpc::Slice slice(s);
  return grpc::ByteBuffer(&slice, 1);
}

}  // namespace

grpc::Status HealthCheck(const std::shared_ptr<grpc::Channel>& channel, const std::string& service,
                         int* serving_status) {
  // HealthCheckRequest { string service = 1; }  HealthCheckResponse { ServingStatus status = 1; }
  std::string req;
  req.push_back(0x0a);
  AppendVarint(req, service.size());
  req += service;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  grpc::ByteBuffer resp;
  const grpc::internal::RpcMethod method("/grpc.health.v1.Health/Check", grpc::internal::RpcMethod::NORMAL_RPC);
  grpc::Status s = grpc::internal::BlockingUnaryCall<grpc::ByteBuffer, grpc::ByteBuffer>(
      channel.get(), method, &ctx, StringToByteBuffer(req), &resp);
  if (s.ok()) {
    const std::string bytes = ByteBufferToString(resp);
    *serving_status = bytes.size() >= 2 && bytes[0] == 0x08 ? bytes[1] : 0;
  }
  return s;
}

grpc::Status ReflectionListServices(const std::shared_ptr<grpc::Channel>& channel, std::string* response_bytes) {
  // ServerReflectionRequest { oneof { string list_services = 7; } }
  const std::string req("\x3a\x00", 2);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  const grpc::internal::RpcMethod method("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
                                         grpc::internal::RpcMethod::BIDI_STREAMING);
  std::unique_ptr<grpc::ClientReaderWriter<grpc::ByteBuffer, grpc::ByteBuffer>> stream(
      grpc::internal::ClientReaderWriterFactory<grpc::ByteBuffer, grpc::ByteBuffer>::Create(channel.get(), method,
                                                                                           &ctx));
  stream->Write(StringToByteBuffer(req));
  stream->WritesDone();
  grpc::ByteBuffer resp;
  while (stream->Read(&resp)) *response_bytes += ByteBufferToString(resp);
  return stream->Finish();
}

// ---- weight sets ------------------------------------------------------------------------------

namespace {

template <typename T>
std::string_view Bytes(const std::vector<T>& v) {
  return std::string_view(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(T));
}

std::vector<float> RandomSigned(std::mt19937_64& rng, size_t n, float sigma) {
  std::vector<float> v(n);
  for (auto& x : v) x = RandomValue(rng, sigma, 8.0f);
  return v;
}

}  // namespace

server::PackedWeightSet MakeWeightSet(std::mt19937_64& rng, const std::string& name,
                                      const std::optional<MhcSetSpec>& mhc, const std::optional<SwaSetSpec>& swa) {
  server::WeightSetPacker packer(name);
  if (mhc) {
    const int64_t n = mhc->hc_mult, C = mhc->hidden, M = n * (n + 2), K = n * C;
    auto* cfg = packer.header().mutable_mhc();
    cfg->set_hc_mult(mhc->hc_mult);
    cfg->set_hidden(C);
    cfg->set_norm_eps(mhc->norm_eps);
    packer.Add("mhc.fn", DType::kFP32, {M, K}, Bytes(RandomSigned(rng, M * K, 0.02f)));
    packer.Add("mhc.scale", DType::kFP32, {3}, Bytes(RandomFloat(rng, 3, 0.5f, 2.0f)));
    packer.Add("mhc.base", DType::kFP32, {M}, Bytes(RandomSigned(rng, M, 0.5f)));
    if (mhc->norm_weight) packer.Add("mhc.norm_weight", DType::kBF16, {C}, Bytes(RandomBf16(rng, C, 1.0f, 4.0f)));
  }
  if (swa) {
    auto* cfg = packer.header().mutable_swa();
    cfg->set_q_rank(swa->q_rank);
    cfg->set_head_dim(swa->head_dim);
    cfg->set_fp8_format(swa->fp8);
    cfg->set_scale_format(swa->scale);
    cfg->set_scale_layout(swa->layout);
    packer.Add("swa.q_norm", DType::kBF16, {swa->q_rank}, Bytes(RandomBf16(rng, swa->q_rank, 1.0f, 4.0f)));
    packer.Add("swa.kv_norm", DType::kBF16, {swa->head_dim}, Bytes(RandomBf16(rng, swa->head_dim, 1.0f, 4.0f)));
    if (swa->wq_b_rows > 0) {
      const int64_t N = swa->wq_b_rows, Q = swa->q_rank;
      const Fp8Format fmt = swa->fp8 == v1::FP8_FORMAT_E4M3FN ? Fp8Format::kE4M3FN : Fp8Format::kE4M3FNUZ;
      std::vector<uint8_t> wq(N * Q);
      for (auto& c : wq) {
        do c = FloatToFp8(RandomValue(rng, 32.0f, 4.0f), fmt); while ((c & 0x7f) == 0);
      }
      packer.Add("swa.wq_b", swa->fp8 == v1::FP8_FORMAT_E4M3FN ? DType::kFP8E4M3FN : DType::kFP8E4M3FNUZ, {N, Q},
                 Bytes(wq));
      packer.Add("swa.wq_b_scale", DType::kFP32, {N / 128, Q / 128},
                 Bytes(RandomFloat(rng, (N / 128) * (Q / 128), 1e-4f, 1e-2f)));
    }
  }
  absl::StatusOr<server::PackedWeightSet> set = packer.Finish();
  EXPECT_TRUE(set.ok()) << set.status();
  return set.ok() ? *std::move(set) : server::PackedWeightSet{};
}

grpc::Status LoadWeights(v1::FusedLayer::Stub& stub, const server::PackedWeightSet& set, v1::WeightSetInfo* info,
                         size_t chunk_bytes, bool replace) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  std::unique_ptr<grpc::ClientWriter<v1::WeightChunk>> writer(stub.LoadWeights(&ctx, info));
  const std::string& payload = set.second;
  size_t off = 0;
  bool first = true;
  while (first || off < payload.size()) {
    v1::WeightChunk chunk;
    if (first) {
      *chunk.mutable_header() = set.first;
      chunk.mutable_header()->set_replace(replace);
    }
    const size_t n = std::min(chunk_bytes, payload.size() - off);
    chunk.set_data(payload.substr(off, n));
    off += n;
    first = false;
    if (!writer->Write(chunk)) break;
  }
  writer->WritesDone();
  return writer->Finish();
}

// ---- requests ---------------------------------------------------------------------------------

v1::Tensor MakeTensor(DType dtype, const std::vector<int64_t>& dims, std::string bytes) {
  v1::Tensor t;
  t.set_dtype(server::ToProto(dtype));
  for (int64_t d : dims) t.add_shape(d);
  t.set_data(std::move(bytes));
  return t;
}

v1::MhcSeamRequest MakeMhcRequest(std::mt19937_64& rng, const std::string& weight_set, const MhcRequestSpec& s) {
  const int64_t T = s.tokens, n = s.hc_mult, C = s.hidden;
  v1::MhcSeamRequest r;
  r.set_weight_set(weight_set);
  r.set_stage(s.stage);
  r.set_mode(s.mode);
  r.set_capture_aux(s.capture_aux);
  *r.mutable_x() = MakeTensorOf(DType::kBF16, {T, C}, RandomBf16(rng, T * C));
  if (s.stage != v1::MHC_STAGE_FIRST) {
    *r.mutable_residual() = MakeTensorOf(DType::kBF16, {T, n, C}, RandomBf16(rng, T * n * C));
    *r.mutable_post_mix() = MakeTensorOf(DType::kFP32, {T, n}, RandomFloat(rng, T * n, 0.05f, 2.0f));
    *r.mutable_comb_mix() = MakeTensorOf(DType::kFP32, {T, n, n}, RandomFloat(rng, T * n * n, 0.01f, 1.0f));
    if (s.pre_mix && s.mode == v1::MHC_MODE_SHIFTED) {
      *r.mutable_pre_mix() = MakeTensorOf(DType::kFP32, {T, n}, RandomFloat(rng, T * n, 0.05f, 1.0f));
    }
  }
  return r;
}

v1::SwaNormQuantRequest MakeSwaRequest(std::mt19937_64& rng, const std::string& weight_set, int64_t tokens,
                                       int64_t row_stride) {
  v1::SwaNormQuantRequest r;
  r.set_weight_set(weight_set);
  *r.mutable_qr_kv() = MakeTensorOf(DType::kBF16, {tokens, row_stride}, RandomBf16(rng, tokens * row_stride));
  return r;
}

// ---- reference ----------------------------------------------------------------------------------

Reference::Reference(const server::PackedWeightSet& set, int64_t fused_max_tokens) {
  BackendOptions o;
  o.num_threads = 2;
  o.fused_max_tokens = fused_max_tokens;
  backend_ = CreateCpuBackend(o);
  auto built = server::BuildWeightSet(*backend_, set.first, set.second, "reference");
  EXPECT_TRUE(built.ok()) << built.status();
  if (built.ok()) set_ = *built;
}

namespace {

TensorView ViewOf(const v1::Tensor& t, DType dtype) {
  TensorView v;
  v.data = const_cast<char*>(t.data().data());
  v.dtype = dtype;
  v.rank = t.shape_size();
  int64_t s = 1;
  for (int k = v.rank - 1; k >= 0; --k) {
    v.shape[k] = t.shape(k);
    v.stride[k] = s;
    s *= t.shape(k);
  }
  return v;
}

// An output tensor filled with 0xFF (NaN for bf16/fp32/e4m3fn) so unwritten bytes show.
TensorView PoisonedOutput(v1::Tensor* t, DType dtype, const std::vector<int64_t>& dims) {
  *t = MakeTensor(dtype, dims, std::string());
  size_t bytes = DTypeSize(dtype);
  for (int64_t d : dims) bytes *= static_cast<size_t>(d);
  t->mutable_data()->assign(bytes, '\xff');
  return ViewOf(*t, dtype);
}

}  // namespace

v1::MhcSeamResponse Reference::RunMhc(const v1::MhcSeamRequest& req, Path path) {
  v1::MhcSeamResponse out;
  const MhcHyperParams& p = set_->on(0).mhc->params();
  const int64_t T = req.x().shape(0), n = p.hc_mult, C = p.hidden;
  MhcArgs a;
  a.stage = server::FromProto(req.stage());
  a.mode = server::FromProto(req.mode());
  a.capture_aux = req.capture_aux();
  a.tokens = T;
  a.x = ViewOf(req.x(), DType::kBF16);
  if (req.has_residual()) a.residual = ViewOf(req.residual(), DType::kBF16);
  if (req.has_post_mix()) a.post_mix = ViewOf(req.post_mix(), DType::kFP32);
  if (req.has_comb_mix()) a.comb_mix = ViewOf(req.comb_mix(), DType::kFP32);
  if (req.has_pre_mix()) a.pre_mix = ViewOf(req.pre_mix(), DType::kFP32);
  a.new_residual = PoisonedOutput(out.mutable_new_residual(), DType::kBF16, {T, n, C});
  if (a.stage != MhcStage::kHead) {
    a.new_pre_mix = PoisonedOutput(out.mutable_new_pre_mix(), DType::kFP32, {T, n});
    a.new_post_mix = PoisonedOutput(out.mutable_new_post_mix(), DType::kFP32, {T, n});
    a.new_comb_mix = PoisonedOutput(out.mutable_new_comb_mix(), DType::kFP32, {T, n, n});
  }
  a.y = PoisonedOutput(out.mutable_y(), DType::kBF16, {T, C});
  if (a.capture_aux) a.aux = PoisonedOutput(out.mutable_aux(), DType::kBF16, {T, C});
  auto r = backend_->RunMhc(*set_->on(0).mhc, a, path);
  EXPECT_TRUE(r.ok()) << r.status();
  return out;
}

v1::SwaNormQuantResponse Reference::RunSwa(const v1::SwaNormQuantRequest& req, Path path) {
  v1::SwaNormQuantResponse out;
  const SwaHyperParams& p = set_->on(0).swa->params();
  const int64_t M = req.qr_kv().shape(0), S = req.qr_kv().shape(1), Q = p.q_rank, D = p.head_dim;
  SwaArgs a;
  a.tokens = M;
  a.qr_kv = TensorView::Strided2D(const_cast<char*>(req.qr_kv().data().data()), DType::kBF16, M, Q + D, S);
  const DType fp8 = p.fp8_format == Fp8Format::kE4M3FN ? DType::kFP8E4M3FN : DType::kFP8E4M3FNUZ;
  a.q_fp8 = PoisonedOutput(out.mutable_q_fp8(), fp8, {M, Q});
  if (p.scale_layout == ScaleLayout::kRowMajor) {
    a.q_scale = PoisonedOutput(out.mutable_q_scale(), DType::kFP32, {M, p.groups()});
  } else {
    a.q_scale = PoisonedOutput(out.mutable_q_scale(), DType::kFP32, {p.groups(), AlignTo4(M)});
  }
  a.kv = PoisonedOutput(out.mutable_kv(), DType::kBF16, {M, D});
  if (p.has_wq_b()) a.q_proj = PoisonedOutput(out.mutable_q_proj(), DType::kBF16, {M, p.wq_b_rows});
  auto r = backend_->RunSwa(*set_->on(0).swa, a, path);
  EXPECT_TRUE(r.ok()) << r.status();
  return out;
}

::testing::AssertionResult TensorsBitwiseEqual(const v1::Tensor& actual, const v1::Tensor& expected) {
  if (actual.dtype() != expected.dtype()) {
    return ::testing::AssertionFailure() << "dtype " << actual.dtype() << " != " << expected.dtype();
  }
  if (actual.shape_size() != expected.shape_size() ||
      !std::equal(actual.shape().begin(), actual.shape().end(), expected.shape().begin())) {
    auto dims = [](const v1::Tensor& t) {
      std::string d;
      for (int64_t x : t.shape()) d += std::to_string(x) + ",";
      return d;
    };
    return ::testing::AssertionFailure() << "shape [" << dims(actual) << "] != [" << dims(expected) << "]";
  }
  if (actual.data().size() != expected.data().size()) {
    return ::testing::AssertionFailure() << "byte length " << actual.data().size() << " != " << expected.data().size();
  }
  for (size_t i = 0; i < actual.data().size(); ++i) {
    if (actual.data()[i] != expected.data()[i]) {
      return ::testing::AssertionFailure() << "first differing byte at " << i << " of " << actual.data().size();
    }
  }
  return ::testing::AssertionSuccess();
}

void ExpectMhcEqual(const v1::MhcSeamResponse& got, const v1::MhcSeamResponse& want) {
  EXPECT_TRUE(TensorsBitwiseEqual(got.new_residual(), want.new_residual())) << "new_residual";
  EXPECT_TRUE(TensorsBitwiseEqual(got.new_pre_mix(), want.new_pre_mix())) << "new_pre_mix";
  EXPECT_TRUE(TensorsBitwiseEqual(got.new_post_mix(), want.new_post_mix())) << "new_post_mix";
  EXPECT_TRUE(TensorsBitwiseEqual(got.new_comb_mix(), want.new_comb_mix())) << "new_comb_mix";
  EXPECT_TRUE(TensorsBitwiseEqual(got.y(), want.y())) << "y";
  EXPECT_TRUE(TensorsBitwiseEqual(got.aux(), want.aux())) << "aux";
}

void ExpectSwaEqual(const v1::SwaNormQuantResponse& got, const v1::SwaNormQuantResponse& want) {
  EXPECT_TRUE(TensorsBitwiseEqual(got.q_fp8(), want.q_fp8())) << "q_fp8";
  EXPECT_TRUE(TensorsBitwiseEqual(got.q_scale(), want.q_scale())) << "q_scale";
  EXPECT_TRUE(TensorsBitwiseEqual(got.kv(), want.kv())) << "kv";
  EXPECT_TRUE(TensorsBitwiseEqual(got.q_proj(), want.q_proj())) << "q_proj";
}

}  // namespace fusedlayer::testing
