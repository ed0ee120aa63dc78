// Every fallback reason is reachable over gRPC and counted twice: in the response's
// ExecutionReport and in fusedlayer_op_fallbacks_total / fusedlayer_op_executions_total. Reasons
// the CPU backend produces are reached for real (n = 2, C = 200, a small --fused_max_tokens, the
// kill switch, FORCE_UNFUSED); the others through FaultBackend. Strict mode (REQUIRE_FUSED) turns
// each into FAILED_PRECONDITION naming the reason, counted in requests_total and not in executions.
#include <chrono>

#include "fault_backend.h"
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

// Counter snapshot for one op.
struct Counts {
  double fused, unfused, reason;
};
Counts Read(TestServer& ts, const char* op, const char* reason) {
  const std::string m = ts.Scrape();
  return {MetricValue(m, "fusedlayer_op_executions_total", {{"op", op}, {"path", "fused"}}),
          MetricValue(m, "fusedlayer_op_executions_total", {{"op", op}, {"path", "unfused"}}),
          MetricValue(m, "fusedlayer_op_fallbacks_total", {{"op", op}, {"reason", reason}})};
}

// One call of `op` with `preference`; checks it ran unfused for `reason` and that the metrics
// moved by exactly one execution and one fallback.
void ExpectFallback(TestServer& ts, std::mt19937_64& rng, const char* op, const std::string& set, int hc_mult,
                    int64_t width, int64_t q_plus_d, int64_t tokens, FallbackReason reason,
                    v1::PathPreference preference = v1::PATH_PREFERENCE_AUTO, bool capture_aux = false) {
  SCOPED_TRACE(::testing::Message() << op << " expecting " << FallbackReasonName(reason));
  const Counts before = Read(ts, op, FallbackReasonName(reason));
  ASSERT_EQ(before.reason, before.reason) << "series fusedlayer_op_fallbacks_total{op=" << op << ",reason="
                                          << FallbackReasonName(reason) << "} missing";
  v1::ExecutionReport report;
  grpc::ClientContext ctx;
  if (std::string(op) == "mhc") {
    MhcRequestSpec spec{hc_mult, width, tokens};
    spec.capture_aux = capture_aux;
    v1::MhcSeamRequest req = MakeMhcRequest(rng, set, spec);
    req.set_path_preference(preference);
    v1::MhcSeamResponse resp;
    grpc::Status s = ts.stub().MhcSeam(WithDeadline(ctx), req, &resp);
    ASSERT_TRUE(s.ok()) << s.error_message();
    report = resp.report();
  } else {
    v1::SwaNormQuantRequest req = MakeSwaRequest(rng, set, tokens, q_plus_d);
    req.set_path_preference(preference);
    v1::SwaNormQuantResponse resp;
    grpc::Status s = ts.stub().SwaNormQuant(WithDeadline(ctx), req, &resp);
    ASSERT_TRUE(s.ok()) << s.error_message();
    report = resp.report();
  }
  EXPECT_EQ(report.path(), v1::EXECUTION_PATH_UNFUSED);
  EXPECT_EQ(report.fallback_reason(), server::ToProto(reason));
  EXPECT_FALSE(report.fallback_detail().empty());
  const Counts after = Read(ts, op, FallbackReasonName(reason));
  EXPECT_EQ(after.unfused - before.unfused, 1);
  EXPECT_EQ(after.fused - before.fused, 0);
  EXPECT_EQ(after.reason - before.reason, 1);
}

