// Bad requests get their exact status code (with a message naming what is wrong), and the server
// keeps serving afterwards. Back-pressure, deadlines and cancellation are exercised with the
// FaultBackend gate holding the executor, never with timing assumptions.
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>

#include "fault_backend.h"
#include "grpcpp/generic/generic_stub.h"
#include "gtest/gtest.h"
#include "server_test_env.h"
#include "test_util.h"

namespace fusedlayer::testing {
namespace {

using server::PackedWeightSet;

grpc::ClientContext* WithDeadline(grpc::ClientContext& ctx) {
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  return &ctx;
}

class ServerErrors : public ::testing::Test {
 protected:
  void SetUp() override {
    rng_ = MakeRng(20);
    server::ServerConfig cfg = TestConfig();
    cfg.max_tokens = 16;
    ts_ = TestServer::Start(cfg, nullptr,
                            {MakeWeightSet(rng_, "both", MhcSetSpec{}, SwaSetSpec{}),
                             MakeWeightSet(rng_, "mhc-only", MhcSetSpec{}, std::nullopt),
                             MakeWeightSet(rng_, "swa-only", std::nullopt, SwaSetSpec{})});
    ASSERT_NE(ts_, nullptr);
  }

  grpc::Status Mhc(const v1::MhcSeamRequest& req) {
    grpc::ClientContext ctx;
    v1::MhcSeamResponse resp;
    return ts_->stub().MhcSeam(WithDeadline(ctx), req, &resp);
  }
  grpc::Status Swa(const v1::SwaNormQuantRequest& req) {
    grpc::ClientContext ctx;
    v1::SwaNormQuantResponse resp;
    return ts_->stub().SwaNormQuant(WithDeadline(ctx), req, &resp);
  }
  void ExpectStillServing() {
    EXPECT_TRUE(Mhc(MakeMhcRequest(rng_, "both", {})).ok());
    EXPECT_TRUE(Swa(MakeSwaRequest(rng_, "both", 2, 384)).ok());
  }
  static void ExpectStatus(const grpc::Status& s, grpc::StatusCode code, const std::string& needle) {
    EXPECT_EQ(s.error_code(), code) << s.error_message();
    EXPECT_NE(s.error_message().find(needle), std::string::npos) << "message '" << s.error_message()
                                                                  << "' does not mention '" << needle << "'";
  }

