// Residual sessions end to end (server/transport/residual_sessions.h, MhcSeamRequest.session):
// in-process servers on the CPU backend and on the lane test backend (device memory apart from the
// host's, copies only through lanes).
//
//  - a whole model's chain (FIRST, SEAMs through two weight sets, HEAD) with the state kept in a
//    session gives y bitwise equal to the same chain with every tensor inline (fresh random inputs
//    with outliers), in both modes and on both paths; return_state gives the state bitwise too;
//  - on lanes, a session call moves x to the device and y back, nothing else;
//  - a call whose fused launch fails re-runs unfused on the same, unchanged state;
//  - every bad request with its status code, and the server still serving; a second call of a busy
//    session is ABORTED; ownership across two bearer tokens; limits, the idle timeout, unload of a
//    weight set a session used, the metrics gauges.
#include <stdlib.h>
#include <unistd.h>

#include <chrono>
#include <future>
#include <mutex>
#include <iostream>
#include <random>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include "client/lib/fusedlayer_client.h"
#include "client/lib/safetensors_io.h"
#include "client_for.h"
#include "gtest/gtest.h"
#include "lane_test_backend.h"
#include "server_process.h"
#include "server_test_env.h"
#include "test_util.h"
#include "two_token_file.h"

namespace fusedlayer::testing {
namespace {

using absl::StatusCode;
using client::FusedLayerClient;
using server::PackedWeightSet;

constexpr int kN = 4;
constexpr int64_t kC = 320;

// The state a chain carries from one call to the next, inline.
struct InlineState {
  v1::Tensor residual, pre_mix, post_mix, comb_mix;
};

// A random request of the chain's next call: x fresh; the inline one carries `state` (from the
// previous response), the session one only x.
struct ChainCall {
  v1::MhcSeamRequest inline_request, session_request;
};
ChainCall NextCall(std::mt19937_64& rng, const std::string& set, v1::MhcStage stage, v1::MhcMode mode, int64_t T,
                   const InlineState& state, const std::string& session, int64_t C = kC) {
  const MhcRequestSpec spec{kN, C, T, stage, mode, /*pre_mix=*/false, /*capture_aux=*/false};
  ChainCall c;
  c.inline_request = MakeMhcRequest(rng, set, spec);  // fresh x (and random state, replaced below)
  if (stage != v1::MHC_STAGE_FIRST) {
    *c.inline_request.mutable_residual() = state.residual;
    *c.inline_request.mutable_post_mix() = state.post_mix;
    *c.inline_request.mutable_comb_mix() = state.comb_mix;
    if (mode == v1::MHC_MODE_SHIFTED) *c.inline_request.mutable_pre_mix() = state.pre_mix;
  }
  c.session_request.set_weight_set(set);
  c.session_request.set_stage(stage);
  c.session_request.set_mode(mode);
  *c.session_request.mutable_x() = c.inline_request.x();
  c.session_request.set_session(session);
  return c;
}

void Advance(const v1::MhcSeamResponse& r, InlineState* state) {
  state->residual = r.new_residual();
  if (r.has_new_post_mix()) {
    state->pre_mix = r.new_pre_mix();
    state->post_mix = r.new_post_mix();
    state->comb_mix = r.new_comb_mix();
  }
}

// FIRST, three SEAMs alternating two weight sets (the attention and FFN seams of a layer and a
// half), HEAD in shifted mode: each call inline and as a session call, y compared bitwise at every
// step, the state (return_state) on every other step. Returns the number of calls.
int RunChain(FusedLayerClient& c, std::mt19937_64& rng, const std::string& session, v1::MhcMode mode, int64_t T,
             v1::PathPreference pref, const std::vector<std::string>& sets, int64_t C = kC) {
  std::vector<v1::MhcStage> stages = {v1::MHC_STAGE_FIRST, v1::MHC_STAGE_SEAM, v1::MHC_STAGE_SEAM, v1::MHC_STAGE_SEAM};
  if (mode == v1::MHC_MODE_SHIFTED) stages.push_back(v1::MHC_STAGE_HEAD);
  InlineState state;
  for (size_t i = 0; i < stages.size(); ++i) {
    SCOPED_TRACE(::testing::Message() << "call " << i << " stage " << stages[i]);
    ChainCall call = NextCall(rng, sets[i % sets.size()], stages[i], mode, T, state, session, C);
    call.inline_request.set_path_preference(pref);
    call.session_request.set_path_preference(pref);
    const bool with_state = i % 2 == 1;
    call.session_request.set_return_state(with_state);
    absl::StatusOr<v1::MhcSeamResponse> want = c.MhcSeam(call.inline_request);
    EXPECT_TRUE(want.ok()) << want.status();
    absl::StatusOr<v1::MhcSeamResponse> got = c.MhcSeam(call.session_request);
    EXPECT_TRUE(got.ok()) << got.status();
    if (!want.ok() || !got.ok()) return 0;
    EXPECT_TRUE(TensorsBitwiseEqual(got->y(), want->y()));
    EXPECT_EQ(got->report().path(), want->report().path());
    if (with_state) {
      EXPECT_TRUE(TensorsBitwiseEqual(got->new_residual(), want->new_residual()));
      EXPECT_EQ(got->has_new_pre_mix(), want->has_new_pre_mix());
      if (want->has_new_pre_mix()) {
        EXPECT_TRUE(TensorsBitwiseEqual(got->new_pre_mix(), want->new_pre_mix()));
        EXPECT_TRUE(TensorsBitwiseEqual(got->new_post_mix(), want->new_post_mix()));
        EXPECT_TRUE(TensorsBitwiseEqual(got->new_comb_mix(), want->new_comb_mix()));
      }
    } else {
      // Only y crosses the socket: the state stays in the session.
      EXPECT_FALSE(got->has_new_residual());
      EXPECT_FALSE(got->has_new_pre_mix());
      EXPECT_FALSE(got->has_new_post_mix());
      EXPECT_FALSE(got->has_new_comb_mix());
      // A SEAM call's bytes, both ways: x + y against x + y + 2 x (R + mixes), ~0.2x (the
      // product target: <= 0.25x); 1 KiB for the messages' small fields.
      if (stages[i] == v1::MHC_STAGE_SEAM) {
        EXPECT_LT(got->ByteSizeLong() + call.session_request.ByteSizeLong(),
                  (want->ByteSizeLong() + call.inline_request.ByteSizeLong()) / 4 + 1024);
      }
    }
    Advance(*want, &state);
  }
  return static_cast<int>(stages.size());
}

std::vector<PackedWeightSet> TwoSets(std::mt19937_64& rng, int64_t C = kC) {
  return {MakeWeightSet(rng, "rs/attn", MhcSetSpec{.hc_mult = kN, .hidden = C}, std::nullopt),
          MakeWeightSet(rng, "rs/ffn", MhcSetSpec{.hc_mult = kN, .hidden = C}, std::nullopt)};
}

// A server on the CPU backend with TwoSets loaded, and a client of it (null if either failed).
struct CpuServer {
  std::unique_ptr<TestServer> ts;
  std::unique_ptr<FusedLayerClient> client;
};
CpuServer StartTwoSetsOnCpu(std::mt19937_64& rng) {
  CpuServer s;
  s.ts = TestServer::Start(TestConfig(), nullptr, TwoSets(rng));
  if (s.ts != nullptr) s.client = ClientFor(*s.ts);
  return s;
}

// A server on the lane test backend (device memory apart from the host's, copies only through
// lanes) with `sets` loaded and `lanes` lanes, its backend's counters and gate, and a client.
struct LaneServer {
  std::unique_ptr<TestServer> ts;
  std::shared_ptr<LaneTestBackend::Control> control;
  std::unique_ptr<FusedLayerClient> client;
};
LaneServer StartOnLanes(std::vector<PackedWeightSet> sets, int lanes, server::ServerConfig cfg = TestConfig()) {
  auto backend = std::make_unique<LaneTestBackend>(8);
  LaneServer s;
  s.control = backend->control();
  cfg.device_lanes = lanes;
  s.ts = TestServer::Start(cfg, std::move(backend), std::move(sets));
  if (s.ts != nullptr) s.client = ClientFor(*s.ts);
  return s;
}

// ---- bitwise equality with the inline chain -------------------------------------------------------

TEST(ResidualSession, ChainIsBitwiseTheInlineChainInBothModesAndPaths) {
  std::mt19937_64 rng = MakeRng(71);
  CpuServer s = StartTwoSetsOnCpu(rng);
  ASSERT_NE(s.client, nullptr);
  FusedLayerClient* c = s.client.get();
  for (auto mode : {v1::MHC_MODE_SHIFTED, v1::MHC_MODE_NORMAL}) {
    for (auto pref : {v1::PATH_PREFERENCE_AUTO, v1::PATH_PREFERENCE_FORCE_UNFUSED}) {
      for (int64_t T : {int64_t{1}, int64_t{7}}) {
        SCOPED_TRACE(::testing::Message() << "mode " << mode << " pref " << pref << " T " << T);
        absl::StatusOr<uint64_t> bytes = c->OpenResidualSession("s", T, kN, kC);
        ASSERT_TRUE(bytes.ok()) << bytes.status();
        EXPECT_GE(*bytes, uint64_t(2 * T * kN * kC * 2));  // two copies of R at least
        const int calls = RunChain(*c, rng, "s", mode, T, pref, {"rs/attn", "rs/ffn"});
        absl::StatusOr<v1::ListResidualSessionsResponse> list = c->ListResidualSessions();
        ASSERT_TRUE(list.ok());
        ASSERT_EQ(list->sessions_size(), 1);
        EXPECT_EQ(list->sessions(0).calls(), uint64_t(calls));
        EXPECT_TRUE(list->sessions(0).has_residual());
        EXPECT_EQ(list->sessions(0).has_mixes(), mode != v1::MHC_MODE_SHIFTED);  // HEAD ends the shifted chain
        absl::StatusOr<v1::CloseResidualSessionResponse> closed = c->CloseResidualSession("s");
        ASSERT_TRUE(closed.ok());
        EXPECT_EQ(closed->closed(), 1u);
        EXPECT_EQ(closed->freed_bytes(), *bytes);
      }
    }
  }
}

// The same on the server's default backend ("auto", with its default lanes): the CPU backend on a
// machine without a GPU; on a GPU host (the H200 device run bundles this suite) the CUDA backend,
// whose fused kernel runs at C = 512 (a multiple of its 128-channel tile), with the session's
// state in device memory and T up to a decode batch.
TEST(ResidualSession, OnTheDefaultBackendTheChainIsBitwiseTheInlineChain) {
  constexpr int64_t kDeviceC = 512;
  std::mt19937_64 rng = MakeRng(81);
  absl::StatusOr<std::unique_ptr<Backend>> backend = CreateBackend("auto");
  ASSERT_TRUE(backend.ok()) << backend.status();
  std::cout << "backend: " << (*backend)->kind() << ", " << (*backend)->device_name() << std::endl;
  auto ts = TestServer::Start(TestConfig(), *std::move(backend), TwoSets(rng, kDeviceC));
  ASSERT_NE(ts, nullptr);
  auto c = ClientFor(*ts);
  ASSERT_NE(c, nullptr);
  for (auto mode : {v1::MHC_MODE_SHIFTED, v1::MHC_MODE_NORMAL}) {
    for (auto pref : {v1::PATH_PREFERENCE_REQUIRE_FUSED, v1::PATH_PREFERENCE_FORCE_UNFUSED}) {
      for (int64_t T : {int64_t{1}, int64_t{64}}) {
        SCOPED_TRACE(::testing::Message() << "mode " << mode << " pref " << pref << " T " << T);
        ASSERT_TRUE(c->OpenResidualSession("d", T, kN, kDeviceC).ok());
        EXPECT_GT(RunChain(*c, rng, "d", mode, T, pref, {"rs/attn", "rs/ffn"}, kDeviceC), 0);
        ASSERT_TRUE(c->CloseResidualSession("d").ok());
      }
    }
  }
}

// On a device backend the state lives in device memory: a session SEAM call copies x to the device
// and y back, one copy each, and its outputs are still bitwise the inline chain's.
TEST(ResidualSession, OnLanesOnlyXAndYCrossBetweenHostAndDevice) {
  std::mt19937_64 rng = MakeRng(72);
  LaneServer server = StartOnLanes(TwoSets(rng), 2);
  ASSERT_NE(server.client, nullptr);
  FusedLayerClient* c = server.client.get();
  LaneTestBackend::Control* control = server.control.get();
  for (auto mode : {v1::MHC_MODE_SHIFTED, v1::MHC_MODE_NORMAL}) {
    SCOPED_TRACE(::testing::Message() << "mode " << mode);
    ASSERT_TRUE(c->OpenResidualSession("lane", 9, kN, kC).ok());
    RunChain(*c, rng, "lane", mode, 9, v1::PATH_PREFERENCE_AUTO, {"rs/attn", "rs/ffn"});
    // One more SEAM, counted alone.
    InlineState unused;
    ChainCall call = NextCall(rng, "rs/attn", v1::MHC_STAGE_SEAM, mode, 9, unused, "lane");
    if (mode == v1::MHC_MODE_SHIFTED) {
      // The shifted chain ended with HEAD: start again.
      ChainCall first = NextCall(rng, "rs/attn", v1::MHC_STAGE_FIRST, mode, 9, unused, "lane");
      ASSERT_TRUE(c->MhcSeam(first.session_request).ok());
    }
    const int64_t to_device = control->copies_to_device.load(), to_host = control->copies_to_host.load();
    absl::StatusOr<v1::MhcSeamResponse> got = c->MhcSeam(call.session_request);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(control->copies_to_device.load() - to_device, 1);  // x
    EXPECT_EQ(control->copies_to_host.load() - to_host, 1);      // y
    ASSERT_TRUE(c->CloseResidualSession("lane").ok());
  }
}

// A fused launch that fails on the device re-runs unfused on the session's unchanged state: the
// call succeeds (reason fused_kernel_error) with the inline chain's bits, and so does the next.
TEST(ResidualSession, AFailedFusedLaunchReRunsOnTheUnchangedState) {
  std::mt19937_64 rng = MakeRng(73);
  LaneServer server = StartOnLanes(TwoSets(rng), 1);
  ASSERT_NE(server.client, nullptr);
  FusedLayerClient* c = server.client.get();
  LaneTestBackend::Control* control = server.control.get();
  const v1::MhcMode mode = v1::MHC_MODE_SHIFTED;
  ASSERT_TRUE(c->OpenResidualSession("f", 5, kN, kC).ok());
  InlineState state;
  for (int i = 0; i < 4; ++i) {
    SCOPED_TRACE(::testing::Message() << "call " << i);
    ChainCall call = NextCall(rng, "rs/ffn", i == 0 ? v1::MHC_STAGE_FIRST : v1::MHC_STAGE_SEAM, mode, 5, state, "f");
    absl::StatusOr<v1::MhcSeamResponse> want = c->MhcSeam(call.inline_request);
    ASSERT_TRUE(want.ok()) << want.status();
    if (i == 2) control->fail_next_kernels = 1;  // the session call's fused launch
    absl::StatusOr<v1::MhcSeamResponse> got = c->MhcSeam(call.session_request);
    ASSERT_TRUE(got.ok()) << got.status();
    if (i == 2) {
      EXPECT_EQ(got->report().path(), v1::EXECUTION_PATH_UNFUSED);
      EXPECT_EQ(got->report().fallback_reason(), v1::FALLBACK_REASON_FUSED_KERNEL_ERROR);
    }
    EXPECT_TRUE(TensorsBitwiseEqual(got->y(), want->y()));
    Advance(*want, &state);
  }
}

// ---- bad requests -------------------------------------------------------------------------------

TEST(ResidualSession, BadRequestsGetTheirCodesAndTheServerKeepsServing) {
  std::mt19937_64 rng = MakeRng(74);
  std::vector<PackedWeightSet> sets = TwoSets(rng);
  sets.push_back(MakeWeightSet(rng, "rs/wide", MhcSetSpec{.hc_mult = kN, .hidden = 2 * kC}, std::nullopt));
  auto ts = TestServer::Start(TestConfig(), nullptr, sets);
  ASSERT_NE(ts, nullptr);
  auto c = ClientFor(*ts);
  ASSERT_NE(c, nullptr);
  // Open.
  EXPECT_EQ(c->OpenResidualSession("", 4, kN, kC).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(c->OpenResidualSession("a/b", 4, kN, kC).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(c->OpenResidualSession(std::string(129, 'a'), 4, kN, kC).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(c->OpenResidualSession("s", 0, kN, kC).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(c->OpenResidualSession("s", -1, kN, kC).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(c->OpenResidualSession("s", int64_t{1} << 40, kN, kC).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(c->OpenResidualSession("s", 4, 0, kC).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(c->OpenResidualSession("s", 4, 9, kC).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(c->OpenResidualSession("s", 4, kN, 0).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(c->OpenResidualSession("s", 4, kN, int64_t{1} << 40).status().code(), StatusCode::kInvalidArgument);
  ASSERT_TRUE(c->OpenResidualSession("s", 4, kN, kC).ok());
  EXPECT_EQ(c->OpenResidualSession("s", 4, kN, kC).status().code(), StatusCode::kAlreadyExists);
  // Close.
  EXPECT_EQ(c->CloseResidualSession("nope").status().code(), StatusCode::kNotFound);
  EXPECT_EQ(c->CloseResidualSession("a b").status().code(), StatusCode::kInvalidArgument);

  InlineState none;
  auto seam = [&](const std::string& set, int64_t T, const std::string& session) {
    return NextCall(rng, set, v1::MHC_STAGE_SEAM, v1::MHC_MODE_SHIFTED, T, none, session).session_request;
  };
  auto code = [&](const v1::MhcSeamRequest& r) { return c->MhcSeam(r).status().code(); };
  // Unknown session; SEAM before FIRST.
  EXPECT_EQ(code(seam("rs/attn", 4, "nope")), StatusCode::kNotFound);
  EXPECT_EQ(code(seam("rs/attn", 4, "bad name")), StatusCode::kInvalidArgument);
  EXPECT_EQ(code(seam("rs/attn", 4, "s")), StatusCode::kFailedPrecondition);
  v1::MhcSeamRequest first = NextCall(rng, "rs/attn", v1::MHC_STAGE_FIRST, v1::MHC_MODE_SHIFTED, 4, none, "s")
                                 .session_request;
  ASSERT_TRUE(c->MhcSeam(first).ok());
  // Shapes against the session; state tensors inline with a session; verify; return_state alone.
  EXPECT_EQ(code(seam("rs/attn", 5, "s")), StatusCode::kInvalidArgument);
  EXPECT_EQ(code(seam("rs/wide", 4, "s")), StatusCode::kInvalidArgument);
  for (int field = 0; field < 4; ++field) {
    v1::MhcSeamRequest r = seam("rs/attn", 4, "s");
    const v1::MhcSeamRequest full =
        MakeMhcRequest(rng, "rs/attn", MhcRequestSpec{kN, kC, 4, v1::MHC_STAGE_SEAM, v1::MHC_MODE_SHIFTED, true});
    if (field == 0) *r.mutable_residual() = full.residual();
    if (field == 1) *r.mutable_post_mix() = full.post_mix();
    if (field == 2) *r.mutable_comb_mix() = full.comb_mix();
    if (field == 3) *r.mutable_pre_mix() = full.pre_mix();
    EXPECT_EQ(code(r), StatusCode::kInvalidArgument) << field;
  }
  {
    v1::MhcSeamRequest r = seam("rs/attn", 4, "s");
    r.set_verify(true);
    EXPECT_EQ(code(r), StatusCode::kInvalidArgument);
    v1::MhcSeamRequest plain =
        MakeMhcRequest(rng, "rs/attn", MhcRequestSpec{kN, kC, 4, v1::MHC_STAGE_SEAM, v1::MHC_MODE_SHIFTED, true});
    plain.set_return_state(true);
    EXPECT_EQ(code(plain), StatusCode::kInvalidArgument);
    v1::MhcSeamRequest shm = seam("rs/attn", 4, "s");
    v1::OutputPlacement* p = shm.add_output_placements();
    p->set_output("y");
    p->mutable_shared_memory()->set_region("r");
    EXPECT_EQ(code(shm), StatusCode::kInvalidArgument);
  }
  // None of that changed the state: the session still runs, and after HEAD a SEAM has no mixes.
  ASSERT_TRUE(c->MhcSeam(seam("rs/attn", 4, "s")).ok());
  v1::MhcSeamRequest head = seam("rs/ffn", 4, "s");
  head.set_stage(v1::MHC_STAGE_HEAD);
  ASSERT_TRUE(c->MhcSeam(head).ok());
  EXPECT_EQ(code(seam("rs/attn", 4, "s")), StatusCode::kFailedPrecondition);
  ASSERT_TRUE(c->MhcSeam(first).ok());
  EXPECT_TRUE(c->MhcSeam(seam("rs/attn", 4, "s")).ok());
  // SWA and inline mHC calls are unaffected.
  EXPECT_TRUE(c->MhcSeam(MakeMhcRequest(rng, "rs/attn", MhcRequestSpec{kN, kC, 4})).ok());
}

TEST(ResidualSession, SessionsOffIsFailedPrecondition) {
  std::mt19937_64 rng = MakeRng(75);
  server::ServerConfig cfg = TestConfig();
  cfg.residual_session_max_sessions = 0;
  auto ts = TestServer::Start(cfg, nullptr, TwoSets(rng));
  ASSERT_NE(ts, nullptr);
  auto c = ClientFor(*ts);
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(c->OpenResidualSession("s", 4, kN, kC).status().code(), StatusCode::kFailedPrecondition);
  InlineState none;
  EXPECT_EQ(
      c->MhcSeam(NextCall(rng, "rs/attn", v1::MHC_STAGE_FIRST, v1::MHC_MODE_SHIFTED, 4, none, "s").session_request)
          .status()
          .code(),
      StatusCode::kFailedPrecondition);
  absl::StatusOr<v1::ListResidualSessionsResponse> list = c->ListResidualSessions();
  ASSERT_TRUE(list.ok());
  EXPECT_EQ(list->sessions_size(), 0);
}

// ---- one call at a time ---------------------------------------------------------------------------

TEST(ResidualSession, ASecondCallOfABusySessionIsAbortedAndTheFirstCompletes) {
  std::mt19937_64 rng = MakeRng(76);
  LaneServer server = StartOnLanes(TwoSets(rng), 2);
  ASSERT_NE(server.client, nullptr);
  FusedLayerClient* c = server.client.get();
  LaneTestBackend::Control* control = server.control.get();
  ASSERT_TRUE(c->OpenResidualSession("busy", 3, kN, kC).ok());
  InlineState none;
  ASSERT_TRUE(
      c->MhcSeam(NextCall(rng, "rs/attn", v1::MHC_STAGE_FIRST, v1::MHC_MODE_SHIFTED, 3, none, "busy").session_request)
          .ok());
  const v1::MhcSeamRequest a =
      NextCall(rng, "rs/attn", v1::MHC_STAGE_SEAM, v1::MHC_MODE_SHIFTED, 3, none, "busy").session_request;
  control->Hold();
  const int64_t kernels = control->KernelsEnqueued();
  auto first = std::async(std::launch::async, [&] { return c->MhcSeam(a); });
  // The first call's kernel is enqueued, so it holds the session and cannot complete (waiting at
  // the gate alone would not say so: a deferred free the FIRST call left queued may be the one there).
  control->WaitForKernelsEnqueued(kernels + 1);
  EXPECT_EQ(c->MhcSeam(a).status().code(), StatusCode::kAborted);
  control->Release();
  ASSERT_TRUE(first.get().ok());
  // Released before its response: the next call finds the session free at once, every time.
  for (int i = 0; i < 20; ++i) ASSERT_TRUE(c->MhcSeam(a).ok()) << i;
}

// Drain (SIGTERM's path) with a session call in flight: it holds its session while its kernel is
// held on the lane, completes when the lane is released, and its y is bitwise the inline chain's.
TEST(ResidualSession, DrainCompletesASessionCallInFlight) {
  std::mt19937_64 rng = MakeRng(79);
  LaneServer server = StartOnLanes(TwoSets(rng), 1);
  ASSERT_NE(server.client, nullptr);
  FusedLayerClient* c = server.client.get();
  LaneTestBackend::Control* control = server.control.get();
  ASSERT_TRUE(c->OpenResidualSession("drain", 3, kN, kC).ok());
  InlineState state;
  const ChainCall first = NextCall(rng, "rs/attn", v1::MHC_STAGE_FIRST, v1::MHC_MODE_SHIFTED, 3, state, "drain");
  absl::StatusOr<v1::MhcSeamResponse> first_inline = c->MhcSeam(first.inline_request);
  ASSERT_TRUE(first_inline.ok()) << first_inline.status();
  ASSERT_TRUE(c->MhcSeam(first.session_request).ok());
  Advance(*first_inline, &state);
  const ChainCall seam = NextCall(rng, "rs/ffn", v1::MHC_STAGE_SEAM, v1::MHC_MODE_SHIFTED, 3, state, "drain");
  absl::StatusOr<v1::MhcSeamResponse> want = c->MhcSeam(seam.inline_request);
  ASSERT_TRUE(want.ok()) << want.status();

  const int64_t kernels = control->KernelsEnqueued();
  control->Hold();
  auto in_flight = std::async(std::launch::async, [&] { return c->MhcSeam(seam.session_request); });
  control->WaitForKernelsEnqueued(kernels + 1);  // past its drain check, holding the session
  std::thread drain([&] { server.ts->server().Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(30)); });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));  // let the drain begin (not asserted)
  control->Release();
  absl::StatusOr<v1::MhcSeamResponse> got = in_flight.get();
  drain.join();
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_TRUE(TensorsBitwiseEqual(got->y(), want->y()));
  EXPECT_FALSE(got->has_new_residual());
}

// ---- ownership, limits, idle timeout, unload --------------------------------------------------------

class ResidualSessionTokens : public TwoTokenFile {};

TEST_F(ResidualSessionTokens, ASessionBelongsToTheTokenThatOpenedIt) {
  std::mt19937_64 rng = MakeRng(77);
  server::ServerConfig cfg = TestConfig();
  cfg.auth_tokens_file = file_;
  cfg.residual_session_max_sessions = 2;
  auto ts = TestServer::Start(cfg, nullptr, TwoSets(rng));
  ASSERT_NE(ts, nullptr);
  auto a = ClientFor(*ts, token_a_), b = ClientFor(*ts, token_b_), nobody = ClientFor(*ts);
  ASSERT_TRUE(a->OpenResidualSession("mine", 4, kN, kC).ok());
  EXPECT_EQ(nobody->OpenResidualSession("x", 4, kN, kC).status().code(), StatusCode::kUnauthenticated);
  InlineState none;
  const v1::MhcSeamRequest first =
      NextCall(rng, "rs/attn", v1::MHC_STAGE_FIRST, v1::MHC_MODE_SHIFTED, 4, none, "mine").session_request;
  // B can neither use, list nor close A's session: the answer for a name never opened.
  EXPECT_EQ(b->MhcSeam(first).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(b->CloseResidualSession("mine").status().code(), StatusCode::kNotFound);
  absl::StatusOr<v1::CloseResidualSessionResponse> none_closed = b->CloseResidualSession("");
  ASSERT_TRUE(none_closed.ok());
  EXPECT_EQ(none_closed->closed(), 0u);
  absl::StatusOr<v1::ListResidualSessionsResponse> listed = b->ListResidualSessions();
  ASSERT_TRUE(listed.ok());
  EXPECT_EQ(listed->sessions_size(), 0);
  // B's own session of the same name is another session; each identity has its own limit.
  ASSERT_TRUE(b->OpenResidualSession("mine", 4, kN, kC).ok());
  ASSERT_TRUE(b->OpenResidualSession("second", 4, kN, kC).ok());
  EXPECT_EQ(b->OpenResidualSession("third", 4, kN, kC).status().code(), StatusCode::kResourceExhausted);
  EXPECT_TRUE(a->MhcSeam(first).ok());
  listed = a->ListResidualSessions();
  ASSERT_TRUE(listed.ok());
  ASSERT_EQ(listed->sessions_size(), 1);
  EXPECT_EQ(listed->sessions(0).calls(), 1u);
  EXPECT_EQ(listed->sessions(0).last_weight_set(), "rs/attn");
  EXPECT_EQ(listed->sessions(0).tokens(), 4);
  const std::string scrape = ScrapeWhenIdle(*ts);
  EXPECT_EQ(MetricValue(scrape, "fusedlayer_residual_sessions"), 3);
  EXPECT_GT(MetricValue(scrape, "fusedlayer_residual_session_bytes"), 3 * 2 * 4 * kN * kC * 2 - 1);
  absl::StatusOr<v1::CloseResidualSessionResponse> all = b->CloseResidualSession("");
  ASSERT_TRUE(all.ok());
  EXPECT_EQ(all->closed(), 2u);
  EXPECT_EQ(MetricValue(ScrapeWhenIdle(*ts), "fusedlayer_residual_sessions"), 1);
}

TEST_F(ResidualSessionTokens, TheTotalLimitHoldsAcrossIdentities) {
  std::mt19937_64 rng = MakeRng(83);
  server::ServerConfig cfg = TestConfig();
  cfg.auth_tokens_file = file_;
  cfg.residual_session_total_bytes = 5 * (16 * kN * kC * 2 + 4096);  // two and a half sessions of T = 16
  auto ts = TestServer::Start(cfg, nullptr, TwoSets(rng));
  ASSERT_NE(ts, nullptr);
  auto a = ClientFor(*ts, token_a_), b = ClientFor(*ts, token_b_);
  ASSERT_TRUE(a->OpenResidualSession("a1", 16, kN, kC).ok());
  ASSERT_TRUE(a->OpenResidualSession("a2", 16, kN, kC).ok());
  absl::StatusOr<uint64_t> refused = b->OpenResidualSession("b1", 16, kN, kC);
  EXPECT_EQ(refused.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(refused.status().message().find("--residual_session_total_bytes"), std::string::npos) << refused.status();
  ASSERT_TRUE(a->CloseResidualSession("a1").ok());
  EXPECT_TRUE(b->OpenResidualSession("b1", 16, kN, kC).ok());
}

TEST(ResidualSession, BytePerIdentityLimitIsResourceExhausted) {
  std::mt19937_64 rng = MakeRng(78);
  server::ServerConfig cfg = TestConfig();
  cfg.residual_session_max_bytes = 3 * 2 * (16 * kN * kC * 2 + 4096);  // about three sessions of T = 16
  auto ts = TestServer::Start(cfg, nullptr, TwoSets(rng));
  ASSERT_NE(ts, nullptr);
  auto c = ClientFor(*ts);
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(c->OpenResidualSession("huge", 64, kN, kC).status().code(), StatusCode::kResourceExhausted);
  int opened = 0;
  absl::Status last;
  for (int i = 0; i < 5 && last.ok(); ++i) {
    absl::StatusOr<uint64_t> s = c->OpenResidualSession("s" + std::to_string(i), 16, kN, kC);
    last = s.status();
    if (s.ok()) ++opened;
  }
  EXPECT_EQ(opened, 3);
  EXPECT_EQ(last.code(), StatusCode::kResourceExhausted);
  ASSERT_TRUE(c->CloseResidualSession("s0").ok());
  EXPECT_TRUE(c->OpenResidualSession("again", 16, kN, kC).ok());  // its bytes were given back
}

// Opens racing for one identity's byte budget: the budget is taken before the device memory is
// allocated, so however many arrive at once (each allocation held 100 ms here, as a large one on a
// busy device may take), the memory held never exceeds the budget; the ones that do not fit are
// RESOURCE_EXHAUSTED, and their names stay free.
TEST(ResidualSession, RacingOpensNeverAllocateBeyondTheIdentitysBytes) {
  std::mt19937_64 rng = MakeRng(81);
  auto backend = std::make_unique<LaneTestBackend>(8);
  const std::shared_ptr<LaneTestBackend::Control> control = backend->control();
  server::ServerConfig cfg = TestConfig();
  cfg.device_lanes = 1;
  const uint64_t one_session = 2 * (16 * kN * kC * 2 + 4096);  // about one session of T = 16
  cfg.residual_session_max_bytes = one_session * 3 / 2;
  auto ts = TestServer::Start(cfg, std::move(backend), TwoSets(rng));
  ASSERT_NE(ts, nullptr);
  auto c = ClientFor(*ts);
  ASSERT_NE(c, nullptr);
  control->allocate_delay_ms = 100;
  const int64_t before = control->allocated_bytes.load();
  control->max_allocated_bytes = before;
  constexpr int kOpens = 6;
  std::vector<absl::StatusOr<uint64_t>> opened(kOpens, absl::UnknownError("not run"));
  std::vector<std::thread> threads;
  for (int i = 0; i < kOpens; ++i) {
    threads.emplace_back([&, i] { opened[i] = c->OpenResidualSession("s" + std::to_string(i), 16, kN, kC); });
  }
  for (std::thread& t : threads) t.join();
  int ok = 0;
  for (int i = 0; i < kOpens; ++i) {
    if (opened[i].ok()) {
      ++ok;
      EXPECT_LE(*opened[i], cfg.residual_session_max_bytes);
    } else {
      EXPECT_EQ(opened[i].status().code(), StatusCode::kResourceExhausted) << "s" << i << ": " << opened[i].status();
    }
  }
  EXPECT_EQ(ok, 1);
  EXPECT_LE(control->max_allocated_bytes.load() - before, static_cast<int64_t>(cfg.residual_session_max_bytes));
  control->allocate_delay_ms = 0;
  for (int i = 0; i < kOpens; ++i) {  // the refused names are free; the budget is back after a close
    if (opened[i].ok()) ASSERT_TRUE(c->CloseResidualSession("s" + std::to_string(i)).ok());
  }
  EXPECT_TRUE(c->OpenResidualSession("s0", 16, kN, kC).ok());
}

// A session closed while a call holds it: the call still uses the session's device block until it
// ends, so the block's bytes stay counted against the identity until then. Closing gives the name
// back at once, the bytes when the call lets go of the block.
TEST(ResidualSession, ClosingABusySessionKeepsItsBytesCountedUntilTheCallEnds) {
  std::mt19937_64 rng = MakeRng(82);
  server::ServerConfig cfg = TestConfig();
  cfg.residual_session_max_bytes = 2 * (3 * kN * kC * 2 + 1024) * 3 / 2;  // one session of T = 3, not two
  LaneServer server = StartOnLanes(TwoSets(rng), 1, cfg);
  ASSERT_NE(server.client, nullptr);
  FusedLayerClient* c = server.client.get();
  LaneTestBackend::Control* control = server.control.get();
  ASSERT_TRUE(c->OpenResidualSession("held", 3, kN, kC).ok());
  InlineState none;
  const v1::MhcSeamRequest first =
      NextCall(rng, "rs/attn", v1::MHC_STAGE_FIRST, v1::MHC_MODE_SHIFTED, 3, none, "held").session_request;
  control->Hold();
  const int64_t kernels = control->KernelsEnqueued();
  auto in_flight = std::async(std::launch::async, [&] { return c->MhcSeam(first); });
  control->WaitForKernelsEnqueued(kernels + 1);  // the call holds the session and its block
  ASSERT_TRUE(c->CloseResidualSession("held").ok());
  absl::StatusOr<v1::ListResidualSessionsResponse> list = c->ListResidualSessions();
  ASSERT_TRUE(list.ok());
  EXPECT_EQ(list->sessions_size(), 0);  // closed: not listed, its name is free
  // The closed session's block is still in use: a second session does not fit beside it.
  EXPECT_EQ(c->OpenResidualSession("next", 3, kN, kC).status().code(), StatusCode::kResourceExhausted);
  control->Release();
  ASSERT_TRUE(in_flight.get().ok());
  EXPECT_TRUE(c->OpenResidualSession("held", 3, kN, kC).ok());  // the bytes are back once the call ended
}

// An unload while a session's first call through the set runs (the set not yet in the session's
// record of sets before the fix): the session is closed with the set, the call completes.
TEST(ResidualSession, AnUnloadWhileASessionsFirstCallRunsClosesTheSession) {
  std::mt19937_64 rng = MakeRng(83);
  LaneServer server = StartOnLanes(TwoSets(rng), 2);  // the unload runs on the other lane's worker
  ASSERT_NE(server.client, nullptr);
  FusedLayerClient* c = server.client.get();
  LaneTestBackend::Control* control = server.control.get();
  ASSERT_TRUE(c->OpenResidualSession("first-call", 3, kN, kC).ok());
  ASSERT_TRUE(c->OpenResidualSession("other-set", 3, kN, kC).ok());
  InlineState none;
  v1::MhcSeamRequest first =
      NextCall(rng, "rs/attn", v1::MHC_STAGE_FIRST, v1::MHC_MODE_SHIFTED, 3, none, "first-call").session_request;
  v1::MhcSeamRequest other = first;
  other.set_weight_set("rs/ffn");
  other.set_session("other-set");
  ASSERT_TRUE(c->MhcSeam(other).ok());
  control->Hold();
  const int64_t kernels = control->KernelsEnqueued();
  auto in_flight = std::async(std::launch::async, [&] { return c->MhcSeam(first); });
  control->WaitForKernelsEnqueued(kernels + 1);  // the first call of "first-call" runs on rs/attn
  absl::StatusOr<v1::UnloadWeightSetResponse> unloaded = c->UnloadWeightSet("rs/attn", {absl::Seconds(20)});
  control->Release();
  ASSERT_TRUE(unloaded.ok()) << unloaded.status();
  ASSERT_TRUE(in_flight.get().ok());
  absl::StatusOr<v1::ListResidualSessionsResponse> list = c->ListResidualSessions();
  ASSERT_TRUE(list.ok());
  ASSERT_EQ(list->sessions_size(), 1);
  EXPECT_EQ(list->sessions(0).name(), "other-set");
  EXPECT_EQ(c->MhcSeam(first).status().code(), StatusCode::kNotFound);
}

TEST(ResidualSession, AnIdleSessionIsClosedAndABusyOneIsNot) {
  std::mt19937_64 rng = MakeRng(79);
  server::ServerConfig cfg = TestConfig();
  cfg.residual_session_idle_seconds = 2;
  auto ts = TestServer::Start(cfg, nullptr, TwoSets(rng));
  ASSERT_NE(ts, nullptr);
  auto c = ClientFor(*ts);
  ASSERT_NE(c, nullptr);
  const auto before_idle = std::chrono::steady_clock::now();
  ASSERT_TRUE(c->OpenResidualSession("idle", 2, kN, kC).ok());
  ASSERT_TRUE(c->OpenResidualSession("used", 2, kN, kC).ok());
  InlineState none;
  const v1::MhcSeamRequest first =
      NextCall(rng, "rs/attn", v1::MHC_STAGE_FIRST, v1::MHC_MODE_SHIFTED, 2, none, "used").session_request;
  // "used" is called every 250 ms (a gap of 2 s would be a call 7x slower than that, even under a
  // sanitizer on a loaded machine); "idle" never. Until "idle" is closed: not before its idle
  // time, and within a bound.
  absl::StatusOr<v1::ListResidualSessionsResponse> list;
  const auto give_up = before_idle + std::chrono::seconds(20);
  do {
    ASSERT_TRUE(c->MhcSeam(first).ok());
    std::this_thread::sleep_for(std::chrono::milliseconds(250));
    list = c->ListResidualSessions();
    ASSERT_TRUE(list.ok());
  } while (list->sessions_size() == 2 && std::chrono::steady_clock::now() < give_up);
  EXPECT_GE(std::chrono::steady_clock::now() - before_idle, std::chrono::seconds(2));  // not early
  ASSERT_EQ(list->sessions_size(), 1);
  EXPECT_EQ(list->sessions(0).name(), "used");
  v1::MhcSeamRequest gone = first;
  gone.set_session("idle");
  EXPECT_EQ(c->MhcSeam(gone).status().code(), StatusCode::kNotFound);
}

TEST(ResidualSession, UnloadingAWeightSetClosesTheSessionsThatUsedIt) {
  std::mt19937_64 rng = MakeRng(80);
  CpuServer s = StartTwoSetsOnCpu(rng);
  ASSERT_NE(s.client, nullptr);
  FusedLayerClient* c = s.client.get();
  ASSERT_TRUE(c->OpenResidualSession("uses-attn", 2, kN, kC).ok());
  ASSERT_TRUE(c->OpenResidualSession("uses-ffn", 2, kN, kC).ok());
  InlineState none;
  v1::MhcSeamRequest first =
      NextCall(rng, "rs/attn", v1::MHC_STAGE_FIRST, v1::MHC_MODE_SHIFTED, 2, none, "uses-attn").session_request;
  ASSERT_TRUE(c->MhcSeam(first).ok());
  first.set_weight_set("rs/ffn");
  first.set_session("uses-ffn");
  ASSERT_TRUE(c->MhcSeam(first).ok());
  ASSERT_TRUE(c->UnloadWeightSet("rs/attn").ok());
  absl::StatusOr<v1::ListResidualSessionsResponse> list = c->ListResidualSessions();
  ASSERT_TRUE(list.ok());
  ASSERT_EQ(list->sessions_size(), 1);
  EXPECT_EQ(list->sessions(0).name(), "uses-ffn");
}

// ---- fusedctl ---------------------------------------------------------------------------------------

// fusedctl with `args`; its exit status, *out its output.
int Fusedctl(const std::vector<std::string>& args, std::string* out) { return RunToEnd(FUSEDCTL_BINARY, args, out); }

TEST(ResidualSession, FusedctlBenchSessionsAndCloseSession) {
  std::mt19937_64 rng = MakeRng(82);
  auto ts = TestServer::Start(TestConfig(), nullptr, TwoSets(rng));
  ASSERT_NE(ts, nullptr);
  const std::string target = "--target=127.0.0.1:" + std::to_string(ts->server().port());
  std::string out;
  ASSERT_EQ(Fusedctl({target, "bench", "--op=mhc", "--weight_set=rs/attn", "--tokens=16", "--concurrency=2",
                      "--duration=0.3", "--transport=session"},
                     &out),
            0)
      << out;
  EXPECT_NE(out.find(" transport=session "), std::string::npos) << out;
  EXPECT_NE(out.find("(x only: residual and mixes in 3 residual sessions;"), std::string::npos) << out;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(out, m, std::regex(R"(session vs tcp  p50 [0-9.]+x, req/s [0-9.]+x, bytes per call ([0-9.]+)x)")))
      << out;
  EXPECT_LT(std::stod(m[1]), 0.25) << out;  // x + y against x + y + 2 (R + mixes)
  // The bench closed its sessions; these are the test's.
  EXPECT_EQ(Fusedctl({target, "sessions"}, &out), 0) << out;
  EXPECT_NE(out.find("no residual sessions open for this identity"), std::string::npos) << out;
  auto c = ClientFor(*ts);
  ASSERT_NE(c, nullptr);
  ASSERT_TRUE(c->OpenResidualSession("cli", 2, kN, kC).ok());
  EXPECT_EQ(Fusedctl({target, "sessions"}, &out), 0) << out;
  EXPECT_TRUE(std::regex_search(out, std::regex(R"(cli  T=2 n=4 C=320  \S+ \S+  empty \(no FIRST call yet\)  0 call\(s\))")))
      << out;
  EXPECT_EQ(Fusedctl({target, "close-session", "cli"}, &out), 0) << out;
  EXPECT_NE(out.find("closed cli, freed"), std::string::npos) << out;
  EXPECT_NE(Fusedctl({target, "close-session", "cli"}, &out), 0) << out;
  EXPECT_NE(out.find("NOT_FOUND"), std::string::npos) << out;
  EXPECT_NE(Fusedctl({target, "bench", "--op=swa", "--weight_set=rs/attn", "--tokens=4", "--duration=0.1",
                      "--transport=session"},
                     &out),
            0);
  EXPECT_NE(out.find("--transport=session applies to --op=mhc only"), std::string::npos) << out;
}

// fusedctl seam --session: --stage=first opens the session and starts it from x, a SEAM continues
// it with x alone; the outputs (written with --output, the state with --return_state) are bitwise
// those of the same two calls with every tensor inline. Then the refusals, each with its message.
TEST(ResidualSession, FusedctlSeamRunsInASession) {
  std::mt19937_64 rng = MakeRng(83);
  CpuServer s = StartTwoSetsOnCpu(rng);
  ASSERT_NE(s.client, nullptr);
  FusedLayerClient* c = s.client.get();
  const std::string target = "--target=127.0.0.1:" + std::to_string(s.ts->server().port());
  char tmpl[] = "/tmp/fl-seam-session-XXXXXX";
  ASSERT_NE(::mkdtemp(tmpl), nullptr);
  const std::string dir = tmpl;
  constexpr int64_t T = 3;

  // The two calls inline, with fresh inputs: FIRST from x1, SEAM from x2 and FIRST's state.
  InlineState state;
  ChainCall first = NextCall(rng, "rs/attn", v1::MHC_STAGE_FIRST, v1::MHC_MODE_SHIFTED, T, state, "");
  absl::StatusOr<v1::MhcSeamResponse> want_first = c->MhcSeam(first.inline_request);
  ASSERT_TRUE(want_first.ok()) << want_first.status();
  Advance(*want_first, &state);
  ChainCall seam = NextCall(rng, "rs/attn", v1::MHC_STAGE_SEAM, v1::MHC_MODE_SHIFTED, T, state, "");
  absl::StatusOr<v1::MhcSeamResponse> want_seam = c->MhcSeam(seam.inline_request);
  ASSERT_TRUE(want_seam.ok()) << want_seam.status();
  ASSERT_TRUE(client::WriteSafetensors(dir + "/x1.safetensors", {{"x", first.inline_request.x()}}).ok());
  ASSERT_TRUE(client::WriteSafetensors(dir + "/x2.safetensors", {{"x", seam.inline_request.x()}}).ok());

  const std::vector<std::string> base = {target, "seam", "--weight_set=rs/attn", "--session=cli-seam"};
  auto with = [&](std::vector<std::string> more) {
    std::vector<std::string> a = base;
    a.insert(a.end(), more.begin(), more.end());
    return a;
  };
  std::string out;
  // A SEAM before the session exists.
  EXPECT_NE(Fusedctl(with({"--input=" + dir + "/x2.safetensors"}), &out), 0) << out;
  EXPECT_NE(out.find("no residual session cli-seam of this identity: start one with --stage=first"), std::string::npos)
      << out;
  ASSERT_EQ(Fusedctl(with({"--stage=first", "--input=" + dir + "/x1.safetensors", "--output=" + dir + "/o1.safetensors"}),
                     &out),
            0)
      << out;
  EXPECT_NE(out.find("opened residual session cli-seam (T=3,"), std::string::npos) << out;
  EXPECT_NE(out.find("pre_mix=session"), std::string::npos) << out;
  ASSERT_EQ(Fusedctl(with({"--input=" + dir + "/x2.safetensors", "--output=" + dir + "/o2.safetensors",
                           "--return_state"}),
                     &out),
            0)
      << out;
  EXPECT_EQ(out.find("opened residual session"), std::string::npos) << out;  // the open one, continued
  EXPECT_NE(out.find("session cli-seam: x sent, the residual and mixes continue on the server (and are returned)"),
            std::string::npos)
      << out;

  absl::StatusOr<client::SafetensorsFile> o1 = client::ReadSafetensors(dir + "/o1.safetensors");
  absl::StatusOr<client::SafetensorsFile> o2 = client::ReadSafetensors(dir + "/o2.safetensors");
  ASSERT_TRUE(o1.ok()) << o1.status();
  ASSERT_TRUE(o2.ok()) << o2.status();
  EXPECT_EQ(o1->tensors.count("new_residual"), 0u);  // FIRST without --return_state: y alone
  EXPECT_TRUE(TensorsBitwiseEqual(o1->tensors["y"], want_first->y()));
  EXPECT_TRUE(TensorsBitwiseEqual(o2->tensors["y"], want_seam->y()));
  EXPECT_TRUE(TensorsBitwiseEqual(o2->tensors["new_residual"], want_seam->new_residual()));
  EXPECT_TRUE(TensorsBitwiseEqual(o2->tensors["new_pre_mix"], want_seam->new_pre_mix()));
  EXPECT_TRUE(TensorsBitwiseEqual(o2->tensors["new_post_mix"], want_seam->new_post_mix()));
  EXPECT_TRUE(TensorsBitwiseEqual(o2->tensors["new_comb_mix"], want_seam->new_comb_mix()));
  EXPECT_EQ(Fusedctl({target, "sessions"}, &out), 0) << out;
  EXPECT_TRUE(std::regex_search(out, std::regex(R"(cli-seam  T=3 n=4 C=320  \S+ \S+  residual \+ mixes  2 call\(s\))")))
      << out;

  // Refusals: each names what is wrong, and the session is unchanged (still 2 calls).
  EXPECT_NE(Fusedctl(with({"--tokens=5"}), &out), 0) << out;
  EXPECT_NE(out.find("--tokens=5: residual session cli-seam has T = 3"), std::string::npos) << out;
  EXPECT_NE(Fusedctl(with({"--transport=shm"}), &out), 0) << out;
  EXPECT_NE(out.find("not with --transport=shm"), std::string::npos) << out;
  EXPECT_NE(Fusedctl(with({"--verify"}), &out), 0) << out;
  EXPECT_NE(out.find("cannot be verified"), std::string::npos) << out;
  EXPECT_NE(Fusedctl(with({"--no_pre_mix"}), &out), 0) << out;
  EXPECT_NE(out.find("take pre_mix from the session"), std::string::npos) << out;
  ASSERT_TRUE(client::WriteSafetensors(dir + "/state.safetensors",
                                       {{"x", seam.inline_request.x()}, {"residual", seam.inline_request.residual()}})
                  .ok());
  EXPECT_NE(Fusedctl(with({"--input=" + dir + "/state.safetensors"}), &out), 0) << out;
  EXPECT_NE(out.find("tensor \"residual\" is not a request field (expected x)"), std::string::npos) << out;
  EXPECT_NE(Fusedctl({target, "seam", "--weight_set=rs/attn", "--return_state"}, &out), 0) << out;
  EXPECT_NE(out.find("--return_state applies to --session calls only"), std::string::npos) << out;
  EXPECT_EQ(Fusedctl({target, "sessions"}, &out), 0) << out;
  EXPECT_NE(out.find("2 call(s)"), std::string::npos) << out;
  EXPECT_EQ(Fusedctl({target, "close-session", "cli-seam"}, &out), 0) << out;
  for (const char* f : {"x1", "x2", "o1", "o2", "state"}) ::unlink((dir + "/" + f + ".safetensors").c_str());
  ::rmdir(dir.c_str());
}

}  // namespace
}  // namespace fusedlayer::testing
