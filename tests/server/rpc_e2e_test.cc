// End-to-end over gRPC on loopback: every RPC, and compute outputs bitwise equal to the library
// run directly on the same inputs and weights.
#include <chrono>
#include <thread>

#include "fault_backend.h"
#include "gtest/gtest.h"
#include "server_test_env.h"
#include "test_util.h"
#include "weights/demo_weights.h"

namespace fusedlayer::testing {
namespace {

using server::PackedWeightSet;

grpc::ClientContext* WithDeadline(grpc::ClientContext& ctx) {
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  return &ctx;
}

TEST(ServerRpc, GetServerInfoDescribesBackendLimitsAndOps) {
  server::ServerConfig cfg = TestConfig();
  cfg.fused_max_tokens = 777;
  cfg.max_tokens = 4096;
  cfg.queue_capacity = 9;
  cfg.max_message_bytes = 8 << 20;
  auto ts = TestServer::Start(cfg);
  ASSERT_NE(ts, nullptr);
  grpc::ClientContext ctx;
  v1::GetServerInfoResponse info;
  ASSERT_TRUE(ts->stub().GetServerInfo(WithDeadline(ctx), {}, &info).ok());
  EXPECT_EQ(info.version(), server::ServerVersion());
  EXPECT_EQ(info.backend(), "cpu");
  EXPECT_EQ(info.device(), "cpu (2 threads)");
  EXPECT_FALSE(info.arch().empty());
  EXPECT_EQ(info.fused_max_tokens(), 777);
  EXPECT_EQ(info.max_tokens(), 4096);
  EXPECT_EQ(info.queue_capacity(), 9);
  EXPECT_EQ(info.max_receive_message_bytes(), 8 << 20);
  EXPECT_EQ(info.max_send_message_bytes(), 8 << 20);
  ASSERT_EQ(info.ops_size(), 2);
  EXPECT_EQ(info.ops(0).op(), "mhc");
  EXPECT_EQ(info.ops(1).op(), "swa");
  // No weights loaded: nothing can fall back; the detail says the backend is asked per set.
  for (const auto& op : info.ops()) {
    EXPECT_TRUE(op.fused_available());
    EXPECT_EQ(op.reason(), v1::FALLBACK_REASON_NONE);
    EXPECT_NE(op.detail().find("no weight set"), std::string::npos) << op.detail();
  }
}

TEST(ServerRpc, LoadListReplaceUnload) {
  auto rng = MakeRng(1);
  auto ts = TestServer::Start(TestConfig());
  ASSERT_NE(ts, nullptr);
  PackedWeightSet set = MakeWeightSet(rng, "test/L0", MhcSetSpec{}, SwaSetSpec{.wq_b_rows = 128});
  v1::WeightSetInfo info;
  // Small chunks: the payload spans many messages.
  ASSERT_TRUE(LoadWeights(ts->stub(), set, &info, /*chunk_bytes=*/4096).ok());
  EXPECT_EQ(info.name(), "test/L0");
  EXPECT_EQ(info.source(), "rpc");
  EXPECT_TRUE(info.has_mhc());
  EXPECT_TRUE(info.has_swa());
  EXPECT_EQ(info.wq_b_rows(), 128);
  // Which implementation computes q_proj is reported (the CPU backend's reference GEMM here).
  EXPECT_EQ(info.wq_b_implementation(), "CPU reference GEMM (swa_cpu_gemm.cc)");
  EXPECT_GT(info.resident_bytes(), 0u);
  EXPECT_EQ(info.sha256(), set.first.sha256());

  {
    grpc::ClientContext ctx;
    v1::ListWeightSetsResponse list;
    ASSERT_TRUE(ts->stub().ListWeightSets(WithDeadline(ctx), {}, &list).ok());
    ASSERT_EQ(list.weight_sets_size(), 1);
    EXPECT_EQ(list.weight_sets(0).name(), "test/L0");
    ASSERT_EQ(list.weight_sets(0).capabilities_size(), 2);
    for (const auto& cap : list.weight_sets(0).capabilities()) EXPECT_TRUE(cap.fused_available()) << cap.op();
  }
  const std::string metrics = ts->Scrape();
  EXPECT_EQ(MetricValue(metrics, "fusedlayer_weights_resident_bytes", {{"device", "cpu:0"}}),
            static_cast<double>(info.resident_bytes()));
  EXPECT_EQ(MetricValue(metrics, "fusedlayer_fused_kernel_available", {{"op", "mhc"}}), 1);
  EXPECT_EQ(MetricValue(metrics, "fusedlayer_fused_kernel_available", {{"op", "swa"}}), 1);

  // Same name without replace: ALREADY_EXISTS; with replace: swapped.
  PackedWeightSet set2 = MakeWeightSet(rng, "test/L0", MhcSetSpec{}, std::nullopt);
  v1::WeightSetInfo info2;
  EXPECT_EQ(LoadWeights(ts->stub(), set2, &info2).error_code(), grpc::StatusCode::ALREADY_EXISTS);
  ASSERT_TRUE(LoadWeights(ts->stub(), set2, &info2, 1 << 16, /*replace=*/true).ok());
  EXPECT_FALSE(info2.has_swa());
  {
    grpc::ClientContext ctx;
    v1::ListWeightSetsResponse list;
    ASSERT_TRUE(ts->stub().ListWeightSets(WithDeadline(ctx), {}, &list).ok());
    ASSERT_EQ(list.weight_sets_size(), 1);
    EXPECT_FALSE(list.weight_sets(0).has_swa());
  }
  {
    grpc::ClientContext ctx;
    v1::UnloadWeightSetRequest req;
    req.set_name("test/L0");
    v1::UnloadWeightSetResponse resp;
    ASSERT_TRUE(ts->stub().UnloadWeightSet(WithDeadline(ctx), req, &resp).ok());
    EXPECT_EQ(resp.freed_bytes(), info2.resident_bytes());
  }
  {
    grpc::ClientContext ctx;
    v1::UnloadWeightSetRequest req;
    req.set_name("test/L0");
    v1::UnloadWeightSetResponse resp;
    EXPECT_EQ(ts->stub().UnloadWeightSet(WithDeadline(ctx), req, &resp).error_code(), grpc::StatusCode::NOT_FOUND);
  }
  {
    grpc::ClientContext ctx;
    v1::ListWeightSetsResponse list;
    ASSERT_TRUE(ts->stub().ListWeightSets(WithDeadline(ctx), {}, &list).ok());
    EXPECT_EQ(list.weight_sets_size(), 0);
  }
  EXPECT_EQ(MetricValue(ts->Scrape(), "fusedlayer_weights_resident_bytes", {{"device", "cpu:0"}}), 0);
}

struct MhcCase {
  v1::MhcStage stage;
  v1::MhcMode mode;
  bool pre_mix;
  bool capture_aux;
  bool norm_weight;
};

TEST(ServerRpc, MhcOutputsEqualTheLibraryBitwiseOnBothPaths) {
  auto rng = MakeRng(2);
  auto ts = TestServer::Start(TestConfig());
  ASSERT_NE(ts, nullptr);
  const std::vector<MhcCase> cases = {
      {v1::MHC_STAGE_SEAM, v1::MHC_MODE_SHIFTED, true, false, true},
      {v1::MHC_STAGE_SEAM, v1::MHC_MODE_SHIFTED, false, true, true},
      {v1::MHC_STAGE_SEAM, v1::MHC_MODE_NORMAL, false, true, false},
      {v1::MHC_STAGE_FIRST, v1::MHC_MODE_SHIFTED, false, false, true},
      {v1::MHC_STAGE_FIRST, v1::MHC_MODE_NORMAL, false, false, true},
      {v1::MHC_STAGE_HEAD, v1::MHC_MODE_SHIFTED, true, false, true},
      {v1::MHC_STAGE_HEAD, v1::MHC_MODE_SHIFTED, false, false, false},
  };
  PackedWeightSet with_norm = MakeWeightSet(rng, "mhc/norm", MhcSetSpec{.hidden = 320}, std::nullopt);
  PackedWeightSet no_norm = MakeWeightSet(rng, "mhc/nonorm", MhcSetSpec{.hidden = 320, .norm_weight = false},
                                          std::nullopt);
  v1::WeightSetInfo info;
  ASSERT_TRUE(LoadWeights(ts->stub(), with_norm, &info).ok());
  ASSERT_TRUE(LoadWeights(ts->stub(), no_norm, &info).ok());
  Reference ref_norm(with_norm), ref_nonorm(no_norm);

  for (const MhcCase& c : cases) {
    for (int64_t T : {int64_t{0}, int64_t{1}, int64_t{5}}) {
      for (auto pref : {v1::PATH_PREFERENCE_AUTO, v1::PATH_PREFERENCE_FORCE_UNFUSED}) {
        SCOPED_TRACE(::testing::Message() << "stage " << c.stage << " mode " << c.mode << " pre_mix " << c.pre_mix
                                        << " aux " << c.capture_aux << " norm " << c.norm_weight << " T " << T
                                        << " pref " << pref);
        const std::string name = c.norm_weight ? "mhc/norm" : "mhc/nonorm";
        v1::MhcSeamRequest req = MakeMhcRequest(
            rng, name, MhcRequestSpec{4, 320, T, c.stage, c.mode, c.pre_mix, c.capture_aux});
        req.set_path_preference(pref);
        req.set_request_id("req-42");
        grpc::ClientContext ctx;
        v1::MhcSeamResponse resp;
        grpc::Status s = ts->stub().MhcSeam(WithDeadline(ctx), req, &resp);
        ASSERT_TRUE(s.ok()) << s.error_message();
        const Path path = pref == v1::PATH_PREFERENCE_AUTO ? Path::kFused : Path::kUnfused;
        EXPECT_EQ(resp.report().path(), path == Path::kFused ? v1::EXECUTION_PATH_FUSED : v1::EXECUTION_PATH_UNFUSED);
        EXPECT_EQ(resp.report().weight_set(), name);
        EXPECT_EQ(resp.report().backend(), "cpu");
        EXPECT_EQ(resp.request_id(), "req-42");
        Reference& ref = c.norm_weight ? ref_norm : ref_nonorm;
        ExpectMhcEqual(resp, ref.RunMhc(req, path));
      }
    }
  }
}

TEST(ServerRpc, SwaOutputsEqualTheLibraryBitwiseOnBothPaths) {
  auto rng = MakeRng(3);
  auto ts = TestServer::Start(TestConfig());
  ASSERT_NE(ts, nullptr);
  struct Case {
    SwaSetSpec spec;
    int64_t extra_cols;
  };
  const std::vector<Case> cases = {
      {{.q_rank = 256, .head_dim = 128, .wq_b_rows = 128}, 0},
      {{.q_rank = 384, .head_dim = 64, .scale = v1::SCALE_FORMAT_UE8M0, .layout = v1::SCALE_LAYOUT_COLUMN_MAJOR_TMA},
       37},
      {{.q_rank = 128, .head_dim = 192, .fp8 = v1::FP8_FORMAT_E4M3FNUZ, .wq_b_rows = 256}, 5},
  };
  int k = 0;
  for (const Case& c : cases) {
    const std::string name = "swa/" + std::to_string(k++);
    PackedWeightSet set = MakeWeightSet(rng, name, std::nullopt, c.spec);
    v1::WeightSetInfo info;
    ASSERT_TRUE(LoadWeights(ts->stub(), set, &info).ok());
    Reference ref(set);
    for (int64_t M : {int64_t{0}, int64_t{1}, int64_t{6}}) {
      for (auto pref : {v1::PATH_PREFERENCE_AUTO, v1::PATH_PREFERENCE_FORCE_UNFUSED}) {
        SCOPED_TRACE(::testing::Message() << name << " M " << M << " pref " << pref);
        v1::SwaNormQuantRequest req =
            MakeSwaRequest(rng, name, M, c.spec.q_rank + c.spec.head_dim + c.extra_cols);
        req.set_path_preference(pref);
        grpc::ClientContext ctx;
        v1::SwaNormQuantResponse resp;
        grpc::Status s = ts->stub().SwaNormQuant(WithDeadline(ctx), req, &resp);
        ASSERT_TRUE(s.ok()) << s.error_message();
        const Path path = pref == v1::PATH_PREFERENCE_AUTO ? Path::kFused : Path::kUnfused;
        EXPECT_EQ(resp.report().path(), path == Path::kFused ? v1::EXECUTION_PATH_FUSED : v1::EXECUTION_PATH_UNFUSED);
        EXPECT_FALSE(resp.request_id().empty());  // generated by the server
        if (c.spec.layout == v1::SCALE_LAYOUT_COLUMN_MAJOR_TMA) {
          ASSERT_EQ(resp.q_scale().shape_size(), 2);
          EXPECT_EQ(resp.q_scale().shape(0), c.spec.q_rank / 128);
          EXPECT_EQ(resp.q_scale().shape(1), AlignTo4(M));
        }
        ExpectSwaEqual(resp, ref.RunSwa(req, path));
      }
    }
  }
}

// A backend whose memory is not host-accessible (a GPU): every tensor goes through Allocate /
// CopyToDevice / CopyToHost, and the outputs are still the library's, bit for bit.
TEST(ServerRpc, DeviceMemoryBackendStagesTensorsAndMatchesTheLibrary) {
  auto rng = MakeRng(6);
  auto backend = std::make_unique<FaultBackend>(CpuBackendFor(TestConfig()));
  auto control = backend->control();
  control->device_memory = true;
  PackedWeightSet set = MakeWeightSet(rng, "dev", MhcSetSpec{},
                                      SwaSetSpec{.layout = v1::SCALE_LAYOUT_COLUMN_MAJOR_TMA, .wq_b_rows = 128});
  auto ts = TestServer::Start(TestConfig(), std::move(backend), {set});
  ASSERT_NE(ts, nullptr);
  Reference ref(set);
  for (auto pref : {v1::PATH_PREFERENCE_AUTO, v1::PATH_PREFERENCE_FORCE_UNFUSED}) {
    const Path path = pref == v1::PATH_PREFERENCE_AUTO ? Path::kFused : Path::kUnfused;
    {
      const int to_dev = control->copies_to_device, to_host = control->copies_to_host;
      v1::MhcSeamRequest req = MakeMhcRequest(rng, "dev", MhcRequestSpec{.tokens = 5, .capture_aux = true});
      req.set_path_preference(pref);
      grpc::ClientContext ctx;
      v1::MhcSeamResponse resp;
      ASSERT_TRUE(ts->stub().MhcSeam(WithDeadline(ctx), req, &resp).ok());
      ExpectMhcEqual(resp, ref.RunMhc(req, path));
      EXPECT_EQ(control->copies_to_device - to_dev, 5);  // x, residual, post_mix, comb_mix, pre_mix
      EXPECT_EQ(control->copies_to_host - to_host, 6);   // new_residual, 3 mixes, y, aux
    }
    {
      const int to_dev = control->copies_to_device, to_host = control->copies_to_host;
      v1::SwaNormQuantRequest req = MakeSwaRequest(rng, "dev", 7, 256 + 128 + 3);
      req.set_path_preference(pref);
      grpc::ClientContext ctx;
      v1::SwaNormQuantResponse resp;
      ASSERT_TRUE(ts->stub().SwaNormQuant(WithDeadline(ctx), req, &resp).ok());
      ExpectSwaEqual(resp, ref.RunSwa(req, path));
      EXPECT_EQ(control->copies_to_device - to_dev, 1);  // qr_kv
      EXPECT_EQ(control->copies_to_host - to_host, 4);   // q_fp8, q_scale, kv, q_proj
    }
  }
}

TEST(ServerRpc, DemoWeightSetsLoadAndServe) {
  auto demo = server::MakeDemoWeightSets(server::kDefaultDemoSeed);
  ASSERT_TRUE(demo.ok()) << demo.status();
  std::vector<PackedWeightSet> sets = *demo;
  auto ts = TestServer::Start(TestConfig(), nullptr, sets);
  ASSERT_NE(ts, nullptr);
  grpc::ClientContext ctx;
  v1::ListWeightSetsResponse list;
  ASSERT_TRUE(ts->stub().ListWeightSets(WithDeadline(ctx), {}, &list).ok());
  std::vector<std::string> names;
  for (const auto& s : list.weight_sets()) names.push_back(s.name());
  EXPECT_EQ(names, (std::vector<std::string>{"v4-pro/demo", "v41-flash/demo"}));

  auto rng = MakeRng(4);
  for (const PackedWeightSet& set : sets) {
    Reference ref(set);
    const int64_t C = set.first.mhc().hidden();
    // 256 tokens at C = 5120 / 7168: 13 / 18 MB each way, well past gRPC's 4 MiB default limit.
    v1::MhcSeamRequest mreq = MakeMhcRequest(rng, set.first.name(), MhcRequestSpec{4, C, 256});
    ASSERT_GT(mreq.ByteSizeLong(), size_t{4} << 20);
    grpc::ClientContext c1;
    v1::MhcSeamResponse mresp;
    ASSERT_TRUE(ts->stub().MhcSeam(WithDeadline(c1), mreq, &mresp).ok());
    EXPECT_EQ(mresp.report().path(), v1::EXECUTION_PATH_FUSED);
    ExpectMhcEqual(mresp, ref.RunMhc(mreq, Path::kFused));

    const int64_t S = set.first.swa().q_rank() + set.first.swa().head_dim();
    v1::SwaNormQuantRequest sreq = MakeSwaRequest(rng, set.first.name(), 1537, S);
    ASSERT_GT(sreq.ByteSizeLong(), size_t{4} << 20);
    grpc::ClientContext c2;
    v1::SwaNormQuantResponse sresp;
    ASSERT_TRUE(ts->stub().SwaNormQuant(WithDeadline(c2), sreq, &sresp).ok());
    EXPECT_EQ(sresp.report().path(), v1::EXECUTION_PATH_FUSED);
    ExpectSwaEqual(sresp, ref.RunSwa(sreq, Path::kFused));
  }
}

TEST(ServerRpc, ConcurrentClientsAllGetTheirOwnResults) {
  auto rng = MakeRng(5);
  auto ts = TestServer::Start(TestConfig());
  ASSERT_NE(ts, nullptr);
  PackedWeightSet set = MakeWeightSet(rng, "conc", MhcSetSpec{}, std::nullopt);
  v1::WeightSetInfo info;
  ASSERT_TRUE(LoadWeights(ts->stub(), set, &info).ok());
  Reference ref(set);
  constexpr int kThreads = 4, kCalls = 8;
  std::vector<std::vector<v1::MhcSeamRequest>> reqs(kThreads);
  for (auto& r : reqs) {
    for (int i = 0; i < kCalls; ++i) r.push_back(MakeMhcRequest(rng, "conc", MhcRequestSpec{.tokens = 1 + i % 4}));
  }
  std::vector<std::vector<v1::MhcSeamResponse>> resps(kThreads, std::vector<v1::MhcSeamResponse>(kCalls));
  std::vector<std::vector<grpc::Status>> statuses(kThreads, std::vector<grpc::Status>(kCalls));
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kCalls; ++i) {
        grpc::ClientContext ctx;
        statuses[t][i] = ts->stub().MhcSeam(WithDeadline(ctx), reqs[t][i], &resps[t][i]);
      }
    });
  }
  for (auto& th : threads) th.join();
  for (int t = 0; t < kThreads; ++t) {
    for (int i = 0; i < kCalls; ++i) {
      ASSERT_TRUE(statuses[t][i].ok()) << statuses[t][i].error_message();
      ExpectMhcEqual(resps[t][i], ref.RunMhc(reqs[t][i], Path::kFused));
    }
  }
  EXPECT_EQ(MetricValue(ts->Scrape(), "fusedlayer_requests_total", {{"method", "MhcSeam"}, {"code", "OK"}}),
            kThreads * kCalls);
}

}  // namespace
}  // namespace fusedlayer::testing