// REQUIRE_FUSED on a request that would fall back for `reason`.
void ExpectStrictFailure(TestServer& ts, std::mt19937_64& rng, const char* op, const std::string& set, int hc_mult,
                         int64_t width, int64_t q_plus_d, int64_t tokens, FallbackReason reason) {
  SCOPED_TRACE(::testing::Message() << op << " strict, expecting " << FallbackReasonName(reason));
  const std::string method = std::string(op) == "mhc" ? "MhcSeam" : "SwaNormQuant";
  const std::string m0 = ts.Scrape();
  const Counts before = Read(ts, op, FallbackReasonName(reason));
  double failed_before =
      MetricValue(m0, "fusedlayer_requests_total", {{"method", method}, {"code", "FAILED_PRECONDITION"}});
  if (failed_before != failed_before) failed_before = 0;  // created on first use
  grpc::ClientContext ctx;
  grpc::Status s;
  if (std::string(op) == "mhc") {
    v1::MhcSeamRequest req = MakeMhcRequest(rng, set, MhcRequestSpec{hc_mult, width, tokens});
    req.set_path_preference(v1::PATH_PREFERENCE_REQUIRE_FUSED);
    v1::MhcSeamResponse resp;
    s = ts.stub().MhcSeam(WithDeadline(ctx), req, &resp);
  } else {
    v1::SwaNormQuantRequest req = MakeSwaRequest(rng, set, tokens, q_plus_d);
    req.set_path_preference(v1::PATH_PREFERENCE_REQUIRE_FUSED);
    v1::SwaNormQuantResponse resp;
    s = ts.stub().SwaNormQuant(WithDeadline(ctx), req, &resp);
  }
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_NE(s.error_message().find(FallbackReasonName(reason)), std::string::npos) << s.error_message();
  const std::string m1 = ts.Scrape();
  const Counts after = Read(ts, op, FallbackReasonName(reason));
  EXPECT_EQ(MetricValue(m1, "fusedlayer_requests_total", {{"method", method}, {"code", "FAILED_PRECONDITION"}}) -
                failed_before,
            1);
  EXPECT_EQ(after.fused - before.fused, 0);
  EXPECT_EQ(after.unfused - before.unfused, 0);
  EXPECT_EQ(after.reason - before.reason, 0);
}

TEST(ServerFallback, EveryOpReasonSeriesIsPreCreatedAtZero) {
  auto ts = TestServer::Start(TestConfig());
  ASSERT_NE(ts, nullptr);
  const std::string m = ts->Scrape();
  for (const char* op : {"mhc", "swa"}) {
    for (FallbackReason r : AllFallbackReasons()) {
      EXPECT_EQ(MetricValue(m, "fusedlayer_op_fallbacks_total", {{"op", op}, {"reason", FallbackReasonName(r)}}), 0)
          << op << " " << FallbackReasonName(r);
    }
    for (const char* path : {"fused", "unfused"}) {
      EXPECT_EQ(MetricValue(m, "fusedlayer_op_executions_total", {{"op", op}, {"path", path}}), 0);
      EXPECT_EQ(MetricValue(m, "fusedlayer_op_duration_seconds_count", {{"op", op}, {"path", path}}), 0);
    }
  }
}

