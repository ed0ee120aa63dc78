// The client's pool of connections (ClientOptions::connections, fusedctl bench --connections): a
// pool of N over TCP loopback really opens N connections (a test-only gRPC service records the peer
// address of every call it answers, one per connection), every kind of call uses every member,
// every member's results are bitwise those of a one-connection client on a real server, a unix
// socket target defaults to one connection, and out-of-range counts are refused by the library
// and by fusedctl.
#include <chrono>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "client/fusedctl/echo_floor.h"
#include "client/lib/fusedlayer_client.h"
#include "grpcpp/generic/async_generic_service.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server_builder.h"
#include "grpcpp/support/server_callback.h"
#include "client_for.h"
#include "gtest/gtest.h"
#include "server_process.h"
#include "server_test_env.h"
#include "test_util.h"

#ifndef FUSEDCTL_BINARY
#error "FUSEDCTL_BINARY must point at the fusedctl executable"
#endif

namespace fusedlayer::testing {
namespace {

using client::ClientOptions;
using client::FusedLayerClient;

// Answers every call of any method with an empty message (a valid encoding of every response
// type: all fields default) and records the peer of each call, i.e. the client end of the
// connection it came over ("ipv4:127.0.0.1:PORT").
class PeerRecorder {
 public:
  PeerRecorder() : service_(*this) {
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    builder.RegisterCallbackGenericService(&service_);
    server_ = builder.BuildAndStart();
  }
  ~PeerRecorder() {
    if (server_) {
      server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
      server_->Wait();
    }
  }
  bool ok() const { return server_ != nullptr && port_ != 0; }
  std::string target() const { return "127.0.0.1:" + std::to_string(port_); }

  // Calls per peer since the last Take(), and forgets them.
  std::map<std::string, int> Take() {
    absl::MutexLock lock(&mu_);
    return std::exchange(calls_by_peer_, {});
  }

 private:
  class Service : public grpc::CallbackGenericService {
   public:
    explicit Service(PeerRecorder& owner) : owner_(owner) {}
    grpc::ServerGenericBidiReactor* CreateReactor(grpc::GenericCallbackServerContext* ctx) override {
      return new Reactor(owner_, ctx->peer());
    }

   private:
    PeerRecorder& owner_;
  };
  class Reactor : public grpc::ServerGenericBidiReactor {
   public:
    Reactor(PeerRecorder& owner, std::string peer) : owner_(owner), peer_(std::move(peer)) {
      // A ByteBuffer must hold a slice to be written, even an empty one.
      const grpc::Slice empty;
      response_ = grpc::ByteBuffer(&empty, 1);
      StartRead(&request_);
    }
    void OnReadDone(bool ok) override {
      if (ok) {
        absl::MutexLock lock(&owner_.mu_);
        ++owner_.calls_by_peer_[peer_];
      }
      StartWriteAndFinish(&response_, grpc::WriteOptions(), grpc::Status::OK);
    }
    void OnDone() override { delete this; }

   private:
    PeerRecorder& owner_;
    const std::string peer_;
    grpc::ByteBuffer request_;
    grpc::ByteBuffer response_;  // zero bytes
  };

