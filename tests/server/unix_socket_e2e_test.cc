// unix: and unix-abstract: listen addresses end to end (docs/operations.md): both compute RPCs and
// health over a unix socket, bit for bit the library's outputs; bearer tokens accepted over it as
// over loopback; the socket file's lifecycle (stale ones replaced, live ones and other files
// refused, removed at shutdown); fusedctl against it, `bench --echo_floor` included, whose echo
// must carry exactly the real call's byte counts.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <optional>
#include <random>
#include <regex>
#include <string>
#include <vector>

#include "client/lib/fusedlayer_client.h"
#include "client/lib/random_inputs.h"
#include "client/lib/wire_request.h"
#include "gtest/gtest.h"
#include "server_process.h"
#include "server_test_env.h"
#include "test_util.h"

#ifndef FUSEDCTL_BINARY
#error "FUSEDCTL_BINARY must point at the fusedctl executable"
#endif
#ifndef UNIX_PEER_PROBE_BINARY
#error "UNIX_PEER_PROBE_BINARY must point at the fusedlayer_unix_peer_probe executable"
#endif

namespace fusedlayer::testing {
namespace {

using absl::StatusCode;
using server::PackedWeightSet;

grpc::ClientContext* WithDeadline(grpc::ClientContext& ctx) {
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  return &ctx;
}

bool IsSocket(const std::string& path) {
  struct stat st {};
  return ::lstat(path.c_str(), &st) == 0 && S_ISSOCK(st.st_mode);
}
bool Exists(const std::string& path) {
  struct stat st {};
  return ::lstat(path.c_str(), &st) == 0;
}

std::string RandomHex(int n) {
  std::random_device rd;
  static constexpr char kHex[] = "0123456789abcdef";
  std::string t;
  for (int i = 0; i < n; ++i) t.push_back(kHex[rd() % 16]);
  return t;
}

// fusedctl with `args` (and `env` entries NAME=VALUE for it alone); its exit status, *out its output.
int Fusedctl(const std::vector<std::string>& env, const std::vector<std::string>& args, std::string* out) {
  std::vector<std::string> argv = env;  // /usr/bin/env: setenv here would race gRPC's threads
  argv.push_back(FUSEDCTL_BINARY);
  argv.insert(argv.end(), args.begin(), args.end());
  ServerProcess p("/usr/bin/env", argv);
  *out = p.ReadAll();
  return p.Wait();
}

class UnixSocketTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/fusedlayer-unix-XXXXXX";
    const char* d = ::mkdtemp(tmpl);
    ASSERT_NE(d, nullptr);
    dir_ = d;
  }
  void TearDown() override { ASSERT_EQ(std::system(("rm -rf '" + dir_ + "'").c_str()), 0); }

  server::ServerConfig UnixConfig(const std::string& socket_name = "fl.sock") {
    server::ServerConfig c = TestConfig();
    c.address = "unix:" + dir_ + "/" + socket_name;
    return c;
  }

  std::string dir_;
};

void ExpectComputeMatchesLibrary(TestServer& ts, std::mt19937_64& rng, const PackedWeightSet& set) {
  Reference ref(set);
  const std::string name = set.first.name();
  {
    v1::MhcSeamRequest req = MakeMhcRequest(rng, name, MhcRequestSpec{.tokens = 5, .capture_aux = true});
    grpc::ClientContext ctx;
    v1::MhcSeamResponse resp;
    const grpc::Status s = ts.stub().MhcSeam(WithDeadline(ctx), req, &resp);
    ASSERT_TRUE(s.ok()) << s.error_message();
    const v1::MhcSeamResponse want = ref.RunMhc(req, Path::kFused);
    EXPECT_EQ(resp.report().path(), v1::EXECUTION_PATH_FUSED);
    EXPECT_TRUE(TensorsBitwiseEqual(resp.new_residual(), want.new_residual()));
    EXPECT_TRUE(TensorsBitwiseEqual(resp.new_pre_mix(), want.new_pre_mix()));
    EXPECT_TRUE(TensorsBitwiseEqual(resp.new_post_mix(), want.new_post_mix()));
    EXPECT_TRUE(TensorsBitwiseEqual(resp.new_comb_mix(), want.new_comb_mix()));
    EXPECT_TRUE(TensorsBitwiseEqual(resp.y(), want.y()));
    EXPECT_TRUE(TensorsBitwiseEqual(resp.aux(), want.aux()));
  }
  {
    v1::SwaNormQuantRequest req = MakeSwaRequest(rng, name, 7, 256 + 128 + 5);
    grpc::ClientContext ctx;
    v1::SwaNormQuantResponse resp;
    const grpc::Status s = ts.stub().SwaNormQuant(WithDeadline(ctx), req, &resp);
    ASSERT_TRUE(s.ok()) << s.error_message();
    const v1::SwaNormQuantResponse want = ref.RunSwa(req, Path::kFused);
    EXPECT_EQ(resp.report().path(), v1::EXECUTION_PATH_FUSED);
    EXPECT_TRUE(TensorsBitwiseEqual(resp.q_fp8(), want.q_fp8()));
    EXPECT_TRUE(TensorsBitwiseEqual(resp.q_scale(), want.q_scale()));
    EXPECT_TRUE(TensorsBitwiseEqual(resp.kv(), want.kv()));
  }
}

