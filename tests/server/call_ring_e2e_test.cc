// Call rings end to end (server/ring/, client/lib/call_ring.h, proto OpenCallRing): in-process servers
// with --allow_call_rings and --allow_shared_memory, regions made by ClientSharedMemory.
//
//  - every ring call's outputs bitwise equal to the same call over TCP (fresh random inputs with
//    outliers, the output ranges poisoned before every call), every mHC variant, T in {0, 1, 7},
//    both paths, and the SWA layouts; the report's path and fallback reason in the completion;
//  - every bad descriptor (garbage bytes, unknown op, role, index, dtype, a reference out of its
//    region, a deadline already passed) answered in its completion record with its code, and the
//    server serving the next call; a slot rewritten while its call is in flight;
//  - OpenCallRing's errors (rings off, unknown weight set, a region of another identity, limits),
//    a token presented twice or never;
//  - a client that goes away mid-call (its connection closed while its call is held in the
//    kernel): the ring closes, its queued call is dropped, the server keeps serving;
//  - dynamic batching across rings; drain with ring calls in flight; the ring metrics;
//  - fusedctl seam|swa --transport=ring: the outputs of the same call by RPC.
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "client/lib/call_ring.h"
#include "client/lib/fusedlayer_client.h"
#include "client/lib/shared_memory.h"
#include "client_for.h"
#include "fault_backend.h"
#include "gtest/gtest.h"
#include "server_process.h"
#include "server_test_env.h"
#include "test_util.h"
#include "two_token_file.h"

#ifndef FUSEDCTL_BINARY
#error "FUSEDCTL_BINARY must point at the fusedctl executable"
#endif