  Service service_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
  absl::Mutex mu_;
  std::map<std::string, int> calls_by_peer_ ABSL_GUARDED_BY(mu_);
};

std::unique_ptr<FusedLayerClient> Connect(const std::string& target, int connections, int expected_concurrency = 1) {
  ClientOptions o;
  o.connections = connections;
  o.expected_concurrency = expected_concurrency;
  absl::StatusOr<std::unique_ptr<FusedLayerClient>> c = FusedLayerClient::Connect(target, std::move(o));
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? *std::move(c) : nullptr;
}

// Each kind of call the client makes, `n` times in a row, and the peers they arrived from.
std::map<std::string, std::map<std::string, int>> PeersPerKindOfCall(FusedLayerClient& c, PeerRecorder& recorder,
                                                                     int n) {
  std::map<std::string, std::map<std::string, int>> peers;
  auto run = [&](const std::string& kind, auto call) {
    for (int i = 0; i < n; ++i) EXPECT_TRUE(call().ok()) << kind;
    peers[kind] = recorder.Take();
  };
  run("GetServerInfo", [&] { return c.GetServerInfo().status(); });
  run("ListWeightSets", [&] { return c.ListWeightSets().status(); });
  run("CheckHealth", [&] { return c.CheckHealth("").status(); });
  run("MhcSeam", [&] { return c.MhcSeam(v1::MhcSeamRequest()).status(); });
  // The shared-request calls go through the methods registered with each member's channel.
  run("MhcSeam shared", [&] { return c.MhcSeam(std::make_shared<const v1::MhcSeamRequest>()).status(); });
  run("SwaNormQuant shared", [&] { return c.SwaNormQuant(std::make_shared<const v1::SwaNormQuantRequest>()).status(); });
  return peers;
}

TEST(ClientConnections, APoolOfFourOpensFourConnectionsAndEveryKindOfCallUsesEach) {
  PeerRecorder recorder;
  ASSERT_TRUE(recorder.ok());
  std::unique_ptr<FusedLayerClient> pool = Connect(recorder.target(), 4);
  ASSERT_NE(pool, nullptr);
  EXPECT_EQ(pool->connections(), 4);
  ASSERT_EQ(pool->channels().size(), 4u);
  EXPECT_EQ(pool->channel(), pool->channels().front());

  std::set<std::string> all_peers;
  for (const auto& [kind, peers] : PeersPerKindOfCall(*pool, recorder, 8)) {
    SCOPED_TRACE(kind);
    // Round robin: 8 calls in a row, 2 on each of 4 connections.
    ASSERT_EQ(peers.size(), 4u);
    for (const auto& [peer, calls] : peers) {
      EXPECT_TRUE(absl::StartsWith(peer, "ipv4:127.0.0.1:")) << peer;
      EXPECT_EQ(calls, 2) << peer;
      all_peers.insert(peer);
    }
  }
  // The same four connections throughout (each member keeps its own).
  EXPECT_EQ(all_peers.size(), 4u);

  // The echo floor's client over the pool's channels (what `fusedctl bench --echo_floor` does).
  const client::EchoFloorClient echo(pool->channels(), 100, pool->options());
  EXPECT_EQ(echo.connections(), 4);
  for (int i = 0; i < 8; ++i) EXPECT_TRUE(echo.Call().ok());
  const std::map<std::string, int> echo_peers = recorder.Take();
  EXPECT_EQ(echo_peers.size(), 4u);
  for (const auto& [peer, calls] : echo_peers) EXPECT_EQ(calls, 2) << peer;
}

TEST(ClientConnections, OneConnectionIsSharedAsBeforeAndTheDefaultFollowsTheConcurrency) {
  PeerRecorder recorder;
  ASSERT_TRUE(recorder.ok());
  // connections = 1: one channel with the client's usual arguments. Two such clients end on one
  // connection (gRPC's global subchannel pool): the behaviour the pool exists to get around.
  std::unique_ptr<FusedLayerClient> a = Connect(recorder.target(), 1);
  std::unique_ptr<FusedLayerClient> b = Connect(recorder.target(), 1);
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(a->connections(), 1);
  for (int i = 0; i < 4; ++i) {
    EXPECT_TRUE(a->GetServerInfo().ok());
    EXPECT_TRUE(b->GetServerInfo().ok());
  }
  std::map<std::string, int> peers = recorder.Take();
  ASSERT_EQ(peers.size(), 1u);
  EXPECT_EQ(peers.begin()->second, 8);

  // The default: 1 up to 4 expected concurrent calls, one more per 4, at most 8.
  EXPECT_EQ(client::DefaultConnections("10.0.0.1:50051", 1), 1);
  EXPECT_EQ(client::DefaultConnections("10.0.0.1:50051", 4), 1);
  EXPECT_EQ(client::DefaultConnections("10.0.0.1:50051", 5), 2);
  EXPECT_EQ(client::DefaultConnections("dns:///fl.internal:443", 16), 4);
  EXPECT_EQ(client::DefaultConnections("10.0.0.1:50051", 1024), 8);
  std::unique_ptr<FusedLayerClient> c16 = Connect(recorder.target(), 0, 16);
  ASSERT_NE(c16, nullptr);
  EXPECT_EQ(c16->connections(), 4);
  for (int i = 0; i < 8; ++i) EXPECT_TRUE(c16->ListWeightSets().ok());
  EXPECT_EQ(recorder.Take().size(), 4u);
  std::unique_ptr<FusedLayerClient> plain = Connect(recorder.target(), 0);  // expected_concurrency 1
  ASSERT_NE(plain, nullptr);
  EXPECT_EQ(plain->connections(), 1);
}

TEST(ClientConnections, UnixSocketTargetsDefaultToOneConnection) {
  for (const std::string target : {"unix:/tmp/fusedlayer-no-such.sock", "unix-abstract:fusedlayer-no-such"}) {
    SCOPED_TRACE(target);
    EXPECT_TRUE(client::IsUnixSocketTarget(target));
    EXPECT_EQ(client::DefaultConnections(target, 64), 1);
    std::unique_ptr<FusedLayerClient> c = Connect(target, 0, 64);
    ASSERT_NE(c, nullptr);
    EXPECT_EQ(c->connections(), 1);
    // An explicit count is honoured (the caller asked for it).
    std::unique_ptr<FusedLayerClient> three = Connect(target, 3, 64);
    ASSERT_NE(three, nullptr);
    EXPECT_EQ(three->connections(), 3);
  }
  EXPECT_FALSE(client::IsUnixSocketTarget("127.0.0.1:50051"));
  EXPECT_FALSE(client::IsUnixSocketTarget("localhost:50051"));
}

TEST(ClientConnections, OutOfRangeCountsAreRefusedAtConstruction) {
  for (const int bad : {-1, -64, client::kMaxConnections + 1, 1000}) {
    ClientOptions o;
    o.connections = bad;
    absl::StatusOr<std::unique_ptr<FusedLayerClient>> c = FusedLayerClient::Connect("127.0.0.1:50051", o);
    ASSERT_FALSE(c.ok()) << bad;
    EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(absl::StrContains(c.status().message(), "connections = " + std::to_string(bad) + " is outside 0..64"))
        << c.status();
  }
  ClientOptions zero_concurrency;
  zero_concurrency.expected_concurrency = 0;
  absl::StatusOr<std::unique_ptr<FusedLayerClient>> c = FusedLayerClient::Connect("127.0.0.1:50051", zero_concurrency);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(c.status().message(), "expected_concurrency")) << c.status();
  ClientOptions most;
  most.connections = client::kMaxConnections;
  EXPECT_TRUE(FusedLayerClient::Connect("127.0.0.1:50051", most).ok());
}

// One server per GPU behind one client: round_robin over the target's addresses sends each call to
// the next server, pick_first (gRPC's default) all of them to the first; both answer with the same
// bits. An unknown policy is refused at construction.
TEST(ClientLoadBalancing, RoundRobinSpreadsCallsOverEveryServerOfTheTarget) {
  auto rng = MakeRng(12);
  server::PackedWeightSet set = MakeWeightSet(rng, "lb/set", MhcSetSpec{}, std::nullopt);
  auto a = TestServer::Start(TestConfig(), nullptr, {set});
  auto b = TestServer::Start(TestConfig(), nullptr, {set});
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  const std::string both = absl::StrCat("ipv4:127.0.0.1:", a->server().port(), ",127.0.0.1:", b->server().port());
  auto executions = [](TestServer& ts) {
    return MetricValue(ScrapeWhenIdle(ts), "fusedlayer_op_executions_total", {{"op", "mhc"}, {"path", "fused"}});
  };
  const v1::MhcSeamRequest req = MakeMhcRequest(rng, "lb/set", MhcRequestSpec{.tokens = 3});
  absl::StatusOr<v1::MhcSeamResponse> want = ClientFor(*a)->MhcSeam(req);
  ASSERT_TRUE(want.ok()) << want.status();
  for (const char* policy : {"round_robin", "pick_first"}) {
    SCOPED_TRACE(policy);
    ClientOptions o;
    o.load_balancing = policy;
    o.connections = 1;
    o.wait_for_ready = true;  // round_robin answers UNAVAILABLE until its subchannels connect
    absl::StatusOr<std::unique_ptr<FusedLayerClient>> c = FusedLayerClient::Connect(both, o);
    ASSERT_TRUE(c.ok()) << c.status();
    // round_robin picks among the subchannels that are ready: call until both servers have
    // answered one (both connected), then count.
    for (int i = 0; i < 200 && std::string(policy) == "round_robin"; ++i) {
      ASSERT_TRUE((*c)->MhcSeam(req).ok());
      if (executions(*a) > 0 && executions(*b) > 0) break;
    }
    const double a0 = executions(*a), b0 = executions(*b);
    constexpr int kCalls = 8;
    for (int i = 0; i < kCalls; ++i) {
      absl::StatusOr<v1::MhcSeamResponse> got = (*c)->MhcSeam(req);
      ASSERT_TRUE(got.ok()) << got.status();
      ExpectMhcEqual(*got, *want);
    }
    const double on_a = executions(*a) - a0, on_b = executions(*b) - b0;
    EXPECT_EQ(on_a + on_b, kCalls);
    if (std::string(policy) == "round_robin") {
      EXPECT_EQ(on_a, kCalls / 2);
      EXPECT_EQ(on_b, kCalls / 2);
    } else {
      EXPECT_TRUE(on_a == kCalls || on_b == kCalls) << on_a << " + " << on_b;
    }
  }
  ClientOptions bad;
  bad.load_balancing = "least_request";
  absl::StatusOr<std::unique_ptr<FusedLayerClient>> c = FusedLayerClient::Connect(both, bad);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(c.status().message(), "round_robin")) << c.status();
}

