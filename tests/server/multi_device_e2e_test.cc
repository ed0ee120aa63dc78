// One server serving several devices (--devices, server/runtime/serving_devices.h), on CPU
// "devices": each a CPU backend of its own with its own executor, through the same code path a
// node's GPUs take. Routing (named, least-loaded, by session), bitwise-equal outputs on every
// device, the `device` label on the op series, GetServerInfo's device list with a device left out
// at start-up, and weight loads that are all or nothing across devices.
#include <cmath>
#include <future>
#include <map>
#include <thread>

#include "forwarding_backend.h"
#include "gtest/gtest.h"
#include "server_test_env.h"
#include "test_util.h"

namespace fusedlayer::testing {
namespace {

grpc::ClientContext* WithDeadline(grpc::ClientContext& ctx) {
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  return &ctx;
}

// A CPU backend whose Prepare* fail for a set of one hidden size (mHC) or q_rank (SWA), as a device
// out of memory would: the device a load fails on.
class FailingPrepareBackend final : public ForwardingBackend {
 public:
  FailingPrepareBackend(std::unique_ptr<Backend> inner, int64_t failing_size)
      : ForwardingBackend(std::move(inner)), failing_size_(failing_size) {}
  absl::StatusOr<std::unique_ptr<PreparedMhcWeights>> PrepareMhc(const MhcHyperParams& p,
                                                                 const MhcWeightsHost& w) override {
    if (p.hidden == failing_size_) return absl::ResourceExhaustedError("device memory: out of memory (test)");
    return ForwardingBackend::PrepareMhc(p, w);
  }
  absl::StatusOr<std::unique_ptr<PreparedSwaWeights>> PrepareSwa(const SwaHyperParams& p,
                                                                 const SwaWeightsHost& w) override {
    if (p.q_rank == failing_size_) return absl::ResourceExhaustedError("device memory: out of memory (test)");
    return ForwardingBackend::PrepareSwa(p, w);
  }

