// Dynamic batching (server/runtime/executor.h, server/exec/batch_assembly.h): the executor's batch
// forming with fake tasks (deterministic: the worker is held while the queue fills), and end to end
// over gRPC: requests that shared a launch get outputs bitwise equal to the library run on each
// request alone, reports that say so, and the batching metrics; the same on the machine's default
// backend (CUDA on a GPU host) against the requests alone; incompatible requests never share a
// launch; deadlines, cancellation and drain while a batch is being formed.
#include <chrono>
#include <future>
#include <iostream>
#include <memory>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "runtime/executor.h"
#include "gtest/gtest.h"
#include "server_test_env.h"
#include "test_util.h"

namespace fusedlayer::testing {
namespace {

using server::BatchableTask;
using server::BatchingOptions;
using server::Executor;

// ---- the executor's batch forming ---------------------------------------------------------------

// Records each launch as the ids of its tasks; `key` decides compatibility.
class FakeTask final : public BatchableTask {
 public:
  FakeTask(int id, int key, int64_t tokens, std::vector<std::vector<int>>* launches, bool batchable = true,
           bool launchable = true)
      : id_(id), key_(key), tokens_(tokens), batchable_(batchable), launchable_(launchable), launches_(launches) {}
  int64_t tokens() const override { return tokens_; }
  bool batchable() const override { return batchable_; }
  bool launchable() const override { return launchable_; }
  bool CompatibleWith(const BatchableTask& other) const override {
    const auto* o = dynamic_cast<const FakeTask*>(&other);
    return o != nullptr && o->key_ == key_;
  }