// Every member against a real server: the same requests give bitwise the same responses as over
// one connection, for each kind of call, and the admin calls (loads, lists, health) work on each.
TEST(ClientConnections, EveryConnectionGivesTheResultsOfOne) {
  auto rng = MakeRng(11);
  server::PackedWeightSet set = MakeWeightSet(rng, "pool/set", MhcSetSpec{}, SwaSetSpec{});
  auto ts = TestServer::Start(TestConfig(), nullptr, {set});
  ASSERT_NE(ts, nullptr);
  const std::string target = "127.0.0.1:" + std::to_string(ts->server().port());
  std::unique_ptr<FusedLayerClient> one = Connect(target, 1);
  std::unique_ptr<FusedLayerClient> pool = Connect(target, 4);
  ASSERT_NE(one, nullptr);
  ASSERT_NE(pool, nullptr);
  ASSERT_EQ(pool->connections(), 4);

  // Each kind in a run of 4 calls, so every member serves each kind once, whatever the counter's start.
  for (int i = 0; i < 4; ++i) {
    SCOPED_TRACE(i);
    const v1::MhcSeamRequest mhc = MakeMhcRequest(rng, "pool/set", MhcRequestSpec{.tokens = 5, .capture_aux = true});
    absl::StatusOr<v1::MhcSeamResponse> want = one->MhcSeam(mhc);
    absl::StatusOr<v1::MhcSeamResponse> got = pool->MhcSeam(mhc);
    ASSERT_TRUE(want.ok()) << want.status();
    ASSERT_TRUE(got.ok()) << got.status();
    ExpectMhcEqual(*got, *want);
    ExpectSameOutputsPresent(*got, *want);
  }
  for (int i = 0; i < 4; ++i) {
    SCOPED_TRACE(i);
    auto mhc = std::make_shared<const v1::MhcSeamRequest>(
        MakeMhcRequest(rng, "pool/set", MhcRequestSpec{.tokens = 7, .mode = v1::MHC_MODE_NORMAL, .pre_mix = false}));
    absl::StatusOr<v1::MhcSeamResponse> want = one->MhcSeam(*mhc);
    absl::StatusOr<v1::MhcSeamResponse> got = pool->MhcSeam(mhc);
    ASSERT_TRUE(want.ok()) << want.status();
    ASSERT_TRUE(got.ok()) << got.status();
    ExpectMhcEqual(*got, *want);
  }
  for (const bool shared : {false, true}) {
    for (int i = 0; i < 4; ++i) {
      SCOPED_TRACE(i);
      const v1::SwaNormQuantRequest swa = MakeSwaRequest(rng, "pool/set", 6, 256 + 128 + 3);
      absl::StatusOr<v1::SwaNormQuantResponse> want = one->SwaNormQuant(swa);
      absl::StatusOr<v1::SwaNormQuantResponse> got =
          shared ? pool->SwaNormQuant(std::make_shared<const v1::SwaNormQuantRequest>(swa)) : pool->SwaNormQuant(swa);
      ASSERT_TRUE(want.ok()) << want.status();
      ASSERT_TRUE(got.ok()) << got.status();
      ExpectSwaEqual(*got, *want);
    }
  }
  // LoadWeights streams and the admin calls, once on each member.
  for (int i = 0; i < 4; ++i) {
    SCOPED_TRACE(i);
    server::PackedWeightSet extra = MakeWeightSet(rng, "pool/extra" + std::to_string(i), MhcSetSpec{}, std::nullopt);
    absl::StatusOr<v1::WeightSetInfo> loaded = pool->LoadWeights(extra.first, extra.second, 1 << 14);
    ASSERT_TRUE(loaded.ok()) << loaded.status();
    EXPECT_EQ(loaded->name(), "pool/extra" + std::to_string(i));
  }
  for (int i = 0; i < 4; ++i) {
    absl::StatusOr<v1::WeightSetInfo> found = pool->FindWeightSet("pool/extra" + std::to_string(i));
    EXPECT_TRUE(found.ok()) << found.status();
    absl::StatusOr<grpc::health::v1::HealthCheckResponse::ServingStatus> health = pool->CheckHealth("");
    ASSERT_TRUE(health.ok()) << health.status();
    EXPECT_EQ(*health, grpc::health::v1::HealthCheckResponse::SERVING);
    EXPECT_TRUE(pool->GetServerInfo().ok());
  }
}