 private:
  const int64_t failing_size_;
};

constexpr int64_t kFailingSize = 384;

// Two serving CPU devices (ids 0 and 1; device 1 refuses sets of size kFailingSize) and one, id 7,
// that failed its start-up check.
std::unique_ptr<TestServer> StartTwoDevices(server::ServerConfig config, std::vector<server::PackedWeightSet> sets = {}) {
  config.cpu_threads = 1;
  std::vector<server::DeviceCandidate> devices;
  devices.push_back(server::DeviceCandidate{0, "cpu:0", CpuBackendFor(config)});
  devices.push_back(server::DeviceCandidate{
      1, "cpu:1", std::unique_ptr<Backend>(std::make_unique<FailingPrepareBackend>(CpuBackendFor(config), kFailingSize))});
  devices.push_back(server::DeviceCandidate{7, "cpu:7", absl::UnavailableError("no device 7 (test)")});
  return TestServer::StartOn(std::move(config), std::move(devices), std::move(sets));
}

v1::GetServerInfoResponse Info(TestServer& ts) {
  grpc::ClientContext ctx;
  v1::GetServerInfoResponse info;
  EXPECT_TRUE(ts.stub().GetServerInfo(WithDeadline(ctx), v1::GetServerInfoRequest(), &info).ok());
  return info;
}

grpc::Status Seam(TestServer& ts, const v1::MhcSeamRequest& req, v1::MhcSeamResponse* resp) {
  grpc::ClientContext ctx;
  return ts.stub().MhcSeam(WithDeadline(ctx), req, resp);
}

grpc::Status Swa(TestServer& ts, const v1::SwaNormQuantRequest& req, v1::SwaNormQuantResponse* resp) {
  grpc::ClientContext ctx;
  return ts.stub().SwaNormQuant(WithDeadline(ctx), req, resp);
}

TEST(MultiDevice, ServerInfoListsEveryDeviceTheOneLeftOutWithItsError) {
  auto rng = MakeRng(450);
  auto ts = StartTwoDevices(TestConfig(), {MakeWeightSet(rng, "both", MhcSetSpec{}, SwaSetSpec{})});
  ASSERT_NE(ts, nullptr);
  const v1::GetServerInfoResponse info = Info(*ts);
  ASSERT_EQ(info.devices_size(), 3);
  EXPECT_EQ(info.device_id(), -1);  // the first GPU's id: none on CPU devices
  for (int d = 0; d < 2; ++d) {
    const v1::DeviceInfo& dev = info.devices(d);
    EXPECT_EQ(dev.device_id(), d);
    EXPECT_EQ(dev.label(), absl::StrCat("cpu:", d));
    EXPECT_TRUE(dev.serving());
    EXPECT_TRUE(dev.error().empty());
    EXPECT_EQ(dev.calls_in_flight(), 0);
    // The set is resident on both, the same bytes on each.
    EXPECT_GT(dev.resident_bytes(), 0u);
    EXPECT_EQ(dev.resident_bytes(), info.devices(0).resident_bytes());
    ASSERT_EQ(dev.ops_size(), 2);
    EXPECT_TRUE(dev.ops(0).fused_available());
  }
  const v1::DeviceInfo& left = info.devices(2);
  EXPECT_EQ(left.device_id(), 7);
  EXPECT_EQ(left.label(), "cpu:7");
  EXPECT_FALSE(left.serving());
  EXPECT_NE(left.error().find("no device 7"), std::string::npos) << left.error();

  // The op series exist per serving device from the start (at 0), none for the device left out.
  const std::string m = ts->Scrape();
  for (const char* device : {"cpu:0", "cpu:1"}) {
    EXPECT_EQ(MetricValue(m, "fusedlayer_op_executions_total", {{"op", "mhc"}, {"path", "fused"}, {"device", device}}),
              0)
        << device;
    EXPECT_EQ(MetricValue(m, "fusedlayer_fused_kernel_available", {{"op", "swa"}, {"device", device}}), 1) << device;
    EXPECT_EQ(MetricValue(m, "fusedlayer_weights_resident_bytes", {{"device", device}}),
              static_cast<double>(info.devices(0).resident_bytes()))
        << device;
  }
  EXPECT_TRUE(std::isnan(MetricValue(m, "fusedlayer_weights_resident_bytes", {{"device", "cpu:7"}})));

  // Each device's health under its own name: a probe for one GPU.
  for (const auto& [device, want] : {std::pair{"cpu:0", 1}, std::pair{"cpu:1", 1}, std::pair{"cpu:7", 2}}) {
    int status = -1;
    ASSERT_TRUE(HealthCheck(ts->channel(), absl::StrCat("fusedlayer.device.", device), &status).ok()) << device;
    EXPECT_EQ(status, want) << device << " (1 SERVING, 2 NOT_SERVING)";
  }
}

TEST(MultiDevice, ANamedDeviceRunsTheCallAndEveryDeviceGivesTheSameBits) {
  auto rng = MakeRng(451);
  const server::PackedWeightSet set = MakeWeightSet(rng, "both", MhcSetSpec{}, SwaSetSpec{.wq_b_rows = 128});
  auto ts = StartTwoDevices(TestConfig(), {set});
  ASSERT_NE(ts, nullptr);
  Reference ref(set);
  for (const MhcVariant& v : kMhcVariants) {
    const v1::MhcSeamRequest base = MakeMhcRequest(
        rng, "both", {.tokens = 5, .stage = v.stage, .mode = v.mode, .pre_mix = v.pre_mix, .capture_aux = v.aux});
    const v1::MhcSeamResponse want = ref.RunMhc(base, Path::kFused);
    // Device 1 first: unnamed calls on an idle server would go 0, 1, 0, ...
    for (int d : {1, 0}) {
      v1::MhcSeamRequest req = base;
      req.set_device_id(d);
      v1::MhcSeamResponse resp;
      ASSERT_TRUE(Seam(*ts, req, &resp).ok());
      EXPECT_EQ(resp.report().device_id(), d);
      EXPECT_EQ(resp.report().path(), v1::EXECUTION_PATH_FUSED);
      SCOPED_TRACE(absl::StrCat("device ", d, " stage ", v1::MhcStage_Name(v.stage)));
      ExpectMhcEqual(resp, want);
      ExpectSameOutputsPresent(resp, want);
    }
  }
  const v1::SwaNormQuantRequest swa_base = MakeSwaRequest(rng, "both", 9, 256 + 128 + 3);
  const v1::SwaNormQuantResponse swa_want = ref.RunSwa(swa_base, Path::kFused);
  for (int d : {1, 0}) {
    v1::SwaNormQuantRequest req = swa_base;
    req.set_device_id(d);
    v1::SwaNormQuantResponse resp;
    ASSERT_TRUE(Swa(*ts, req, &resp).ok());
    EXPECT_EQ(resp.report().device_id(), d);
    SCOPED_TRACE(absl::StrCat("swa on device ", d));
    ExpectSwaEqual(resp, swa_want);
  }
  // Counted on the device that ran them: 5 seams and one SWA call each.
  const std::string m = ScrapeWhenIdle(*ts);
  for (const char* device : {"cpu:0", "cpu:1"}) {
    EXPECT_EQ(MetricValue(m, "fusedlayer_op_executions_total", {{"op", "mhc"}, {"path", "fused"}, {"device", device}}),
              5)
        << device;
    EXPECT_EQ(MetricValue(m, "fusedlayer_op_executions_total", {{"op", "swa"}, {"path", "fused"}, {"device", device}}),
              1)
        << device;
    EXPECT_EQ(MetricValue(m, "fusedlayer_request_stage_seconds_count",
                          {{"op", "mhc"}, {"stage", "device"}, {"device", device}}),
              5)
        << device;
  }
}

TEST(MultiDevice, AFallbackIsCountedOnTheDeviceThatFellBack) {
  auto rng = MakeRng(452);
  auto ts = StartTwoDevices(TestConfig(), {MakeWeightSet(rng, "both", MhcSetSpec{}, std::nullopt)});
  ASSERT_NE(ts, nullptr);
  v1::MhcSeamRequest req = MakeMhcRequest(rng, "both", {});
  req.set_path_preference(v1::PATH_PREFERENCE_FORCE_UNFUSED);
  req.set_device_id(1);
  v1::MhcSeamResponse resp;
  ASSERT_TRUE(Seam(*ts, req, &resp).ok());
  EXPECT_EQ(resp.report().path(), v1::EXECUTION_PATH_UNFUSED);
  const std::string m = ScrapeWhenIdle(*ts);
  EXPECT_EQ(MetricValue(m, "fusedlayer_op_fallbacks_total",
                        {{"op", "mhc"}, {"reason", "client_forced_unfused"}, {"device", "cpu:1"}}),
            1);
  EXPECT_EQ(MetricValue(m, "fusedlayer_op_fallbacks_total",
                        {{"op", "mhc"}, {"reason", "client_forced_unfused"}, {"device", "cpu:0"}}),
            0);
}

TEST(MultiDevice, ADeviceTheServerDoesNotServeIsInvalidArgument) {
  auto rng = MakeRng(453);
  auto ts = StartTwoDevices(TestConfig(), {MakeWeightSet(rng, "both", MhcSetSpec{}, SwaSetSpec{})});
  ASSERT_NE(ts, nullptr);
  for (int id : {7, 2, -1}) {  // left out, never listed, negative
    v1::MhcSeamRequest req = MakeMhcRequest(rng, "both", {});
    req.set_device_id(id);
    v1::MhcSeamResponse resp;
    grpc::Status s = Seam(*ts, req, &resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << id;
    EXPECT_NE(s.error_message().find("cpu:0 (id 0), cpu:1 (id 1)"), std::string::npos) << s.error_message();
    v1::SwaNormQuantRequest sreq = MakeSwaRequest(rng, "both", 2, 256 + 128);
    sreq.set_device_id(id);
    v1::SwaNormQuantResponse sresp;
    EXPECT_EQ(Swa(*ts, sreq, &sresp).error_code(), grpc::StatusCode::INVALID_ARGUMENT) << id;
  }
  // Refused calls leave the server serving, on either device.
  for (int d : {1, 0}) {
    v1::MhcSeamRequest req = MakeMhcRequest(rng, "both", {});
    req.set_device_id(d);
    v1::MhcSeamResponse resp;
    ASSERT_TRUE(Seam(*ts, req, &resp).ok()) << d;
    EXPECT_EQ(resp.report().device_id(), d);
  }
}

TEST(MultiDevice, UnnamedCallsGoToTheLeastLoadedDevice) {
  auto rng = MakeRng(454);
  auto ts = StartTwoDevices(TestConfig(), {MakeWeightSet(rng, "both", MhcSetSpec{}, std::nullopt)});
  ASSERT_NE(ts, nullptr);
  // One at a time: both devices are idle at every call, and ties go in turn.
  std::map<int, int> calls;
  for (int i = 0; i < 12; ++i) {
    v1::MhcSeamResponse resp;
    ASSERT_TRUE(Seam(*ts, MakeMhcRequest(rng, "both", {}), &resp).ok());
    ++calls[resp.report().device_id()];
  }
  EXPECT_EQ(calls[0], 6);
  EXPECT_EQ(calls[1], 6);
  EXPECT_EQ(calls.size(), 2u);

  // A device with a call in flight is not picked while the other is idle: hold device 0's
  // executor with a long control task, queue a call there by name, then send unnamed calls.
  std::promise<void> release;
  std::shared_future<void> released = release.get_future().share();
  ASSERT_TRUE(ts->server().devices()[0].executor->SubmitControl([released](double) { released.wait(); }).ok());
  std::thread held([&] {
    v1::MhcSeamRequest req = MakeMhcRequest(rng, "both", {});
    req.set_device_id(0);
    v1::MhcSeamResponse resp;
    EXPECT_TRUE(Seam(*ts, req, &resp).ok());
  });
  while (ts->server().devices()[0].calls_in_flight.load() == 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  std::mt19937_64 rng2 = MakeRng(455);
  for (int i = 0; i < 4; ++i) {
    // The previous call counts on device 1 until its task is gone, a moment after its answer:
    // each call is sent with device 1 idle again, as the case is meant.
    while (ts->server().devices()[1].calls_in_flight.load() != 0) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    v1::MhcSeamResponse resp;
    ASSERT_TRUE(Seam(*ts, MakeMhcRequest(rng2, "both", {}), &resp).ok());
    EXPECT_EQ(resp.report().device_id(), 1) << "sent to the device with a call waiting";
  }
  release.set_value();
  held.join();
}

TEST(MultiDevice, ALoadThatFailsOnOneDeviceIsVisibleOnNone) {
  auto rng = MakeRng(456);
  auto ts = StartTwoDevices(TestConfig(), {MakeWeightSet(rng, "kept", MhcSetSpec{}, std::nullopt)});
  ASSERT_NE(ts, nullptr);
  const uint64_t before = Info(*ts).devices(0).resident_bytes();
  // Device 1 cannot prepare a set of this size: device 0 could, and must not show it either.
  for (bool replace : {false, true}) {
    v1::WeightSetInfo info;
    server::PackedWeightSet big =
        MakeWeightSet(rng, replace ? "kept" : "new", MhcSetSpec{.hidden = kFailingSize}, std::nullopt);
    grpc::Status s = LoadWeights(ts->stub(), big, &info, 1 << 16, replace);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
    EXPECT_NE(s.error_message().find("device 1"), std::string::npos) << s.error_message();
  }
  grpc::ClientContext ctx;
  v1::ListWeightSetsResponse list;
  ASSERT_TRUE(ts->stub().ListWeightSets(WithDeadline(ctx), v1::ListWeightSetsRequest(), &list).ok());
  ASSERT_EQ(list.weight_sets_size(), 1);
  EXPECT_EQ(list.weight_sets(0).name(), "kept");
  EXPECT_EQ(list.weight_sets(0).mhc().hidden(), 256) << "the replacement must not be published anywhere";
  for (int d : {0, 1}) {
    v1::MhcSeamRequest req = MakeMhcRequest(rng, "new", {});
    req.set_device_id(d);
    v1::MhcSeamResponse resp;
    EXPECT_EQ(Seam(*ts, req, &resp).error_code(), grpc::StatusCode::NOT_FOUND) << d;
    v1::MhcSeamRequest kept = MakeMhcRequest(rng, "kept", {});
    kept.set_device_id(d);
    EXPECT_TRUE(Seam(*ts, kept, &resp).ok()) << d;
  }
  // What device 0 prepared for the failed loads was released (on its executor).
  const v1::GetServerInfoResponse after = Info(*ts);
  EXPECT_EQ(after.devices(0).resident_bytes(), before);
  EXPECT_EQ(after.devices(1).resident_bytes(), before);
}

TEST(MultiDevice, ASessionLivesOnOneDeviceAndItsCallsRunThere) {
  auto rng = MakeRng(457);
  server::ServerConfig config = TestConfig();
  auto ts = StartTwoDevices(config, {MakeWeightSet(rng, "both", MhcSetSpec{}, std::nullopt)});
  ASSERT_NE(ts, nullptr);
  const int64_t T = 4;
  v1::OpenResidualSessionRequest open;
  open.set_name("s1");
  open.set_tokens(T);
  open.set_hc_mult(4);
  open.set_hidden(256);
  open.set_device_id(1);
  {
    grpc::ClientContext ctx;
    v1::OpenResidualSessionResponse opened;
    ASSERT_TRUE(ts->stub().OpenResidualSession(WithDeadline(ctx), open, &opened).ok());
    EXPECT_EQ(opened.device_id(), 1);
  }
  // A FIRST call through the session runs on its device, whatever the loads are.
  v1::MhcSeamRequest first = MakeMhcRequest(rng, "both", {.tokens = T, .stage = v1::MHC_STAGE_FIRST});
  first.set_session("s1");
  for (int i = 0; i < 3; ++i) {
    v1::MhcSeamResponse resp;
    ASSERT_TRUE(Seam(*ts, first, &resp).ok());
    EXPECT_EQ(resp.report().device_id(), 1);
  }
  // Naming another device than the session's is a contradiction.
  first.set_device_id(0);
  v1::MhcSeamResponse resp;
  grpc::Status s = Seam(*ts, first, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(s.error_message().find("residual session"), std::string::npos) << s.error_message();
  // Listed with its device; a session opened on a device the server does not serve is refused.
  {
    grpc::ClientContext ctx;
    v1::ListResidualSessionsResponse list;
    ASSERT_TRUE(ts->stub().ListResidualSessions(WithDeadline(ctx), v1::ListResidualSessionsRequest(), &list).ok());
    ASSERT_EQ(list.sessions_size(), 1);
    EXPECT_EQ(list.sessions(0).device_id(), 1);
  }
  open.set_name("s2");
  open.set_device_id(7);
  grpc::ClientContext ctx;
  v1::OpenResidualSessionResponse opened;
  EXPECT_EQ(ts->stub().OpenResidualSession(WithDeadline(ctx), open, &opened).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
}

TEST(MultiDevice, VerifyComparesOnTheDeviceTheCallRanOn) {
  auto rng = MakeRng(458);
  auto ts = StartTwoDevices(TestConfig(), {MakeWeightSet(rng, "both", MhcSetSpec{}, SwaSetSpec{})});
  ASSERT_NE(ts, nullptr);
  for (int d : {1, 0}) {
    v1::MhcSeamRequest req = MakeMhcRequest(rng, "both", {});
    req.set_verify(true);
    req.set_device_id(d);
    v1::MhcSeamResponse resp;
    ASSERT_TRUE(Seam(*ts, req, &resp).ok());
    EXPECT_EQ(resp.report().device_id(), d);
    EXPECT_TRUE(resp.verification().compared()) << resp.verification().reason();
    EXPECT_FALSE(resp.verification().mismatch());
  }
  // Each comparison counts on the device its call ran on.
  const std::string m = ScrapeWhenIdle(*ts);
  for (const char* device : {"cpu:0", "cpu:1"}) {
    EXPECT_EQ(MetricValue(m, "fusedlayer_shadow_comparisons_total", {{"op", "mhc"}, {"device", device}}), 1) << device;
    EXPECT_EQ(MetricValue(m, "fusedlayer_shadow_mismatches_total", {{"op", "mhc"}, {"output", "y"}, {"device", device}}),
              0)
        << device;
  }
}

TEST(MultiDevice, NoDevicePassingItsCheckFailsTheStart) {
  std::vector<server::DeviceCandidate> devices;
  devices.push_back(server::DeviceCandidate{0, "cuda:0", absl::UnavailableError("no GPU (test)")});
  devices.push_back(server::DeviceCandidate{1, "cuda:1", absl::UnavailableError("no GPU either (test)")});
  auto started = server::FusedLayerServer::Start(TestConfig(), std::move(devices), {});
  ASSERT_FALSE(started.ok());
  EXPECT_EQ(started.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(started.status().message().find("cuda:1: no GPU either"), std::string::npos) << started.status();
}

TEST(DeviceList, ParsesTheFlag) {
  EXPECT_EQ(*server::ParseDeviceList("", 4), (std::vector<int>{0}));
  EXPECT_EQ(*server::ParseDeviceList("all", 3), (std::vector<int>{0, 1, 2}));
  EXPECT_EQ(*server::ParseDeviceList("all", 0), (std::vector<int>{0}));
  EXPECT_EQ(*server::ParseDeviceList("2,0", 1), (std::vector<int>{2, 0}));
  EXPECT_EQ(*server::ParseDeviceList(" 1 , 3", 1), (std::vector<int>{1, 3}));
  for (const char* bad : {"1,1", "x", "-1", "0,", "1;2", "4096"}) {
    absl::StatusOr<std::vector<int>> got = server::ParseDeviceList(bad, 8);
    EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
}

}  // namespace
}  // namespace fusedlayer::testing