 private:
  void RunBatch(std::vector<std::unique_ptr<BatchableTask>>& batch, const std::vector<double>& waited) override {
    EXPECT_EQ(batch.size(), waited.size());
    std::vector<int> ids;
    for (const auto& t : batch) ids.push_back(static_cast<const FakeTask&>(*t).id_);
    launches_->push_back(ids);  // worker thread only; read after Stop() joined it
  }
  const int id_, key_;
  const int64_t tokens_;
  const bool batchable_, launchable_;
  std::vector<std::vector<int>>* const launches_;
};

// Holds the worker in a plain task until the returned promise is set.
std::promise<void> HoldWorker(Executor& ex) {
  std::promise<void> release;
  std::shared_future<void> released = release.get_future().share();
  std::promise<void> started;
  std::future<void> running = started.get_future();
  EXPECT_TRUE(ex.Submit([released, &started](double) mutable {
                  started.set_value();
                  released.wait();
                }).ok());
  running.wait();
  return release;
}

TEST(ExecutorBatching, CompatibleQueuedTasksShareALaunchInQueueOrderWithinTheBudget) {
  std::vector<std::vector<int>> launches;
  {
    Executor ex(64, BatchingOptions{8, std::chrono::microseconds(0)});
    std::promise<void> release = HoldWorker(ex);
    auto submit = [&](int id, int key, int64_t tokens, bool batchable = true) {
      ASSERT_TRUE(ex.SubmitBatchable(std::make_unique<FakeTask>(id, key, tokens, &launches, batchable)).ok());
    };
    submit(1, 0, 2);
    submit(2, 1, 1);  // other key: skipped by task 1's batch, leads its own
    submit(3, 0, 3);  // joins 1 (5 tokens)
    submit(4, 0, 4);  // 9 > 8: over the budget, leads the next batch
    submit(5, 1, 2);  // joins 2
    ASSERT_TRUE(ex.SubmitControl([](double) {}).ok());  // a barrier: nothing after it joins 4
    submit(6, 0, 1);
    submit(7, 0, 1, /*batchable=*/false);  // e.g. verify = true: always alone
    submit(8, 0, 1);
    EXPECT_EQ(ex.queued(), 9u);
    release.set_value();
    ex.Stop();
  }
  const std::vector<std::vector<int>> want = {{1, 3}, {2, 5}, {4}, {6, 8}, {7}};
  EXPECT_EQ(launches, want);
}

// Tasks that expired or were cancelled while queued go with a batch (which answers them) but take
// none of its budget, so they never push a live task into a later launch.
TEST(ExecutorBatching, TasksThatCannotLaunchJoinWithoutTakingTheBudget) {
  std::vector<std::vector<int>> launches;
  {
    Executor ex(64, BatchingOptions{2, std::chrono::microseconds(0)});
    std::promise<void> release = HoldWorker(ex);
    auto submit = [&](int id, bool launchable) {
      ASSERT_TRUE(ex.SubmitBatchable(std::make_unique<FakeTask>(id, 0, 1, &launches, true, launchable)).ok());
    };
    submit(1, true);
    submit(2, false);  // expired: joins 1 for free
    submit(3, true);   // fills the budget of 2 with 1
    submit(4, false);  // (the budget is full: the next batch)
    submit(5, true);
    release.set_value();
    ex.Stop();
  }
  const std::vector<std::vector<int>> want = {{1, 2, 3}, {4, 5}};
  EXPECT_EQ(launches, want);
}

TEST(ExecutorBatching, OffWhenTheBudgetIsOneToken) {
  std::vector<std::vector<int>> launches;
  {
    Executor ex(64, BatchingOptions{1, std::chrono::microseconds(0)});
    std::promise<void> release = HoldWorker(ex);
    for (int id = 1; id <= 3; ++id) {
      ASSERT_TRUE(ex.SubmitBatchable(std::make_unique<FakeTask>(id, 0, 1, &launches)).ok());
    }
    release.set_value();
    ex.Stop();
  }
  const std::vector<std::vector<int>> want = {{1}, {2}, {3}};
  EXPECT_EQ(launches, want);
}

// With a queue delay the first task waits for compatible arrivals; a full budget, or any other work
// arriving, launches at once (the delay here is an hour: this test would hang, not pass, if either
// did not end the wait).
TEST(ExecutorBatching, QueueDelayWaitsOnlyWhileNothingElseIsQueued) {
  std::vector<std::vector<int>> launches;
  std::promise<void> launched;
  {
    Executor ex(64, BatchingOptions{3, std::chrono::hours(1)});
    ASSERT_TRUE(ex.SubmitBatchable(std::make_unique<FakeTask>(1, 0, 1, &launches)).ok());
    std::this_thread::sleep_for(std::chrono::milliseconds(50));  // the worker is waiting for task 1's batch
    ASSERT_TRUE(ex.SubmitBatchable(std::make_unique<FakeTask>(3, 0, 2, &launches)).ok());  // fills 3 tokens
    ASSERT_TRUE(ex.SubmitBatchable(std::make_unique<FakeTask>(4, 0, 1, &launches)).ok());  // waits for more...
    ASSERT_TRUE(ex.SubmitBatchable(std::make_unique<FakeTask>(2, 1, 1, &launches)).ok());  // ...until this
    ASSERT_TRUE(ex.Submit([&](double) { launched.set_value(); }).ok());                     // ends 2's wait
    launched.get_future().wait();
    ex.Stop();
  }
  const std::vector<std::vector<int>> want = {{1, 3}, {4}, {2}};
  EXPECT_EQ(launches, want);
}

// Stop ends a batch's wait and runs it (drain).
TEST(ExecutorBatching, StopRunsTheBatchBeingFormed) {
  std::vector<std::vector<int>> launches;
  {
    Executor ex(64, BatchingOptions{8, std::chrono::hours(1)});
    ASSERT_TRUE(ex.SubmitBatchable(std::make_unique<FakeTask>(1, 0, 1, &launches)).ok());
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    ex.Stop();
  }
  const std::vector<std::vector<int>> want = {{1}};
  EXPECT_EQ(launches, want);
}

// ---- end to end ---------------------------------------------------------------------------------

grpc::ClientContext* WithDeadline(grpc::ClientContext& ctx, std::chrono::milliseconds d = std::chrono::seconds(60)) {
  ctx.set_deadline(std::chrono::system_clock::now() + d);
  return &ctx;
}

// Sends every request at once from its own thread; returns the statuses and fills `responses`.
template <typename Request, typename Response, typename CallFn>
std::vector<grpc::Status> SendConcurrently(const std::vector<Request>& requests, std::vector<Response>& responses,
                                           CallFn call, std::chrono::milliseconds deadline = std::chrono::seconds(60)) {
  responses.assign(requests.size(), Response());
  std::vector<grpc::Status> statuses(requests.size());
  std::vector<std::thread> threads;
  for (size_t i = 0; i < requests.size(); ++i) {
    threads.emplace_back([&, i] {
      grpc::ClientContext ctx;
      statuses[i] = call(WithDeadline(ctx, deadline), requests[i], &responses[i]);
    });
  }
  for (std::thread& t : threads) t.join();
  return statuses;
}

// A server whose batches launch exactly when `budget` tokens are queued (the delay is only a
// backstop: a missing request makes the test slow, and its batch_requests check fail).
server::ServerConfig BatchingConfig(int64_t budget) {
  server::ServerConfig cfg = TestConfig();
  cfg.max_batch_tokens = budget;
  cfg.max_queue_delay_us = 20'000'000;
  return cfg;
}

struct MhcCase {
  const char* name;
  MhcRequestSpec spec;
  v1::PathPreference preference;
};

TEST(ServerBatching, MhcRequestsSharingALaunchGetTheirOwnOutputsBitwise) {
  std::mt19937_64 rng = MakeRng();
  const std::vector<int64_t> tokens = {1, 2, 3, 5, 8, 13};
  int64_t budget = 0;
  for (int64_t t : tokens) budget += t;
  const server::PackedWeightSet set = MakeWeightSet(rng, "b/mhc", MhcSetSpec{.hidden = 512}, std::nullopt);
  auto ts = TestServer::Start(BatchingConfig(budget), nullptr, {set});
  ASSERT_NE(ts, nullptr);
  Reference ref(set);
  const MhcCase cases[] = {
      {"seam shifted, delayed pre", {.hidden = 512, .pre_mix = true}, v1::PATH_PREFERENCE_AUTO},
      {"seam shifted, no pre mix", {.hidden = 512, .pre_mix = false}, v1::PATH_PREFERENCE_AUTO},
      {"seam normal", {.hidden = 512, .mode = v1::MHC_MODE_NORMAL, .pre_mix = false}, v1::PATH_PREFERENCE_AUTO},
      {"seam aux", {.hidden = 512, .capture_aux = true}, v1::PATH_PREFERENCE_AUTO},
      {"first", {.hidden = 512, .stage = v1::MHC_STAGE_FIRST, .pre_mix = false}, v1::PATH_PREFERENCE_AUTO},
      {"head", {.hidden = 512, .stage = v1::MHC_STAGE_HEAD}, v1::PATH_PREFERENCE_AUTO},
      {"seam unfused", {.hidden = 512}, v1::PATH_PREFERENCE_FORCE_UNFUSED},
  };
  for (const MhcCase& c : cases) {
    SCOPED_TRACE(c.name);
    std::vector<v1::MhcSeamRequest> requests;
    for (int64_t t : tokens) {
      MhcRequestSpec spec = c.spec;
      spec.tokens = t;
      requests.push_back(MakeMhcRequest(rng, "b/mhc", spec));
      requests.back().set_path_preference(c.preference);
    }
    std::vector<v1::MhcSeamResponse> responses;
    const auto statuses = SendConcurrently(requests, responses, [&](grpc::ClientContext* ctx, const auto& req, auto* resp) {
      return ts->stub().MhcSeam(ctx, req, resp);
    });
    const Path path = c.preference == v1::PATH_PREFERENCE_FORCE_UNFUSED ? Path::kUnfused : Path::kFused;
    for (size_t i = 0; i < requests.size(); ++i) {
      ASSERT_TRUE(statuses[i].ok()) << statuses[i].error_message();
      EXPECT_EQ(responses[i].report().batch_requests(), tokens.size()) << "request " << i;
      EXPECT_EQ(responses[i].report().batch_tokens(), budget);
      EXPECT_EQ(responses[i].report().path(), server::ToProto(path));
      ExpectMhcEqual(responses[i], ref.RunMhc(requests[i], path));
    }
  }
  // One launch per case, each serving every request of the case.
  const std::string scrape = ScrapeWhenIdle(*ts);
  const double launches = MetricValue(scrape, "fusedlayer_batch_requests_count", {{"op", "mhc"}});
  const double served = MetricValue(scrape, "fusedlayer_batch_requests_sum", {{"op", "mhc"}});
  EXPECT_EQ(served, static_cast<double>(std::size(cases) * tokens.size()));
  EXPECT_EQ(launches, static_cast<double>(std::size(cases)));
  EXPECT_EQ(MetricValue(scrape, "fusedlayer_batch_tokens_sum", {{"op", "mhc"}}),
            static_cast<double>(std::size(cases) * budget));
  EXPECT_EQ(MetricValue(scrape, "fusedlayer_op_executions_total", {{"op", "mhc"}, {"path", "fused"}}),
            static_cast<double>((std::size(cases) - 1) * tokens.size()));
}

TEST(ServerBatching, SwaRequestsSharingALaunchGetTheirOwnOutputsBitwise) {
  std::mt19937_64 rng = MakeRng();
  const std::vector<int64_t> tokens = {1, 3, 4, 6, 9};
  int64_t budget = 0;
  for (int64_t t : tokens) budget += t;
  const SwaSetSpec specs[] = {
      {.layout = v1::SCALE_LAYOUT_ROW_MAJOR},
      // The TMA layout [G, align4(M)]: each request's scales are columns of the batch's, its
      // padding rows zero as for a request alone.
      {.fp8 = v1::FP8_FORMAT_E4M3FNUZ, .scale = v1::SCALE_FORMAT_UE8M0, .layout = v1::SCALE_LAYOUT_COLUMN_MAJOR_TMA},
      {.layout = v1::SCALE_LAYOUT_ROW_MAJOR, .wq_b_rows = 256},
  };
  for (const SwaSetSpec& spec : specs) {
    SCOPED_TRACE(::testing::Message() << "layout " << spec.layout << " fp8 " << spec.fp8 << " wq_b " << spec.wq_b_rows);
    const server::PackedWeightSet set = MakeWeightSet(rng, "b/swa", std::nullopt, spec);
    auto ts = TestServer::Start(BatchingConfig(budget), nullptr, {set});
    ASSERT_NE(ts, nullptr);
    Reference ref(set);
    for (v1::PathPreference preference : {v1::PATH_PREFERENCE_AUTO, v1::PATH_PREFERENCE_FORCE_UNFUSED}) {
      std::vector<v1::SwaNormQuantRequest> requests;
      for (size_t i = 0; i < tokens.size(); ++i) {
        // Row strides differ per request: the batch gathers dense rows.
        const int64_t cols = spec.q_rank + spec.head_dim;
        requests.push_back(MakeSwaRequest(rng, "b/swa", tokens[i], cols + 8 * static_cast<int64_t>(i)));
        requests.back().set_path_preference(preference);
      }
      std::vector<v1::SwaNormQuantResponse> responses;
      const auto statuses = SendConcurrently(requests, responses, [&](grpc::ClientContext* ctx, const auto& req,
                                                                      auto* resp) {
        return ts->stub().SwaNormQuant(ctx, req, resp);
      });
      const Path path = preference == v1::PATH_PREFERENCE_FORCE_UNFUSED ? Path::kUnfused : Path::kFused;
      for (size_t i = 0; i < requests.size(); ++i) {
        ASSERT_TRUE(statuses[i].ok()) << statuses[i].error_message();
        EXPECT_EQ(responses[i].report().batch_requests(), tokens.size()) << "request " << i;
        EXPECT_EQ(responses[i].report().path(), server::ToProto(path));
        ExpectSwaEqual(responses[i], ref.RunSwa(requests[i], path));
      }
    }
  }
}

// Requests that fall back for the same reason alone and batched may share a launch; each report
// still gives the reason's detail for its own request (T = 5, T = 6), not for the batch (T = 11).
TEST(ServerBatching, ABatchThatFallsBackReportsEachRequestsOwnDetail) {
  std::mt19937_64 rng = MakeRng();
  const server::PackedWeightSet set = MakeWeightSet(rng, "b/mhc", MhcSetSpec{.hidden = 512}, std::nullopt);
  server::ServerConfig cfg = BatchingConfig(11);
  cfg.fused_max_tokens = 4;
  auto ts = TestServer::Start(cfg, nullptr, {set});
  ASSERT_NE(ts, nullptr);
  Reference ref(set);
  std::vector<v1::MhcSeamRequest> requests;
  for (int64_t t : {5, 6}) requests.push_back(MakeMhcRequest(rng, "b/mhc", {.hidden = 512, .tokens = t}));
  std::vector<v1::MhcSeamResponse> responses;
  const auto statuses = SendConcurrently(requests, responses, [&](grpc::ClientContext* ctx, const auto& req, auto* resp) {
    return ts->stub().MhcSeam(ctx, req, resp);
  });
  for (size_t i = 0; i < requests.size(); ++i) {
    ASSERT_TRUE(statuses[i].ok()) << statuses[i].error_message();
    const v1::ExecutionReport& report = responses[i].report();
    EXPECT_EQ(report.batch_requests(), 2u);
    EXPECT_EQ(report.path(), v1::EXECUTION_PATH_UNFUSED);
    EXPECT_NE(report.fallback_reason(), v1::FALLBACK_REASON_NONE);
    EXPECT_EQ(report.fallback_detail(), absl::StrCat("T = ", 5 + i, " exceeds fused_max_tokens = 4"));
    ExpectMhcEqual(responses[i], ref.RunMhc(requests[i], Path::kUnfused));
  }
}

TEST(ServerBatching, IncompatibleRequestsNeverShareALaunch) {
  std::mt19937_64 rng = MakeRng();
  const server::PackedWeightSet a = MakeWeightSet(rng, "b/a", MhcSetSpec{}, std::nullopt);
  const server::PackedWeightSet b = MakeWeightSet(rng, "b/b", MhcSetSpec{}, std::nullopt);
  // The budget is never reached: each batch launches when the 1 s delay is up, with what it took.
  server::ServerConfig cfg = TestConfig();
  cfg.max_batch_tokens = 1000;
  cfg.max_queue_delay_us = 1'000'000;
  auto ts = TestServer::Start(cfg, nullptr, {a, b});
  ASSERT_NE(ts, nullptr);
  Reference ref_a(a), ref_b(b);
  std::vector<v1::MhcSeamRequest> requests;
  std::vector<int> group;  // requests of one group may share a launch
  for (int i = 0; i < 12; ++i) {
    const int g = i % 4;  // weight set a shifted, a normal, a unfused, b shifted
    MhcRequestSpec spec{.tokens = 1 + i % 3};
    if (g == 1) spec.mode = v1::MHC_MODE_NORMAL, spec.pre_mix = false;
    requests.push_back(MakeMhcRequest(rng, g == 3 ? "b/b" : "b/a", spec));
    if (g == 2) requests.back().set_path_preference(v1::PATH_PREFERENCE_FORCE_UNFUSED);
    group.push_back(g);
  }
  requests[5].set_verify(true);  // group 1, always alone
  std::vector<v1::MhcSeamResponse> responses;
  const auto statuses = SendConcurrently(requests, responses, [&](grpc::ClientContext* ctx, const auto& req, auto* resp) {
    return ts->stub().MhcSeam(ctx, req, resp);
  });
  for (size_t i = 0; i < requests.size(); ++i) {
    ASSERT_TRUE(statuses[i].ok()) << statuses[i].error_message();
    const int max_share = i == 5 ? 1 : (group[i] == 1 ? 2 : 3);
    EXPECT_GE(responses[i].report().batch_requests(), 1u);
    EXPECT_LE(responses[i].report().batch_requests(), static_cast<uint32_t>(max_share)) << "request " << i;
    const Path path = group[i] == 2 ? Path::kUnfused : Path::kFused;
    // The path each request asked for is the path its launch ran, and the report says so: a launch
    // that mixed AUTO and FORCE_UNFUSED requests would report one path for both, and on the CPU
    // backend their outputs can be bitwise the same on either path, so the outputs alone cannot
    // tell.
    EXPECT_EQ(responses[i].report().path(), group[i] == 2 ? v1::EXECUTION_PATH_UNFUSED : v1::EXECUTION_PATH_FUSED)
        << "request " << i;
    EXPECT_EQ(responses[i].report().fallback_reason(),
              group[i] == 2 ? v1::FALLBACK_REASON_CLIENT_FORCED_UNFUSED : v1::FALLBACK_REASON_NONE)
        << "request " << i;
    ExpectMhcEqual(responses[i], (group[i] == 3 ? ref_b : ref_a).RunMhc(requests[i], path));
  }
  EXPECT_TRUE(responses[5].verification().compared());
  EXPECT_FALSE(responses[5].verification().mismatch());
}

// On the machine's default backend (the CPU here; on a GPU host, whose device run bundles this suite,
// the CUDA backend with its fused kernels at C = 512 and Q = 256, a multiple of their 128-channel
// tiles): requests that shared a launch get outputs bitwise equal to the same requests run alone on
// the same backend, by a second server with batching off. The tests above compare with the library
// on the CPU; on a device it is the kernels' batch invariance (a reduction order that depends on C,
// never on T) that must hold through the server's batch gathering and scattering.
TEST(ServerBatching, OnTheDefaultBackendBatchedRequestsAreBitwiseTheSameRequestsAlone) {
  std::mt19937_64 rng = MakeRng();
  const std::vector<int64_t> tokens = {1, 2, 5, 8, 48};  // 64 tokens: a decode batch
  int64_t budget = 0;
  for (int64_t t : tokens) budget += t;
  constexpr int64_t kC = 512;
  const SwaSetSpec swa{.wq_b_rows = 256};
  const server::PackedWeightSet set = MakeWeightSet(rng, "b/both", MhcSetSpec{.hidden = kC}, swa);
  auto start = [&](server::ServerConfig cfg) -> std::unique_ptr<TestServer> {
    absl::StatusOr<std::unique_ptr<Backend>> backend = CreateBackend("auto");
    EXPECT_TRUE(backend.ok()) << backend.status();
    if (!backend.ok()) return nullptr;
    std::cout << "backend: " << (*backend)->kind() << ", " << (*backend)->device_name() << std::endl;
    return TestServer::Start(std::move(cfg), *std::move(backend), {set});
  };
  auto batched = start(BatchingConfig(budget));
  auto alone = start(TestConfig());  // batching off
  ASSERT_NE(batched, nullptr);
  ASSERT_NE(alone, nullptr);
  // Sends `requests` at once to the batching server (one launch), then each alone to the other
  // server, and compares the outputs bitwise.
  auto check = [&]<typename Request, typename Response>(
                   const std::vector<Request>& requests,
                   grpc::Status (*call)(TestServer&, grpc::ClientContext*, const Request&, Response*),
                   void (*expect_equal)(const Response&, const Response&)) {
    std::vector<Response> responses;
    const auto statuses = SendConcurrently(requests, responses, [&](grpc::ClientContext* ctx, const Request& req,
                                                                    Response* resp) {
      return call(*batched, ctx, req, resp);
    });
    for (size_t i = 0; i < requests.size(); ++i) {
      ASSERT_TRUE(statuses[i].ok()) << statuses[i].error_message();
      EXPECT_EQ(responses[i].report().batch_requests(), tokens.size()) << "request " << i;
      Response want;
      grpc::ClientContext ctx;
      const grpc::Status s = call(*alone, WithDeadline(ctx), requests[i], &want);
      ASSERT_TRUE(s.ok()) << s.error_message();
      EXPECT_EQ(want.report().batch_requests(), 1u);
      EXPECT_EQ(responses[i].report().path(), want.report().path()) << "request " << i;
      expect_equal(responses[i], want);
    }
  };
  auto mhc_call = +[](TestServer& ts, grpc::ClientContext* ctx, const v1::MhcSeamRequest& req,
                      v1::MhcSeamResponse* resp) { return ts.stub().MhcSeam(ctx, req, resp); };
  auto swa_call = +[](TestServer& ts, grpc::ClientContext* ctx, const v1::SwaNormQuantRequest& req,
                      v1::SwaNormQuantResponse* resp) { return ts.stub().SwaNormQuant(ctx, req, resp); };
  for (v1::PathPreference preference : {v1::PATH_PREFERENCE_AUTO, v1::PATH_PREFERENCE_FORCE_UNFUSED}) {
    for (v1::MhcMode mode : {v1::MHC_MODE_SHIFTED, v1::MHC_MODE_NORMAL}) {
      SCOPED_TRACE(::testing::Message() << "mHC mode " << mode << " preference " << preference);
      std::vector<v1::MhcSeamRequest> requests;
      for (int64_t t : tokens) {
        requests.push_back(MakeMhcRequest(
            rng, "b/both", {.hidden = kC, .tokens = t, .mode = mode, .pre_mix = mode == v1::MHC_MODE_SHIFTED}));
        requests.back().set_path_preference(preference);
      }
      check(requests, mhc_call, &ExpectMhcEqual);
    }
    SCOPED_TRACE(::testing::Message() << "SWA preference " << preference);
    std::vector<v1::SwaNormQuantRequest> requests;
    for (size_t i = 0; i < tokens.size(); ++i) {
      requests.push_back(MakeSwaRequest(rng, "b/both", tokens[i], swa.q_rank + swa.head_dim + 8 * int64_t(i)));
      requests.back().set_path_preference(preference);
    }
    check(requests, swa_call, &ExpectSwaEqual);
  }
}

// Batches of 3 tokens that wait up to 1.5 s: long enough for a 300 ms deadline (SendExpiring) to
// pass while a request's batch is being formed.
server::ServerConfig SlowBatchConfig() {
  server::ServerConfig cfg = TestConfig();
  cfg.max_batch_tokens = 3;
  cfg.max_queue_delay_us = 1'500'000;
  return cfg;
}

// Sends `req` with a 300 ms deadline; returns its status once that passed.
grpc::Status SendExpiring(TestServer& ts, const v1::MhcSeamRequest& req) {
  grpc::ClientContext ctx;
  v1::MhcSeamResponse resp;
  return ts.stub().MhcSeam(WithDeadline(ctx, std::chrono::milliseconds(300)), req, &resp);
}

// A request whose deadline passes while its batch is being formed is answered DEADLINE_EXCEEDED and
// not launched; one cancelled by its client likewise; the rest of the batch runs.
TEST(ServerBatching, DeadlinesAndCancellationWhileWaitingForABatch) {
  std::mt19937_64 rng = MakeRng();
  const server::PackedWeightSet set = MakeWeightSet(rng, "b/mhc", MhcSetSpec{}, std::nullopt);
  auto ts = TestServer::Start(SlowBatchConfig(), nullptr, {set});
  ASSERT_NE(ts, nullptr);
  Reference ref(set);
  const v1::MhcSeamRequest expiring = MakeMhcRequest(rng, "b/mhc", {.tokens = 1});
  const v1::MhcSeamRequest cancelled = MakeMhcRequest(rng, "b/mhc", {.tokens = 1});
  const v1::MhcSeamRequest kept = MakeMhcRequest(rng, "b/mhc", {.tokens = 1});
  grpc::Status expiring_status, cancelled_status;
  std::thread t1([&] { expiring_status = SendExpiring(*ts, expiring); });
  grpc::ClientContext cancel_ctx;
  std::thread t2([&] {
    v1::MhcSeamResponse resp;
    cancelled_status = ts->stub().MhcSeam(WithDeadline(cancel_ctx), cancelled, &resp);
  });
  t1.join();  // the batch (budget 3) is still waiting: only two requests arrived
  cancel_ctx.TryCancel();
  t2.join();
  EXPECT_EQ(expiring_status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << expiring_status.error_message();
  EXPECT_EQ(cancelled_status.error_code(), grpc::StatusCode::CANCELLED) << cancelled_status.error_message();
  // The two that ended take none of the budget: the third waits out the delay (1.5 s from the
  // first's arrival) and launches alone live.
  grpc::ClientContext ctx;
  v1::MhcSeamResponse resp;
  ASSERT_TRUE(ts->stub().MhcSeam(WithDeadline(ctx), kept, &resp).ok());
  EXPECT_EQ(resp.report().batch_requests(), 1u);
  ExpectMhcEqual(resp, ref.RunMhc(kept, Path::kFused));
  const std::string scrape = ScrapeWhenIdle(*ts);
  EXPECT_EQ(MetricValue(scrape, "fusedlayer_op_executions_total", {{"op", "mhc"}, {"path", "fused"}}), 1.0);
}

// A batch whose first request (the one whose worker formed it) expired while waiting: it is answered
// DEADLINE_EXCEEDED, and its gRPC call may be gone before the launch (OnDone frees its messages), so
// the launch of the two live requests must read nothing of it (under ASan a read of its request is a
// heap-use-after-free). The live requests share one launch and get their own outputs.
TEST(ServerBatching, ABatchWhoseFirstRequestExpiredLaunchesItsLiveRequestsTogether) {
  std::mt19937_64 rng = MakeRng();
  const server::PackedWeightSet set = MakeWeightSet(rng, "b/mhc", MhcSetSpec{}, std::nullopt);
  auto ts = TestServer::Start(SlowBatchConfig(), nullptr, {set});
  ASSERT_NE(ts, nullptr);
  Reference ref(set);
  // Its worker is still forming the batch when this returns (1.5 s delay, 1 of 3 tokens).
  const grpc::Status expiring_status = SendExpiring(*ts, MakeMhcRequest(rng, "b/mhc", {.tokens = 1}));
  EXPECT_EQ(expiring_status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << expiring_status.error_message();
  std::vector<v1::MhcSeamRequest> requests;
  for (int i = 0; i < 2; ++i) requests.push_back(MakeMhcRequest(rng, "b/mhc", {.tokens = 1}));
  std::vector<v1::MhcSeamResponse> responses;
  const auto statuses = SendConcurrently(requests, responses, [&](grpc::ClientContext* ctx, const auto& req, auto* resp) {
    return ts->stub().MhcSeam(ctx, req, resp);
  });
  for (size_t i = 0; i < requests.size(); ++i) {
    ASSERT_TRUE(statuses[i].ok()) << statuses[i].error_message();
    EXPECT_EQ(responses[i].report().batch_requests(), 2u) << "request " << i;
    EXPECT_EQ(responses[i].report().path(), v1::EXECUTION_PATH_FUSED);
    ExpectMhcEqual(responses[i], ref.RunMhc(requests[i], Path::kFused));
  }
  const std::string scrape = ScrapeWhenIdle(*ts);
  EXPECT_EQ(MetricValue(scrape, "fusedlayer_batch_requests_count", {{"op", "mhc"}}), 1.0);
  EXPECT_EQ(MetricValue(scrape, "fusedlayer_batch_requests_sum", {{"op", "mhc"}}), 2.0);
}

// Drain (SIGTERM's path) while a batch is being formed: the batch launches at once and the
// in-flight requests complete. The queue delay (60 s, the flag's most) is longer than the drain
// deadline (10 s): a drain that let the batch wait out its delay would cancel the requests instead.
TEST(ServerBatching, DrainCompletesTheBatchBeingFormed) {
  std::mt19937_64 rng = MakeRng();
  const server::PackedWeightSet set = MakeWeightSet(rng, "b/mhc", MhcSetSpec{}, std::nullopt);
  server::ServerConfig cfg = TestConfig();
  cfg.max_batch_tokens = 100;
  cfg.max_queue_delay_us = 60'000'000;
  auto ts = TestServer::Start(cfg, nullptr, {set});
  ASSERT_NE(ts, nullptr);
  Reference ref(set);
  std::vector<v1::MhcSeamRequest> requests;
  for (int i = 0; i < 3; ++i) requests.push_back(MakeMhcRequest(rng, "b/mhc", {.tokens = 2}));
  std::vector<v1::MhcSeamResponse> responses;
  std::thread drain([&] {
    // Once all three are in the server (waiting for their batch: the budget is not reached).
    WaitForInflightRequests(*ts, 3);
    ts->server().Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(10));
  });
  const auto statuses = SendConcurrently(requests, responses, [&](grpc::ClientContext* ctx, const auto& req, auto* resp) {
    return ts->stub().MhcSeam(ctx, req, resp);
  });
  drain.join();
  for (size_t i = 0; i < requests.size(); ++i) {
    ASSERT_TRUE(statuses[i].ok()) << statuses[i].error_message();
    ExpectMhcEqual(responses[i], ref.RunMhc(requests[i], Path::kFused));
  }
}

}  // namespace
}  // namespace fusedlayer::testing