  std::mt19937_64 rng_;
  std::unique_ptr<TestServer> ts_;
};

// The compute methods parse their own requests (server/rpc/wire_messages.h): bytes that are not a
// message of the method's type are INVALID_ARGUMENT naming the type, on both methods, and the server
// keeps serving.
TEST_F(ServerErrors, UnparsableRequestBytesAreInvalidArgument) {
  grpc::GenericStub generic(ts_->channel());
  const std::string valid = MakeMhcRequest(rng_, "both", {.tokens = 2}).SerializeAsString();
  for (const auto& [method, type] : {std::pair{"/fusedlayer.v1.FusedLayer/MhcSeam", "MhcSeamRequest"},
                                     {"/fusedlayer.v1.FusedLayer/SwaNormQuant", "SwaNormQuantRequest"}}) {
    for (const std::string& garbage :
         {std::string("\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01", 11), valid.substr(0, valid.size() - 7)}) {
      SCOPED_TRACE(method);
      grpc::ClientContext ctx;
      grpc::Slice slice(garbage.data(), garbage.size());
      grpc::ByteBuffer request(&slice, 1), response;
      std::mutex mu;
      std::condition_variable cv;
      bool done = false;
      grpc::Status status;
      generic.UnaryCall(WithDeadline(ctx), method, grpc::StubOptions(), &request, &response, [&](grpc::Status s) {
        std::lock_guard<std::mutex> lock(mu);
        status = std::move(s);
        done = true;
        cv.notify_all();
      });
      std::unique_lock<std::mutex> lock(mu);
      cv.wait(lock, [&] { return done; });
      ExpectStatus(status, grpc::StatusCode::INVALID_ARGUMENT, type);
    }
  }
  ExpectStillServing();
}

TEST_F(ServerErrors, MhcTensorValidation) {
  {  // wrong byte length
    auto req = MakeMhcRequest(rng_, "both", {});
    req.mutable_residual()->mutable_data()->pop_back();
    ExpectStatus(Mhc(req), grpc::StatusCode::INVALID_ARGUMENT, "residual");
  }
  {  // wrong dtype
    auto req = MakeMhcRequest(rng_, "both", {});
    req.mutable_post_mix()->set_dtype(v1::DATA_TYPE_BF16);
    ExpectStatus(Mhc(req), grpc::StatusCode::INVALID_ARGUMENT, "post_mix");
  }
  {  // wrong shape (C)
    auto req = MakeMhcRequest(rng_, "both", MhcRequestSpec{.hidden = 192});
    ExpectStatus(Mhc(req), grpc::StatusCode::INVALID_ARGUMENT, "x");
  }
  {  // wrong shape (T disagrees between tensors)
    auto req = MakeMhcRequest(rng_, "both", {});
    *req.mutable_comb_mix() = MakeTensorOf(DType::kFP32, {2, 4, 4}, RandomFloat(rng_, 32, 0.1f, 1.0f));
    ExpectStatus(Mhc(req), grpc::StatusCode::INVALID_ARGUMENT, "comb_mix");
  }
  {  // missing tensor
    auto req = MakeMhcRequest(rng_, "both", {});
    req.clear_residual();
    ExpectStatus(Mhc(req), grpc::StatusCode::INVALID_ARGUMENT, "residual");
  }
  {  // tensor not allowed for the stage
    auto req = MakeMhcRequest(rng_, "both", {});
    req.set_stage(v1::MHC_STAGE_FIRST);
    ExpectStatus(Mhc(req), grpc::StatusCode::INVALID_ARGUMENT, "residual");
  }
  {  // head stage in normal mode
    auto req = MakeMhcRequest(rng_, "both", MhcRequestSpec{.stage = v1::MHC_STAGE_HEAD, .pre_mix = false});
    req.set_mode(v1::MHC_MODE_NORMAL);
    ExpectStatus(Mhc(req), grpc::StatusCode::INVALID_ARGUMENT, "head");
  }
  {  // T over --max_tokens
    auto req = MakeMhcRequest(rng_, "both", MhcRequestSpec{.tokens = 17});
    ExpectStatus(Mhc(req), grpc::StatusCode::INVALID_ARGUMENT, "max_tokens");
  }
  {  // negative dimension
    auto req = MakeMhcRequest(rng_, "both", {});
    req.mutable_x()->set_shape(0, -3);
    ExpectStatus(Mhc(req), grpc::StatusCode::INVALID_ARGUMENT, "x");
  }
  {  // unknown enum value
    auto req = MakeMhcRequest(rng_, "both", {});
    req.set_path_preference(static_cast<v1::PathPreference>(9));
    ExpectStatus(Mhc(req), grpc::StatusCode::INVALID_ARGUMENT, "path_preference");
  }
  ExpectStillServing();
  const std::string m = ts_->Scrape();
  EXPECT_EQ(MetricValue(m, "fusedlayer_requests_total", {{"method", "MhcSeam"}, {"code", "INVALID_ARGUMENT"}}), 10);
  EXPECT_EQ(MetricValue(m, "fusedlayer_op_executions_total", {{"op", "mhc"}, {"path", "fused"}}), 1);
}

TEST_F(ServerErrors, SwaTensorValidation) {
  {  // row stride below Q + D
    ExpectStatus(Swa(MakeSwaRequest(rng_, "both", 2, 383)), grpc::StatusCode::INVALID_ARGUMENT, "qr_kv");
  }
  {  // wrong byte length
    auto req = MakeSwaRequest(rng_, "both", 2, 384);
    req.mutable_qr_kv()->mutable_data()->append("xy");
    ExpectStatus(Swa(req), grpc::StatusCode::INVALID_ARGUMENT, "qr_kv");
  }
  {  // wrong dtype
    auto req = MakeSwaRequest(rng_, "both", 2, 384);
    req.mutable_qr_kv()->set_dtype(v1::DATA_TYPE_FP32);
    ExpectStatus(Swa(req), grpc::StatusCode::INVALID_ARGUMENT, "qr_kv");
  }
  {  // wrong rank
    auto req = MakeSwaRequest(rng_, "both", 2, 384);
    req.mutable_qr_kv()->add_shape(1);
    ExpectStatus(Swa(req), grpc::StatusCode::INVALID_ARGUMENT, "qr_kv");
  }
  {  // over --max_tokens
    ExpectStatus(Swa(MakeSwaRequest(rng_, "both", 17, 384)), grpc::StatusCode::INVALID_ARGUMENT, "max_tokens");
  }
  ExpectStillServing();
}

TEST_F(ServerErrors, UnknownWeightSetOrMissingPartIsNotFound) {
  ExpectStatus(Mhc(MakeMhcRequest(rng_, "nope", {})), grpc::StatusCode::NOT_FOUND, "nope");
  ExpectStatus(Swa(MakeSwaRequest(rng_, "nope", 1, 384)), grpc::StatusCode::NOT_FOUND, "nope");
  ExpectStatus(Mhc(MakeMhcRequest(rng_, "swa-only", {})), grpc::StatusCode::NOT_FOUND, "mHC");
  ExpectStatus(Swa(MakeSwaRequest(rng_, "mhc-only", 1, 384)), grpc::StatusCode::NOT_FOUND, "SWA");
  ExpectStillServing();
}

TEST_F(ServerErrors, LoadWeightsFailuresPublishNothing) {
  PackedWeightSet good = MakeWeightSet(rng_, "new", MhcSetSpec{}, std::nullopt);
  v1::WeightSetInfo info;
  {  // checksum mismatch
    PackedWeightSet bad = good;
    bad.second[bad.second.size() / 2] ^= 0x01;
    ExpectStatus(LoadWeights(ts_->stub(), bad, &info), grpc::StatusCode::DATA_LOSS, "new");
  }
  {  // truncated stream: the client sends fewer bytes than payload_bytes
    PackedWeightSet bad = good;
    bad.second.resize(bad.second.size() - 100);
    ExpectStatus(LoadWeights(ts_->stub(), bad, &info), grpc::StatusCode::DATA_LOSS, "stream ended");
  }
  {  // over-long stream
    PackedWeightSet bad = good;
    bad.second += "extra";
    ExpectStatus(LoadWeights(ts_->stub(), bad, &info), grpc::StatusCode::INVALID_ARGUMENT, "payload_bytes");
  }
  {  // no header first
    grpc::ClientContext ctx;
    auto writer = ts_->stub().LoadWeights(WithDeadline(ctx), &info);
    v1::WeightChunk chunk;
    chunk.set_data("abc");
    writer->Write(chunk);
    writer->WritesDone();
    ExpectStatus(writer->Finish(), grpc::StatusCode::INVALID_ARGUMENT, "header");
  }
  {  // empty stream
    grpc::ClientContext ctx;
    auto writer = ts_->stub().LoadWeights(WithDeadline(ctx), &info);
    writer->WritesDone();
    ExpectStatus(writer->Finish(), grpc::StatusCode::INVALID_ARGUMENT, "header");
  }
  {  // a bad tensor shape in the header: the weights layer's INVALID_ARGUMENT comes through
    PackedWeightSet bad = good;
    bad.first.mutable_mhc()->set_hidden(255);
    ExpectStatus(LoadWeights(ts_->stub(), bad, &info), grpc::StatusCode::INVALID_ARGUMENT, "new");
  }
  {  // payload over the server's cap
    PackedWeightSet bad = good;
    bad.first.set_payload_bytes(uint64_t{1} << 40);
    ExpectStatus(LoadWeights(ts_->stub(), bad, &info), grpc::StatusCode::RESOURCE_EXHAUSTED, "payload_bytes");
  }
  grpc::ClientContext ctx;
  v1::ListWeightSetsResponse list;
  ASSERT_TRUE(ts_->stub().ListWeightSets(WithDeadline(ctx), {}, &list).ok());
  for (const auto& s : list.weight_sets()) EXPECT_NE(s.name(), "new");
  // And the good one loads afterwards.
  EXPECT_TRUE(LoadWeights(ts_->stub(), good, &info).ok());
  ExpectStillServing();
}

// A client's request_id and weight-set name reach the response, log lines and error messages:
// escaped (no forged log lines, no terminal escapes) and bounded in length.
TEST_F(ServerErrors, ClientStringsAreEscapedAndBoundedInEchoes) {
  v1::MhcSeamRequest req = MakeMhcRequest(rng_, "both", {});
  req.set_request_id("abc\nE 2026-12-02T00:00:00Z forged\x1b[2J" + std::string(10000, 'x'));
  {
    grpc::ClientContext ctx;
    v1::MhcSeamResponse resp;
    ASSERT_TRUE(ts_->stub().MhcSeam(WithDeadline(ctx), req, &resp).ok());
    const std::string& id = resp.request_id();
    EXPECT_EQ(id.find('\n'), std::string::npos) << id;
    EXPECT_EQ(id.find('\x1b'), std::string::npos) << id;
    EXPECT_LE(id.size(), 128u * 4 + 32) << id.size();
    EXPECT_EQ(id.rfind("abc\\nE 2026", 0), 0u) << id;
    EXPECT_NE(id.find("(10037 bytes)"), std::string::npos) << id;
  }
  // An ordinary id comes back unchanged.
  req.set_request_id("orchestrator-7/req-42");
  {
    grpc::ClientContext ctx;
    v1::MhcSeamResponse resp;
    ASSERT_TRUE(ts_->stub().MhcSeam(WithDeadline(ctx), req, &resp).ok());
    EXPECT_EQ(resp.request_id(), "orchestrator-7/req-42");
  }
  // An unknown weight set with a newline in its name: NOT_FOUND, the name escaped in the message.
  req.set_weight_set("no\nsuch" + std::string(5000, 'y'));
  const grpc::Status s = Mhc(req);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND) << s.error_message();
  EXPECT_EQ(s.error_message().find('\n'), std::string::npos) << s.error_message();
  EXPECT_NE(s.error_message().find("no\\nsuch"), std::string::npos) << s.error_message();
  EXPECT_LT(s.error_message().size(), 1000u);
}

TEST(ServerLimits, OversizeMessagesAreResourceExhausted) {
  auto rng = MakeRng(21);
  server::ServerConfig cfg = TestConfig();
  cfg.max_message_bytes = 256 << 10;
  auto ts = TestServer::Start(cfg, nullptr, {MakeWeightSet(rng, "s", MhcSetSpec{}, std::nullopt)});
  ASSERT_NE(ts, nullptr);
  // Request above the receive limit (the client's own limits are large): 2656 bytes per token.
  {
    grpc::ClientContext ctx;
    v1::MhcSeamResponse resp;
    auto req = MakeMhcRequest(rng, "s", MhcRequestSpec{.tokens = 120});
    ASSERT_GT(req.ByteSizeLong(), size_t{256} << 10);
    EXPECT_EQ(ts->stub().MhcSeam(WithDeadline(ctx), req, &resp).error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  }
  // Request under the limit whose response (with aux: 3168 bytes per token) is above it: the
  // server says so itself.
  {
    grpc::ClientContext ctx;
    v1::MhcSeamResponse resp;
    auto req = MakeMhcRequest(rng, "s", MhcRequestSpec{.tokens = 90, .capture_aux = true});
    ASSERT_LT(req.ByteSizeLong(), size_t{256} << 10);
    grpc::Status s = ts->stub().MhcSeam(WithDeadline(ctx), req, &resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
    EXPECT_NE(s.error_message().find("max_message_bytes"), std::string::npos) << s.error_message();
  }
  grpc::ClientContext ctx;
  v1::MhcSeamResponse resp;
  EXPECT_TRUE(ts->stub().MhcSeam(WithDeadline(ctx), MakeMhcRequest(rng, "s", {}), &resp).ok());
}

// Issues MhcSeam asynchronously (callback API); `done` flips when it finishes.
struct AsyncMhc {
  grpc::ClientContext ctx;
  v1::MhcSeamRequest req;
  v1::MhcSeamResponse resp;
  grpc::Status status;
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;

  void Start(v1::FusedLayer::Stub& stub) {
    stub.async()->MhcSeam(&ctx, &req, &resp, [this](grpc::Status s) {
      std::lock_guard<std::mutex> l(mu);
      status = std::move(s);
      done = true;
      cv.notify_all();
    });
  }
  void Wait() {
    std::unique_lock<std::mutex> l(mu);
    cv.wait(l, [&] { return done; });
  }
};

// Waits until `n` tasks wait in the executor queue.
void WaitQueued(TestServer& ts, size_t n) {
  while (ts.server().queued_tasks() < n) std::this_thread::sleep_for(std::chrono::milliseconds(1));
}

class ServerBackPressure : public ::testing::Test {
 protected:
  void SetUp() override {
    rng_ = MakeRng(22);
    server::ServerConfig cfg = TestConfig();
    cfg.queue_capacity = 1;
    auto backend = std::make_unique<FaultBackend>(CpuBackendFor(cfg));
    control_ = backend->control();
    ts_ = TestServer::Start(cfg, std::move(backend), {MakeWeightSet(rng_, "s", MhcSetSpec{}, std::nullopt)});
    ASSERT_NE(ts_, nullptr);
  }
  // Holds the executor inside a kernel with one call (returned; still running).
  std::unique_ptr<AsyncMhc> Occupy() {
    const int entered = control_->Entered();
    control_->CloseGate();
    auto a = std::make_unique<AsyncMhc>();
    a->req = MakeMhcRequest(rng_, "s", {});
    a->ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    a->Start(ts_->stub());
    control_->WaitEntered(entered + 1);
    return a;
  }
  double Metric(const std::string& name, const std::map<std::string, std::string>& labels) {
    return MetricValue(ts_->Scrape(), name, labels);
  }

  std::mt19937_64 rng_;
  std::shared_ptr<FaultBackend::Control> control_;
  std::unique_ptr<TestServer> ts_;
};

TEST_F(ServerBackPressure, FullQueueIsResourceExhausted) {
  auto running = Occupy();
  auto queued = std::make_unique<AsyncMhc>();
  queued->req = MakeMhcRequest(rng_, "s", {});
  queued->ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  queued->Start(ts_->stub());
  WaitQueued(*ts_, 1);
  {
    grpc::ClientContext ctx;
    v1::MhcSeamResponse resp;
    grpc::Status s = ts_->stub().MhcSeam(WithDeadline(ctx), MakeMhcRequest(rng_, "s", {}), &resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
    EXPECT_NE(s.error_message().find("queue"), std::string::npos) << s.error_message();
  }
  control_->OpenGate();
  running->Wait();
  queued->Wait();
  EXPECT_TRUE(running->status.ok());
  EXPECT_TRUE(queued->status.ok());
  const std::string m = ScrapeWhenIdle(*ts_);
  EXPECT_EQ(MetricValue(m, "fusedlayer_requests_total", {{"method", "MhcSeam"}, {"code", "RESOURCE_EXHAUSTED"}}), 1);
  EXPECT_EQ(MetricValue(m, "fusedlayer_requests_total", {{"method", "MhcSeam"}, {"code", "OK"}}), 2);
}

TEST_F(ServerBackPressure, ExpiredDeadlineIsNotLaunched) {
  auto running = Occupy();
  const double fused_before = Metric("fusedlayer_op_executions_total", {{"op", "mhc"}, {"path", "fused"}});
  auto late = std::make_unique<AsyncMhc>();
  late->req = MakeMhcRequest(rng_, "s", {});
  const auto deadline = std::chrono::system_clock::now() + std::chrono::seconds(2);
  late->ctx.set_deadline(deadline);
  late->Start(ts_->stub());
  WaitQueued(*ts_, 1);
  late->Wait();  // the client gives up at its deadline while the call is still queued
  EXPECT_EQ(late->status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  // The server's copy of the deadline is the client's timeout counted from when the call arrived,
  // so it lies a little after `deadline`; launch the queued call only once it has surely passed
  // (otherwise the launch check sees the client's cancellation first and reports CANCELLED).
  std::this_thread::sleep_until(deadline + std::chrono::seconds(1));
  control_->OpenGate();
  running->Wait();
  EXPECT_TRUE(running->status.ok());
  // Only the running call executed; the queued one was dropped at its launch check.
  WaitQueued(*ts_, 0);
  EXPECT_EQ(Metric("fusedlayer_op_executions_total", {{"op", "mhc"}, {"path", "fused"}}) - fused_before, 1);
  // The server recorded the dropped call: its launch check looks at the deadline first.
  ScrapeWhenIdle(*ts_);
  const double dropped = Metric("fusedlayer_requests_total", {{"method", "MhcSeam"}, {"code", "DEADLINE_EXCEEDED"}});
  EXPECT_EQ(dropped, 1) << ts_->Scrape();
}

TEST_F(ServerBackPressure, CancelledCallIsNotLaunched) {
  auto running = Occupy();
  const double fused_before = Metric("fusedlayer_op_executions_total", {{"op", "mhc"}, {"path", "fused"}});
  auto cancelled = std::make_unique<AsyncMhc>();
  cancelled->req = MakeMhcRequest(rng_, "s", {});
  cancelled->ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  cancelled->Start(ts_->stub());
  WaitQueued(*ts_, 1);
  cancelled->ctx.TryCancel();
  cancelled->Wait();
  EXPECT_EQ(cancelled->status.error_code(), grpc::StatusCode::CANCELLED);
  // The client's TryCancel completes locally; the server learns of it when its transport has read
  // the stream reset and run OnCancel, asynchronously (a later RPC on the same connection may be
  // served first: seen once on a loaded 2-core CI machine). Wait until the server has seen it
  // (fusedlayer_cancelled_calls_total), then check the behaviour: a cancellation the server knows
  // of is never launched.
  for (int i = 0; i < 2000 && Metric("fusedlayer_cancelled_calls_total", {{"method", "MhcSeam"}}) < 1; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_EQ(Metric("fusedlayer_cancelled_calls_total", {{"method", "MhcSeam"}}), 1);
  control_->OpenGate();
  running->Wait();
  EXPECT_TRUE(running->status.ok());
  ScrapeWhenIdle(*ts_);
  EXPECT_EQ(Metric("fusedlayer_op_executions_total", {{"op", "mhc"}, {"path", "fused"}}) - fused_before, 1);
  EXPECT_EQ(Metric("fusedlayer_requests_total", {{"method", "MhcSeam"}, {"code", "CANCELLED"}}), 1);
}

}  // namespace
}  // namespace fusedlayer::testing

namespace fusedlayer::testing {
namespace {

// Shutdown (what SIGTERM does) lets calls already accepted finish, the running one and the queued
// one, while new calls are refused.
TEST_F(ServerBackPressure, ShutdownDrainsAcceptedCalls) {
  auto running = Occupy();
  auto queued = std::make_unique<AsyncMhc>();
  queued->req = MakeMhcRequest(rng_, "s", {});
  queued->ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  queued->Start(ts_->stub());
  WaitQueued(*ts_, 1);
  std::thread stopper([&] { ts_->server().Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(60)); });
  // Wait until the server refuses new calls: the shutdown has begun with both calls accepted.
  for (;;) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    v1::GetServerInfoResponse info;
    if (!ts_->stub().GetServerInfo(&ctx, {}, &info).ok()) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  control_->OpenGate();
  running->Wait();
  queued->Wait();
  stopper.join();
  EXPECT_TRUE(running->status.ok()) << running->status.error_message();
  EXPECT_TRUE(queued->status.ok()) << queued->status.error_message();
}

}  // namespace
}  // namespace fusedlayer::testing
