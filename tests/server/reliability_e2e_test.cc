// Reliability end to end: injected faults against the real binary (fusedlayer_server_faults, the
// test-only build with --fault_inject), graceful drain on SIGTERM with a call in flight, the drain
// deadline, and LoadWeights faults (a cancelled stream, a corrupt replacement) that must never make
// a partial or corrupt weight set visible. Calls are held in flight with the slow_kernel fault, and
// every wait is on an observable event (a log line, the inflight gauge), never on a sleep.
#include <signal.h>

#include <atomic>
#include <cmath>
#include <chrono>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "demo_server_process.h"
#include "server_process.h"
#include "server_test_env.h"
#include "weights/demo_weights.h"

#ifndef FUSEDLAYER_SERVER_BINARY
#error "FUSEDLAYER_SERVER_BINARY must point at the fusedlayer_server executable"
#endif
#ifndef FUSEDLAYER_FAULT_SERVER_BINARY
#error "FUSEDLAYER_FAULT_SERVER_BINARY must point at the fusedlayer_server_faults executable"
#endif

namespace fusedlayer::testing {
namespace {

constexpr char kDemo[] = "v41-flash/demo";  // mHC C = 5120, n = 4
constexpr int64_t kDemoHidden = 5120;

// The demo set as the binary builds it (same seed), for reference outputs.
server::PackedWeightSet DemoSet(const std::string& name) {
  auto sets = server::MakeDemoWeightSets(server::kDefaultDemoSeed);
  EXPECT_TRUE(sets.ok()) << sets.status();
  for (auto& s : *sets) {
    if (s.first.name() == name) return s;
  }
  ADD_FAILURE() << "no demo set " << name;
  return {};
}

// A running binary with the demo weights (demo_server_process.h), plus the waits the drain and
// overload tests need.
struct RunningServer : DemoServerProcess {
  using DemoServerProcess::DemoServerProcess;
  // A scrape taken once no call is in flight (OnDone, which counts the call, may trail the client).
  std::string IdleMetrics() {
    for (int i = 0; i < 1000; ++i) {
      std::string m = Metrics();
      if (MetricValue(m, "fusedlayer_inflight_requests") == 0) return m;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    ADD_FAILURE() << "calls still in flight";
    return Metrics();
  }
  // Waits until `n` calls are inside the server (the inflight gauge).
  void WaitInflight(int n) {
    for (int i = 0; i < 6000; ++i) {
      if (MetricValue(Metrics(), "fusedlayer_inflight_requests") >= n) return;
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    ADD_FAILURE() << "fewer than " << n << " calls in flight";
  }
};

grpc::Status Seam(v1::FusedLayer::Stub& stub, const v1::MhcSeamRequest& req, v1::MhcSeamResponse* resp) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
  return stub.MhcSeam(&ctx, req, resp);
}

void ExpectSameOutputs(const v1::MhcSeamResponse& actual, const v1::MhcSeamResponse& expected) {
  EXPECT_TRUE(TensorsBitwiseEqual(actual.y(), expected.y()));
  EXPECT_TRUE(TensorsBitwiseEqual(actual.new_residual(), expected.new_residual()));
  EXPECT_TRUE(TensorsBitwiseEqual(actual.new_post_mix(), expected.new_post_mix()));
  EXPECT_TRUE(TensorsBitwiseEqual(actual.new_comb_mix(), expected.new_comb_mix()));
  EXPECT_TRUE(TensorsBitwiseEqual(actual.new_pre_mix(), expected.new_pre_mix()));
}

class Reliability : public ::testing::Test {
 protected:
  std::mt19937_64 rng_{std::random_device{}()};
};

// ---- the flag exists only in fault-injection builds -------------------------------------------

// (A build configured with -DFUSEDLAYER_FAULT_INJECTION=ON gives the production binary the flag.)
#if !FUSEDLAYER_FAULT_INJECTION
TEST_F(Reliability, ProductionBinaryRefusesFaultInjection) {
  ServerProcess p(FUSEDLAYER_SERVER_BINARY, {"--backend=cpu", "--address=127.0.0.1:0", "--metrics_address=",
                                             "--fault_inject=fused_launch_error"});
  const std::string log = p.ReadAll();
  EXPECT_EQ(p.Wait(), 1) << log;
  EXPECT_NE(log.find("fault_inject"), std::string::npos) << log;
}
#endif

TEST_F(Reliability, UnknownFaultFailsFast) {
  ServerProcess p(FUSEDLAYER_FAULT_SERVER_BINARY, {"--backend=cpu", "--address=127.0.0.1:0", "--metrics_address=",
                                                   "--fault_inject=disk_on_fire"});
  const std::string log = p.ReadAll();
  EXPECT_EQ(p.Wait(), 1) << log;
  EXPECT_NE(log.find("disk_on_fire"), std::string::npos) << log;
}

// ---- injected faults --------------------------------------------------------------------------

TEST_F(Reliability, FusedLaunchErrorIsServedUnfusedAndCounted) {
  RunningServer s(FUSEDLAYER_FAULT_SERVER_BINARY, {"--fault_inject=fused_launch_error=1"}, /*armed=*/true);
  ASSERT_NE(s.port, 0) << s.process.log();
  Reference ref(DemoSet(kDemo));
  const v1::MhcSeamRequest req = MakeMhcRequest(rng_, kDemo, {.hidden = kDemoHidden, .tokens = 3});

  v1::MhcSeamResponse resp;
  ASSERT_TRUE(Seam(*s.stub, req, &resp).ok());
  EXPECT_EQ(resp.report().path(), v1::EXECUTION_PATH_UNFUSED);
  EXPECT_EQ(resp.report().fallback_reason(), v1::FALLBACK_REASON_FUSED_KERNEL_ERROR);
  ExpectSameOutputs(resp, ref.RunMhc(req, Path::kUnfused));

  // The injection budget (1) is spent: the next call takes the fused path again.
  v1::MhcSeamResponse again;
  ASSERT_TRUE(Seam(*s.stub, req, &again).ok());
  EXPECT_EQ(again.report().path(), v1::EXECUTION_PATH_FUSED);
  ExpectSameOutputs(again, ref.RunMhc(req, Path::kFused));

  const std::string m = s.IdleMetrics();
  EXPECT_EQ(MetricValue(m, "fusedlayer_op_fallbacks_total", {{"op", "mhc"}, {"reason", "fused_kernel_error"}}), 1);
  EXPECT_EQ(MetricValue(m, "fusedlayer_requests_total", {{"method", "MhcSeam"}, {"code", "OK"}}), 2);
  ASSERT_EQ(kill(s.process.pid(), SIGTERM), 0);
  EXPECT_EQ(s.process.Wait(), 0);
}

TEST_F(Reliability, DeviceAllocationFailureIsResourceExhaustedAndServingContinues) {
  RunningServer s(FUSEDLAYER_FAULT_SERVER_BINARY, {"--fault_inject=alloc_failure=1"}, /*armed=*/true);
  ASSERT_NE(s.port, 0) << s.process.log();
  Reference ref(DemoSet(kDemo));
  const v1::MhcSeamRequest req = MakeMhcRequest(rng_, kDemo, {.hidden = kDemoHidden, .tokens = 2});

  v1::MhcSeamResponse resp;
  const grpc::Status failed = Seam(*s.stub, req, &resp);
  EXPECT_EQ(failed.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << failed.error_message();
  EXPECT_NE(failed.error_message().find("allocation"), std::string::npos) << failed.error_message();

  // Still serving: health, and the same request succeeds with the library's bits.
  int health = 0;
  ASSERT_TRUE(HealthCheck(s.channel, "fusedlayer.mhc", &health).ok());
  EXPECT_EQ(health, 1);
  v1::MhcSeamResponse ok;
  ASSERT_TRUE(Seam(*s.stub, req, &ok).ok());
  EXPECT_EQ(ok.report().path(), v1::EXECUTION_PATH_FUSED);
  ExpectSameOutputs(ok, ref.RunMhc(req, Path::kFused));

  const std::string m = s.IdleMetrics();
  EXPECT_EQ(MetricValue(m, "fusedlayer_requests_total", {{"method", "MhcSeam"}, {"code", "RESOURCE_EXHAUSTED"}}), 1);
  // Out of memory is load, not a broken kernel: no fused_kernel_error page.
  EXPECT_EQ(MetricValue(m, "fusedlayer_op_fallbacks_total", {{"op", "mhc"}, {"reason", "fused_kernel_error"}}), 0);
  ASSERT_EQ(kill(s.process.pid(), SIGTERM), 0);
  EXPECT_EQ(s.process.Wait(), 0);
}

// ---- memory admission ----------------------------------------------------------------------

// A FIRST-stage request sends only x and gets ~(n + 1) times its size back. One whose response is
// over the send limit must be refused before its response is allocated and before the op runs.
TEST_F(Reliability, OutputAmplificationIsRefusedBeforeTheOpRuns) {
  // x of T = 20 at C = 5120 is 204,800 bytes, under the limit; the response (new_residual, y and
  // the mixes) is 1,025,920 bytes, over it.
  RunningServer s(FUSEDLAYER_SERVER_BINARY, {"--max_message_bytes=1000000"}, /*armed=*/false);
  ASSERT_NE(s.port, 0) << s.process.log();
  const std::string before = s.IdleMetrics();
  const v1::MhcSeamRequest amplified =
      MakeMhcRequest(rng_, kDemo, {.hidden = kDemoHidden, .tokens = 20, .stage = v1::MHC_STAGE_FIRST});
  ASSERT_LT(amplified.ByteSizeLong(), 1000000u);

  v1::MhcSeamResponse resp;
  const grpc::Status refused = Seam(*s.stub, amplified, &resp);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << refused.error_message();
  EXPECT_NE(refused.error_message().find("1025920 bytes"), std::string::npos) << refused.error_message();
  EXPECT_NE(refused.error_message().find("--max_message_bytes"), std::string::npos) << refused.error_message();

  const std::string after = s.IdleMetrics();
  for (const char* path : {"fused", "unfused"}) {
    EXPECT_EQ(MetricValue(after, "fusedlayer_op_executions_total", {{"op", "mhc"}, {"path", path}}),
              MetricValue(before, "fusedlayer_op_executions_total", {{"op", "mhc"}, {"path", path}}))
        << "the op ran for a request whose response could never be sent (path " << path << ")";
  }
  EXPECT_EQ(MetricValue(after, "fusedlayer_requests_total", {{"method", "MhcSeam"}, {"code", "RESOURCE_EXHAUSTED"}}),
            1);

  // Nothing else is affected: a request whose response fits is served with the library's bits.
  Reference ref(DemoSet(kDemo));
  const v1::MhcSeamRequest small =
      MakeMhcRequest(rng_, kDemo, {.hidden = kDemoHidden, .tokens = 4, .stage = v1::MHC_STAGE_FIRST});
  v1::MhcSeamResponse ok;
  ASSERT_TRUE(Seam(*s.stub, small, &ok).ok());
  ExpectSameOutputs(ok, ref.RunMhc(small, Path::kFused));
  ASSERT_EQ(kill(s.process.pid(), SIGTERM), 0);
  EXPECT_EQ(s.process.Wait(), 0);
}

// Compute calls are admitted by the bytes they hold (request + response), not only by count: with
// room for one call, a second concurrent one is RESOURCE_EXHAUSTED, a call that could never fit is
// RESOURCE_EXHAUSTED, and the bytes come back when the call is done.
TEST_F(Reliability, ComputeCallsAreAdmittedByBytesInFlight) {
  // A seam call at T = 4, C = 5120 holds ~205 KB of request and 205,184 bytes of response: one fits
  // in 600,000 bytes, two do not. The 10 s kernel keeps the first in flight while the others come.
  RunningServer s(FUSEDLAYER_FAULT_SERVER_BINARY, {"--fault_inject=slow_kernel=10000", "--max_inflight_bytes=600000"},
                  /*armed=*/true);
  ASSERT_NE(s.port, 0) << s.process.log();
  Reference ref(DemoSet(kDemo));
  const v1::MhcSeamRequest req = MakeMhcRequest(rng_, kDemo, {.hidden = kDemoHidden, .tokens = 4});

  grpc::Status first_status;
  v1::MhcSeamResponse first;
  std::thread caller([&] { first_status = Seam(*s.stub, req, &first); });
  // Admitted: its bytes are counted (the gauge is set before the call is queued).
  double held = 0;
  for (int i = 0; i < 6000 && !(held > 0); ++i) {
    held = MetricValue(s.Metrics(), "fusedlayer_inflight_bytes");
    if (!(held > 0)) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  ASSERT_GT(held, 400000) << "the first call's bytes were never counted";
  EXPECT_LE(held, 600000);

  v1::MhcSeamResponse second;
  const grpc::Status busy = Seam(*s.stub, req, &second);
  EXPECT_EQ(busy.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << busy.error_message();
  EXPECT_NE(busy.error_message().find("--max_inflight_bytes"), std::string::npos) << busy.error_message();

  const v1::MhcSeamRequest too_big = MakeMhcRequest(rng_, kDemo, {.hidden = kDemoHidden, .tokens = 8});
  v1::MhcSeamResponse never;
  const grpc::Status never_fits = Seam(*s.stub, too_big, &never);
  EXPECT_EQ(never_fits.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << never_fits.error_message();
  EXPECT_NE(never_fits.error_message().find("more than the server admits at once"), std::string::npos)
      << never_fits.error_message();

  caller.join();
  ASSERT_TRUE(first_status.ok()) << first_status.error_message();
  ExpectSameOutputs(first, ref.RunMhc(req, Path::kFused));

  // Released when the call completed: the same call is admitted again.
  const std::string idle = s.IdleMetrics();
  EXPECT_EQ(MetricValue(idle, "fusedlayer_inflight_bytes"), 0);
  v1::MhcSeamResponse again;
  ASSERT_TRUE(Seam(*s.stub, req, &again).ok());
  ExpectSameOutputs(again, ref.RunMhc(req, Path::kFused));
  const std::string m = s.IdleMetrics();
  EXPECT_EQ(MetricValue(m, "fusedlayer_requests_total", {{"method", "MhcSeam"}, {"code", "RESOURCE_EXHAUSTED"}}), 2);
  EXPECT_EQ(MetricValue(m, "fusedlayer_requests_total", {{"method", "MhcSeam"}, {"code", "OK"}}), 2);
  EXPECT_EQ(MetricValue(m, "fusedlayer_inflight_bytes"), 0);
  ASSERT_EQ(kill(s.process.pid(), SIGTERM), 0);
  EXPECT_EQ(s.process.Wait(), 0);
}

// --max_concurrent_streams reaches the transport: with 1, a client's second concurrent call on the
// same connection waits in the client and never reaches the server (its deadline, a tenth of the
// first call's kernel time, passes there).
TEST_F(Reliability, MaxConcurrentStreamsHoldsFurtherCallsInTheClient) {
  RunningServer s(FUSEDLAYER_FAULT_SERVER_BINARY, {"--fault_inject=slow_kernel=10000", "--max_concurrent_streams=1"},
                  /*armed=*/true);
  ASSERT_NE(s.port, 0) << s.process.log();
  const v1::MhcSeamRequest req = MakeMhcRequest(rng_, kDemo, {.hidden = kDemoHidden, .tokens = 2});
  grpc::Status first_status;
  v1::MhcSeamResponse first;
  std::thread caller([&] { first_status = Seam(*s.stub, req, &first); });
  s.WaitInflight(1);

  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(1));
  v1::MhcSeamResponse second;
  const grpc::Status held = s.stub->MhcSeam(&ctx, req, &second);
  EXPECT_EQ(held.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << held.error_message();
  caller.join();
  ASSERT_TRUE(first_status.ok()) << first_status.error_message();

  // The server saw exactly one call: the second never got a stream.
  const std::string m = s.IdleMetrics();
  EXPECT_EQ(MetricValue(m, "fusedlayer_requests_total", {{"method", "MhcSeam"}, {"code", "OK"}}), 1);
  const double deadline_exceeded =
      MetricValue(m, "fusedlayer_requests_total", {{"method", "MhcSeam"}, {"code", "DEADLINE_EXCEEDED"}});
  EXPECT_TRUE(std::isnan(deadline_exceeded) || deadline_exceeded == 0) << deadline_exceeded;
  ASSERT_EQ(kill(s.process.pid(), SIGTERM), 0);
  EXPECT_EQ(s.process.Wait(), 0);
}

// ---- graceful drain ---------------------------------------------------------------------------

TEST_F(Reliability, SigtermDrainsInFlightCallsAndRefusesNewOnes) {
  // The kernel of every call sleeps 10 s: the call is certainly in flight when SIGTERM arrives.
  constexpr double kDrainSeconds = 60;
  RunningServer s(FUSEDLAYER_FAULT_SERVER_BINARY, {"--fault_inject=slow_kernel=10000", "--drain_seconds=60"},
                  /*armed=*/true);
  ASSERT_NE(s.port, 0) << s.process.log();
  Reference ref(DemoSet(kDemo));
  const v1::MhcSeamRequest req = MakeMhcRequest(rng_, kDemo, {.hidden = kDemoHidden, .tokens = 4});

  grpc::Status in_flight_status;
  v1::MhcSeamResponse in_flight;
  std::atomic<bool> done{false};
  std::thread caller([&] {
    in_flight_status = Seam(*s.stub, req, &in_flight);
    done = true;
  });
  s.WaitInflight(1);
  const auto signalled = std::chrono::steady_clock::now();
  ASSERT_EQ(kill(s.process.pid(), SIGTERM), 0);
  // This line is logged once new calls are refused (a call admitted before it is a normal call).
  ASSERT_FALSE(s.process.ReadUntil(std::regex("draining: health NOT_SERVING")).empty()) << s.process.log();
  EXPECT_FALSE(done.load()) << "the in-flight call finished before the drain started";

  // New calls during the drain are never served: UNAVAILABLE, from gRPC (listener closed, GOAWAY)
  // or, for a call that raced the GOAWAY and still reached the handler, from the service itself.
  // gRPC 1.51 may instead hold such a racing stream and cancel it when the drain ends (CANCELLED).
  // A health Check behaves the same way, or reports NOT_SERVING (docs/operations.md).
  v1::MhcSeamResponse refused;
  const grpc::Status rs = Seam(*s.stub, req, &refused);
  EXPECT_TRUE(rs.error_code() == grpc::StatusCode::UNAVAILABLE || rs.error_code() == grpc::StatusCode::CANCELLED)
      << rs.error_code() << " " << rs.error_message();
  int health = 0;
  const grpc::Status hs = HealthCheck(s.channel, "", &health);
  EXPECT_TRUE(hs.ok() ? health == 2
                      : hs.error_code() == grpc::StatusCode::UNAVAILABLE || hs.error_code() == grpc::StatusCode::CANCELLED)
      << hs.error_code() << " " << health;

  caller.join();
  ASSERT_TRUE(in_flight_status.ok()) << in_flight_status.error_message();
  ExpectSameOutputs(in_flight, ref.RunMhc(req, Path::kFused));

  const std::string log = s.process.ReadAll();
  EXPECT_EQ(s.process.Wait(), 0) << log;
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - signalled).count(), kDrainSeconds);
  EXPECT_NE(log.find("shut down cleanly"), std::string::npos) << log;
}

TEST_F(Reliability, DrainDeadlineCancelsInFlightCallsAndExitsZero) {
  // --drain_seconds=1 against a 6 s kernel: the deadline passes with the call still running.
  RunningServer s(FUSEDLAYER_FAULT_SERVER_BINARY, {"--fault_inject=slow_kernel=6000", "--drain_seconds=1"},
                  /*armed=*/true);
  ASSERT_NE(s.port, 0) << s.process.log();
  const v1::MhcSeamRequest req = MakeMhcRequest(rng_, kDemo, {.hidden = kDemoHidden, .tokens = 2});
  grpc::Status status;
  v1::MhcSeamResponse resp;
  std::thread caller([&] { status = Seam(*s.stub, req, &resp); });
  s.WaitInflight(1);
  ASSERT_EQ(kill(s.process.pid(), SIGTERM), 0);
  caller.join();
  // gRPC's Shutdown(deadline) cancels what is left with UNAVAILABLE ("Cancelling all calls"): a
  // retryable code, so a client retries on another replica.
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE) << status.error_message();
  const std::string log = s.process.ReadAll();
  EXPECT_EQ(s.process.Wait(), 0) << log;
  EXPECT_NE(log.find("shut down cleanly"), std::string::npos) << log;
}

// ---- LoadWeights faults (in-process server) ---------------------------------------------------

class LoadWeightsFaults : public ::testing::Test {
 protected:
  void SetUp() override {
    live_ = MakeWeightSet(rng_, "live", MhcSetSpec{}, std::nullopt);  // mHC only: swa health NOT_SERVING
    ts_ = TestServer::Start(TestConfig(), nullptr, {live_});
    ASSERT_NE(ts_, nullptr);
  }
  std::vector<std::string> Names() {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    v1::ListWeightSetsResponse list;
    EXPECT_TRUE(ts_->stub().ListWeightSets(&ctx, {}, &list).ok());
    std::vector<std::string> names;
    for (const auto& s : list.weight_sets()) names.push_back(s.name());
    return names;
  }
  int Health(const std::string& service) {
    int status = 0;
    EXPECT_TRUE(HealthCheck(ts_->channel(), service, &status).ok());
    return status;
  }

  std::mt19937_64 rng_{std::random_device{}()};
  server::PackedWeightSet live_;
  std::unique_ptr<TestServer> ts_;
};

TEST_F(LoadWeightsFaults, CancelledStreamPublishesNothing) {
  const auto before = Names();
  ASSERT_EQ(Health("fusedlayer.swa"), 2);
  // A set with an SWA part: were any of it published, the swa health would flip to SERVING.
  server::PackedWeightSet next = MakeWeightSet(rng_, "next", MhcSetSpec{}, SwaSetSpec{});
  for (const bool replace_live : {false, true}) {
    server::PackedWeightSet set = next;
    if (replace_live) set.first.set_name("live");
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    v1::WeightSetInfo info;
    auto writer = ts_->stub().LoadWeights(&ctx, &info);
    v1::WeightChunk chunk;
    *chunk.mutable_header() = set.first;
    chunk.mutable_header()->set_replace(replace_live);
    chunk.set_data(set.second.substr(0, set.second.size() / 2));  // half the payload, then the client gives up
    ASSERT_TRUE(writer->Write(chunk));
    ctx.TryCancel();
    EXPECT_EQ(writer->Finish().error_code(), grpc::StatusCode::CANCELLED);
  }
  EXPECT_EQ(Names(), before);
  EXPECT_EQ(Health("fusedlayer.swa"), 2);
  EXPECT_EQ(Health("fusedlayer.mhc"), 1);
  // The live set still computes what the library computes.
  const v1::MhcSeamRequest req = MakeMhcRequest(rng_, "live", {});
  v1::MhcSeamResponse resp;
  ASSERT_TRUE(Seam(ts_->stub(), req, &resp).ok());
  ExpectSameOutputs(resp, Reference(live_).RunMhc(req, Path::kFused));
}

TEST_F(LoadWeightsFaults, CorruptReplacementIsDataLossAndTheOldSetKeepsServing) {
  const v1::MhcSeamRequest req = MakeMhcRequest(rng_, "live", {});
  v1::MhcSeamResponse before;
  ASSERT_TRUE(Seam(ts_->stub(), req, &before).ok());

  server::PackedWeightSet replacement = MakeWeightSet(rng_, "live", MhcSetSpec{}, std::nullopt);
  replacement.second[replacement.second.size() / 3] ^= 0x40;  // the header's sha256 no longer matches
  v1::WeightSetInfo info;
  const grpc::Status s = LoadWeights(ts_->stub(), replacement, &info, 4096, /*replace=*/true);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::DATA_LOSS) << s.error_message();

  v1::MhcSeamResponse after;
  ASSERT_TRUE(Seam(ts_->stub(), req, &after).ok());
  ExpectSameOutputs(after, before);
  ExpectSameOutputs(after, Reference(live_).RunMhc(req, Path::kFused));
  EXPECT_EQ(Names(), std::vector<std::string>{"live"});
  EXPECT_EQ(Health("fusedlayer.mhc"), 1);
}

// ---- LoadWeights under hostile load ----------------------------------------------------------

// An upload without sha256 would skip the integrity check: refused for RPC uploads.
TEST_F(LoadWeightsFaults, UploadWithoutSha256IsRefused) {
  server::PackedWeightSet set = MakeWeightSet(rng_, "unchecked", MhcSetSpec{}, std::nullopt);
  set.first.clear_sha256();
  v1::WeightSetInfo info;
  const grpc::Status s = LoadWeights(ts_->stub(), set, &info);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  EXPECT_NE(s.error_message().find("sha256 is required"), std::string::npos) << s.error_message();
  EXPECT_EQ(Names(), std::vector<std::string>{"live"});
}

// An open LoadWeights stream, written by hand: the header with the first `first_bytes` of the payload.
struct OpenUpload {
  OpenUpload(v1::FusedLayer::Stub& stub, const server::PackedWeightSet& set, size_t first_bytes) : set_(set) {
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    writer = stub.LoadWeights(&ctx, &info);
    v1::WeightChunk chunk;
    *chunk.mutable_header() = set.first;
    chunk.set_data(set.second.substr(0, first_bytes));
    sent_ = first_bytes;
    ok = writer->Write(chunk);
  }
  // Sends the rest of the payload and finishes.
  grpc::Status Finish() {
    if (sent_ < set_.second.size()) {
      v1::WeightChunk chunk;
      chunk.set_data(set_.second.substr(sent_));
      writer->Write(chunk);
    }
    writer->WritesDone();
    return writer->Finish();
  }
  const server::PackedWeightSet& set_;
  size_t sent_ = 0;
  bool ok = false;
  grpc::ClientContext ctx;
  v1::WeightSetInfo info;
  std::unique_ptr<grpc::ClientWriter<v1::WeightChunk>> writer;
};

// Polls `scrape` until `metric` >= `at_least`; returns the last value.
template <typename Scrape>
double WaitMetricAtLeast(Scrape&& scrape, const char* metric, double at_least) {
  double v = 0;
  for (int i = 0; i < 6000; ++i) {
    v = MetricValue(scrape(), metric);
    if (v >= at_least) return v;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  ADD_FAILURE() << metric << " stayed at " << v << " < " << at_least;
  return v;
}

TEST(LoadWeightsLimits, ConcurrentStreamsAreBounded) {
  std::mt19937_64 rng{std::random_device{}()};
  server::ServerConfig config = TestConfig();
  config.max_concurrent_uploads = 1;
  std::unique_ptr<TestServer> ts = TestServer::Start(config);
  ASSERT_NE(ts, nullptr);
  const server::PackedWeightSet a = MakeWeightSet(rng, "a", MhcSetSpec{}, std::nullopt);
  const server::PackedWeightSet b = MakeWeightSet(rng, "b", MhcSetSpec{}, std::nullopt);

  OpenUpload first(ts->stub(), a, a.second.size() / 2);
  ASSERT_TRUE(first.ok);
  WaitMetricAtLeast([&] { return ts->Scrape(); }, "fusedlayer_inflight_requests", 1);
  OpenUpload second(ts->stub(), b, b.second.size() / 2);
  const grpc::Status refused = second.Finish();
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << refused.error_message();
  EXPECT_NE(refused.error_message().find("--max_concurrent_uploads"), std::string::npos) << refused.error_message();

  const grpc::Status loaded = first.Finish();
  ASSERT_TRUE(loaded.ok()) << loaded.error_message();
  // The slot comes back once the stream is done.
  ScrapeWhenIdle(*ts);
  v1::WeightSetInfo info;
  const grpc::Status again = LoadWeights(ts->stub(), b, &info);
  EXPECT_TRUE(again.ok()) << again.error_message();
}

TEST(LoadWeightsLimits, BufferedBytesOfAllUploadsAreBounded) {
  std::mt19937_64 rng{std::random_device{}()};
  const server::PackedWeightSet a = MakeWeightSet(rng, "a", MhcSetSpec{}, std::nullopt);
  const server::PackedWeightSet b = MakeWeightSet(rng, "b", MhcSetSpec{}, std::nullopt);
  ASSERT_EQ(a.second.size(), b.second.size());
  const size_t payload = a.second.size();
  server::ServerConfig config = TestConfig();
  // Room for one whole payload and a half, not for two.
  config.max_upload_buffer_bytes = payload + payload / 2;
  std::unique_ptr<TestServer> ts = TestServer::Start(config);
  ASSERT_NE(ts, nullptr);

  const size_t most = payload * 4 / 5;
  OpenUpload first(ts->stub(), a, most);
  ASSERT_TRUE(first.ok);
  EXPECT_EQ(WaitMetricAtLeast([&] { return ts->Scrape(); }, "fusedlayer_upload_buffered_bytes", most), most);
  OpenUpload second(ts->stub(), b, most);
  const grpc::Status refused = second.Finish();
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << refused.error_message();
  EXPECT_NE(refused.error_message().find("--max_upload_buffer_bytes"), std::string::npos) << refused.error_message();

  const grpc::Status loaded = first.Finish();
  ASSERT_TRUE(loaded.ok()) << loaded.error_message();
  const std::string idle = ScrapeWhenIdle(*ts);
  EXPECT_EQ(MetricValue(idle, "fusedlayer_upload_buffered_bytes"), 0);
  v1::WeightSetInfo info;
  const grpc::Status again = LoadWeights(ts->stub(), b, &info);
  EXPECT_TRUE(again.ok()) << again.error_message();
}

// A client that sends the header (and part of the payload) and then stalls, without half-closing:
// after --upload_idle_timeout_seconds the server ends the stream with DEADLINE_EXCEEDED, releases
// its buffered bytes and its upload slot, and publishes nothing. The client's own deadline (60 s)
// is far away: before the idle timeout existed it alone ended the stream.
TEST(LoadWeightsLimits, StalledUploadIsEndedAfterTheIdleTimeout) {
  std::mt19937_64 rng{std::random_device{}()};
  server::ServerConfig config = TestConfig();
  config.max_concurrent_uploads = 1;
  config.upload_idle_timeout_seconds = 1;
  std::unique_ptr<TestServer> ts = TestServer::Start(config);
  ASSERT_NE(ts, nullptr);
  const server::PackedWeightSet a = MakeWeightSet(rng, "stalled", MhcSetSpec{}, std::nullopt);
  for (const size_t first_bytes : {size_t{0}, a.second.size() / 2}) {  // header only; header + half
    OpenUpload stalled(ts->stub(), a, first_bytes);
    ASSERT_TRUE(stalled.ok);
    if (first_bytes > 0) {
      EXPECT_EQ(WaitMetricAtLeast([&] { return ts->Scrape(); }, "fusedlayer_upload_buffered_bytes", first_bytes),
                first_bytes);
    }
    // No WritesDone, no more chunks: Finish waits for the server's verdict.
    const grpc::Status ended = stalled.writer->Finish();
    EXPECT_EQ(ended.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << ended.error_message();
    EXPECT_NE(ended.error_message().find("--upload_idle_timeout_seconds=1"), std::string::npos)
        << ended.error_message();
    EXPECT_NE(ended.error_message().find("after " + std::to_string(first_bytes) + " payload bytes"), std::string::npos)
        << ended.error_message();
    const std::string idle = ScrapeWhenIdle(*ts);
    EXPECT_EQ(MetricValue(idle, "fusedlayer_upload_buffered_bytes"), 0);
    EXPECT_EQ(MetricValue(idle, "fusedlayer_requests_total", {{"method", "LoadWeights"}, {"code", "DEADLINE_EXCEEDED"}}),
              first_bytes == 0 ? 1 : 2);
  }
  // The single upload slot is free again, and nothing of the stalled streams was published.
  grpc::ClientContext list_ctx;
  v1::ListWeightSetsResponse list;
  ASSERT_TRUE(ts->stub().ListWeightSets(&list_ctx, {}, &list).ok());
  EXPECT_EQ(list.weight_sets_size(), 0);
  v1::WeightSetInfo info;
  const grpc::Status loaded = LoadWeights(ts->stub(), a, &info);
  ASSERT_TRUE(loaded.ok()) << loaded.error_message();
  EXPECT_EQ(info.name(), "stalled");
}

// A client that half-closes and then gives up while its set is still queued behind device work
// gets CANCELLED, and the set is never published.
TEST_F(Reliability, LoadWeightsCancelledAfterTheStreamEndedPublishesNothing) {
  RunningServer s(FUSEDLAYER_FAULT_SERVER_BINARY, {"--fault_inject=slow_kernel=10000"}, /*armed=*/true);
  ASSERT_NE(s.port, 0) << s.process.log();
  const v1::MhcSeamRequest req = MakeMhcRequest(rng_, kDemo, {.hidden = kDemoHidden, .tokens = 2});
  grpc::Status compute_status;
  v1::MhcSeamResponse compute;
  std::thread caller([&] { compute_status = Seam(*s.stub, req, &compute); });
  s.WaitInflight(1);  // the executor is busy for 10 s: the upload queues behind it

  const server::PackedWeightSet set = MakeWeightSet(rng_, "abandoned", MhcSetSpec{}, std::nullopt);
  OpenUpload upload(*s.stub, set, set.second.size());
  ASSERT_TRUE(upload.ok);
  upload.writer->WritesDone();
  ASSERT_FALSE(s.process.ReadUntil(std::regex("LoadWeights 'abandoned'.*queued for build")).empty()) << s.process.log();
  upload.ctx.TryCancel();
  EXPECT_EQ(upload.writer->Finish().error_code(), grpc::StatusCode::CANCELLED);

  const std::string outcome = s.process.ReadUntil(std::regex("weight set 'abandoned'"));
  EXPECT_NE(outcome.find("not published"), std::string::npos) << outcome;
  caller.join();
  EXPECT_TRUE(compute_status.ok()) << compute_status.error_message();
  grpc::ClientContext ctx;
  v1::ListWeightSetsResponse list;
  ASSERT_TRUE(s.stub->ListWeightSets(&ctx, {}, &list).ok());
  for (const auto& w : list.weight_sets()) EXPECT_NE(w.name(), "abandoned");
  ASSERT_EQ(kill(s.process.pid(), SIGTERM), 0);
  EXPECT_EQ(s.process.Wait(), 0);
}

// An upload that was open when the drain started finishes its stream during the drain: UNAVAILABLE
// (retry on another replica), nothing published.
TEST_F(Reliability, LoadWeightsIsRefusedWhileDraining) {
  RunningServer s(FUSEDLAYER_SERVER_BINARY, {"--drain_seconds=60"}, /*armed=*/false);
  ASSERT_NE(s.port, 0) << s.process.log();
  const server::PackedWeightSet set = MakeWeightSet(rng_, "late", MhcSetSpec{}, std::nullopt);
  OpenUpload upload(*s.stub, set, set.second.size() / 2);
  ASSERT_TRUE(upload.ok);
  s.WaitInflight(1);
  ASSERT_EQ(kill(s.process.pid(), SIGTERM), 0);
  ASSERT_FALSE(s.process.ReadUntil(std::regex("draining: health NOT_SERVING")).empty()) << s.process.log();
  const grpc::Status refused = upload.Finish();
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::UNAVAILABLE) << refused.error_message();
  EXPECT_NE(refused.error_message().find("draining"), std::string::npos) << refused.error_message();
  const std::string log = s.process.ReadAll();
  EXPECT_EQ(s.process.Wait(), 0) << log;
  EXPECT_EQ(log.find("loaded weight set 'late'"), std::string::npos) << log;
}

}  // namespace
}  // namespace fusedlayer::testing
