// Shadow verification end to end (README "Shadow verification", docs/shadow.md):
//  - in-process servers at --shadow_sample_rate=1: zero mismatches over many random requests for
//    both ops and every config; every fused request is compared exactly once, after its response;
//  - verify = true: the comparison comes back in the response (and is counted); FORCE_UNFUSED gives
//    compared = false with the reason; REQUIRE_FUSED that cannot run stays FAILED_PRECONDITION;
//  - the shadow queue bound (jobs and bytes) with the background lane held by the test hook:
//    serving responses all OK while shadow jobs wait, the overflow counted as dropped;
//  - zero-copy capture: sampled responses are bitwise those an unsampled server returns for the
//    same requests; the calls' messages stay alive exactly while queued jobs hold them and are all
//    freed after the jobs ran or were dropped at shutdown;
//  - the fault-injection binary with numeric faults (ulp_flip, wrong_scale): mismatches counted
//    under the right output label, one log line per mismatch, bounded dumps, and fusedctl replay
//    reproducing them (exit 3) on the faulty server and not on a correct one (exit 0).
#include <sys/wait.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <unistd.h>
#include <map>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "demo_server_process.h"
#include "fault_backend.h"
#include "server_process.h"
#include "server_test_env.h"
#include "shadow/shared_messages.h"
#include "test_util.h"

#ifndef FUSEDLAYER_FAULT_SERVER_BINARY
#error "FUSEDLAYER_FAULT_SERVER_BINARY must point at the fusedlayer_server_faults executable"
#endif
#ifndef FUSEDCTL_BINARY
#error "FUSEDCTL_BINARY must point at the fusedctl executable"
#endif