TEST_F(UnixSocketTest, ServesBothOpsAndHealthAndRemovesTheSocketAtShutdown) {
  auto rng = MakeRng(1);
  PackedWeightSet set = MakeWeightSet(rng, "ux/L0", MhcSetSpec{}, SwaSetSpec{});
  const server::ServerConfig config = UnixConfig();
  const std::string path = dir_ + "/fl.sock";
  auto ts = TestServer::Start(config, nullptr, {set});
  ASSERT_NE(ts, nullptr);
  EXPECT_EQ(ts->server().port(), 0);  // a unix socket has no port
  EXPECT_TRUE(IsSocket(path));
  ExpectComputeMatchesLibrary(*ts, rng, set);
  int serving = 0;
  ASSERT_TRUE(HealthCheck(ts->channel(), "", &serving).ok());
  EXPECT_EQ(serving, 1);
  ts->Shutdown();
  ts.reset();
  EXPECT_FALSE(Exists(path)) << "the socket file outlived the server";
}

TEST_F(UnixSocketTest, AbstractSocketServesBothOps) {
  auto rng = MakeRng(2);
  PackedWeightSet set = MakeWeightSet(rng, "ux/abs", MhcSetSpec{}, SwaSetSpec{});
  server::ServerConfig config = TestConfig();
  config.address = "unix-abstract:fusedlayer-test-" + RandomHex(16);
  auto ts = TestServer::Start(config, nullptr, {set});
  ASSERT_NE(ts, nullptr);
  EXPECT_EQ(ts->server().port(), 0);
  ExpectComputeMatchesLibrary(*ts, rng, set);
  std::string out;
  EXPECT_EQ(Fusedctl({}, {"--target=" + config.address, "health"}, &out), 0) << out;
  EXPECT_NE(out.find("SERVING"), std::string::npos) << out;
}