namespace fusedlayer::testing {
namespace {

using absl::StatusCode;
using client::CallRing;
using client::ClientSharedMemory;
using client::FusedLayerClient;
using client::RingCallResult;
using server::PackedWeightSet;

server::ServerConfig RingConfig() {
  server::ServerConfig c = TestConfig();
  c.allow_shared_memory = true;
  c.allow_call_rings = true;
  // A socket per server: the tests of one binary may run servers side by side.
  c.call_ring_socket = "/tmp/fl-ring-test-" + std::to_string(::getpid()) + "-" + std::to_string(std::random_device{}());
  return c;
}

v1::MhcConfig MhcConfigOf(const MhcRequestSpec& spec) {
  v1::MhcConfig c;
  c.set_hc_mult(spec.hc_mult);
  c.set_hidden(spec.hidden);
  return c;
}

v1::CallRingRegion Bound(const std::string& name) {
  v1::CallRingRegion r;
  r.set_name(name);
  return r;
}

template <typename Request>
void PoisonOutputs(const ClientSharedMemory& shm, const Request& by_ref) {
  for (const v1::OutputPlacement& p : by_ref.output_placements()) {
    std::memset(shm.data() + p.shared_memory().offset(), 0xFF, p.shared_memory().byte_size());
  }
}

// Every Tensor field of `a` and `b`: present in both or neither, and equal (dtype, shape, bytes).
void ExpectSameTensors(const google::protobuf::Message& a, const google::protobuf::Message& b) {
  const google::protobuf::Descriptor* type = a.GetDescriptor();
  for (int i = 0; i < type->field_count(); ++i) {
    const google::protobuf::FieldDescriptor* f = type->field(i);
    if (f->message_type() != v1::Tensor::descriptor() || f->is_repeated()) continue;
    SCOPED_TRACE(f->name());
    ASSERT_EQ(a.GetReflection()->HasField(a, f), b.GetReflection()->HasField(b, f));
    if (!a.GetReflection()->HasField(a, f)) continue;
    const auto& ta = static_cast<const v1::Tensor&>(a.GetReflection()->GetMessage(a, f));
    const auto& tb = static_cast<const v1::Tensor&>(b.GetReflection()->GetMessage(b, f));
    EXPECT_EQ(ta.dtype(), tb.dtype());
    EXPECT_EQ(std::vector<int64_t>(ta.shape().begin(), ta.shape().end()),
              std::vector<int64_t>(tb.shape().begin(), tb.shape().end()));
    EXPECT_TRUE(ta.data() == tb.data());
  }
}

// A ring call of `by_ref` (every tensor in `shm`): OK, and the response it stands for, read back
// from the region into the RPC's response shape (`shaped`: the same call over shared memory by RPC,
// whose outputs are references with their shapes).
template <typename Request, typename Response>
RingCallResult RingCallInto(CallRing& ring, uint32_t slot, const Request& by_ref, const ClientSharedMemory& shm,
                            const std::vector<std::string>& sets, const std::vector<v1::CallRingRegion>& regions,
                            Response shaped, Response* out) {
  absl::StatusOr<wire::RingCallDescriptor> call = client::RingCallOf(by_ref, sets, regions);
  EXPECT_TRUE(call.ok()) << call.status();
  PoisonOutputs(shm, by_ref);
  RingCallResult r = ring.Call(slot, *call);
  EXPECT_TRUE(r.status.ok()) << r.status;
  EXPECT_TRUE(shm.Fetch(shaped).ok());
  // What a ring caller without the RPC's response gets (fusedctl --transport=ring): the outputs as
  // the region placed them, with the dtypes and shapes the server's response gives them.
  Response placed;
  EXPECT_TRUE(shm.FetchPlaced(placed).ok());
  ExpectSameTensors(placed, shaped);
  *out = std::move(shaped);
  return r;
}

struct RingServer {
  std::unique_ptr<TestServer> ts;
  std::unique_ptr<FusedLayerClient> client;
};
RingServer StartRingServer(std::vector<PackedWeightSet> sets, server::ServerConfig cfg = RingConfig(),
                           std::unique_ptr<Backend> backend = nullptr) {
  RingServer s;
  s.ts = TestServer::Start(cfg, std::move(backend), std::move(sets));
  if (s.ts != nullptr) s.client = ClientFor(*s.ts);
  return s;
}

// ---- bitwise equality with TCP ------------------------------------------------------------------

TEST(CallRing, MhcCallsEqualTcpBitwiseForEveryVariantAndPath) {
  std::mt19937_64 rng = MakeRng(71);
  const PackedWeightSet set = MakeWeightSet(rng, "ring/mhc", MhcSetSpec{.hc_mult = 4, .hidden = 320}, std::nullopt);
  RingServer s = StartRingServer({set});
  ASSERT_NE(s.client, nullptr);
  for (const MhcVariant& k : kMhcVariants) {
    for (int64_t T : {int64_t{0}, int64_t{1}, int64_t{7}}) {
      for (auto pref : {v1::PATH_PREFERENCE_AUTO, v1::PATH_PREFERENCE_FORCE_UNFUSED}) {
        SCOPED_TRACE(::testing::Message() << "stage " << k.stage << " mode " << k.mode << " aux " << k.aux << " T "
                                          << T << " pref " << pref);
        const MhcRequestSpec spec{4, 320, T, k.stage, k.mode, k.pre_mix, k.aux};
        v1::MhcSeamRequest req = MakeMhcRequest(rng, "ring/mhc", spec);
        req.set_path_preference(pref);
        absl::StatusOr<v1::MhcSeamResponse> tcp = s.client->MhcSeam(req);
        ASSERT_TRUE(tcp.ok()) << tcp.status();
        absl::StatusOr<std::unique_ptr<ClientSharedMemory>> shm =
            ClientSharedMemory::Create(*s.client, client::MhcRequestSharedBytes(req, MhcConfigOf(spec)));
        ASSERT_TRUE(shm.ok()) << shm.status();
        v1::MhcSeamRequest by_ref = req;
        ASSERT_TRUE((*shm)->Prepare(by_ref, MhcConfigOf(spec)).ok());
        absl::StatusOr<v1::MhcSeamResponse> shaped = s.client->MhcSeam(by_ref);
        ASSERT_TRUE(shaped.ok()) << shaped.status();
        const std::vector<std::string> sets = {"ring/mhc"};
        const std::vector<v1::CallRingRegion> regions = {Bound((*shm)->region_name())};
        absl::StatusOr<std::unique_ptr<CallRing>> ring = CallRing::Open(*s.client, {sets, regions, 2});
        ASSERT_TRUE(ring.ok()) << ring.status();
        for (uint32_t slot : {0u, 1u, 0u}) {  // a slot used twice: its second seq
          v1::MhcSeamResponse got;
          RingCallResult r = RingCallInto(**ring, slot, by_ref, **shm, sets, regions, *shaped, &got);
          ExpectMhcEqual(got, *tcp);
          EXPECT_EQ(r.path, tcp->report().path());
          EXPECT_EQ(r.fallback_reason, tcp->report().fallback_reason());
          EXPECT_EQ(r.fallback_detail, tcp->report().fallback_detail());
          EXPECT_GE(r.batch_requests, 1u);
          EXPECT_GT(r.server_seconds, 0);
          // The stages of the call, as its RPC's report has them: disjoint parts of server_seconds.
          EXPECT_GT(r.stages.decode(), 0);
          EXPECT_GT(r.stages.device(), 0);
          const double staged = r.stages.decode() + r.queue_seconds + r.stages.copy_in() + r.stages.device() +
                                r.stages.copy_out() + r.stages.response();
          EXPECT_LE(staged, r.server_seconds * (1 + 1e-9));
        }
      }
    }
  }
}

TEST(CallRing, SwaCallsEqualTcpBitwiseForEveryLayout) {
  std::mt19937_64 rng = MakeRng(72);
  int v = 0;
  for (const auto& [swa, extra] : kSwaLayoutVariants) {
    const std::string name = "ring/swa" + std::to_string(v++);
    const PackedWeightSet set = MakeWeightSet(rng, name, std::nullopt, swa);
    RingServer s = StartRingServer({set});
    ASSERT_NE(s.client, nullptr);
    for (int64_t M : {int64_t{0}, int64_t{1}, int64_t{9}}) {
      for (auto pref : {v1::PATH_PREFERENCE_AUTO, v1::PATH_PREFERENCE_FORCE_UNFUSED}) {
        SCOPED_TRACE(::testing::Message() << name << " M " << M << " pref " << pref);
        v1::SwaNormQuantRequest req = MakeSwaRequest(rng, name, M, swa.q_rank + swa.head_dim + extra);
        req.set_path_preference(pref);
        absl::StatusOr<v1::SwaNormQuantResponse> tcp = s.client->SwaNormQuant(req);
        ASSERT_TRUE(tcp.ok()) << tcp.status();
        v1::SwaConfig cfg;
        cfg.set_q_rank(swa.q_rank);
        cfg.set_head_dim(swa.head_dim);
        cfg.set_fp8_format(swa.fp8);
        cfg.set_scale_format(swa.scale);
        cfg.set_scale_layout(swa.layout);
        absl::StatusOr<std::unique_ptr<ClientSharedMemory>> shm =
            ClientSharedMemory::Create(*s.client, client::SwaRequestSharedBytes(req, cfg, swa.wq_b_rows));
        ASSERT_TRUE(shm.ok()) << shm.status();
        v1::SwaNormQuantRequest by_ref = req;
        ASSERT_TRUE((*shm)->Prepare(by_ref, cfg, swa.wq_b_rows).ok());
        absl::StatusOr<v1::SwaNormQuantResponse> shaped = s.client->SwaNormQuant(by_ref);
        ASSERT_TRUE(shaped.ok()) << shaped.status();
        const std::vector<std::string> sets = {name};
        const std::vector<v1::CallRingRegion> regions = {Bound((*shm)->region_name())};
        absl::StatusOr<std::unique_ptr<CallRing>> ring = CallRing::Open(*s.client, {sets, regions, 1});
        ASSERT_TRUE(ring.ok()) << ring.status();
        v1::SwaNormQuantResponse got;
        RingCallResult r = RingCallInto(**ring, 0, by_ref, **shm, sets, regions, *shaped, &got);
        ExpectSwaEqual(got, *tcp);
        EXPECT_EQ(r.path, tcp->report().path());
        EXPECT_EQ(r.fallback_reason, tcp->report().fallback_reason());
      }
    }
  }
}

// ---- bad descriptors ------------------------------------------------------------------------------

// One valid mHC call in a region, and a ring bound to it, for the error cases.
struct ValidCall {
  RingServer s;
  std::unique_ptr<ClientSharedMemory> shm;
  v1::MhcSeamRequest by_ref;
  v1::MhcSeamResponse tcp, shaped;
  std::vector<std::string> sets;
  std::vector<v1::CallRingRegion> regions;
  std::unique_ptr<CallRing> ring;
  wire::RingCallDescriptor call{};