namespace fusedlayer::testing {
namespace {

double Shadow(const std::string& m, const std::string& name, const std::map<std::string, std::string>& labels) {
  return MetricValue(m, "fusedlayer_shadow_" + name, labels);
}

// Polls the scrape until `done(scrape)` holds; fails after ~30 s.
template <typename Done>
std::string WaitForMetrics(const std::function<std::string()>& scrape, Done done) {
  std::string m;
  for (int i = 0; i < 3000; ++i) {
    m = scrape();
    if (done(m)) return m;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ADD_FAILURE() << "condition not reached; last scrape:\n" << m;
  return m;
}

server::ServerConfig ShadowConfig(double rate, int64_t queue = 64) {
  server::ServerConfig c = TestConfig();
  c.shadow_sample_rate = rate;
  c.shadow_queue_size = queue;
  return c;
}

SwaSetSpec SwaSpec(v1::Fp8Format fp8, v1::ScaleFormat scale, v1::ScaleLayout layout, int64_t wq_b) {
  return {.q_rank = 512, .head_dim = 128, .fp8 = fp8, .scale = scale, .layout = layout, .wq_b_rows = wq_b};
}

TEST(ShadowE2E, ZeroMismatchesOverManyRandomRequestsInEveryConfig) {
  std::mt19937_64 rng = MakeRng(31);
  std::vector<server::PackedWeightSet> sets;
  sets.push_back(MakeWeightSet(rng, "mhc/norm", MhcSetSpec{}, std::nullopt));
  sets.push_back(MakeWeightSet(rng, "mhc/nonorm", MhcSetSpec{.norm_weight = false}, std::nullopt));
  std::vector<std::string> swa_sets;
  int k = 0;
  for (auto fp8 : {v1::FP8_FORMAT_E4M3FN, v1::FP8_FORMAT_E4M3FNUZ}) {
    for (auto scale : {v1::SCALE_FORMAT_FP32, v1::SCALE_FORMAT_UE8M0}) {
      for (auto layout : {v1::SCALE_LAYOUT_ROW_MAJOR, v1::SCALE_LAYOUT_COLUMN_MAJOR_TMA}) {
        for (int64_t wq_b : {int64_t{0}, int64_t{256}}) {
          const std::string name = "swa/" + std::to_string(k++);
          sets.push_back(MakeWeightSet(rng, name, std::nullopt, SwaSpec(fp8, scale, layout, wq_b)));
          swa_sets.push_back(name);
        }
      }
    }
  }
  auto ts = TestServer::Start(ShadowConfig(1.0), nullptr, std::move(sets));
  ASSERT_NE(ts, nullptr);
  int fused[2] = {0, 0};
  std::uniform_int_distribution<int64_t> tokens(1, 24);
  for (int round = 0; round < 2; ++round) {
    for (const char* set : {"mhc/norm", "mhc/nonorm"}) {
      for (v1::MhcStage stage : {v1::MHC_STAGE_SEAM, v1::MHC_STAGE_FIRST, v1::MHC_STAGE_HEAD}) {
        for (v1::MhcMode mode : {v1::MHC_MODE_SHIFTED, v1::MHC_MODE_NORMAL}) {
          for (bool aux : {false, true}) {
            if (stage == v1::MHC_STAGE_HEAD && mode == v1::MHC_MODE_NORMAL) continue;
            if (aux && stage != v1::MHC_STAGE_SEAM) continue;
            MhcRequestSpec spec;
            spec.tokens = tokens(rng);
            spec.stage = stage;
            spec.mode = mode;
            spec.pre_mix = mode == v1::MHC_MODE_SHIFTED && stage != v1::MHC_STAGE_FIRST && (round == 0);
            spec.capture_aux = aux;
            v1::MhcSeamRequest req = MakeMhcRequest(rng, set, spec);
            v1::MhcSeamResponse resp;
            grpc::ClientContext ctx;
            grpc::Status s = ts->stub().MhcSeam(&ctx, req, &resp);
            ASSERT_TRUE(s.ok()) << s.error_message();
            EXPECT_FALSE(resp.has_verification());  // only when asked
            if (resp.report().path() == v1::EXECUTION_PATH_FUSED) ++fused[0];
          }
        }
      }
    }
    for (const std::string& set : swa_sets) {
      const int64_t m = tokens(rng);
      v1::SwaNormQuantRequest req = MakeSwaRequest(rng, set, m * 4, 512 + 128 + 8 * round);
      v1::SwaNormQuantResponse resp;
      grpc::ClientContext ctx;
      grpc::Status s = ts->stub().SwaNormQuant(&ctx, req, &resp);
      ASSERT_TRUE(s.ok()) << s.error_message();
      if (resp.report().path() == v1::EXECUTION_PATH_FUSED) ++fused[1];
    }
  }
  ASSERT_EQ(fused[0], 28);  // every config runs fused on the CPU backend (n = 4, C = 256)
  ASSERT_EQ(fused[1], 32);
  const std::string m = WaitForMetrics([&] { return ts->Scrape(); }, [&](const std::string& s) {
    return Shadow(s, "comparisons_total", {{"op", "mhc"}}) == fused[0] &&
           Shadow(s, "comparisons_total", {{"op", "swa"}}) == fused[1];
  });
  for (const char* op : {"mhc", "swa"}) {
    EXPECT_EQ(Shadow(m, "dropped_total", {{"op", op}}), 0) << op;
    EXPECT_EQ(Shadow(m, "errors_total", {{"op", op}}), 0) << op;
  }
  for (const char* out : {"new_residual", "new_pre_mix", "new_post_mix", "new_comb_mix", "y", "aux"}) {
    EXPECT_EQ(Shadow(m, "mismatches_total", {{"op", "mhc"}, {"output", out}}), 0) << out;
  }
  for (const char* out : {"q_fp8", "q_scale", "kv", "q_proj"}) {
    EXPECT_EQ(Shadow(m, "mismatches_total", {{"op", "swa"}, {"output", out}}), 0) << out;
  }
  // Bitwise outputs: every comparison observed 0 ulp; y and new_residual always observed.
  EXPECT_EQ(Shadow(m, "ulp_distance_bucket", {{"op", "mhc"}, {"output", "new_residual"}, {"le", "0"}}), fused[0]);
  EXPECT_EQ(Shadow(m, "ulp_distance_count", {{"op", "mhc"}, {"output", "y"}}), fused[0]);
  EXPECT_EQ(Shadow(m, "ulp_distance_bucket", {{"op", "swa"}, {"output", "kv"}, {"le", "0"}}), fused[1]);
  EXPECT_EQ(Shadow(m, "max_abs_diff_count", {{"op", "swa"}, {"output", "q_proj"}}), fused[1] / 2);
  EXPECT_EQ(ts->server().shadow().queued_jobs(), 0u);
}

TEST(ShadowE2E, VerifyReturnsTheComparisonSynchronously) {
  std::mt19937_64 rng = MakeRng(32);
  std::vector<server::PackedWeightSet> sets;
  sets.push_back(MakeWeightSet(rng, "both", MhcSetSpec{},
                               SwaSpec(v1::FP8_FORMAT_E4M3FN, v1::SCALE_FORMAT_UE8M0,
                                       v1::SCALE_LAYOUT_COLUMN_MAJOR_TMA, 256)));
  sets.push_back(MakeWeightSet(rng, "n2", MhcSetSpec{.hc_mult = 2, .hidden = 256}, std::nullopt));
  // Sampling off: only verify compares.
  auto ts = TestServer::Start(ShadowConfig(0.0), nullptr, std::move(sets));
  ASSERT_NE(ts, nullptr);

  MhcRequestSpec spec;
  spec.tokens = 9;
  spec.mode = v1::MHC_MODE_NORMAL;
  spec.pre_mix = false;
  v1::MhcSeamRequest req = MakeMhcRequest(rng, "both", spec);
  req.set_verify(true);
  req.set_request_id("verify-1");
  v1::MhcSeamResponse resp;
  {
    grpc::ClientContext ctx;
    ASSERT_TRUE(ts->stub().MhcSeam(&ctx, req, &resp).ok());
  }
  ASSERT_EQ(resp.report().path(), v1::EXECUTION_PATH_FUSED);
  ASSERT_TRUE(resp.has_verification());
  const v1::Verification& v = resp.verification();
  EXPECT_TRUE(v.compared());
  EXPECT_FALSE(v.mismatch());
  std::vector<std::string> names;
  for (const v1::OutputComparison& o : v.outputs()) {
    names.push_back(o.output());
    EXPECT_FALSE(o.mismatch()) << o.output() << ": " << o.detail();
    EXPECT_GT(o.total_elements(), 0) << o.output();
    EXPECT_FALSE(o.rule().empty());
  }
  EXPECT_EQ(names, (std::vector<std::string>{"new_residual", "new_pre_mix", "new_post_mix", "new_comb_mix", "y"}));
  // Recorded synchronously: visible in the first scrape after the response.
  std::string m = ts->Scrape();
  EXPECT_EQ(Shadow(m, "comparisons_total", {{"op", "mhc"}}), 1);
  // The outputs returned are the fused path's, exactly as without verify.
  {
    v1::MhcSeamRequest plain = req;
    plain.set_verify(false);
    v1::MhcSeamResponse r;
    grpc::ClientContext ctx;
    ASSERT_TRUE(ts->stub().MhcSeam(&ctx, plain, &r).ok());
    EXPECT_TRUE(TensorsBitwiseEqual(r.y(), resp.y()));
    EXPECT_TRUE(TensorsBitwiseEqual(r.new_residual(), resp.new_residual()));
    EXPECT_TRUE(TensorsBitwiseEqual(r.new_comb_mix(), resp.new_comb_mix()));
    EXPECT_FALSE(r.has_verification());
  }

  v1::SwaNormQuantRequest sreq = MakeSwaRequest(rng, "both", 7, 512 + 128);
  sreq.set_verify(true);
  v1::SwaNormQuantResponse sresp;
  {
    grpc::ClientContext ctx;
    ASSERT_TRUE(ts->stub().SwaNormQuant(&ctx, sreq, &sresp).ok());
  }
  ASSERT_TRUE(sresp.verification().compared());
  EXPECT_FALSE(sresp.verification().mismatch());
  ASSERT_EQ(sresp.verification().outputs_size(), 4);
  EXPECT_EQ(sresp.verification().outputs(3).output(), "q_proj");
  m = ts->Scrape();
  EXPECT_EQ(Shadow(m, "comparisons_total", {{"op", "swa"}}), 1);

  // FORCE_UNFUSED: nothing fused to compare.
  req.set_path_preference(v1::PATH_PREFERENCE_FORCE_UNFUSED);
  {
    grpc::ClientContext ctx;
    v1::MhcSeamResponse r;
    ASSERT_TRUE(ts->stub().MhcSeam(&ctx, req, &r).ok());
    EXPECT_FALSE(r.verification().compared());
    EXPECT_EQ(r.verification().reason(), "ran unfused (client_forced_unfused)");
    EXPECT_EQ(r.verification().outputs_size(), 0);
  }
  // AUTO on a set the fused kernel cannot take: compared = false, naming the fallback reason.
  MhcRequestSpec n2;
  n2.hc_mult = 2;
  v1::MhcSeamRequest req2 = MakeMhcRequest(rng, "n2", n2);
  req2.set_verify(true);
  {
    grpc::ClientContext ctx;
    v1::MhcSeamResponse r;
    ASSERT_TRUE(ts->stub().MhcSeam(&ctx, req2, &r).ok());
    EXPECT_FALSE(r.verification().compared());
    EXPECT_EQ(r.verification().reason(), "ran unfused (hc_mult_unsupported)");
  }
  // REQUIRE_FUSED that cannot run: FAILED_PRECONDITION as without verify.
  req2.set_path_preference(v1::PATH_PREFERENCE_REQUIRE_FUSED);
  {
    grpc::ClientContext ctx;
    v1::MhcSeamResponse r;
    grpc::Status s = ts->stub().MhcSeam(&ctx, req2, &r);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
    EXPECT_NE(s.error_message().find("hc_mult_unsupported"), std::string::npos) << s.error_message();
  }
  m = ScrapeWhenIdle(*ts);
  EXPECT_EQ(Shadow(m, "comparisons_total", {{"op", "mhc"}}), 1);  // unfused runs are not compared
}

// verify = true runs the op twice in the call's own executor job: --max_inflight_verify bounds how
// many such calls are admitted at once. Over it: RESOURCE_EXHAUSTED before anything runs, while
// calls without verify are admitted as before; the slot comes back when the call is done.
TEST(ShadowE2E, VerifyCallsAreBoundedByMaxInflightVerify) {
  std::mt19937_64 rng = MakeRng(44);
  server::ServerConfig cfg = ShadowConfig(0.0);
  cfg.max_inflight_verify = 1;
  auto backend = std::make_unique<FaultBackend>(CpuBackendFor(cfg));
  std::shared_ptr<FaultBackend::Control> control = backend->control();
  auto ts = TestServer::Start(cfg, std::move(backend), {MakeWeightSet(rng, "v", MhcSetSpec{}, std::nullopt)});
  ASSERT_NE(ts, nullptr);
  v1::MhcSeamRequest verify = MakeMhcRequest(rng, "v", {});
  verify.set_verify(true);
  const v1::MhcSeamRequest plain = MakeMhcRequest(rng, "v", {});
  auto call = [&](const v1::MhcSeamRequest& req, v1::MhcSeamResponse* resp) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    return ts->stub().MhcSeam(&ctx, req, resp);
  };

  const int entered = control->Entered();
  control->CloseGate();
  grpc::Status running_status, plain_status;
  v1::MhcSeamResponse running, plain_resp;
  std::thread holder([&] { running_status = call(verify, &running); });
  control->WaitEntered(entered + 1);  // the verify call is inside its first run: it holds the slot

  v1::MhcSeamResponse refused_resp;
  const grpc::Status refused = call(verify, &refused_resp);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << refused.error_message();
  EXPECT_NE(refused.error_message().find("--max_inflight_verify"), std::string::npos) << refused.error_message();
  EXPECT_EQ(control->Entered(), entered + 1) << "the refused verify call ran";
  std::thread plain_caller([&] { plain_status = call(plain, &plain_resp); });  // admitted: queues

  control->OpenGate();
  holder.join();
  plain_caller.join();
  ASSERT_TRUE(running_status.ok()) << running_status.error_message();
  EXPECT_TRUE(running.verification().compared());
  EXPECT_FALSE(running.verification().mismatch());
  ASSERT_TRUE(plain_status.ok()) << plain_status.error_message();
  EXPECT_FALSE(plain_resp.has_verification());

  // The slot is given back when the call is done (its OnDone, just after the client saw the
  // status): the next verify call is admitted once the server is idle.
  ScrapeWhenIdle(*ts);
  v1::MhcSeamResponse again;
  const grpc::Status after = call(verify, &again);
  ASSERT_TRUE(after.ok()) << after.error_message();
  EXPECT_TRUE(again.verification().compared());
}

TEST(ShadowE2E, VerifyIsRefusedWhenSwitchedOff) {
  std::mt19937_64 rng = MakeRng(45);
  server::ServerConfig cfg = ShadowConfig(0.0);
  cfg.max_inflight_verify = 0;
  auto ts = TestServer::Start(cfg, nullptr, {MakeWeightSet(rng, "v", MhcSetSpec{}, std::nullopt)});
  ASSERT_NE(ts, nullptr);
  v1::MhcSeamRequest req = MakeMhcRequest(rng, "v", {});
  req.set_verify(true);
  v1::MhcSeamResponse resp;
  {
    grpc::ClientContext ctx;
    const grpc::Status s = ts->stub().MhcSeam(&ctx, req, &resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << s.error_message();
    EXPECT_NE(s.error_message().find("--max_inflight_verify=0"), std::string::npos) << s.error_message();
  }
  req.set_verify(false);
  grpc::ClientContext ctx;
  EXPECT_TRUE(ts->stub().MhcSeam(&ctx, req, &resp).ok());
}

TEST(ShadowE2E, QueueBoundDropsAndServingNeverWaitsBehindShadowWork) {
  std::mt19937_64 rng = MakeRng(33);
  std::vector<server::PackedWeightSet> sets;
  sets.push_back(MakeWeightSet(rng, "s", MhcSetSpec{}, SwaSpec(v1::FP8_FORMAT_E4M3FN, v1::SCALE_FORMAT_FP32,
                                                             v1::SCALE_LAYOUT_ROW_MAJOR, 0)));
  auto ts = TestServer::Start(ShadowConfig(1.0, /*queue=*/3), nullptr, std::move(sets));
  ASSERT_NE(ts, nullptr);
  server::Executor& ex = ts->server().executor();
  ex.PauseBackgroundForTest(true);  // shadow jobs stay queued: the slowest possible shadow lane
  constexpr int kRequests = 20;
  for (int i = 0; i < kRequests; ++i) {
    MhcRequestSpec spec;
    spec.tokens = 4;
    v1::MhcSeamRequest req = MakeMhcRequest(rng, "s", spec);
    v1::MhcSeamResponse resp;
    grpc::ClientContext ctx;
    grpc::Status s = ts->stub().MhcSeam(&ctx, req, &resp);
    // Every serving request is answered while shadow jobs wait: serving never queues behind them.
    ASSERT_TRUE(s.ok()) << i << ": " << s.error_message();
    ASSERT_EQ(resp.report().path(), v1::EXECUTION_PATH_FUSED);
    EXPECT_EQ(ts->server().queued_tasks(), 0u);
    // The job is queued right after the response (Complete, then Submit): the client can be faster.
    for (int k = 0; k < 1000 && ex.background_queued() < static_cast<size_t>(std::min(i + 1, 3)); ++k) {
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    EXPECT_EQ(ex.background_queued(), static_cast<size_t>(std::min(i + 1, 3)));
  }
  EXPECT_EQ(ts->server().shadow().queued_jobs(), 3u);
  EXPECT_EQ(ex.background_started(), 0u);
  std::string m = ScrapeWhenIdle(*ts);
  EXPECT_EQ(Shadow(m, "dropped_total", {{"op", "mhc"}}), kRequests - 3);
  EXPECT_EQ(Shadow(m, "queued_jobs", {}), 3);
  EXPECT_GT(Shadow(m, "queued_bytes", {}), 0);
  EXPECT_EQ(Shadow(m, "comparisons_total", {{"op", "mhc"}}), 0);
  EXPECT_EQ(MetricValue(m, "fusedlayer_requests_total", {{"method", "MhcSeam"}, {"code", "OK"}}), kRequests);

  ex.PauseBackgroundForTest(false);
  m = WaitForMetrics([&] { return ts->Scrape(); },
                     [](const std::string& s) { return Shadow(s, "comparisons_total", {{"op", "mhc"}}) == 3; });
  EXPECT_EQ(Shadow(m, "mismatches_total", {{"op", "mhc"}, {"output", "new_residual"}}), 0);
  EXPECT_EQ(ex.background_started(), 3u);
  WaitForMetrics([&] { return ts->Scrape(); },
                 [](const std::string& s) { return Shadow(s, "queued_jobs", {}) == 0 && Shadow(s, "queued_bytes", {}) == 0; });
}

TEST(ShadowE2E, ByteBoundDropsJobsLargerThanTheBudget) {
  std::mt19937_64 rng = MakeRng(34);
  std::vector<server::PackedWeightSet> sets;
  sets.push_back(MakeWeightSet(rng, "s", MhcSetSpec{}, std::nullopt));
  server::ServerConfig c = ShadowConfig(1.0, 64);
  // A T = 2 request at C = 256 needs ~10 KB of copies; T = 64 ~ 300 KB.
  c.shadow_queue_max_bytes = 100 << 10;
  auto ts = TestServer::Start(c, nullptr, std::move(sets));
  ASSERT_NE(ts, nullptr);
  for (int64_t tokens : {2, 64, 2}) {
    MhcRequestSpec spec;
    spec.tokens = tokens;
    v1::MhcSeamRequest req = MakeMhcRequest(rng, "s", spec);
    v1::MhcSeamResponse resp;
    grpc::ClientContext ctx;
    ASSERT_TRUE(ts->stub().MhcSeam(&ctx, req, &resp).ok());
  }
  std::string m = WaitForMetrics([&] { return ts->Scrape(); }, [](const std::string& s) {
    return Shadow(s, "comparisons_total", {{"op", "mhc"}}) == 2;
  });
  EXPECT_EQ(Shadow(m, "dropped_total", {{"op", "mhc"}}), 1);
}

// Every Tensor field of two responses of one type: the same fields set, bitwise equal.
void ExpectSameOutputs(const google::protobuf::Message& a, const google::protobuf::Message& b, const std::string& what) {
  const google::protobuf::Descriptor* d = a.GetDescriptor();
  const google::protobuf::Reflection* r = a.GetReflection();
  int n = 0;
  for (int i = 0; i < d->field_count(); ++i) {
    const google::protobuf::FieldDescriptor* f = d->field(i);
    if (f->is_repeated() || f->message_type() != v1::Tensor::descriptor()) continue;
    ASSERT_EQ(r->HasField(a, f), r->HasField(b, f)) << what << ": " << f->name();
    if (!r->HasField(a, f)) continue;
    ++n;
    EXPECT_TRUE(TensorsBitwiseEqual(static_cast<const v1::Tensor&>(r->GetMessage(a, f)),
                                    static_cast<const v1::Tensor&>(r->GetMessage(b, f))))
        << what << ": " << f->name();
  }
  EXPECT_GT(n, 0) << what;
}

// Polls until the process holds `want` live call messages (gRPC releases a call's shortly after the
// client has its response).
void WaitForLiveMessages(uint64_t want) {
  for (int i = 0; i < 2000 && server::shadow::SharedMessagesCounters::live() != want; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_EQ(server::shadow::SharedMessagesCounters::live(), want);
}

TEST(ShadowE2E, ZeroCopyCaptureLeavesResponsesBitwiseAndFreesEveryCallsMessages) {
  const uint64_t live0 = server::shadow::SharedMessagesCounters::live();
  std::mt19937_64 rng = MakeRng(35);
  std::vector<server::PackedWeightSet> sets;  // the same weights on both servers
  sets.push_back(MakeWeightSet(rng, "s", MhcSetSpec{}, SwaSpec(v1::FP8_FORMAT_E4M3FN, v1::SCALE_FORMAT_FP32,
                                                             v1::SCALE_LAYOUT_ROW_MAJOR, 256)));
  std::vector<server::PackedWeightSet> same = sets;
  auto sampled = TestServer::Start(ShadowConfig(1.0, 64), nullptr, std::move(sets));
  auto plain = TestServer::Start(ShadowConfig(0.0), nullptr, std::move(same));
  ASSERT_NE(sampled, nullptr);
  ASSERT_NE(plain, nullptr);
  server::Executor& ex = sampled->server().executor();
  ex.PauseBackgroundForTest(true);  // the jobs hold the calls' messages after the responses went out

  constexpr int kEach = 6;
  for (int i = 0; i < kEach; ++i) {
    MhcRequestSpec spec;
    spec.tokens = 1 + 5 * i;
    spec.capture_aux = i % 2 == 1;
    v1::MhcSeamRequest req = MakeMhcRequest(rng, "s", spec);
    req.set_request_id("zc-mhc-" + std::to_string(i));
    v1::MhcSeamResponse a, b;
    grpc::ClientContext ca, cb;
    ASSERT_TRUE(sampled->stub().MhcSeam(&ca, req, &a).ok());
    ASSERT_TRUE(plain->stub().MhcSeam(&cb, req, &b).ok());
    ASSERT_EQ(a.report().path(), v1::EXECUTION_PATH_FUSED);
    ASSERT_EQ(b.report().path(), v1::EXECUTION_PATH_FUSED);
    EXPECT_EQ(a.request_id(), b.request_id());
    EXPECT_FALSE(a.has_verification());
    ExpectSameOutputs(a, b, req.request_id());
  }
  for (int i = 0; i < kEach; ++i) {
    v1::SwaNormQuantRequest req = MakeSwaRequest(rng, "s", 1 + 3 * i, 512 + 128 + 8);
    req.set_request_id("zc-swa-" + std::to_string(i));
    v1::SwaNormQuantResponse a, b;
    grpc::ClientContext ca, cb;
    ASSERT_TRUE(sampled->stub().SwaNormQuant(&ca, req, &a).ok());
    ASSERT_TRUE(plain->stub().SwaNormQuant(&cb, req, &b).ok());
    ASSERT_EQ(a.report().path(), v1::EXECUTION_PATH_FUSED);
    EXPECT_EQ(a.request_id(), b.request_id());
    ExpectSameOutputs(a, b, req.request_id());
  }
  // Every response is out; what is still alive is exactly what the queued jobs hold.
  EXPECT_EQ(sampled->server().shadow().queued_jobs(), static_cast<size_t>(2 * kEach));
  WaitForLiveMessages(live0 + 2 * kEach);

  ex.PauseBackgroundForTest(false);
  std::string m = WaitForMetrics([&] { return sampled->Scrape(); }, [](const std::string& s) {
    return Shadow(s, "comparisons_total", {{"op", "mhc"}}) == kEach &&
           Shadow(s, "comparisons_total", {{"op", "swa"}}) == kEach && Shadow(s, "queued_jobs", {}) == 0;
  });
  for (const char* o : {"new_residual", "y", "new_pre_mix"}) {
    EXPECT_EQ(Shadow(m, "mismatches_total", {{"op", "mhc"}, {"output", o}}), 0) << o;
  }
  for (const char* o : {"kv", "q_fp8", "q_scale", "q_proj"}) {
    EXPECT_EQ(Shadow(m, "mismatches_total", {{"op", "swa"}, {"output", o}}), 0) << o;
  }
  EXPECT_EQ(Shadow(m, "dropped_total", {{"op", "mhc"}}), 0);
  WaitForLiveMessages(live0);

  // Shutdown with jobs still queued: they are dropped and the messages they held are freed.
  ex.PauseBackgroundForTest(true);
  for (int i = 0; i < 3; ++i) {
    MhcRequestSpec spec;
    spec.tokens = 8;
    v1::MhcSeamRequest req = MakeMhcRequest(rng, "s", spec);
    v1::MhcSeamResponse a;
    grpc::ClientContext ca;
    ASSERT_TRUE(sampled->stub().MhcSeam(&ca, req, &a).ok());
  }
  WaitForLiveMessages(live0 + 3);
  sampled->Shutdown();
  EXPECT_EQ(ex.background_started(), static_cast<uint64_t>(2 * kEach));
  EXPECT_EQ(sampled->server().shadow().queued_jobs(), 0u);
  WaitForLiveMessages(live0);
}

TEST(ShadowE2E, AResponseOverTheSendLimitIsNotShadowedAndReleasesItsMessages) {
  const uint64_t live0 = server::shadow::SharedMessagesCounters::live();
  std::mt19937_64 rng = MakeRng(37);
  server::ServerConfig cfg = ShadowConfig(1.0, 64);
  cfg.max_message_bytes = 256 << 10;
  auto ts = TestServer::Start(cfg, nullptr, {MakeWeightSet(rng, "s", MhcSetSpec{}, std::nullopt)});
  ASSERT_NE(ts, nullptr);
  // Under the receive limit, but the response (with aux) is over the send limit: it is refused
  // before it is allocated and before the op runs (memory admission), so nothing is sampled.
  v1::MhcSeamRequest req = MakeMhcRequest(rng, "s", MhcRequestSpec{.tokens = 90, .capture_aux = true});
  ASSERT_LT(req.ByteSizeLong(), size_t{256} << 10);
  grpc::ClientContext ctx;
  v1::MhcSeamResponse resp;
  EXPECT_EQ(ts->stub().MhcSeam(&ctx, req, &resp).error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  const std::string m = ScrapeWhenIdle(*ts);
  // It never ran, so no job was captured.
  EXPECT_EQ(MetricValue(m, "fusedlayer_op_executions_total", {{"op", "mhc"}, {"path", "fused"}}), 0);
  EXPECT_EQ(Shadow(m, "comparisons_total", {{"op", "mhc"}}), 0);
  EXPECT_EQ(Shadow(m, "dropped_total", {{"op", "mhc"}}), 0);
  EXPECT_EQ(Shadow(m, "queued_jobs", {}), 0);
  EXPECT_EQ(Shadow(m, "queued_bytes", {}), 0);
  EXPECT_EQ(ts->server().executor().background_started(), 0u);
  WaitForLiveMessages(live0);
}

// ---- the fault-injection binary -----------------------------------------------------------------

// Runs fusedctl with `args`; returns the exit code and sets *output (stdout + stderr).
int Fusedctl(const std::vector<std::string>& args, std::string* output) {
  std::string cmd = std::string(FUSEDCTL_BINARY);
  for (const std::string& a : args) cmd += " '" + a + "'";
  cmd += " 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  if (p == nullptr) return -1;
  char buf[4096];
  output->clear();
  while (fgets(buf, sizeof(buf), p) != nullptr) *output += buf;
  const int status = pclose(p);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

std::vector<std::string> Dumps(const std::string& dir) {
  std::vector<std::string> out;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    if (e.path().extension() == ".safetensors") out.push_back(e.path().string());
  }
  std::sort(out.begin(), out.end());
  return out;
}

std::string MakeTempDir() {
  std::string tmpl = (std::filesystem::temp_directory_path() / "fusedlayer-shadow-e2e-XXXXXX").string();
  EXPECT_NE(mkdtemp(tmpl.data()), nullptr);
  return tmpl;
}

TEST(ShadowFaults, UlpFlipIsCountedLoggedDumpedAndReplayed) {
  const std::string dir = MakeTempDir();
  DemoServerProcess faulty(FUSEDLAYER_FAULT_SERVER_BINARY,
                // A queue that holds all 7 sampled jobs: the calls return before their shadow jobs
                // finish, and with the default bound (4) a slow (ASan) run dropped one.
                {"--fault_inject=ulp_flip", "--shadow_sample_rate=1", "--shadow_dump_dir=" + dir,
                 "--shadow_dump_max_files=2", "--shadow_queue_size=16"},
                true);
  ASSERT_NE(faulty.port, 0) << faulty.process.ReadAll();
  std::mt19937_64 rng = MakeRng(41);
  constexpr int kSeam = 4, kSwa = 3;
  for (int i = 0; i < kSeam; ++i) {
    MhcRequestSpec spec;
    spec.hidden = 5120;
    spec.tokens = 2;
    v1::MhcSeamRequest req = MakeMhcRequest(rng, "v41-flash/demo", spec);
    req.set_request_id("flip-mhc-" + std::to_string(i));
    v1::MhcSeamResponse resp;
    grpc::ClientContext ctx;
    grpc::Status s = faulty.stub->MhcSeam(&ctx, req, &resp);
    ASSERT_TRUE(s.ok()) << s.error_message();
    EXPECT_EQ(resp.report().path(), v1::EXECUTION_PATH_FUSED);
  }
  for (int i = 0; i < kSwa; ++i) {
    v1::SwaNormQuantRequest req = MakeSwaRequest(rng, "v41-flash/demo", 3, 1280 + 512);
    req.set_request_id("flip-swa-" + std::to_string(i));
    v1::SwaNormQuantResponse resp;
    grpc::ClientContext ctx;
    ASSERT_TRUE(faulty.stub->SwaNormQuant(&ctx, req, &resp).ok());
  }
  // A comparison is counted before its dump is attempted: wait for both.
  const std::string m = WaitForMetrics([&] { return faulty.Metrics(); }, [&](const std::string& s) {
    double dumps = 0;
    for (const char* op : {"mhc", "swa"}) {
      for (const char* r : {"written", "limit_reached", "error"}) dumps += Shadow(s, "dumps_total", {{"op", op}, {"result", r}});
    }
    return Shadow(s, "comparisons_total", {{"op", "mhc"}}) == kSeam &&
           Shadow(s, "comparisons_total", {{"op", "swa"}}) == kSwa && dumps == kSeam + kSwa;
  });
  // The right output label, and only it.
  EXPECT_EQ(Shadow(m, "mismatches_total", {{"op", "mhc"}, {"output", "new_residual"}}), kSeam);
  for (const char* out : {"new_pre_mix", "new_post_mix", "new_comb_mix", "y", "aux"}) {
    EXPECT_EQ(Shadow(m, "mismatches_total", {{"op", "mhc"}, {"output", out}}), 0) << out;
  }
  EXPECT_EQ(Shadow(m, "mismatches_total", {{"op", "swa"}, {"output", "kv"}}), kSwa);
  for (const char* out : {"q_fp8", "q_scale", "q_proj"}) {
    EXPECT_EQ(Shadow(m, "mismatches_total", {{"op", "swa"}, {"output", out}}), 0) << out;
  }
  EXPECT_EQ(Shadow(m, "ulp_distance_bucket", {{"op", "mhc"}, {"output", "new_residual"}, {"le", "1"}}), kSeam);
  EXPECT_EQ(Shadow(m, "ulp_distance_bucket", {{"op", "mhc"}, {"output", "new_residual"}, {"le", "0"}}), 0);
  // Dumps: bounded at 2 files; the rest counted as limit_reached.
  const double written = Shadow(m, "dumps_total", {{"op", "mhc"}, {"result", "written"}}) +
                         Shadow(m, "dumps_total", {{"op", "swa"}, {"result", "written"}});
  const double skipped = Shadow(m, "dumps_total", {{"op", "mhc"}, {"result", "limit_reached"}}) +
                         Shadow(m, "dumps_total", {{"op", "swa"}, {"result", "limit_reached"}});
  EXPECT_EQ(written, 2);
  EXPECT_EQ(skipped, kSeam + kSwa - 2);
  const std::vector<std::string> dumps = Dumps(dir);
  ASSERT_EQ(dumps.size(), 2u);
  // One log line per mismatch, with the request id, op, weight set, output and diff.
  for (int i = 0; i < kSeam; ++i) {
    const std::string line = faulty.process.ReadUntil(std::regex("shadow mismatch: request flip-mhc-"));
    ASSERT_FALSE(line.empty()) << faulty.process.log();
    EXPECT_NE(line.find("op mhc weight set 'v41-flash/demo'"), std::string::npos) << line;
    EXPECT_NE(line.find("new_residual(max_abs_diff="), std::string::npos) << line;
  }
  // The first dump is an mHC case (requests were sequential and mHC came first).
  std::string out;
  const int rc = Fusedctl({"replay", "--dump=" + dumps[0], "--target=127.0.0.1:" + std::to_string(faulty.port)}, &out);
  EXPECT_EQ(rc, 3) << out;
  EXPECT_NE(out.find("op mhc, weight set 'v41-flash/demo'"), std::string::npos) << out;
  EXPECT_NE(out.find("fused output identical to the dump"), std::string::npos) << out;
  EXPECT_NE(out.find("REPRODUCED"), std::string::npos) << out;
  EXPECT_NE(out.find("new_residual   MISMATCH"), std::string::npos) << out;

  // fusedctl seam --verify shows the server's verdict too.
  EXPECT_EQ(Fusedctl({"seam", "--weight_set=v41-flash/demo", "--tokens=2", "--verify",
                      "--target=127.0.0.1:" + std::to_string(faulty.port)},
                     &out),
            0)
      << out;
  EXPECT_NE(out.find("verification (fused vs unfused, this server): MISMATCH"), std::string::npos) << out;

  // On a correct server the fused output differs from the faulty dump and the mismatch is gone.
  DemoServerProcess clean(FUSEDLAYER_SERVER_BINARY, {}, false);
  ASSERT_NE(clean.port, 0) << clean.process.ReadAll();
  EXPECT_EQ(Fusedctl({"swa", "--weight_set=v4-pro/demo", "--tokens=3", "--verify",
                      "--target=127.0.0.1:" + std::to_string(clean.port)},
                     &out),
            0)
      << out;
  EXPECT_NE(out.find("verification (fused vs unfused, this server): within tolerance"), std::string::npos) << out;
  const int rc2 = Fusedctl({"replay", "--dump=" + dumps[0], "--target=127.0.0.1:" + std::to_string(clean.port)}, &out);
  EXPECT_EQ(rc2, 0) << out;
  EXPECT_NE(out.find("fused output different from the dump; mismatch not reproduced"), std::string::npos) << out;
  // Not a dump: an error (exit 1), not a verdict.
  const std::string not_dump = dir + "/not-a-dump.bin";
  { std::ofstream(not_dump) << "garbage"; }
  EXPECT_EQ(Fusedctl({"replay", "--dump=" + not_dump, "--target=127.0.0.1:" + std::to_string(clean.port)}, &out), 1)
      << out;
  std::filesystem::remove_all(dir);
}

// Dumps of verify = true calls (the client's choice) go to <dump_dir>/verify under their own
// bounds: verify calls cannot use up the budget of the sampled dumps.
TEST(ShadowFaults, VerifyDumpsHaveTheirOwnBudget) {
  const std::string dir = MakeTempDir();
  DemoServerProcess faulty(FUSEDLAYER_FAULT_SERVER_BINARY,
                           {"--fault_inject=ulp_flip", "--shadow_sample_rate=1", "--shadow_dump_dir=" + dir,
                            "--shadow_dump_max_files=2", "--verify_dump_max_files=1"},
                           true);
  ASSERT_NE(faulty.port, 0) << faulty.process.ReadAll();
  std::mt19937_64 rng = MakeRng(46);
  constexpr int kVerify = 3, kSampled = 2;
  for (int i = 0; i < kVerify + kSampled; ++i) {
    v1::MhcSeamRequest req = MakeMhcRequest(rng, "v41-flash/demo", {.hidden = 5120, .tokens = 2});
    req.set_verify(i < kVerify);  // the verify calls first: before the fix they took the whole budget
    req.set_request_id("budget-" + std::to_string(i));
    v1::MhcSeamResponse resp;
    grpc::ClientContext ctx;
    const grpc::Status s = faulty.stub->MhcSeam(&ctx, req, &resp);
    ASSERT_TRUE(s.ok()) << s.error_message();
    if (i < kVerify) EXPECT_TRUE(resp.verification().mismatch()) << i;
  }
  const std::string m = WaitForMetrics([&] { return faulty.Metrics(); }, [&](const std::string& s) {
    double dumps = 0;
    for (const char* r : {"written", "limit_reached", "error"}) dumps += Shadow(s, "dumps_total", {{"op", "mhc"}, {"result", r}});
    return Shadow(s, "comparisons_total", {{"op", "mhc"}}) == kVerify + kSampled && dumps == kVerify + kSampled;
  });
  EXPECT_EQ(Shadow(m, "dumps_total", {{"op", "mhc"}, {"result", "written"}}), 1 + kSampled);
  EXPECT_EQ(Shadow(m, "dumps_total", {{"op", "mhc"}, {"result", "limit_reached"}}), kVerify - 1);
  EXPECT_EQ(Dumps(dir).size(), static_cast<size_t>(kSampled));  // the sampled dumps all fit
  const std::vector<std::string> verify_dumps = Dumps(dir + "/verify");
  ASSERT_EQ(verify_dumps.size(), 1u);
  // Still a replayable dump, of the first verify call.
  std::string out;
  EXPECT_EQ(Fusedctl({"replay", "--dump=" + verify_dumps[0], "--target=127.0.0.1:" + std::to_string(faulty.port)}, &out),
            3)
      << out;
  EXPECT_NE(out.find("REPRODUCED"), std::string::npos) << out;
}

TEST(ShadowFaults, WrongScaleIsAQScaleMismatchForBothScaleFormats) {
  DemoServerProcess faulty(FUSEDLAYER_FAULT_SERVER_BINARY, {"--fault_inject=wrong_scale", "--shadow_sample_rate=1"}, true);
  ASSERT_NE(faulty.port, 0) << faulty.process.ReadAll();
  std::mt19937_64 rng = MakeRng(42);
  // v41-flash/demo: fp32 scales, row-major (Q = 1280); v4-pro/demo: UE8M0, column-major (Q = 1536).
  for (auto [set, width] : {std::pair{"v41-flash/demo", 1280 + 512}, {"v4-pro/demo", 1536 + 512}}) {
    for (int i = 0; i < 2; ++i) {
      v1::SwaNormQuantRequest req = MakeSwaRequest(rng, set, 5, width);
      v1::SwaNormQuantResponse resp;
      grpc::ClientContext ctx;
      ASSERT_TRUE(faulty.stub->SwaNormQuant(&ctx, req, &resp).ok());
      ASSERT_EQ(resp.report().path(), v1::EXECUTION_PATH_FUSED);
    }
  }
  const std::string m = WaitForMetrics([&] { return faulty.Metrics(); }, [](const std::string& s) {
    return Shadow(s, "comparisons_total", {{"op", "swa"}}) == 4;
  });
  EXPECT_EQ(Shadow(m, "mismatches_total", {{"op", "swa"}, {"output", "q_scale"}}), 4);
  for (const char* out : {"q_fp8", "kv", "q_proj"}) {
    EXPECT_EQ(Shadow(m, "mismatches_total", {{"op", "swa"}, {"output", out}}), 0) << out;
  }
  const std::string line = faulty.process.ReadUntil(std::regex("shadow mismatch: request srv-"));
  EXPECT_NE(line.find("q_scale(max_abs_diff="), std::string::npos) << line;
}

TEST(ShadowFaults, BadSampleRateIsAStartupError) {
  for (const char* bad : {"--shadow_sample_rate=1.5", "--shadow_sample_rate=-0.1"}) {
    ServerProcess p(FUSEDLAYER_SERVER_BINARY, {"--backend=cpu", "--address=127.0.0.1:0", "--metrics_address=", bad});
    const std::string log = p.ReadAll();
    EXPECT_EQ(p.Wait(), 1) << log;
    EXPECT_NE(log.find("--shadow_sample_rate must be in [0, 1]"), std::string::npos) << log;
  }
}

}  // namespace
}  // namespace fusedlayer::testing