TEST(ServerFallback, RealCpuReasons) {
  auto rng = MakeRng(10);
  server::ServerConfig cfg = TestConfig();
  cfg.fused_max_tokens = 4;
  auto ts = TestServer::Start(cfg, nullptr,
                              {MakeWeightSet(rng, "n2", MhcSetSpec{.hc_mult = 2, .hidden = 256}, std::nullopt),
                               MakeWeightSet(rng, "c200", MhcSetSpec{.hc_mult = 4, .hidden = 200},
                                             SwaSetSpec{.q_rank = 128, .head_dim = 200}),
                               MakeWeightSet(rng, "ok", MhcSetSpec{}, SwaSetSpec{})});
  ASSERT_NE(ts, nullptr);

  ExpectFallback(*ts, rng, "mhc", "n2", 2, 256, 0, 3, FallbackReason::kHcMultUnsupported);
  ExpectFallback(*ts, rng, "mhc", "c200", 4, 200, 0, 3, FallbackReason::kHiddenSizeUnsupported);
  ExpectFallback(*ts, rng, "swa", "c200", 0, 0, 328, 3, FallbackReason::kHiddenSizeUnsupported);
  ExpectFallback(*ts, rng, "mhc", "ok", 4, 256, 0, 5, FallbackReason::kTooManyTokens);
  ExpectFallback(*ts, rng, "swa", "ok", 0, 0, 384, 5, FallbackReason::kTooManyTokens);
  ExpectFallback(*ts, rng, "mhc", "ok", 4, 256, 0, 4, FallbackReason::kClientForcedUnfused,
                 v1::PATH_PREFERENCE_FORCE_UNFUSED);
  ExpectFallback(*ts, rng, "swa", "ok", 0, 0, 384, 4, FallbackReason::kClientForcedUnfused,
                 v1::PATH_PREFERENCE_FORCE_UNFUSED);

  ExpectStrictFailure(*ts, rng, "mhc", "n2", 2, 256, 0, 3, FallbackReason::kHcMultUnsupported);
  ExpectStrictFailure(*ts, rng, "mhc", "c200", 4, 200, 0, 3, FallbackReason::kHiddenSizeUnsupported);
  ExpectStrictFailure(*ts, rng, "swa", "c200", 0, 0, 328, 3, FallbackReason::kHiddenSizeUnsupported);
  ExpectStrictFailure(*ts, rng, "mhc", "ok", 4, 256, 0, 5, FallbackReason::kTooManyTokens);
  ExpectStrictFailure(*ts, rng, "swa", "ok", 0, 0, 384, 5, FallbackReason::kTooManyTokens);

  // REQUIRE_FUSED where fused can run: it runs fused.
  grpc::ClientContext ctx;
  v1::MhcSeamRequest req = MakeMhcRequest(rng, "ok", MhcRequestSpec{.tokens = 4});
  req.set_path_preference(v1::PATH_PREFERENCE_REQUIRE_FUSED);
  v1::MhcSeamResponse resp;
  ASSERT_TRUE(ts->stub().MhcSeam(WithDeadline(ctx), req, &resp).ok());
  EXPECT_EQ(resp.report().path(), v1::EXECUTION_PATH_FUSED);
  EXPECT_EQ(resp.report().fallback_reason(), v1::FALLBACK_REASON_NONE);
}

TEST(ServerFallback, KillSwitchDisablesFusedPerOp) {
  auto rng = MakeRng(11);
  server::ServerConfig cfg = TestConfig();
  ASSERT_TRUE(server::ParseDisableFused("mhc", cfg).ok());
  auto ts = TestServer::Start(cfg, nullptr, {MakeWeightSet(rng, "ok", MhcSetSpec{}, SwaSetSpec{})});
  ASSERT_NE(ts, nullptr);
  ExpectFallback(*ts, rng, "mhc", "ok", 4, 256, 0, 2, FallbackReason::kDisabledByConfig);
  ExpectStrictFailure(*ts, rng, "mhc", "ok", 4, 256, 0, 2, FallbackReason::kDisabledByConfig);
  // FORCE_UNFUSED is the client's choice and wins over the kill switch as the reported reason.
  ExpectFallback(*ts, rng, "mhc", "ok", 4, 256, 0, 2, FallbackReason::kClientForcedUnfused,
                 v1::PATH_PREFERENCE_FORCE_UNFUSED);

  // swa is untouched.
  grpc::ClientContext ctx;
  v1::SwaNormQuantResponse resp;
  ASSERT_TRUE(ts->stub().SwaNormQuant(WithDeadline(ctx), MakeSwaRequest(rng, "ok", 2, 384), &resp).ok());
  EXPECT_EQ(resp.report().path(), v1::EXECUTION_PATH_FUSED);

  const std::string m = ts->Scrape();
  EXPECT_EQ(MetricValue(m, "fusedlayer_fused_kernel_available", {{"op", "mhc"}}), 0);
  EXPECT_EQ(MetricValue(m, "fusedlayer_fused_kernel_available", {{"op", "swa"}}), 1);
  grpc::ClientContext c2;
  v1::GetServerInfoResponse info;
  ASSERT_TRUE(ts->stub().GetServerInfo(WithDeadline(c2), {}, &info).ok());
  ASSERT_EQ(info.ops_size(), 2);
  EXPECT_FALSE(info.ops(0).fused_available());
  EXPECT_EQ(info.ops(0).reason(), v1::FALLBACK_REASON_DISABLED_BY_CONFIG);
  EXPECT_TRUE(info.ops(1).fused_available());
  grpc::ClientContext c3;
  v1::ListWeightSetsResponse list;
  ASSERT_TRUE(ts->stub().ListWeightSets(WithDeadline(c3), {}, &list).ok());
  ASSERT_EQ(list.weight_sets_size(), 1);
  for (const auto& cap : list.weight_sets(0).capabilities()) {
    if (cap.op() == "mhc") {
      EXPECT_FALSE(cap.fused_available());
      EXPECT_EQ(cap.reason(), v1::FALLBACK_REASON_DISABLED_BY_CONFIG);
    } else {
      EXPECT_TRUE(cap.fused_available());
    }
  }
}