  // The valid call runs, and its outputs are TCP's: the server is serving.
  void ExpectServing(uint32_t slot = 0) {
    v1::MhcSeamResponse got;
    RingCallInto(*ring, slot, by_ref, *shm, sets, regions, shaped, &got);
    ExpectMhcEqual(got, tcp);
  }
};
void MakeValidCall(ValidCall* v, std::mt19937_64& rng, server::ServerConfig cfg = RingConfig(),
                   std::unique_ptr<Backend> backend = nullptr, uint32_t slots = 2) {
  const PackedWeightSet set = MakeWeightSet(rng, "ring/err", MhcSetSpec{.hc_mult = 4, .hidden = 256}, std::nullopt);
  v->s = StartRingServer({set}, cfg, std::move(backend));
  ASSERT_NE(v->s.client, nullptr);
  const MhcRequestSpec spec{.hc_mult = 4, .hidden = 256, .tokens = 5};
  const v1::MhcSeamRequest req = MakeMhcRequest(rng, "ring/err", spec);
  absl::StatusOr<v1::MhcSeamResponse> tcp = v->s.client->MhcSeam(req);
  ASSERT_TRUE(tcp.ok()) << tcp.status();
  v->tcp = *tcp;
  absl::StatusOr<std::unique_ptr<ClientSharedMemory>> shm =
      ClientSharedMemory::Create(*v->s.client, client::MhcRequestSharedBytes(req, MhcConfigOf(spec)));
  ASSERT_TRUE(shm.ok()) << shm.status();
  v->shm = std::move(*shm);
  v->by_ref = req;
  ASSERT_TRUE(v->shm->Prepare(v->by_ref, MhcConfigOf(spec)).ok());
  absl::StatusOr<v1::MhcSeamResponse> shaped = v->s.client->MhcSeam(v->by_ref);
  ASSERT_TRUE(shaped.ok()) << shaped.status();
  v->shaped = *shaped;
  v->sets = {"ring/err"};
  v->regions = {Bound(v->shm->region_name())};
  absl::StatusOr<std::unique_ptr<CallRing>> ring = CallRing::Open(*v->s.client, {v->sets, v->regions, slots});
  ASSERT_TRUE(ring.ok()) << ring.status();
  v->ring = std::move(*ring);
  absl::StatusOr<wire::RingCallDescriptor> call = client::RingCallOf(v->by_ref, v->sets, v->regions);
  ASSERT_TRUE(call.ok()) << call.status();
  v->call = *call;
}

// A ring bound to a device (OpenCallRingRequest.device_id) runs every call there: on a server of
// two CPU devices, all its calls count on device 1, and its outputs are those of the RPC.
TEST(CallRing, ARingBoundToADeviceRunsEveryCallThere) {
  std::mt19937_64 rng = MakeRng(77);
  const PackedWeightSet set = MakeWeightSet(rng, "ring/dev", MhcSetSpec{.hc_mult = 4, .hidden = 256}, std::nullopt);
  server::ServerConfig cfg = RingConfig();
  cfg.cpu_threads = 1;
  std::vector<server::DeviceCandidate> devices;
  devices.push_back(server::DeviceCandidate{0, "cpu:0", CpuBackendFor(cfg)});
  devices.push_back(server::DeviceCandidate{1, "cpu:1", CpuBackendFor(cfg)});
  RingServer s;
  s.ts = TestServer::StartOn(cfg, std::move(devices), {set});
  ASSERT_NE(s.ts, nullptr);
  s.client = ClientFor(*s.ts);
  const MhcRequestSpec spec{4, 256, 5, v1::MHC_STAGE_SEAM, v1::MHC_MODE_SHIFTED, true, false};
  const v1::MhcSeamRequest req = MakeMhcRequest(rng, "ring/dev", spec);
  absl::StatusOr<v1::MhcSeamResponse> tcp = s.client->MhcSeam(req);
  ASSERT_TRUE(tcp.ok()) << tcp.status();
  absl::StatusOr<std::unique_ptr<ClientSharedMemory>> shm =
      ClientSharedMemory::Create(*s.client, client::MhcRequestSharedBytes(req, MhcConfigOf(spec)));
  ASSERT_TRUE(shm.ok()) << shm.status();
  v1::MhcSeamRequest by_ref = req;
  ASSERT_TRUE((*shm)->Prepare(by_ref, MhcConfigOf(spec)).ok());
  absl::StatusOr<v1::MhcSeamResponse> shaped = s.client->MhcSeam(by_ref);  // by RPC: on either device
  ASSERT_TRUE(shaped.ok()) << shaped.status();
  const std::vector<std::string> sets = {"ring/dev"};
  const std::vector<v1::CallRingRegion> regions = {Bound((*shm)->region_name())};

  CallRing::Options bad{sets, regions, 1};
  bad.device_id = 3;
  EXPECT_EQ(CallRing::Open(*s.client, bad).status().code(), StatusCode::kInvalidArgument);

  const std::string before = ScrapeWhenIdle(*s.ts);
  CallRing::Options options{sets, regions, 1};
  options.device_id = 1;
  absl::StatusOr<std::unique_ptr<CallRing>> ring = CallRing::Open(*s.client, options);
  ASSERT_TRUE(ring.ok()) << ring.status();
  constexpr int kCalls = 4;
  for (int i = 0; i < kCalls; ++i) {
    v1::MhcSeamResponse got;
    RingCallInto(**ring, 0, by_ref, **shm, sets, regions, *shaped, &got);
    ExpectMhcEqual(got, *tcp);
  }
  const std::string after = ScrapeWhenIdle(*s.ts);
  auto fused_on = [](const std::string& m, const char* device) {
    return MetricValue(m, "fusedlayer_op_executions_total", {{"op", "mhc"}, {"path", "fused"}, {"device", device}});
  };
  EXPECT_EQ(fused_on(after, "cpu:1") - fused_on(before, "cpu:1"), kCalls);
  EXPECT_EQ(fused_on(after, "cpu:0") - fused_on(before, "cpu:0"), 0);
}

TEST(CallRing, EveryBadDescriptorIsAnsweredInItsCompletionAndTheServerKeepsServing) {
  std::mt19937_64 rng = MakeRng(73);
  ValidCall v;
  MakeValidCall(&v, rng);
  ASSERT_NE(v.ring, nullptr);
  struct Case {
    const char* what;
    std::function<void(wire::RingCallDescriptor&)> edit;
    StatusCode code;
    const char* message;
  };
  const std::vector<Case> cases = {
      {"unknown op", [](auto& c) { c.op = 7; }, StatusCode::kInvalidArgument, "not an op"},
      {"weight set index", [](auto& c) { c.weight_set = 1; }, StatusCode::kInvalidArgument, "weight_set index 1"},
      {"path preference", [](auto& c) { c.path_preference = 9; }, StatusCode::kInvalidArgument, "PathPreference"},
      {"stage", [](auto& c) { c.stage = 3; }, StatusCode::kInvalidArgument, "MhcStage"},
      {"flags", [](auto& c) { c.flags = 0x80; }, StatusCode::kInvalidArgument, "unknown bits"},
      {"num tensors", [](auto& c) { c.num_tensors = 13; }, StatusCode::kInvalidArgument, "num_tensors"},
      {"SWA role in mHC", [](auto& c) { c.tensors[0].role = static_cast<uint32_t>(wire::RingRole::kQrKv); },
       StatusCode::kInvalidArgument, "not a tensor of MhcSeam"},
      {"role twice", [](auto& c) { c.tensors[1].role = c.tensors[0].role; }, StatusCode::kInvalidArgument,
       "given twice"},
      {"region index", [](auto& c) { c.tensors[0].region = 5; }, StatusCode::kInvalidArgument, "region index 5"},
      {"dtype", [](auto& c) { c.tensors[0].dtype = 99; }, StatusCode::kInvalidArgument, "not a DataType"},
      {"rank", [](auto& c) { c.tensors[0].rank = 4; }, StatusCode::kInvalidArgument, "rank 4"},
      {"out of the region", [](auto& c) { c.tensors[0].offset = uint64_t{1} << 40; }, StatusCode::kInvalidArgument,
       ""},
      {"offset overflow", [](auto& c) { c.tensors[0].offset = ~uint64_t{0} - 63; }, StatusCode::kInvalidArgument, ""},
      {"byte size", [](auto& c) { c.tensors[0].byte_size += 2; }, StatusCode::kInvalidArgument, ""},
      {"input missing", [](auto& c) { c.tensors[0].role = static_cast<uint32_t>(wire::RingRole::kNone); },
       StatusCode::kInvalidArgument, ""},
      {"deadline passed", [](auto& c) { c.deadline_ns = 1; }, StatusCode::kDeadlineExceeded, "not launched"},
  };
  for (const Case& k : cases) {
    SCOPED_TRACE(k.what);
    wire::RingCallDescriptor bad = v.call;
    k.edit(bad);
    RingCallResult r = v.ring->Call(1, bad);
    EXPECT_EQ(r.status.code(), k.code) << r.status;
    EXPECT_NE(r.status.message().find(k.message), std::string::npos) << r.status;
    v.ExpectServing(0);
  }
  // Garbage: random bytes for the whole descriptor, many times; every one answered, none OK
  // (an op of 1 or 2 with valid references by chance is beyond 2^-60).
  for (int i = 0; i < 300; ++i) {
    wire::RingCallDescriptor junk;
    auto* bytes = reinterpret_cast<uint8_t*>(&junk);
    for (size_t b = 0; b < sizeof(junk); ++b) bytes[b] = static_cast<uint8_t>(rng());
    if (i % 3 == 0) junk.op = 1 + (i % 2);  // past the op check, into the references
    RingCallResult r = v.ring->Call(1, junk, absl::Seconds(30));
    EXPECT_FALSE(r.status.ok());
    EXPECT_NE(r.status.code(), StatusCode::kDeadlineExceeded) << "no completion for garbage call " << i;
  }
  v.ExpectServing(0);
  v.ExpectServing(1);
}

// The client rewrites its slot (descriptor and seq words) while the call is held in the kernel:
// the call that runs is the one copied at submission, its completion comes for its seq, and the
// next call of the slot is taken normally.
TEST(CallRing, ASlotRewrittenWhileItsCallIsInFlightDoesNotChangeTheCall) {
  std::mt19937_64 rng = MakeRng(74);
  auto backend = std::make_unique<FaultBackend>(CpuBackendFor(TestConfig()));
  std::shared_ptr<FaultBackend::Control> control = backend->control();
  ValidCall v;
  MakeValidCall(&v, rng, RingConfig(), std::move(backend));
  ASSERT_NE(v.ring, nullptr);
  const int entered = control->Entered();
  control->CloseGate();
  PoisonOutputs(*v.shm, v.by_ref);
  ASSERT_TRUE(v.ring->Submit(0, v.call).ok());
  control->WaitEntered(entered + 1);
  // Garbage over the descriptor, and the seq moved back and forth, while the call is held.
  wire::RingSlot* slot = v.ring->raw_slot(0);
  std::memset(&slot->call, 0xA5, sizeof(slot->call));
  control->OpenGate();
  RingCallResult r = v.ring->Wait(0);
  ASSERT_TRUE(r.status.ok()) << r.status;
  v1::MhcSeamResponse got = v.shaped;
  ASSERT_TRUE(v.shm->Fetch(got).ok());
  ExpectMhcEqual(got, v.tcp);
  // The garbage left in the slot is not taken as a call (its seq did not move); the next one is.
  v.ExpectServing(0);
}

// ---- opening ----------------------------------------------------------------------------------------

TEST(CallRing, OpenCallRingOnAServerWithoutRingsIsFailedPrecondition) {
  std::mt19937_64 rng = MakeRng(75);
  const PackedWeightSet set = MakeWeightSet(rng, "ring/open", MhcSetSpec{.hc_mult = 4, .hidden = 256}, std::nullopt);
  server::ServerConfig off = RingConfig();
  off.allow_call_rings = false;
  RingServer s = StartRingServer({set}, off);
  ASSERT_NE(s.client, nullptr);
  absl::StatusOr<std::unique_ptr<CallRing>> ring = CallRing::Open(*s.client, {{"ring/open"}, {}, 1});
  EXPECT_EQ(ring.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(ring.status().message().find("--allow_call_rings"), std::string::npos);
}

class CallRingIdentities : public TwoTokenFile {};

TEST_F(CallRingIdentities, OpenCallRingChecksBindingsAndLimitsPerIdentity) {
  std::mt19937_64 rng = MakeRng(75);
  const PackedWeightSet set = MakeWeightSet(rng, "ring/open", MhcSetSpec{.hc_mult = 4, .hidden = 256}, std::nullopt);
  server::ServerConfig cfg = RingConfig();
  cfg.call_ring_max_per_identity = 2;
  cfg.call_ring_max_slots = 16;
  cfg.auth_tokens_file = file_;
  RingServer s = StartRingServer({set}, cfg);
  ASSERT_NE(s.ts, nullptr);
  auto alice = ClientFor(*s.ts, token_a_);
  auto bob = ClientFor(*s.ts, token_b_);
  ASSERT_TRUE(alice != nullptr && bob != nullptr);
  EXPECT_EQ(CallRing::Open(*alice, {{"no/such"}, {}, 1}).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(CallRing::Open(*alice, {{"ring/open"}, {Bound("nowhere")}, 1}).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(CallRing::Open(*alice, {{"ring/open"}, {}, 17}).status().code(), StatusCode::kInvalidArgument);
  // Bob's region is not Alice's to bind: NOT_FOUND, as for a region nobody registered.
  absl::StatusOr<std::unique_ptr<ClientSharedMemory>> bobs = ClientSharedMemory::Create(*bob, 4096);
  ASSERT_TRUE(bobs.ok()) << bobs.status();
  EXPECT_EQ(CallRing::Open(*alice, {{"ring/open"}, {Bound((*bobs)->region_name())}, 1}).status().code(),
            StatusCode::kNotFound);
  auto b1 = CallRing::Open(*bob, {{"ring/open"}, {Bound((*bobs)->region_name())}, 1});
  EXPECT_TRUE(b1.ok()) << b1.status();
  // Per identity: two rings; closing one frees its place.
  auto a1 = CallRing::Open(*alice, {{"ring/open"}, {}, 1});
  auto a2 = CallRing::Open(*alice, {{"ring/open"}, {}, 16});
  ASSERT_TRUE(a1.ok() && a2.ok());
  EXPECT_EQ(CallRing::Open(*alice, {{"ring/open"}, {}, 1}).status().code(), StatusCode::kResourceExhausted);
  auto b2 = CallRing::Open(*bob, {{"ring/open"}, {}, 1});
  EXPECT_TRUE(b2.ok()) << "bob's rings are counted apart: " << b2.status();
  a1->reset();
  absl::StatusOr<std::unique_ptr<CallRing>> again;
  for (int i = 0; i < 200; ++i) {  // the poller sees the connection's end asynchronously
    again = CallRing::Open(*alice, {{"ring/open"}, {}, 1});
    if (again.ok()) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_TRUE(again.ok()) << again.status();
}

// The handover socket: a token is good once; a wrong one gets an error and no descriptor.
TEST(CallRing, ATokenIsHandedOverOnceAndAWrongOneGetsNothing) {
  std::mt19937_64 rng = MakeRng(76);
  const PackedWeightSet set = MakeWeightSet(rng, "ring/tok", MhcSetSpec{.hc_mult = 4, .hidden = 256}, std::nullopt);
  RingServer s = StartRingServer({set});
  ASSERT_NE(s.client, nullptr);
  v1::OpenCallRingRequest req;
  req.add_weight_sets("ring/tok");
  absl::StatusOr<v1::OpenCallRingResponse> opened = s.client->OpenCallRing(req);
  ASSERT_TRUE(opened.ok()) << opened.status();
  auto present = [&](const std::string& token, std::string* reply) {
    sockaddr_un sa{};
    sa.sun_family = AF_UNIX;
    std::memcpy(sa.sun_path, opened->socket_path().data(), opened->socket_path().size());
    const int fd = ::socket(AF_UNIX, SOCK_STREAM, 0);
    EXPECT_EQ(::connect(fd, reinterpret_cast<const sockaddr*>(&sa), sizeof(sa)), 0);
    EXPECT_EQ(::send(fd, token.data(), token.size(), 0), static_cast<ssize_t>(token.size()));
    int fds[2] = {-1, -1};
    const int n = wire::ReceiveWithDescriptors(fd, reply, 256, fds, 2);
    for (int i = 0; i < std::max(n, 0); ++i) ::close(fds[i]);
    return std::pair<int, int>(fd, n);
  };
  std::string reply;
  std::string wrong = opened->token();
  wrong[0] ^= 1;
  auto [bad_fd, bad_n] = present(wrong, &reply);
  EXPECT_EQ(bad_n, 0);
  EXPECT_EQ(reply.rfind("ERR", 0), 0u) << reply;
  ::close(bad_fd);
  auto [fd, n] = present(opened->token(), &reply);
  EXPECT_EQ(n, 2);
  EXPECT_EQ(reply.rfind("OK", 0), 0u) << reply;
  auto [again_fd, again_n] = present(opened->token(), &reply);
  EXPECT_EQ(again_n, 0) << "a token is good once";
  ::close(again_fd);
  ::close(fd);
}

// ---- a client that goes away -----------------------------------------------------------------------

TEST(CallRing, AClientThatGoesAwayMidCallClosesItsRingAndTheServerKeepsServing) {
  std::mt19937_64 rng = MakeRng(77);
  auto backend = std::make_unique<FaultBackend>(CpuBackendFor(TestConfig()));
  std::shared_ptr<FaultBackend::Control> control = backend->control();
  server::ServerConfig cfg = RingConfig();
  cfg.max_batch_tokens = 0;
  ValidCall v;
  MakeValidCall(&v, rng, cfg, std::move(backend));
  ASSERT_NE(v.ring, nullptr);
  const int entered = control->Entered();
  control->CloseGate();
  // Call 1 is held in the kernel, call 2 waits in the queue behind it; then the client's
  // connection closes (what its exit does).
  ASSERT_TRUE(v.ring->Submit(0, v.call).ok());
  control->WaitEntered(entered + 1);
  ASSERT_TRUE(v.ring->Submit(1, v.call).ok());
  WaitForInflightRequests(*v.s.ts, 2);
  ::shutdown(v.ring->connection_fd(), SHUT_RDWR);
  for (int i = 0; i < 500 && MetricValue(v.s.ts->Scrape(), "fusedlayer_call_rings_open") != 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(MetricValue(v.s.ts->Scrape(), "fusedlayer_call_rings_open"), 0);
  control->OpenGate();
  // The held call ran (it was launched before the ring closed); the queued one was dropped at its
  // launch check. Both completions still land in the memory this process maps.
  EXPECT_TRUE(v.ring->Wait(0).status.ok());
  RingCallResult dropped = v.ring->Wait(1);
  EXPECT_EQ(dropped.status.code(), StatusCode::kCancelled) << dropped.status;
  // Another ring of the same client works.
  absl::StatusOr<std::unique_ptr<CallRing>> ring = CallRing::Open(*v.s.client, {v.sets, v.regions, 2});
  ASSERT_TRUE(ring.ok()) << ring.status();
  v.ring = std::move(*ring);
  v.ExpectServing(0);
  EXPECT_EQ(MetricValue(ScrapeWhenIdle(*v.s.ts), "fusedlayer_inflight_requests"), 0);
}

// ---- batching, drain, metrics -------------------------------------------------------------------

// Calls of several rings, served by several pollers, queued together share one launch, and each
// gets its own outputs bitwise; a ring that closes leaves the others (on its poller and the
// others) serving.
TEST(CallRing, CallsOfRingsOnSeveralPollersAreBatchedTogether) {
  std::mt19937_64 rng = MakeRng(78);
  auto backend = std::make_unique<FaultBackend>(CpuBackendFor(TestConfig()));
  std::shared_ptr<FaultBackend::Control> control = backend->control();
  const PackedWeightSet set = MakeWeightSet(rng, "ring/batch", MhcSetSpec{.hc_mult = 4, .hidden = 256}, std::nullopt);
  server::ServerConfig cfg = RingConfig();
  cfg.max_batch_tokens = 64;
  cfg.call_ring_pollers = 3;  // 4 rings: one poller serves two
  RingServer s = StartRingServer({set}, cfg, std::move(backend));
  ASSERT_NE(s.client, nullptr);
  constexpr int kRings = 4;
  const MhcRequestSpec spec{.hc_mult = 4, .hidden = 256, .tokens = 1};
  std::vector<std::unique_ptr<ClientSharedMemory>> shms;
  std::vector<std::unique_ptr<CallRing>> rings;
  std::vector<v1::MhcSeamRequest> by_refs;
  std::vector<v1::MhcSeamResponse> tcps, shapeds;
  const std::vector<std::string> sets = {"ring/batch"};
  for (int i = 0; i < kRings; ++i) {
    const v1::MhcSeamRequest req = MakeMhcRequest(rng, "ring/batch", spec);
    absl::StatusOr<v1::MhcSeamResponse> tcp = s.client->MhcSeam(req);
    ASSERT_TRUE(tcp.ok()) << tcp.status();
    tcps.push_back(*tcp);
    auto shm = ClientSharedMemory::Create(*s.client, client::MhcRequestSharedBytes(req, MhcConfigOf(spec)));
    ASSERT_TRUE(shm.ok()) << shm.status();
    v1::MhcSeamRequest by_ref = req;
    ASSERT_TRUE((*shm)->Prepare(by_ref, MhcConfigOf(spec)).ok());
    auto shaped = s.client->MhcSeam(by_ref);
    ASSERT_TRUE(shaped.ok()) << shaped.status();
    shapeds.push_back(*shaped);
    auto ring = CallRing::Open(*s.client, {sets, {Bound((*shm)->region_name())}, 1});
    ASSERT_TRUE(ring.ok()) << ring.status();
    PoisonOutputs(**shm, by_ref);
    by_refs.push_back(by_ref);
    shms.push_back(std::move(*shm));
    rings.push_back(std::move(*ring));
  }
  // Hold the executor in a first call, queue one call per ring behind it, then let go: the queued
  // ones form one batch.
  const int entered = control->Entered();
  control->CloseGate();
  std::thread holder([&] { (void)s.client->MhcSeam(MakeMhcRequest(rng, "ring/batch", spec)); });
  control->WaitEntered(entered + 1);
  for (int i = 0; i < kRings; ++i) {
    auto call = client::RingCallOf(by_refs[i], sets, {Bound(shms[i]->region_name())});
    ASSERT_TRUE(call.ok()) << call.status();
    ASSERT_TRUE(rings[i]->Submit(0, *call).ok());
  }
  WaitForInflightRequests(*s.ts, kRings + 1);
  control->OpenGate();
  holder.join();
  for (int i = 0; i < kRings; ++i) {
    RingCallResult r = rings[i]->Wait(0);
    ASSERT_TRUE(r.status.ok()) << r.status;
    EXPECT_EQ(r.batch_requests, static_cast<uint32_t>(kRings)) << "ring " << i;
    v1::MhcSeamResponse got = shapeds[i];
    ASSERT_TRUE(shms[i]->Fetch(got).ok());
    ExpectMhcEqual(got, tcps[i]);
  }
  const std::string scrape = ScrapeWhenIdle(*s.ts);
  EXPECT_EQ(MetricValue(scrape, "fusedlayer_call_ring_calls_total", {{"method", "MhcSeam"}}), kRings);
  EXPECT_EQ(MetricValue(scrape, "fusedlayer_call_rings_open"), kRings);
  EXPECT_GT(MetricValue(scrape, "fusedlayer_call_ring_poller_busy_seconds_total"), 0);
  // Each ring closes in turn; the ones left keep serving, each call alone now.
  for (int closed = 0; closed < kRings; ++closed) {
    rings[closed].reset();
    for (int i = closed + 1; i < kRings; ++i) {
      SCOPED_TRACE(::testing::Message() << "ring " << i << " after " << closed + 1 << " closed");
      v1::MhcSeamResponse got;
      RingCallResult r = RingCallInto(*rings[i], 0, by_refs[i], *shms[i], sets, {Bound(shms[i]->region_name())},
                                      shapeds[i], &got);
      ASSERT_TRUE(r.status.ok()) << r.status;
      ExpectMhcEqual(got, tcps[i]);
    }
  }
}

// Drain with ring calls in flight: they finish with their outputs; a ring opened after is refused.
TEST(CallRing, DrainFinishesRingCallsInFlight) {
  std::mt19937_64 rng = MakeRng(79);
  auto backend = std::make_unique<FaultBackend>(CpuBackendFor(TestConfig()));
  std::shared_ptr<FaultBackend::Control> control = backend->control();
  ValidCall v;
  MakeValidCall(&v, rng, RingConfig(), std::move(backend));
  ASSERT_NE(v.ring, nullptr);
  const int entered = control->Entered();
  control->CloseGate();
  PoisonOutputs(*v.shm, v.by_ref);
  ASSERT_TRUE(v.ring->Submit(0, v.call).ok());
  control->WaitEntered(entered + 1);
  std::thread drain([&] { v.s.ts->server().Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(30)); });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));  // the drain has begun (not a correctness condition)
  control->OpenGate();
  RingCallResult r = v.ring->Wait(0);
  drain.join();
  ASSERT_TRUE(r.status.ok()) << r.status;
  v1::MhcSeamResponse got = v.shaped;
  ASSERT_TRUE(v.shm->Fetch(got).ok());
  ExpectMhcEqual(got, v.tcp);
}

// ---- fusedctl seam|swa --transport=ring ------------------------------------------------------------

// The part of fusedctl's output after "outputs": one summary line per output tensor.
std::string OutputsSection(const std::string& out) {
  const size_t at = out.find("\noutputs\n");
  return at == std::string::npos ? std::string() : out.substr(at);
}

TEST(FusedctlRing, SeamAndSwaThroughARingPrintTheOutputsOfTheSameCallByRpc) {
  std::mt19937_64 rng = MakeRng(77);
  const PackedWeightSet set = MakeWeightSet(rng, "ring/ctl", MhcSetSpec{.hc_mult = 4, .hidden = 256}, SwaSetSpec{});
  RingServer s = StartRingServer({set});
  ASSERT_NE(s.client, nullptr);
  const std::string target = "--target=127.0.0.1:" + std::to_string(s.ts->server().port());
  for (const std::vector<std::string>& call :
       {std::vector<std::string>{"seam", "--tokens=5", "--capture_aux"}, std::vector<std::string>{"seam", "--stage=head"},
        std::vector<std::string>{"swa", "--tokens=9"}}) {
    SCOPED_TRACE(call[0] + " " + call[1]);
    std::vector<std::string> args = {target};
    args.insert(args.end(), call.begin(), call.end());
    args.insert(args.end(), {"--weight_set=ring/ctl", "--seed=12345"});
    std::string by_rpc, by_ring;
    std::vector<std::string> shm = args, ring = args;
    shm.push_back("--transport=shm");
    ring.push_back("--transport=ring");
    ASSERT_EQ(RunToEnd(FUSEDCTL_BINARY, shm, &by_rpc), 0) << by_rpc;
    ASSERT_EQ(RunToEnd(FUSEDCTL_BINARY, ring, &by_ring), 0) << by_ring;
    EXPECT_NE(by_ring.find("call ring: a "), std::string::npos) << by_ring;
    EXPECT_NE(by_ring.find("  path        fused"), std::string::npos) << by_ring;
    ASSERT_FALSE(OutputsSection(by_rpc).empty()) << by_rpc;
    EXPECT_EQ(OutputsSection(by_ring), OutputsSection(by_rpc)) << by_ring << "\n----\n" << by_rpc;
  }
  // No verification in a completion: refused before anything is sent.
  std::string out;
  EXPECT_NE(RunToEnd(FUSEDCTL_BINARY, {target, "seam", "--weight_set=ring/ctl", "--verify", "--transport=ring"}, &out),
            0);
  EXPECT_NE(out.find("--verify: a call ring's completion carries no verification"), std::string::npos) << out;
}

}  // namespace
}  // namespace fusedlayer::testing