// fusedctl with `args`; its exit status, *out its output.
int Fusedctl(const std::vector<std::string>& args, std::string* out) {
  ServerProcess p(FUSEDCTL_BINARY, args);
  *out = p.ReadAll();
  return p.Wait();
}

TEST(FusedctlConnections, BenchSaysHowManyConnectionsEachRowUsedAndRefusesBadCounts) {
  auto rng = MakeRng(12);
  server::PackedWeightSet set = MakeWeightSet(rng, "pool/bench", MhcSetSpec{}, SwaSetSpec{});
  auto ts = TestServer::Start(TestConfig(), nullptr, {set});
  ASSERT_NE(ts, nullptr);
  const std::string target = "--target=127.0.0.1:" + std::to_string(ts->server().port());
  const std::vector<std::string> bench = {target, "bench", "--op=swa", "--weight_set=pool/bench", "--tokens=4",
                                          "--duration=0.3", "--echo_floor"};
  std::string out;
  {
    std::vector<std::string> args = bench;
    args.insert(args.end(), {"--concurrency=3", "--connections=3"});
    ASSERT_EQ(Fusedctl(args, &out), 0) << out;
    EXPECT_TRUE(absl::StrContains(out, " concurrency=3 connections=3 ")) << out;
    EXPECT_TRUE(absl::StrContains(out, "\nconnections  3 (calls spread round robin)\n")) << out;
    EXPECT_TRUE(absl::StrContains(out, "echo floor   bare gRPC echo over 127.0.0.1 (plaintext), 3 connections, ")) << out;
  }
  {
    // The default from --concurrency, for the row and the floor alike.
    std::vector<std::string> args = bench;
    args.push_back("--concurrency=8");
    ASSERT_EQ(Fusedctl(args, &out), 0) << out;
    EXPECT_TRUE(absl::StrContains(out, " concurrency=8 connections=2 ")) << out;
    EXPECT_TRUE(absl::StrContains(out, "\nconnections  2 (calls spread round robin)\n")) << out;
    EXPECT_TRUE(absl::StrContains(out, "(plaintext), 2 connections, ")) << out;
  }
  for (const std::string bad : {"-1", "65", "1000"}) {
    std::vector<std::string> args = bench;
    args.push_back("--connections=" + bad);
    EXPECT_EQ(Fusedctl(args, &out), 2) << out;
    EXPECT_TRUE(absl::StrContains(out, "--connections=" + bad + " is outside 0..64")) << out;
  }
  // A bench-only flag: another command refuses it.
  EXPECT_EQ(Fusedctl({target, "health", "--connections=2"}, &out), 2) << out;
  EXPECT_TRUE(absl::StrContains(out, "--connections does not apply to 'health'")) << out;
}

}  // namespace
}  // namespace fusedlayer::testing