// A plaintext unix socket is accepted by the server itself, which reads each connection's peer
// credentials (SO_PEERCRED; server/rpc/plaintext_listener.h): a caller is the identity "uid:N" of its
// user, so processes of different users have separate region namespaces, and the server registers
// only shared-memory objects the caller could open read-write itself. The second process is
// fusedlayer_unix_peer_probe; run as root, the test starts it as nobody (65534) with setpriv, and
// the server, running as root too, could open the test's owner-only object: only the credential
// check stops it (the confused deputy of docs/security.md). Run as another user, the probe runs as
// that same user: the same identity, which may use the same object.
TEST_F(UnixSocketTest, PeersAreIdentifiedByTheirUserAndActOnlyOnObjectsTheyCouldOpen) {
  server::ServerConfig config = UnixConfig();
  config.allow_shared_memory = true;
  const std::string path = dir_ + "/fl.sock";
  auto ts = TestServer::Start(config);
  ASSERT_NE(ts, nullptr);
  absl::StatusOr<std::unique_ptr<client::FusedLayerClient>> mine = client::FusedLayerClient::Connect(config.address);
  ASSERT_TRUE(mine.ok()) << mine.status();
  // Two owner-only objects of this process: one it registers, one nobody registers (so that no
  // other rule, such as an object held by another identity, stands between the probe and it).
  std::vector<int> fds;
  auto make_object = [&](const std::string& key) {
    const int fd = ::shm_open(key.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    EXPECT_GE(fd, 0) << key;
    EXPECT_EQ(::ftruncate(fd, 4096), 0);
    fds.push_back(fd);
  };
  const std::string registered = "/fl-peer-" + RandomHex(32), key = "/fl-peer-" + RandomHex(32);
  make_object(registered);
  make_object(key);
  ASSERT_TRUE((*mine)->RegisterSystemSharedMemory("mine", registered, 0, 4096).ok());

  const bool root = ::geteuid() == 0;
  std::string binary = UNIX_PEER_PROBE_BINARY;
  std::vector<std::string> args;
  if (root) {
    // nobody must reach the socket (the directory searchable, the socket writable) and run the
    // probe, whose build folder may lie under a directory only root can enter: a copy goes next to
    // the socket.
    ASSERT_EQ(::chmod(dir_.c_str(), 0711), 0);
    ASSERT_EQ(::chmod(path.c_str(), 0666), 0);
    const std::string probe_copy = dir_ + "/probe";
    std::filesystem::copy_file(UNIX_PEER_PROBE_BINARY, probe_copy);
    ASSERT_EQ(::chmod(probe_copy.c_str(), 0755), 0);
    binary = "/usr/bin/setpriv";
    args = {"--reuid=65534", "--regid=65534", "--clear-groups", probe_copy};
  }
  args.push_back(config.address);
  args.push_back(key);
  ServerProcess probe(binary, args);
  const std::string out = probe.ReadAll();
  ASSERT_EQ(probe.Wait(), 0) << out;
  absl::StatusOr<v1::SystemSharedMemoryStatusResponse> listed = (*mine)->SystemSharedMemoryStatus();
  ASSERT_TRUE(listed.ok()) << listed.status();
  if (root) {
    EXPECT_NE(out.find("uid: 65534\n"), std::string::npos) << out;
    EXPECT_NE(out.find("theirs: PERMISSION_DENIED shared-memory object " + key +
                       " is not readable and writable by the calling process's user (uid 65534)"),
              std::string::npos)
        << out;
    EXPECT_NE(out.find("own: OK"), std::string::npos) << out;  // its own object, mode 0600
    EXPECT_NE(out.find("listed: own\n"), std::string::npos) << out;  // not "mine": another identity's
    ASSERT_EQ(listed->regions_size(), 1);  // nor does this process see the probe's
    EXPECT_EQ(listed->regions(0).name(), "mine");
  } else {
    EXPECT_NE(out.find("uid: " + std::to_string(::getuid()) + "\n"), std::string::npos) << out;
    EXPECT_NE(out.find("theirs: OK"), std::string::npos) << out;
    EXPECT_NE(out.find("own: OK"), std::string::npos) << out;
    EXPECT_NE(out.find("listed: mine,own,theirs\n"), std::string::npos) << out;  // one identity
    ASSERT_EQ(listed->regions_size(), 2);  // the probe unregistered "own" on its way out
  }
  for (const int fd : fds) ::close(fd);
  ::shm_unlink(registered.c_str());
  ::shm_unlink(key.c_str());
}

TEST_F(UnixSocketTest, TokensAreAcceptedOverAUnixSocketAsOverLoopback) {
  const std::string compute = RandomHex(48), admin = RandomHex(48);
  const std::string tokens_file = dir_ + "/tokens";
  std::ofstream(tokens_file) << compute << " compute\n" << admin << " admin\n";
  auto rng = MakeRng(3);
  PackedWeightSet set = MakeWeightSet(rng, "ux/tok", MhcSetSpec{}, std::nullopt);
  server::ServerConfig config = UnixConfig();
  config.auth_tokens_file = tokens_file;  // no TLS: allowed because unix: is local-only
  auto ts = TestServer::Start(config, nullptr, {set});
  ASSERT_NE(ts, nullptr);
  const std::string target = "unix:" + dir_ + "/fl.sock";
  auto call = [&](const std::string& token) {
    client::ClientOptions o;
    o.bearer_token = token;
    auto c = client::FusedLayerClient::Connect(target, o);
    EXPECT_TRUE(c.ok()) << c.status();
    return (*c)->MhcSeam(MakeMhcRequest(rng, "ux/tok", MhcRequestSpec{.tokens = 2}));
  };
  absl::StatusOr<v1::MhcSeamResponse> ok = call(compute);
  EXPECT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(call("").status().code(), StatusCode::kUnauthenticated);
  EXPECT_EQ(call(RandomHex(48)).status().code(), StatusCode::kUnauthenticated);
  EXPECT_EQ(call(admin).status().code(), StatusCode::kPermissionDenied);
  // fusedctl: the token from the environment; health needs none.
  std::string out;
  EXPECT_EQ(Fusedctl({"FUSEDCTL_TOKEN=" + compute}, {"--target=" + target, "list"}, &out), 0) << out;
  EXPECT_NE(out.find("ux/tok"), std::string::npos) << out;
  EXPECT_EQ(out.find(compute), std::string::npos) << "fusedctl printed the token";
  EXPECT_EQ(Fusedctl({}, {"--target=" + target, "info"}, &out), 1) << out;
  EXPECT_NE(out.find("UNAUTHENTICATED"), std::string::npos) << out;
  EXPECT_EQ(Fusedctl({}, {"--target=" + target, "health"}, &out), 0) << out;
}

TEST_F(UnixSocketTest, StaleSocketIsReplacedLiveSocketAndOtherFilesAreRefused) {
  // A socket file nobody listens on, as a crashed server leaves it.
  const std::string stale = dir_ + "/stale.sock";
  {
    const int fd = ::socket(AF_UNIX, SOCK_STREAM, 0);
    ASSERT_GE(fd, 0);
    sockaddr_un sa{};
    sa.sun_family = AF_UNIX;
    std::snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", stale.c_str());
    ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)), 0);
    ::close(fd);
    ASSERT_TRUE(IsSocket(stale));
  }
  auto first = TestServer::Start(UnixConfig("stale.sock"));
  ASSERT_NE(first, nullptr);
  int serving = 0;
  ASSERT_TRUE(HealthCheck(first->channel(), "", &serving).ok());
  EXPECT_EQ(serving, 1);

  // The same path while `first` serves on it: refused, and `first` keeps its socket.
  auto second = server::FusedLayerServer::Start(UnixConfig("stale.sock"), CpuBackendFor(TestConfig()), {});
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), StatusCode::kUnavailable) << second.status();
  EXPECT_NE(second.status().message().find("another process is accepting connections"), std::string::npos)
      << second.status();
  ASSERT_TRUE(HealthCheck(MakeChannelTo("unix:" + stale), "", &serving).ok());
  EXPECT_EQ(serving, 1);

  // A regular file at the path is never removed.
  const std::string file = dir_ + "/data.sock";
  std::ofstream(file) << "not a socket";
  auto on_file = server::FusedLayerServer::Start(UnixConfig("data.sock"), CpuBackendFor(TestConfig()), {});
  ASSERT_FALSE(on_file.ok());
  EXPECT_EQ(on_file.status().code(), StatusCode::kFailedPrecondition) << on_file.status();
  EXPECT_NE(on_file.status().message().find("is not a socket"), std::string::npos) << on_file.status();
  std::ifstream in(file);
  std::string contents;
  std::getline(in, contents);
  EXPECT_EQ(contents, "not a socket");
}

