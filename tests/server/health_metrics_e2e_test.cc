// Health transitions, server reflection, and the /metrics exposition (names, pre-created series,
// build info) checked with `promtool check metrics` on a live scrape.
#include <cstdio>
#include <fstream>

#include "gtest/gtest.h"
#include "server_test_env.h"
#include "test_util.h"

namespace fusedlayer::testing {
namespace {

constexpr int kServing = 1, kNotServing = 2;

int Health(TestServer& ts, const std::string& service) {
  int status = -1;
  grpc::Status s = HealthCheck(ts.channel(), service, &status);
  EXPECT_TRUE(s.ok()) << service << ": " << s.error_code() << " " << s.error_message();
  return status;
}

grpc::ClientContext* WithDeadline(grpc::ClientContext& ctx) {
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  return &ctx;
}

TEST(ServerHealth, PerOpStatusFollowsLoadedWeights) {
  auto rng = MakeRng(30);
  auto ts = TestServer::Start(TestConfig());
  ASSERT_NE(ts, nullptr);
  EXPECT_EQ(Health(*ts, ""), kServing);
  EXPECT_EQ(Health(*ts, "fusedlayer.v1.FusedLayer"), kServing);
  EXPECT_EQ(Health(*ts, "fusedlayer.mhc"), kNotServing);
  EXPECT_EQ(Health(*ts, "fusedlayer.swa"), kNotServing);
  int unused = 0;
  EXPECT_EQ(HealthCheck(ts->channel(), "no.such.service", &unused).error_code(), grpc::StatusCode::NOT_FOUND);

  v1::WeightSetInfo info;
  ASSERT_TRUE(LoadWeights(ts->stub(), MakeWeightSet(rng, "m", MhcSetSpec{}, std::nullopt), &info).ok());
  EXPECT_EQ(Health(*ts, "fusedlayer.mhc"), kServing);
  EXPECT_EQ(Health(*ts, "fusedlayer.swa"), kNotServing);
  ASSERT_TRUE(LoadWeights(ts->stub(), MakeWeightSet(rng, "s", std::nullopt, SwaSetSpec{}), &info).ok());
  EXPECT_EQ(Health(*ts, "fusedlayer.swa"), kServing);

  // A failed load changes nothing.
  auto bad = MakeWeightSet(rng, "bad", std::nullopt, SwaSetSpec{});
  bad.first.set_sha256(std::string(64, '0'));
  EXPECT_EQ(LoadWeights(ts->stub(), bad, &info).error_code(), grpc::StatusCode::DATA_LOSS);

  grpc::ClientContext ctx;
  v1::UnloadWeightSetRequest req;
  req.set_name("m");
  v1::UnloadWeightSetResponse resp;
  ASSERT_TRUE(ts->stub().UnloadWeightSet(WithDeadline(ctx), req, &resp).ok());
  EXPECT_EQ(Health(*ts, "fusedlayer.mhc"), kNotServing);
  EXPECT_EQ(Health(*ts, "fusedlayer.swa"), kServing);
  EXPECT_EQ(Health(*ts, ""), kServing);
}

// fusedlayer_fused_kernel_available{op} and GetServerInfo's per-op capability follow the loaded
// sets: 0 with the backend's reason while every loaded set with that part would fall back.
TEST(ServerCapability, FollowsLoadedWeightSets) {
  auto rng = MakeRng(33);
  auto ts = TestServer::Start(TestConfig());
  ASSERT_NE(ts, nullptr);
  auto mhc_cap = [&]() {
    grpc::ClientContext ctx;
    v1::GetServerInfoResponse info;
    EXPECT_TRUE(ts->stub().GetServerInfo(WithDeadline(ctx), {}, &info).ok());
    EXPECT_EQ(info.ops_size(), 2);
    const double gauge = MetricValue(ts->Scrape(), "fusedlayer_fused_kernel_available", {{"op", "mhc"}});
    EXPECT_EQ(gauge, info.ops(0).fused_available() ? 1 : 0);
    return info.ops(0);
  };
  auto unload = [&](const std::string& name) {
    grpc::ClientContext ctx;
    v1::UnloadWeightSetRequest req;
    req.set_name(name);
    v1::UnloadWeightSetResponse resp;
    ASSERT_TRUE(ts->stub().UnloadWeightSet(WithDeadline(ctx), req, &resp).ok());
  };
  EXPECT_TRUE(mhc_cap().fused_available());  // nothing loaded, nothing falls back
  v1::WeightSetInfo info;
  ASSERT_TRUE(LoadWeights(ts->stub(), MakeWeightSet(rng, "n2", MhcSetSpec{.hc_mult = 2}, std::nullopt), &info).ok());
  v1::OpCapability cap = mhc_cap();
  EXPECT_FALSE(cap.fused_available());
  EXPECT_EQ(cap.reason(), v1::FALLBACK_REASON_HC_MULT_UNSUPPORTED);
  EXPECT_NE(cap.detail().find("n2"), std::string::npos) << cap.detail();
  ASSERT_TRUE(LoadWeights(ts->stub(), MakeWeightSet(rng, "n4", MhcSetSpec{}, std::nullopt), &info).ok());
  EXPECT_TRUE(mhc_cap().fused_available());
  unload("n4");
  EXPECT_FALSE(mhc_cap().fused_available());
  unload("n2");
  EXPECT_TRUE(mhc_cap().fused_available());
}

TEST(ServerHealth, StartupSetsAreWarmAndServing) {
  auto rng = MakeRng(31);
  auto ts = TestServer::Start(TestConfig(), nullptr, {MakeWeightSet(rng, "b", MhcSetSpec{}, SwaSetSpec{})});
  ASSERT_NE(ts, nullptr);
  EXPECT_EQ(Health(*ts, "fusedlayer.mhc"), kServing);
  EXPECT_EQ(Health(*ts, "fusedlayer.swa"), kServing);
}

TEST(ServerReflection, ListsTheFusedLayerService) {
  auto ts = TestServer::Start(TestConfig());
  ASSERT_NE(ts, nullptr);
  std::string bytes;
  grpc::Status s = ReflectionListServices(ts->channel(), &bytes);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_NE(bytes.find("fusedlayer.v1.FusedLayer"), std::string::npos);
  EXPECT_NE(bytes.find("grpc.health.v1.Health"), std::string::npos);
}

TEST(ServerMetrics, ExpositionPassesPromtoolAndHasTheDocumentedNames) {
  auto rng = MakeRng(32);
  auto ts = TestServer::Start(TestConfig(), nullptr, {MakeWeightSet(rng, "b", MhcSetSpec{}, SwaSetSpec{})});
  ASSERT_NE(ts, nullptr);
  // Some traffic, including an error, so every family has samples.
  for (auto pref : {v1::PATH_PREFERENCE_AUTO, v1::PATH_PREFERENCE_FORCE_UNFUSED}) {
    grpc::ClientContext c1;
    v1::MhcSeamRequest req = MakeMhcRequest(rng, "b", {});
    req.set_path_preference(pref);
    v1::MhcSeamResponse resp;
    ASSERT_TRUE(ts->stub().MhcSeam(WithDeadline(c1), req, &resp).ok());
  }
  grpc::ClientContext c2;
  v1::SwaNormQuantResponse sresp;
  EXPECT_EQ(ts->stub().SwaNormQuant(WithDeadline(c2), MakeSwaRequest(rng, "zzz", 1, 384), &sresp).error_code(),
            grpc::StatusCode::NOT_FOUND);

  const std::string m = ScrapeWhenIdle(*ts);
  for (const char* name :
       {"fusedlayer_op_executions_total", "fusedlayer_op_fallbacks_total", "fusedlayer_fused_kernel_available",
        "fusedlayer_op_duration_seconds", "fusedlayer_requests_total", "fusedlayer_request_duration_seconds",
        "fusedlayer_request_bytes_total", "fusedlayer_response_bytes_total", "fusedlayer_inflight_requests",
        "fusedlayer_queue_duration_seconds", "fusedlayer_request_stage_seconds", "fusedlayer_weights_resident_bytes",
        "fusedlayer_build_info"}) {
    EXPECT_NE(m.find(std::string("# TYPE ") + name + " "), std::string::npos) << name;
  }
  EXPECT_EQ(MetricValue(m, "fusedlayer_build_info",
                        {{"version", server::ServerVersion()}, {"backend", "cpu"}, {"arch", ts->server().backend().arch()}}),
            1);
  EXPECT_EQ(MetricValue(m, "fusedlayer_op_executions_total", {{"op", "mhc"}, {"path", "fused"}}), 1);
  EXPECT_EQ(MetricValue(m, "fusedlayer_op_executions_total", {{"op", "mhc"}, {"path", "unfused"}}), 1);
  EXPECT_EQ(MetricValue(m, "fusedlayer_op_duration_seconds_count", {{"op", "mhc"}, {"path", "fused"}}), 1);
  EXPECT_EQ(MetricValue(m, "fusedlayer_requests_total", {{"method", "MhcSeam"}, {"code", "OK"}}), 2);
  EXPECT_EQ(MetricValue(m, "fusedlayer_requests_total", {{"method", "SwaNormQuant"}, {"code", "NOT_FOUND"}}), 1);
  // Error series the server can return exist from the start at 0 (a series born at 1 is invisible
  // to rate() and increase(), so the first error of a kind would not show on a dashboard).
  EXPECT_EQ(MetricValue(m, "fusedlayer_requests_total", {{"method", "MhcSeam"}, {"code", "DATA_LOSS"}}), 0);
  EXPECT_EQ(MetricValue(m, "fusedlayer_requests_total", {{"method", "LoadWeights"}, {"code", "INTERNAL"}}), 0);
  EXPECT_EQ(MetricValue(m, "fusedlayer_requests_total", {{"method", "SwaNormQuant"}, {"code", "RESOURCE_EXHAUSTED"}}), 0);
  EXPECT_EQ(MetricValue(m, "fusedlayer_request_duration_seconds_count", {{"method", "MhcSeam"}}), 2);
  EXPECT_GT(MetricValue(m, "fusedlayer_request_bytes_total", {{"method", "MhcSeam"}}), 0);
  EXPECT_GT(MetricValue(m, "fusedlayer_response_bytes_total", {{"method", "MhcSeam"}}), 0);
  // Every executor task is timed: the startup load (build + warm-up) and the two compute calls.
  EXPECT_EQ(MetricValue(m, "fusedlayer_queue_duration_seconds_count", {}), 3);

  // promtool must be installed (Debian package `prometheus`); its absence is a failure, not a skip.
  const std::string path = ::testing::TempDir() + "fusedlayer_metrics.prom";
  {
    std::ofstream out(path);
    out << m;
  }
  FILE* p = popen(("promtool check metrics < " + path + " 2>&1; echo \"rc=$?\"").c_str(), "r");
  ASSERT_NE(p, nullptr);
  std::string output;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), p)) > 0) output.append(buf, n);
  pclose(p);
  EXPECT_NE(output.find("rc=0"), std::string::npos) << "promtool check metrics failed:\n" << output;
  EXPECT_EQ(output.find("not found"), std::string::npos) << "promtool is missing (install Debian `prometheus`):\n"
                                                          << output;
}

}  // namespace
}  // namespace fusedlayer::testing