TEST(ServerFallback, InjectedBackendReasons) {
  auto rng = MakeRng(12);
  auto backend = std::make_unique<FaultBackend>(CpuBackendFor(TestConfig()));
  auto control = backend->control();
  auto ts = TestServer::Start(TestConfig(), std::move(backend), {MakeWeightSet(rng, "ok", MhcSetSpec{}, SwaSetSpec{})});
  ASSERT_NE(ts, nullptr);
  for (FallbackReason r : {FallbackReason::kBackendHasNoFusedKernel, FallbackReason::kDeviceArchUnsupported,
                           FallbackReason::kAuxCaptureRequested, FallbackReason::kWorkspaceUnavailable}) {
    control->ForceReason(r);
    ExpectFallback(*ts, rng, "mhc", "ok", 4, 256, 0, 2, r, v1::PATH_PREFERENCE_AUTO,
                   /*capture_aux=*/r == FallbackReason::kAuxCaptureRequested);
    ExpectFallback(*ts, rng, "swa", "ok", 0, 0, 384, 2, r);
    ExpectStrictFailure(*ts, rng, "mhc", "ok", 4, 256, 0, 2, r);
    ExpectStrictFailure(*ts, rng, "swa", "ok", 0, 0, 384, 2, r);
  }
  control->ForceReason(std::nullopt);
}

TEST(ServerFallback, FusedKernelErrorReRunsUnfusedWithTheSameOutputs) {
  auto rng = MakeRng(13);
  auto backend = std::make_unique<FaultBackend>(CpuBackendFor(TestConfig()));
  auto control = backend->control();
  PackedWeightSet set = MakeWeightSet(rng, "ok", MhcSetSpec{}, SwaSetSpec{.wq_b_rows = 128});
  auto ts = TestServer::Start(TestConfig(), std::move(backend), {set});
  ASSERT_NE(ts, nullptr);
  control->fail_fused = true;
  ExpectFallback(*ts, rng, "mhc", "ok", 4, 256, 0, 3, FallbackReason::kFusedKernelError);
  ExpectFallback(*ts, rng, "swa", "ok", 0, 0, 384, 3, FallbackReason::kFusedKernelError);

  // The re-run's outputs are the unfused path's, bit for bit.
  Reference ref(set);
  v1::MhcSeamRequest req = MakeMhcRequest(rng, "ok", MhcRequestSpec{.tokens = 3});
  grpc::ClientContext ctx;
  v1::MhcSeamResponse resp;
  ASSERT_TRUE(ts->stub().MhcSeam(WithDeadline(ctx), req, &resp).ok());
  EXPECT_EQ(resp.report().fallback_reason(), v1::FALLBACK_REASON_FUSED_KERNEL_ERROR);
  const v1::MhcSeamResponse want = ref.RunMhc(req, Path::kUnfused);
  EXPECT_TRUE(TensorsBitwiseEqual(resp.y(), want.y()));
  EXPECT_TRUE(TensorsBitwiseEqual(resp.new_residual(), want.new_residual()));

  // Under REQUIRE_FUSED a failing fused kernel is FAILED_PRECONDITION naming fused_kernel_error.
  ExpectStrictFailure(*ts, rng, "mhc", "ok", 4, 256, 0, 3, FallbackReason::kFusedKernelError);
  control->fail_fused = false;
}

}  // namespace
}  // namespace fusedlayer::testing