TEST_F(UnixSocketTest, BadUnixAddressesAreRefusedAtValidation) {
  for (const std::string& bad : {std::string("unix:"), std::string("unix-abstract:"), "unix:/tmp/" + std::string(120, 'x'),
                                 "unix-abstract:" + std::string(108, 'y')}) {
    server::ServerConfig c = TestConfig();
    c.address = bad;
    const absl::Status s = c.Validate();
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(s.message().find("--address="), std::string::npos) << s;
  }
  server::ServerConfig longest = TestConfig();
  longest.address = "unix:/" + std::string(106, 'z');  // 107 bytes: the most a sun_path holds
  EXPECT_TRUE(longest.Validate().ok()) << longest.Validate();
  // A directory that does not exist: the bind fails, with the address named.
  auto s = server::FusedLayerServer::Start(UnixConfig("no/such/dir.sock"), CpuBackendFor(TestConfig()), {});
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), StatusCode::kUnavailable) << s.status();
  EXPECT_NE(s.status().message().find("unix:"), std::string::npos) << s.status();
}

// ---- fusedctl, bench --echo_floor -----------------------------------------------------------------

// The "echo bytes" line: request (server received), response (client received), and the call's.
struct EchoBytes {
  uint64_t echo_request = 0, echo_response = 0, call_request = 0, call_response = 0;
};
bool ParseEchoBytes(const std::string& out, EchoBytes* b) {
  std::smatch m;
  const std::regex re(
      R"(echo bytes   request (\d+) B \(server received\), response (\d+) B \(client received\); call request (\d+) B, response (\d+) B)");
  if (!std::regex_search(out, m, re)) return false;
  b->echo_request = std::stoull(m[1]);
  b->echo_response = std::stoull(m[2]);
  b->call_request = std::stoull(m[3]);
  b->call_response = std::stoull(m[4]);
  return true;
}

void ExpectEchoFloorBlock(const std::string& out, uint64_t want_request_bytes) {
  EchoBytes b;
  ASSERT_TRUE(ParseEchoBytes(out, &b)) << out;
  EXPECT_EQ(b.call_request, want_request_bytes) << out;
  EXPECT_EQ(b.echo_request, b.call_request) << out;
  EXPECT_EQ(b.echo_response, b.call_response) << out;
  EXPECT_GT(b.call_response, b.call_request / 2) << out;  // a seam returns about what it receives
  EXPECT_TRUE(std::regex_search(out, std::regex(R"(\necho         [1-9]\d* ok, 0 failed in [0-9.]+ s, [0-9.]+ req/s\n)")))
      << out;
  EXPECT_TRUE(std::regex_search(out, std::regex(R"(\necho latency p50 \S+ \S+  p90 \S+ \S+  p99 \S+ \S+  max)"))) << out;
  EXPECT_TRUE(std::regex_search(
      out, std::regex(R"(\nvs floor     round trip / echo: p50 [0-9.]+x  p90 [0-9.]+x  p99 [0-9.]+x; req/s call / echo [0-9.]+x\n)")))
      << out;
}

TEST_F(UnixSocketTest, FusedctlCommandsAndBenchEchoFloorOverUnixAndTcp) {
  auto rng = MakeRng(4);
  PackedWeightSet set = MakeWeightSet(rng, "ux/bench", MhcSetSpec{}, SwaSetSpec{});
  auto ts = TestServer::Start(UnixConfig(), nullptr, {set});
  ASSERT_NE(ts, nullptr);
  const std::string unix_target = "unix:" + dir_ + "/fl.sock";
  std::string out;
  EXPECT_EQ(Fusedctl({}, {"--target=" + unix_target, "health"}, &out), 0) << out;
  EXPECT_NE(out.find("SERVING"), std::string::npos) << out;
  EXPECT_EQ(Fusedctl({}, {"--target=" + unix_target, "info"}, &out), 0) << out;
  EXPECT_EQ(Fusedctl({}, {"--target=" + unix_target, "swa", "--weight_set=ux/bench", "--tokens=3"}, &out), 0) << out;

  // The real request's size, computed here from the same spec the bench uses (sizes do not depend
  // on the random values).
  auto client = client::FusedLayerClient::Connect(unix_target);
  ASSERT_TRUE(client.ok());
  absl::StatusOr<v1::WeightSetInfo> info = (*client)->FindWeightSet("ux/bench");
  ASSERT_TRUE(info.ok()) << info.status();
  absl::StatusOr<v1::MhcSeamRequest> mhc_req = client::RandomMhcRequest(
      info->mhc(), client::MhcRequestSpec{.weight_set = "ux/bench", .tokens = 6}, rng);
  ASSERT_TRUE(mhc_req.ok());
  const std::vector<std::string> bench = {"bench", "--op=mhc", "--weight_set=ux/bench", "--tokens=6",
                                          "--concurrency=2", "--duration=0.3", "--echo_floor"};
  std::vector<std::string> args = {"--target=" + unix_target};
  args.insert(args.end(), bench.begin(), bench.end());
  ASSERT_EQ(Fusedctl({}, args, &out), 0) << out;
  EXPECT_NE(out.find("echo floor   bare gRPC echo over a unix socket (plaintext)"), std::string::npos) << out;
  // The bench sends a shared request (its tensors as patches after the message, client/lib/wire_request.h).
  ExpectEchoFloorBlock(out, client::EncodeRequestByReference(std::make_shared<v1::MhcSeamRequest>(*mhc_req)).Length());

  // The same over TCP loopback: a second server, the echo on 127.0.0.1.
  auto tcp = TestServer::Start(TestConfig(), nullptr, {set});
  ASSERT_NE(tcp, nullptr);
  absl::StatusOr<v1::SwaNormQuantRequest> swa_req = client::RandomSwaRequest(
      info->swa(), client::SwaRequestSpec{.weight_set = "ux/bench", .tokens = 4}, rng);
  ASSERT_TRUE(swa_req.ok());
  ASSERT_EQ(Fusedctl({}, {"--target=127.0.0.1:" + std::to_string(tcp->server().port()), "bench", "--op=swa",
                          "--weight_set=ux/bench", "--tokens=4", "--concurrency=3", "--duration=0.3", "--echo_floor"},
                     &out),
            0)
      << out;
  EXPECT_NE(out.find("echo floor   bare gRPC echo over 127.0.0.1 (plaintext)"), std::string::npos) << out;
  ExpectEchoFloorBlock(out, client::EncodeRequestByReference(std::make_shared<v1::SwaNormQuantRequest>(*swa_req)).Length());

  // --copy_requests: protobuf's serialization, the message's own size.
  ASSERT_EQ(Fusedctl({}, {"--target=127.0.0.1:" + std::to_string(tcp->server().port()), "bench", "--op=swa",
                          "--weight_set=ux/bench", "--tokens=4", "--concurrency=1", "--duration=0.3", "--echo_floor",
                          "--copy_requests"},
                     &out),
            0)
      << out;
  EXPECT_NE(out.find(" requests=serialized\n"), std::string::npos) << out;
  ExpectEchoFloorBlock(out, swa_req->ByteSizeLong());

  // Without the flag there is no floor block.
  args.pop_back();
  ASSERT_EQ(Fusedctl({}, args, &out), 0) << out;
  EXPECT_EQ(out.find("echo"), std::string::npos) << out;
}

// fusedctl bench --transport=shm of a call whose tensors are over the server's message limit
// inline: the shared-memory row runs, the TCP row is reported as refused (the bench does not fail),
// and only the echo floor of the call's own bytes runs (there is no inline call to floor). Over TCP;
// it lives in this suite with the other fusedctl bench --echo_floor cases, which are outside the TSan
// set (scripts/sanitize.sh: the echo-floor server's generic reactor inside libgrpc++).
TEST(FusedctlBench, ReportsARefusedTcpRowAndKeepsTheSharedMemoryRow) {
  auto rng = MakeRng(50);
  const PackedWeightSet set = MakeWeightSet(rng, "shm/bench", MhcSetSpec{}, std::nullopt);
  server::ServerConfig config = TestConfig();
  config.allow_shared_memory = true;
  config.max_message_bytes = 64 << 10;  // an mHC call of 64 tokens is over it inline
  auto ts = TestServer::Start(config, nullptr, {set});
  ASSERT_NE(ts, nullptr);
  std::string out;
  ASSERT_EQ(RunToEnd(FUSEDCTL_BINARY,
                     {"--target=127.0.0.1:" + std::to_string(ts->server().port()), "bench", "--op=mhc",
                      "--weight_set=shm/bench", "--tokens=64", "--duration=0.3", "--transport=shm", "--echo_floor"},
                     &out),
            0)
      << out;
  EXPECT_NE(out.find(" transport=shm "), std::string::npos) << out;
  EXPECT_NE(out.find("tcp (the same request, tensors inline): refused, RESOURCE_EXHAUSTED"), std::string::npos) << out;
  EXPECT_NE(out.find("echo of this call's own bytes"), std::string::npos) << out;
  EXPECT_EQ(out.find("echo of the bytes inline"), std::string::npos) << out;
  EXPECT_EQ(out.find(" vs tcp "), std::string::npos) << out;
}

}  // namespace
}  // namespace fusedlayer::testing
