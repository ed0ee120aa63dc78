// Transport security end to end: TLS, mutual TLS, bearer tokens with per-method rights, the open
// health and reflection services, startup refusals of the binary, and fusedctl over TLS.
//
// Certificates are throwaway ones made here with the `openssl` CLI (Debian package openssl) in a
// fresh temporary directory: a CA, a server certificate for IP:127.0.0.1 and DNS:localhost, a client
// certificate from the same CA, and a client certificate from a second, untrusted CA.
#include <sys/stat.h>
#include <stdlib.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <random>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "auth/identity_file.h"
#include "auth/token_auth_processor.h"
#include "auth/token_file.h"
#include "auth/transport_security.h"
#include "client/lib/fusedlayer_client.h"
#include "client/lib/transport_credentials.h"
#include "gtest/gtest.h"
#include "server_process.h"
#include "server_test_env.h"
#include "test_util.h"

#ifndef FUSEDLAYER_SERVER_BINARY
#error "FUSEDLAYER_SERVER_BINARY must point at the fusedlayer_server executable"
#endif
#ifndef FUSEDCTL_BINARY
#error "FUSEDCTL_BINARY must point at the fusedctl executable"
#endif

namespace fusedlayer::testing {
namespace {

namespace auth = server::auth;
using absl::StatusCode;
using client::ClientOptions;
using client::FusedLayerClient;

void WriteFile(const std::string& path, const std::string& contents) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << contents;
  ASSERT_TRUE(out.good()) << path;
}

// 64 hex characters from the OS entropy source: a fresh token per test run.
std::string RandomToken() {
  std::random_device rd;
  static constexpr char kHex[] = "0123456789abcdef";
  std::string t;
  for (int i = 0; i < 64; ++i) t.push_back(kHex[rd() % 16]);
  return t;
}

// ---- throwaway PKI ----------------------------------------------------------------------------

struct Pki {
  std::string dir;
  std::string ca, server_cert, server_key, client_cert, client_key, rogue_cert, rogue_key;
  // From the trusted CA too: one with a SPIFFE ID (a single URI SAN), one whose subject has two
  // attributes (one with a space), one listed nowhere.
  std::string spiffe_cert, spiffe_key, ops_cert, ops_key, unlisted_cert, unlisted_key;
};

// Runs a shell command (openssl); returns its exit status. Called before any gRPC thread exists
// for the suite's servers, so system()'s fork is safe.
int Shell(const std::string& command) { return std::system((command + " >/dev/null 2>&1").c_str()); }

Pki* MakePki() {
  auto* pki = new Pki;
  char tmpl[] = "/tmp/fusedlayer-security-XXXXXX";
  const char* dir = mkdtemp(tmpl);
  if (dir == nullptr) return nullptr;
  pki->dir = dir;
  const std::string d = pki->dir + "/";
  // ECDSA P-256 keys: generated in milliseconds (RSA would dominate the suite's time on 2 cores).
  const std::string newkey = " -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes ";
  auto make_ca = [&](const std::string& name) {
    return Shell("openssl req -x509" + newkey + "-days 2 -subj /CN=" + name + " -keyout " + d + name + ".key -out " + d +
                 name + ".pem -addext basicConstraints=critical,CA:TRUE -addext keyUsage=critical,keyCertSign,cRLSign");
  };
  auto make_leaf = [&](const std::string& name, const std::string& ca, const std::string& cn, const std::string& ext) {
    std::ofstream(d + name + ".ext") << ext << "\n";
    if (int rc = Shell("openssl req" + newkey + "-subj '/CN=" + cn + "' -keyout " + d + name + ".key -out " + d + name +
                       ".csr");
        rc != 0) {
      return rc;
    }
    return Shell("openssl x509 -req -days 2 -in " + d + name + ".csr -CA " + d + ca + ".pem -CAkey " + d + ca +
                 ".key -CAcreateserial -extfile " + d + name + ".ext -out " + d + name + ".pem");
  };
  if (make_ca("ca") != 0 || make_ca("rogue-ca") != 0) return nullptr;
  if (make_leaf("server", "ca", "localhost",
                "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth") != 0) {
    return nullptr;
  }
  if (make_leaf("client", "ca", "fusedlayer-test-client", "extendedKeyUsage=clientAuth") != 0) return nullptr;
  if (make_leaf("rogue", "rogue-ca", "fusedlayer-rogue-client", "extendedKeyUsage=clientAuth") != 0) return nullptr;
  if (make_leaf("spiffe", "ca", "fusedlayer-loader",
                "subjectAltName=URI:spiffe://fusedlayer.test/ns/ci/sa/loader\nextendedKeyUsage=clientAuth") != 0) {
    return nullptr;
  }
  if (make_leaf("ops", "ca", "fusedlayer-ops/O=Acme Inc", "extendedKeyUsage=clientAuth") != 0) return nullptr;
  if (make_leaf("unlisted", "ca", "fusedlayer-unlisted", "extendedKeyUsage=clientAuth") != 0) return nullptr;
  pki->ca = d + "ca.pem";
  pki->server_cert = d + "server.pem";
  pki->server_key = d + "server.key";
  pki->client_cert = d + "client.pem";
  pki->client_key = d + "client.key";
  pki->rogue_cert = d + "rogue.pem";
  pki->rogue_key = d + "rogue.key";
  pki->spiffe_cert = d + "spiffe.pem";
  pki->spiffe_key = d + "spiffe.key";
  pki->ops_cert = d + "ops.pem";
  pki->ops_key = d + "ops.key";
  pki->unlisted_cert = d + "unlisted.pem";
  pki->unlisted_key = d + "unlisted.key";
  return pki;
}

class SecurityTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    pki_ = MakePki();
    if (pki_ != nullptr) {
      compute_token_ = RandomToken();
      admin_token_ = RandomToken();
      both_token_ = RandomToken();
      tokens_file_ = pki_->dir + "/tokens";
      WriteFile(tokens_file_, "# fusedlayer test tokens\n" + compute_token_ + " compute\n\n" + admin_token_ +
                                  " admin\n" + both_token_ + "   admin,compute  \n");
      identities_file_ = pki_->dir + "/identities";
      // The subject as gRPC reports it: RFC 2253, the last attribute first.
      WriteFile(identities_file_,
                "# fusedlayer test client identities\n"
                "subject:CN=fusedlayer-test-client compute\n"
                "spiffe://fusedlayer.test/ns/ci/sa/loader admin\n"
                "subject:O=Acme Inc,CN=fusedlayer-ops\tcompute,admin\n"
                "# a subject that no certificate has, and a SPIFFE ID on no certificate\n"
                "subject:CN=fusedlayer-unlisted,O=Elsewhere admin\n"
                "spiffe://fusedlayer.test/ns/ci/sa/unlisted compute,admin\n");
    }
  }
  static void TearDownTestSuite() {
    if (pki_ != nullptr) Shell("rm -rf '" + pki_->dir + "'");
    delete pki_;
    pki_ = nullptr;
  }
  void SetUp() override { ASSERT_NE(pki_, nullptr) << "making the test certificates with the openssl CLI failed"; }

  // A server config over TLS (and, when given, client certificates and tokens).
  static server::ServerConfig TlsConfig(bool mutual, bool tokens) {
    server::ServerConfig c = TestConfig();
    c.tls_cert = pki_->server_cert;
    c.tls_key = pki_->server_key;
    if (mutual) c.tls_client_ca = pki_->ca;
    if (tokens) c.auth_tokens_file = tokens_file_;
    // TLS without tokens must be accepted explicitly (StartRefusesTlsWithoutTokensUnlessAllowed).
    c.allow_unauthenticated_tls = !tokens;
    return c;
  }

  // A client of 127.0.0.1:port. `ca` empty: plaintext. The server certificate is checked against
  // IP:127.0.0.1 unless `server_name` overrides it.
  static std::unique_ptr<FusedLayerClient> Client(int port, const std::string& token, const std::string& ca,
                                                  const std::string& cert = "", const std::string& key = "",
                                                  const std::string& server_name = "", int connections = 1) {
    ClientOptions o;
    o.deadline = absl::Seconds(30);
    o.connections = connections;
    o.bearer_token = token;
    o.tls_server_name = server_name;
    if (!ca.empty()) {
      absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> creds =
          client::TlsChannelCredentials({.ca = ca, .cert = cert, .key = key});
      EXPECT_TRUE(creds.ok()) << creds.status();
      if (!creds.ok()) return nullptr;
      o.credentials = *creds;
    }
    absl::StatusOr<std::unique_ptr<FusedLayerClient>> c =
        FusedLayerClient::Connect("127.0.0.1:" + std::to_string(port), std::move(o));
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? *std::move(c) : nullptr;
  }

  static Pki* pki_;
  static std::string compute_token_, admin_token_, both_token_, tokens_file_, identities_file_;
};

Pki* SecurityTest::pki_ = nullptr;
std::string SecurityTest::compute_token_, SecurityTest::admin_token_, SecurityTest::both_token_,
    SecurityTest::tokens_file_, SecurityTest::identities_file_;

// ---- TLS ----------------------------------------------------------------------------------------

TEST_F(SecurityTest, TlsServesAndRefusesPlaintextClients) {
  auto ts = TestServer::Start(TlsConfig(/*mutual=*/false, /*tokens=*/false));
  ASSERT_NE(ts, nullptr);
  const int port = ts->server().port();

  auto tls = Client(port, "", pki_->ca);
  ASSERT_NE(tls, nullptr);
  absl::StatusOr<v1::GetServerInfoResponse> info = tls->GetServerInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->backend(), "cpu");
  absl::StatusOr<grpc::health::v1::HealthCheckResponse::ServingStatus> health = tls->CheckHealth("");
  ASSERT_TRUE(health.ok()) << health.status();
  EXPECT_EQ(*health, grpc::health::v1::HealthCheckResponse::SERVING);

  // The server certificate names DNS:localhost too: verified through the name override.
  auto by_name = Client(port, "", pki_->ca, "", "", "localhost");
  ASSERT_NE(by_name, nullptr);
  EXPECT_TRUE(by_name->ListWeightSets().ok());
  // ... and a name it does not carry fails verification.
  auto wrong_name = Client(port, "", pki_->ca, "", "", "fusedlayer.example");
  ASSERT_NE(wrong_name, nullptr);
  EXPECT_EQ(wrong_name->GetServerInfo().status().code(), StatusCode::kUnavailable);
  // A client that does not trust the server's CA refuses the connection.
  auto untrusting = Client(port, "", pki_->dir + "/rogue-ca.pem");
  ASSERT_NE(untrusting, nullptr);
  EXPECT_EQ(untrusting->GetServerInfo().status().code(), StatusCode::kUnavailable);

  auto plain = Client(port, "", "");
  ASSERT_NE(plain, nullptr);
  EXPECT_EQ(plain->GetServerInfo().status().code(), StatusCode::kUnavailable);
  EXPECT_EQ(plain->CheckHealth("").status().code(), StatusCode::kUnavailable);

  // Still serving TLS clients after the refusals.
  EXPECT_TRUE(tls->GetServerInfo().ok());
}

TEST_F(SecurityTest, MutualTlsRequiresATrustedClientCertificate) {
  auto ts = TestServer::Start(TlsConfig(/*mutual=*/true, /*tokens=*/false));
  ASSERT_NE(ts, nullptr);
  const int port = ts->server().port();
  auto good = Client(port, "", pki_->ca, pki_->client_cert, pki_->client_key);
  ASSERT_NE(good, nullptr);
  ASSERT_TRUE(good->GetServerInfo().ok());

  auto no_cert = Client(port, "", pki_->ca);
  ASSERT_NE(no_cert, nullptr);
  EXPECT_EQ(no_cert->GetServerInfo().status().code(), StatusCode::kUnavailable);
  EXPECT_TRUE(good->ListWeightSets().ok());

  auto untrusted = Client(port, "", pki_->ca, pki_->rogue_cert, pki_->rogue_key);
  ASSERT_NE(untrusted, nullptr);
  EXPECT_EQ(untrusted->GetServerInfo().status().code(), StatusCode::kUnavailable);
  // Probes must present a certificate too under mutual TLS (the handshake precedes any service).
  EXPECT_EQ(untrusted->CheckHealth("").status().code(), StatusCode::kUnavailable);
  EXPECT_TRUE(good->GetServerInfo().ok());

  auto plain = Client(port, "", "");
  ASSERT_NE(plain, nullptr);
  EXPECT_EQ(plain->GetServerInfo().status().code(), StatusCode::kUnavailable);
  EXPECT_TRUE(good->CheckHealth("").ok());
}

// ---- tokens -------------------------------------------------------------------------------------

TEST_F(SecurityTest, BearerTokensOverTlsEnforceRightsPerMethod) {
  std::mt19937_64 rng = MakeRng(7);
  std::vector<server::PackedWeightSet> initial;
  initial.push_back(MakeWeightSet(rng, "sec/resident", MhcSetSpec{}, std::nullopt));
  auto ts = TestServer::Start(TlsConfig(/*mutual=*/false, /*tokens=*/true), nullptr, std::move(initial));
  ASSERT_NE(ts, nullptr);
  const int port = ts->server().port();
  auto anonymous = Client(port, "", pki_->ca);
  auto wrong = Client(port, RandomToken(), pki_->ca);
  auto compute = Client(port, compute_token_, pki_->ca);
  auto admin = Client(port, admin_token_, pki_->ca);
  auto both = Client(port, both_token_, pki_->ca);
  ASSERT_TRUE(anonymous && wrong && compute && admin && both);
  const v1::MhcSeamRequest seam = MakeMhcRequest(rng, "sec/resident", MhcRequestSpec{});
  auto still_serving = [&] {
    absl::StatusOr<v1::MhcSeamResponse> r = compute->MhcSeam(seam);
    EXPECT_TRUE(r.ok()) << r.status();
  };

  // No token / unknown token: UNAUTHENTICATED on every FusedLayer method.
  EXPECT_EQ(anonymous->MhcSeam(seam).status().code(), StatusCode::kUnauthenticated);
  EXPECT_EQ(anonymous->GetServerInfo().status().code(), StatusCode::kUnauthenticated);
  EXPECT_EQ(anonymous->UnloadWeightSet("sec/resident").status().code(), StatusCode::kUnauthenticated);
  still_serving();
  EXPECT_EQ(wrong->MhcSeam(seam).status().code(), StatusCode::kUnauthenticated);
  EXPECT_EQ(wrong->ListWeightSets().status().code(), StatusCode::kUnauthenticated);
  still_serving();

  // The compute right covers the compute and read-only methods ...
  absl::StatusOr<v1::MhcSeamResponse> r = compute->MhcSeam(seam);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->y().dtype(), v1::DATA_TYPE_BF16);
  EXPECT_TRUE(compute->GetServerInfo().ok());
  EXPECT_TRUE(compute->ListWeightSets().ok());
  // ... but not the admin ones.
  server::PackedWeightSet extra = MakeWeightSet(rng, "sec/loaded", MhcSetSpec{}, std::nullopt);
  EXPECT_EQ(compute->LoadWeights(extra.first, extra.second).status().code(), StatusCode::kPermissionDenied);
  still_serving();
  EXPECT_EQ(compute->UnloadWeightSet("sec/resident").status().code(), StatusCode::kPermissionDenied);
  still_serving();  // the set is still there

  // The admin right: LoadWeights / UnloadWeightSet only.
  absl::StatusOr<v1::WeightSetInfo> loaded = admin->LoadWeights(extra.first, extra.second);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->name(), "sec/loaded");
  EXPECT_EQ(admin->MhcSeam(seam).status().code(), StatusCode::kPermissionDenied);
  EXPECT_EQ(admin->GetServerInfo().status().code(), StatusCode::kPermissionDenied);
  still_serving();
  EXPECT_TRUE(admin->UnloadWeightSet("sec/loaded").ok());

  // compute,admin: both kinds.
  EXPECT_TRUE(both->MhcSeam(seam).ok());
  EXPECT_TRUE(both->LoadWeights(extra.first, extra.second).ok());
  absl::StatusOr<v1::ListWeightSetsResponse> list = both->ListWeightSets();
  ASSERT_TRUE(list.ok()) << list.status();
  EXPECT_EQ(list->weight_sets_size(), 2);

  // Health and reflection need no token (probes cannot present one).
  absl::StatusOr<grpc::health::v1::HealthCheckResponse::ServingStatus> health = anonymous->CheckHealth("");
  ASSERT_TRUE(health.ok()) << health.status();
  EXPECT_EQ(*health, grpc::health::v1::HealthCheckResponse::SERVING);
  EXPECT_TRUE(anonymous->CheckHealth("fusedlayer.mhc").ok());
  std::string reflection;
  EXPECT_TRUE(ReflectionListServices(anonymous->channel(), &reflection).ok());
  EXPECT_NE(reflection.find("fusedlayer.v1.FusedLayer"), std::string::npos);
  // A wrong token on an open service is ignored rather than refused (the probe path stays simple).
  EXPECT_TRUE(wrong->CheckHealth("").ok());
  still_serving();
}

// A client with a pool of connections (ClientOptions::connections) sets up each member as it did its
// one channel: the TLS credentials with a client certificate, the server-name override and the
// token reach the server on every connection, and a member without the token is refused alike.
TEST_F(SecurityTest, EveryConnectionOfAPoolCarriesTlsTheServerNameAndTheToken) {
  std::mt19937_64 rng = MakeRng(73);
  std::vector<server::PackedWeightSet> initial;
  initial.push_back(MakeWeightSet(rng, "sec/pool", MhcSetSpec{}, std::nullopt));
  auto ts = TestServer::Start(TlsConfig(/*mutual=*/true, /*tokens=*/true), nullptr, std::move(initial));
  ASSERT_NE(ts, nullptr);
  const int port = ts->server().port();
  constexpr int kConnections = 3;
  auto both = Client(port, both_token_, pki_->ca, pki_->client_cert, pki_->client_key, "localhost", kConnections);
  auto anonymous = Client(port, "", pki_->ca, pki_->client_cert, pki_->client_key, "localhost", kConnections);
  ASSERT_TRUE(both && anonymous);
  ASSERT_EQ(both->connections(), kConnections);
  const auto seam = std::make_shared<const v1::MhcSeamRequest>(MakeMhcRequest(rng, "sec/pool", MhcRequestSpec{}));
  // Runs of kConnections calls of one kind: each member serves each kind once.
  for (int i = 0; i < kConnections; ++i) {
    SCOPED_TRACE(i);
    EXPECT_TRUE(both->MhcSeam(*seam).ok());
  }
  for (int i = 0; i < kConnections; ++i) EXPECT_TRUE(both->MhcSeam(seam).ok());
  for (int i = 0; i < kConnections; ++i) EXPECT_TRUE(both->GetServerInfo().ok());
  for (int i = 0; i < kConnections; ++i) {
    server::PackedWeightSet extra = MakeWeightSet(rng, "sec/pool-load", MhcSetSpec{}, std::nullopt);
    extra.first.set_replace(true);
    absl::StatusOr<v1::WeightSetInfo> loaded = both->LoadWeights(extra.first, extra.second);
    EXPECT_TRUE(loaded.ok()) << loaded.status();
  }
  for (int i = 0; i < kConnections; ++i) {
    EXPECT_EQ(anonymous->MhcSeam(seam).status().code(), StatusCode::kUnauthenticated);
    EXPECT_TRUE(anonymous->CheckHealth("").ok());  // health needs no token, on any member
  }
}

TEST_F(SecurityTest, TokensWithoutTlsServeLoopbackThroughLocalCredentials) {
  server::ServerConfig c = TestConfig();  // 127.0.0.1:0
  c.auth_tokens_file = tokens_file_;
  auto ts = TestServer::Start(c);
  ASSERT_NE(ts, nullptr);
  const int port = ts->server().port();
  auto compute = Client(port, compute_token_, "");
  auto anonymous = Client(port, "", "");
  ASSERT_TRUE(compute && anonymous);
  EXPECT_TRUE(compute->GetServerInfo().ok());
  EXPECT_EQ(anonymous->GetServerInfo().status().code(), StatusCode::kUnauthenticated);
  EXPECT_EQ(compute->UnloadWeightSet("nothing").status().code(), StatusCode::kPermissionDenied);
  EXPECT_TRUE(anonymous->CheckHealth("").ok());
  EXPECT_TRUE(compute->ListWeightSets().ok());
}

TEST_F(SecurityTest, StartRefusesTokensInClearTextOnANetworkAddress) {
  server::ServerConfig c = TestConfig();
  c.address = "0.0.0.0:0";
  c.auth_tokens_file = tokens_file_;
  absl::StatusOr<std::unique_ptr<server::FusedLayerServer>> s =
      server::FusedLayerServer::Start(c, CpuBackendFor(c), {});
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.status().message().find("clear text"), std::string::npos) << s.status();
  // With TLS the same address is fine.
  server::ServerConfig t = TlsConfig(false, true);
  t.address = "0.0.0.0:0";
  auto ts = TestServer::Start(t);
  ASSERT_NE(ts, nullptr);
  auto compute = Client(ts->server().port(), compute_token_, pki_->ca);
  ASSERT_NE(compute, nullptr);
  EXPECT_TRUE(compute->GetServerInfo().ok());
}

// TLS or mutual TLS without a token file would let everyone who completes the handshake load and
// unload weight sets: refused at startup unless --allow_unauthenticated_tls accepts it.
TEST_F(SecurityTest, StartRefusesTlsWithoutTokensUnlessAllowed) {
  for (const bool mutual : {false, true}) {
    server::ServerConfig c = TlsConfig(mutual, /*tokens=*/false);
    c.allow_unauthenticated_tls = false;
    const absl::Status s = server::FusedLayerServer::Start(c, CpuBackendFor(c), {}).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << "mutual " << mutual << ": " << s;
    EXPECT_NE(s.message().find("--auth_tokens_file"), std::string::npos) << s;
    EXPECT_NE(s.message().find("--allow_unauthenticated_tls"), std::string::npos) << s;
    // With tokens it starts; accepted explicitly it starts too.
    c.auth_tokens_file = tokens_file_;
    EXPECT_TRUE(server::FusedLayerServer::Start(c, CpuBackendFor(c), {}).ok()) << "mutual " << mutual;
    c.auth_tokens_file.clear();
    c.allow_unauthenticated_tls = true;
    EXPECT_TRUE(server::FusedLayerServer::Start(c, CpuBackendFor(c), {}).ok()) << "mutual " << mutual;
  }
}

TEST_F(SecurityTest, BadTlsFilesFailStartWithTheFlagName) {
  auto start = [](server::ServerConfig c) {
    return server::FusedLayerServer::Start(c, CpuBackendFor(c), {}).status();
  };
  server::ServerConfig c = TlsConfig(false, false);
  c.tls_key = "";
  absl::Status s = start(c);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("--tls_key"), std::string::npos) << s;

  c = TlsConfig(false, false);
  c.tls_key = pki_->client_key;  // a real key, but not the certificate's
  s = start(c);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("does not match"), std::string::npos) << s;

  c = TlsConfig(false, false);
  c.tls_cert = pki_->dir + "/tokens";  // not PEM
  s = start(c);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("--tls_cert"), std::string::npos) << s;

  c = TestConfig();
  c.tls_client_ca = pki_->ca;  // mutual TLS without a server certificate
  s = start(c);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("--tls_client_ca"), std::string::npos) << s;

  c = TlsConfig(true, false);
  c.tls_client_ca = pki_->dir + "/missing.pem";
  s = start(c);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("missing.pem"), std::string::npos) << s;
}

// ---- client-certificate identities (mutual TLS) --------------------------------------------------

// Every FusedLayer method and the right it needs, called with the given client (OK or the code).
struct MethodCodes {
  StatusCode seam, swa, info, list, load, unload;
};

MethodCodes CallEveryMethod(FusedLayerClient& c, std::mt19937_64& rng, const std::string& load_name) {
  MethodCodes m;
  m.seam = c.MhcSeam(MakeMhcRequest(rng, "sec/resident", MhcRequestSpec{})).status().code();
  m.swa = c.SwaNormQuant(MakeSwaRequest(rng, "sec/swa", 2, 256 + 128)).status().code();
  m.info = c.GetServerInfo().status().code();
  m.list = c.ListWeightSets().status().code();
  server::PackedWeightSet extra = MakeWeightSet(rng, load_name, MhcSetSpec{}, std::nullopt);
  m.load = c.LoadWeights(extra.first, extra.second).status().code();
  // Unloads what it just loaded when it could; NOT_FOUND proves the call got past authorization.
  m.unload = c.UnloadWeightSet(load_name).status().code();
  return m;
}

void ExpectCodes(const MethodCodes& got, const MethodCodes& want, const std::string& who) {
  EXPECT_EQ(got.seam, want.seam) << who << ": MhcSeam";
  EXPECT_EQ(got.swa, want.swa) << who << ": SwaNormQuant";
  EXPECT_EQ(got.info, want.info) << who << ": GetServerInfo";
  EXPECT_EQ(got.list, want.list) << who << ": ListWeightSets";
  EXPECT_EQ(got.load, want.load) << who << ": LoadWeights";
  EXPECT_EQ(got.unload, want.unload) << who << ": UnloadWeightSet";
}

constexpr StatusCode kOk = StatusCode::kOk, kDenied = StatusCode::kPermissionDenied,
                     kUnauth = StatusCode::kUnauthenticated;
constexpr MethodCodes kComputeOnly{kOk, kOk, kOk, kOk, kDenied, kDenied};
constexpr MethodCodes kAdminOnly{kDenied, kDenied, kDenied, kDenied, kOk, kOk};
constexpr MethodCodes kEverything{kOk, kOk, kOk, kOk, kOk, kOk};
constexpr MethodCodes kNobody{kUnauth, kUnauth, kUnauth, kUnauth, kUnauth, kUnauth};

std::vector<server::PackedWeightSet> ResidentSets(std::mt19937_64& rng) {
  std::vector<server::PackedWeightSet> sets;
  sets.push_back(MakeWeightSet(rng, "sec/resident", MhcSetSpec{}, std::nullopt));
  sets.push_back(MakeWeightSet(rng, "sec/swa", std::nullopt, SwaSetSpec{}));
  return sets;
}

// Mutual TLS with --auth_identities_file and no token file: each certificate gets the rights of
// its SPIFFE ID or subject; a certificate of the trusted CA listed nowhere gets UNAUTHENTICATED;
// one of another CA does not complete the handshake; a token is refused (the server checks none).
TEST_F(SecurityTest, MutualTlsIdentitiesGrantRightsPerCertificate) {
  std::mt19937_64 rng = MakeRng(71);
  server::ServerConfig c = TlsConfig(/*mutual=*/true, /*tokens=*/false);
  c.allow_unauthenticated_tls = false;  // the identities are the authorization
  c.auth_identities_file = identities_file_;
  auto ts = TestServer::Start(c, nullptr, ResidentSets(rng));
  ASSERT_NE(ts, nullptr);
  const int port = ts->server().port();
  auto by_subject = Client(port, "", pki_->ca, pki_->client_cert, pki_->client_key);
  auto by_spiffe = Client(port, "", pki_->ca, pki_->spiffe_cert, pki_->spiffe_key);
  auto by_two_attribute_subject = Client(port, "", pki_->ca, pki_->ops_cert, pki_->ops_key);
  auto unlisted = Client(port, "", pki_->ca, pki_->unlisted_cert, pki_->unlisted_key);
  auto with_token = Client(port, compute_token_, pki_->ca, pki_->client_cert, pki_->client_key);
  auto rogue = Client(port, "", pki_->ca, pki_->rogue_cert, pki_->rogue_key);
  ASSERT_TRUE(by_subject && by_spiffe && by_two_attribute_subject && unlisted && with_token && rogue);

  ExpectCodes(CallEveryMethod(*by_subject, rng, "sec/a"), kComputeOnly, "subject CN=fusedlayer-test-client");
  ExpectCodes(CallEveryMethod(*by_spiffe, rng, "sec/b"), kAdminOnly, "spiffe://fusedlayer.test/ns/ci/sa/loader");
  ExpectCodes(CallEveryMethod(*by_two_attribute_subject, rng, "sec/c"), kEverything, "subject O=Acme Inc,CN=...");
  ExpectCodes(CallEveryMethod(*unlisted, rng, "sec/d"), kNobody, "an unlisted certificate");
  const absl::Status unlisted_status = unlisted->GetServerInfo().status();
  EXPECT_NE(unlisted_status.message().find("--auth_identities_file"), std::string::npos) << unlisted_status;
  // A token where none is checked: refused, although the certificate alone would have sufficed.
  const absl::Status token_status = with_token->GetServerInfo().status();
  EXPECT_EQ(token_status.code(), kUnauth) << token_status;
  EXPECT_NE(token_status.message().find("no --auth_tokens_file"), std::string::npos) << token_status;
  EXPECT_EQ(rogue->GetServerInfo().status().code(), StatusCode::kUnavailable);
  // Probes need the handshake, not an identity.
  EXPECT_TRUE(unlisted->CheckHealth("").ok());
  EXPECT_TRUE(by_subject->MhcSeam(MakeMhcRequest(rng, "sec/resident", MhcRequestSpec{})).ok());
}

// Identities and tokens together: a call has the union of its certificate's and its token's
// rights; a bad token is refused even with a good certificate.
TEST_F(SecurityTest, MutualTlsIdentitiesCombineWithTokens) {
  std::mt19937_64 rng = MakeRng(72);
  server::ServerConfig c = TlsConfig(/*mutual=*/true, /*tokens=*/true);
  c.auth_identities_file = identities_file_;
  auto ts = TestServer::Start(c, nullptr, ResidentSets(rng));
  ASSERT_NE(ts, nullptr);
  const int port = ts->server().port();
  struct Case {
    std::string who, cert, key, token;
    MethodCodes want;
  };
  const std::vector<Case> cases = {
      {"compute certificate, no token", pki_->client_cert, pki_->client_key, "", kComputeOnly},
      {"compute certificate + admin token", pki_->client_cert, pki_->client_key, admin_token_, kEverything},
      {"admin certificate + compute token", pki_->spiffe_cert, pki_->spiffe_key, compute_token_, kEverything},
      {"unlisted certificate + compute token", pki_->unlisted_cert, pki_->unlisted_key, compute_token_, kComputeOnly},
      {"unlisted certificate + admin token", pki_->unlisted_cert, pki_->unlisted_key, admin_token_, kAdminOnly},
      {"unlisted certificate, no token", pki_->unlisted_cert, pki_->unlisted_key, "", kNobody},
      {"compute certificate + unknown token", pki_->client_cert, pki_->client_key, RandomToken(), kNobody},
  };
  int n = 0;
  for (const Case& k : cases) {
    auto client = Client(port, k.token, pki_->ca, k.cert, k.key);
    ASSERT_NE(client, nullptr) << k.who;
    ExpectCodes(CallEveryMethod(*client, rng, "sec/combined-" + std::to_string(n++)), k.want, k.who);
  }
}

TEST_F(SecurityTest, IdentitiesNeedMutualTls) {
  for (const bool tls : {false, true}) {
    server::ServerConfig c = tls ? TlsConfig(/*mutual=*/false, /*tokens=*/true) : TestConfig();
    c.auth_identities_file = identities_file_;
    const absl::Status s = server::FusedLayerServer::Start(c, CpuBackendFor(c), {}).status();
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s;
    EXPECT_NE(s.message().find("--tls_client_ca"), std::string::npos) << s;
  }
  // A bad identity file names the file and line; mutual TLS alone is refused without it.
  server::ServerConfig c = TlsConfig(/*mutual=*/true, /*tokens=*/false);
  c.allow_unauthenticated_tls = false;
  absl::Status s = server::FusedLayerServer::Start(c, CpuBackendFor(c), {}).status();
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("--auth_identities_file"), std::string::npos) << s;
  const std::string bad = pki_->dir + "/bad-identities";
  WriteFile(bad, "spiffe://fusedlayer.test/x compute\nCN=no-prefix admin\n");
  c.auth_identities_file = bad;
  s = server::FusedLayerServer::Start(c, CpuBackendFor(c), {}).status();
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("bad-identities:2:"), std::string::npos) << s;
}

// ---- the authorization header, as a client or proxy might shape it -------------------------------

// One call of `method` with the given raw `authorization` values (none, one, or several).
grpc::Status CallWithHeaders(v1::FusedLayer::Stub& stub, const std::string& method,
                             const std::vector<std::string>& values, std::mt19937_64& rng) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  for (const std::string& v : values) ctx.AddMetadata("authorization", v);
  if (method == "MhcSeam") {
    v1::MhcSeamResponse r;
    return stub.MhcSeam(&ctx, MakeMhcRequest(rng, "sec/resident", MhcRequestSpec{}), &r);
  }
  if (method == "SwaNormQuant") {
    v1::SwaNormQuantResponse r;
    return stub.SwaNormQuant(&ctx, MakeSwaRequest(rng, "sec/swa", 2, 256 + 128), &r);
  }
  if (method == "GetServerInfo") {
    v1::GetServerInfoResponse r;
    return stub.GetServerInfo(&ctx, {}, &r);
  }
  if (method == "ListWeightSets") {
    v1::ListWeightSetsResponse r;
    return stub.ListWeightSets(&ctx, {}, &r);
  }
  if (method == "UnloadWeightSet") {
    v1::UnloadWeightSetRequest req;
    req.set_name("sec/not-loaded");  // past authorization: NOT_FOUND
    v1::UnloadWeightSetResponse r;
    return stub.UnloadWeightSet(&ctx, req, &r);
  }
  // LoadWeights: the header of a set that fails validation after authorization (no sha256).
  v1::WeightSetInfo info;
  auto writer = stub.LoadWeights(&ctx, &info);
  v1::WeightChunk chunk;
  chunk.mutable_header()->set_name("sec/unchecked");
  chunk.mutable_header()->set_payload_bytes(1);
  writer->Write(chunk);
  writer->WritesDone();
  return writer->Finish();
}

// Bearer tokens over loopback (local credentials) and over TLS: every shape of the header, and
// every token against every method, with exact status codes.
TEST_F(SecurityTest, AuthorizationHeaderShapesAndRightsPerMethod) {
  std::mt19937_64 rng = MakeRng(73);
  for (const bool tls : {false, true}) {
    SCOPED_TRACE(tls ? "TLS" : "loopback, local credentials");
    server::ServerConfig c = tls ? TlsConfig(/*mutual=*/false, /*tokens=*/true) : TestConfig();
    c.auth_tokens_file = tokens_file_;
    auto ts = TestServer::Start(c, nullptr, ResidentSets(rng));
    ASSERT_NE(ts, nullptr);
    std::shared_ptr<grpc::Channel> channel;
    if (tls) {
      std::ifstream in(pki_->ca);
      std::stringstream ca;
      ca << in.rdbuf();
      grpc::SslCredentialsOptions o;
      o.pem_root_certs = ca.str();
      channel = grpc::CreateChannel("127.0.0.1:" + std::to_string(ts->server().port()), grpc::SslCredentials(o));
    } else {
      channel = MakeChannel(ts->server().port());
    }
    auto stub = v1::FusedLayer::NewStub(channel);
    auto code = [&](const std::string& method, const std::vector<std::string>& values) {
      const grpc::Status s = CallWithHeaders(*stub, method, values, rng);
      return std::make_pair(s.error_code(), s.error_message());
    };
    const std::string bearer_compute = "Bearer " + compute_token_;

    // The header's shape, on a compute method with a token that has the right.
    struct Shape {
      std::string what;
      std::vector<std::string> values;
      grpc::StatusCode want;
      std::string message;  // in the error
    };
    const std::vector<Shape> shapes = {
        {"no header", {}, grpc::StatusCode::UNAUTHENTICATED, "missing credentials"},
        {"empty header", {""}, grpc::StatusCode::UNAUTHENTICATED, "not `Bearer <token>`"},
        {"Basic scheme", {"Basic dXNlcjpwYXNzd29yZA=="}, grpc::StatusCode::UNAUTHENTICATED, "not `Bearer <token>`"},
        {"scheme without a token", {"Bearer"}, grpc::StatusCode::UNAUTHENTICATED, "not `Bearer <token>`"},
        {"the token without a scheme", {compute_token_}, grpc::StatusCode::UNAUTHENTICATED, "not `Bearer <token>`"},
        {"two spaces after Bearer", {"Bearer  " + compute_token_}, grpc::StatusCode::UNAUTHENTICATED,
         "invalid bearer token"},
        // (A tab cannot be sent: gRPC's client refuses it as a header value.)
        {"lowercase scheme", {"bearer " + compute_token_}, grpc::StatusCode::OK, ""},
        {"uppercase scheme", {"BEARER " + compute_token_}, grpc::StatusCode::OK, ""},
        {"two identical headers", {bearer_compute, bearer_compute}, grpc::StatusCode::UNAUTHENTICATED,
         "2 authorization headers"},
        {"a good and a bad header", {bearer_compute, "Bearer " + RandomToken()}, grpc::StatusCode::UNAUTHENTICATED,
         "2 authorization headers"},
        {"a bad and a good header", {"Basic x", bearer_compute}, grpc::StatusCode::UNAUTHENTICATED,
         "2 authorization headers"},
        {"an admin and a compute token", {"Bearer " + admin_token_, bearer_compute},
         grpc::StatusCode::UNAUTHENTICATED, "2 authorization headers"},
        {"an unknown token", {"Bearer " + RandomToken()}, grpc::StatusCode::UNAUTHENTICATED, "invalid bearer token"},
        {"the token with a suffix", {bearer_compute + "x"}, grpc::StatusCode::UNAUTHENTICATED, "invalid bearer token"},
        {"a prefix of the token", {bearer_compute.substr(0, bearer_compute.size() - 1)},
         grpc::StatusCode::UNAUTHENTICATED, "invalid bearer token"},
    };
    for (const Shape& sh : shapes) {
      const auto [got, message] = code("GetServerInfo", sh.values);
      EXPECT_EQ(got, sh.want) << sh.what << ": " << message;
      EXPECT_NE(message.find(sh.message), std::string::npos) << sh.what << ": " << message;
      EXPECT_EQ(message.find(compute_token_), std::string::npos) << sh.what << ": the token is in the error";
    }

    // Each token against each method: the right it lacks is PERMISSION_DENIED, the right it has
    // gets past authorization (OK, or the method's own error for the deliberately bad requests).
    const std::vector<std::string> compute_methods = {"MhcSeam", "SwaNormQuant", "GetServerInfo", "ListWeightSets"};
    const std::vector<std::pair<std::string, grpc::StatusCode>> admin_methods = {
        {"LoadWeights", grpc::StatusCode::INVALID_ARGUMENT},  // no sha256
        {"UnloadWeightSet", grpc::StatusCode::NOT_FOUND}};
    for (const auto& [token, name] : std::vector<std::pair<std::string, std::string>>{
             {compute_token_, "compute"}, {admin_token_, "admin"}, {both_token_, "compute,admin"}}) {
      const bool compute = name != "admin", admin = name != "compute";
      for (const std::string& m : compute_methods) {
        const auto [got, message] = code(m, {"Bearer " + token});
        EXPECT_EQ(got, compute ? grpc::StatusCode::OK : grpc::StatusCode::PERMISSION_DENIED)
            << name << " token, " << m << ": " << message;
      }
      for (const auto& [m, past_auth] : admin_methods) {
        const auto [got, message] = code(m, {"Bearer " + token});
        EXPECT_EQ(got, admin ? past_auth : grpc::StatusCode::PERMISSION_DENIED)
            << name << " token, " << m << ": " << message;
        if (!admin) EXPECT_NE(message.find("do not include admin"), std::string::npos) << message;
      }
    }
    // No header on the admin methods: UNAUTHENTICATED (not PERMISSION_DENIED).
    for (const auto& [m, unused] : admin_methods) {
      EXPECT_EQ(code(m, {}).first, grpc::StatusCode::UNAUTHENTICATED) << m;
    }
    // Health stays open whatever the header says.
    int serving = 0;
    EXPECT_TRUE(HealthCheck(channel, "", &serving).ok());
    EXPECT_EQ(serving, 1);
  }
}

// ---- the binary ---------------------------------------------------------------------------------

TEST_F(SecurityTest, BinaryExitsOneOnABadTokenFileWithoutPrintingTokens) {
  const std::string secret = RandomToken();
  struct Case {
    std::string contents;
    std::string expected;  // in the error line
  };
  const std::vector<Case> cases = {
      {"# ok\n" + secret + " compute\nshorttoken admin\n", "tokens:3: token has 10 characters"},
      {secret + " root\n", "tokens:1: unknown right 'root'"},
      {secret + " compute,compute\n", "tokens:1: right 'compute' listed twice"},
      {secret + "\n", "tokens:1: expected `<token> <rights>`"},
      {secret + " compute\n" + secret + " admin\n", "tokens:2: token already listed"},
      {secret.substr(0, 20) + "\"quoted\" compute\n", "characters outside"},
      {"# nothing but comments\n\n", "no tokens"},
  };
  const std::string path = pki_->dir + "/bad-tokens";
  for (const Case& k : cases) {
    WriteFile(path, k.contents);
    ServerProcess p(FUSEDLAYER_SERVER_BINARY, {"--backend=cpu", "--address=127.0.0.1:0", "--metrics_address=",
                                               "--auth_tokens_file=" + path});
    const std::string log = p.ReadAll();
    EXPECT_EQ(p.Wait(), 1) << log;
    EXPECT_NE(log.find("--auth_tokens_file"), std::string::npos) << log;
    EXPECT_NE(log.find(k.expected), std::string::npos) << "want '" << k.expected << "' in: " << log;
    EXPECT_EQ(log.find(secret.substr(0, 16)), std::string::npos) << "a token reached the log: " << log;
  }
  ServerProcess missing(FUSEDLAYER_SERVER_BINARY, {"--backend=cpu", "--address=127.0.0.1:0", "--metrics_address=",
                                                   "--auth_tokens_file=" + pki_->dir + "/no-such-file"});
  const std::string log = missing.ReadAll();
  EXPECT_EQ(missing.Wait(), 1) << log;
  EXPECT_NE(log.find("no-such-file: cannot open"), std::string::npos) << log;
}

TEST_F(SecurityTest, BinaryRefusesTokensWithoutTlsOnANetworkAddress) {
  ServerProcess p(FUSEDLAYER_SERVER_BINARY, {"--backend=cpu", "--address=0.0.0.0:0", "--metrics_address=",
                                             "--auth_tokens_file=" + tokens_file_});
  const std::string log = p.ReadAll();
  EXPECT_EQ(p.Wait(), 1) << log;
  EXPECT_NE(log.find("would send bearer tokens in clear text on --address=0.0.0.0:0"), std::string::npos) << log;
}

TEST_F(SecurityTest, BinaryWarnsOnceWhenPlaintextAndOpen) {
  ServerProcess p(FUSEDLAYER_SERVER_BINARY,
                  {"--backend=cpu", "--cpu_threads=1", "--address=127.0.0.1:0", "--metrics_address=127.0.0.1:0"});
  const std::string warning = p.ReadUntil(std::regex("transport security"));
  ASSERT_FALSE(warning.empty()) << p.log();
  EXPECT_EQ(warning.rfind("W ", 0), 0u) << warning;  // a WARNING line
  EXPECT_NE(warning.find("plaintext, no tokens"), std::string::npos) << warning;
  ASSERT_EQ(kill(p.pid(), SIGTERM), 0);
  const std::string log = p.ReadAll();
  EXPECT_EQ(p.Wait(), 0) << log;
  size_t count = 0;
  for (size_t at = log.find("transport security"); at != std::string::npos; at = log.find("transport security", at + 1)) {
    ++count;
  }
  EXPECT_EQ(count, 1u) << log;
}

// A token file other local users can read: one WARNING at startup naming the flag; chmod 600: none.
TEST_F(SecurityTest, BinaryWarnsWhenTheTokenFileIsReadableByOthers) {
  const std::string path = pki_->dir + "/tokens-perm";
  WriteFile(path, "# test\n" + compute_token_ + " compute\n");
  for (const mode_t mode : {mode_t{0644}, mode_t{0600}}) {
    ASSERT_EQ(chmod(path.c_str(), mode), 0);
    ServerProcess p(FUSEDLAYER_SERVER_BINARY, {"--backend=cpu", "--cpu_threads=1", "--address=127.0.0.1:0",
                                               "--metrics_address=127.0.0.1:0", "--auth_tokens_file=" + path});
    ASSERT_FALSE(p.ReadUntil(std::regex("serving fusedlayer")).empty()) << p.log();
    ASSERT_EQ(kill(p.pid(), SIGTERM), 0);
    const std::string log = p.ReadAll();
    EXPECT_EQ(p.Wait(), 0) << log;
    const bool warned = log.find("--auth_tokens_file=" + path + " is readable by group or others") != std::string::npos;
    EXPECT_EQ(warned, mode == 0644) << "mode " << std::oct << mode << ": " << log;
    EXPECT_EQ(log.find(compute_token_), std::string::npos) << "a token reached the log";
  }
}

TEST_F(SecurityTest, BinaryBindsMetricsToLoopbackWhenAuthIsOnByDefault) {
  // No --metrics_address: the default 0.0.0.0:9464 becomes 127.0.0.1:9464. Port 9464 may be taken
  // on a shared machine, so the assertion is on the decision line, logged before the bind.
  ServerProcess p(FUSEDLAYER_SERVER_BINARY, {"--backend=cpu", "--cpu_threads=1", "--address=127.0.0.1:0",
                                             "--auth_tokens_file=" + tokens_file_});
  const std::string line = p.ReadUntil(std::regex("metrics bind"));
  EXPECT_NE(line.find("metrics bind 127.0.0.1:9464"), std::string::npos) << p.log();
  // An explicit --metrics_address is kept as given.
  ServerProcess q(FUSEDLAYER_SERVER_BINARY, {"--backend=cpu", "--cpu_threads=1", "--address=127.0.0.1:0",
                                             "--metrics_address=127.0.0.1:0", "--auth_tokens_file=" + tokens_file_});
  const std::string metrics = q.ReadUntil(std::regex("metrics on http://"));
  EXPECT_NE(metrics.find("metrics on http://127.0.0.1:0/metrics"), std::string::npos) << q.log();
  EXPECT_EQ(q.log().find("metrics bind"), std::string::npos) << q.log();
}

// ---- fusedctl -----------------------------------------------------------------------------------

TEST_F(SecurityTest, FusedctlSpeaksTlsAndTokens) {
  auto ts = TestServer::Start(TlsConfig(/*mutual=*/true, /*tokens=*/true));
  ASSERT_NE(ts, nullptr);
  const std::string target = "--target=127.0.0.1:" + std::to_string(ts->server().port());
  const std::string token_file = pki_->dir + "/fusedctl-token";
  WriteFile(token_file, compute_token_ + "\n");
  const std::vector<std::string> tls = {"--tls_ca=" + pki_->ca, "--tls_cert=" + pki_->client_cert,
                                        "--tls_key=" + pki_->client_key, "--tls_server_name=localhost"};
  auto run = [&](std::vector<std::string> env, std::vector<std::string> args, std::string* out) {
    // /usr/bin/env sets the variables for the child only (setenv here would race gRPC's threads).
    std::vector<std::string> argv = std::move(env);
    argv.push_back(FUSEDCTL_BINARY);
    argv.push_back(target);
    argv.insert(argv.end(), tls.begin(), tls.end());
    argv.insert(argv.end(), args.begin(), args.end());
    ServerProcess p("/usr/bin/env", argv);
    *out = p.ReadAll();
    return p.Wait();
  };
  std::string out;
  // Health over TLS, no token needed.
  EXPECT_EQ(run({}, {"health"}, &out), 0) << out;
  EXPECT_NE(out.find("SERVING"), std::string::npos) << out;
  // Token from a file, and from FUSEDCTL_TOKEN.
  EXPECT_EQ(run({}, {"--token_file=" + token_file, "info"}, &out), 0) << out;
  EXPECT_EQ(run({"FUSEDCTL_TOKEN=" + compute_token_}, {"list"}, &out), 0) << out;
  // Without a token, and with the compute token on an admin command.
  EXPECT_EQ(run({}, {"info"}, &out), 1) << out;
  EXPECT_NE(out.find("fusedctl: error: UNAUTHENTICATED"), std::string::npos) << out;
  EXPECT_EQ(run({"FUSEDCTL_TOKEN=" + compute_token_}, {"unload", "sec/none"}, &out), 1) << out;
  EXPECT_NE(out.find("fusedctl: error: PERMISSION_DENIED"), std::string::npos) << out;
  EXPECT_EQ(out.find(compute_token_), std::string::npos) << out;
}

// ---- units: token file, method rights, addresses -----------------------------------------------

TEST(TokenFile, ParsesRightsCommentsAndCrlf) {
  const std::string a(16, 'a'), b = "B-._~+/0123456789xyz==", c(40, 'c');
  absl::StatusOr<std::vector<auth::TokenEntry>> t =
      auth::ParseTokenFile("  # comment\r\n" + a + " compute\r\n\n\t" + b + "\tadmin\n" + c + " admin,compute", "f");
  ASSERT_TRUE(t.ok()) << t.status();
  ASSERT_EQ(t->size(), 3u);
  EXPECT_EQ((*t)[0].rights, auth::kRightCompute);
  EXPECT_EQ((*t)[1].rights, auth::kRightAdmin);
  EXPECT_EQ((*t)[2].rights, auth::kRightCompute | auth::kRightAdmin);
  EXPECT_EQ((*t)[1].digest, auth::DigestToken(b));

  auth::TokenAuthProcessor p(*t);
  EXPECT_EQ(p.RightsOf(a), auth::kRightCompute);
  EXPECT_EQ(p.RightsOf(c), auth::kRightCompute | auth::kRightAdmin);
  EXPECT_EQ(p.RightsOf(a + "x"), auth::kRightNone);
  EXPECT_EQ(p.RightsOf(a.substr(1)), auth::kRightNone);
  EXPECT_EQ(p.RightsOf(""), auth::kRightNone);
}

TEST(TokenFile, RejectsMalformedLinesWithoutQuotingTheToken) {
  const std::string tok = "s3cr3t-t0ken-abcdefgh";
  for (const std::string& bad :
       {tok + " compute admin", tok + " Compute", tok + " compute,", tok + " ,admin", tok + " compute;admin",
        std::string(15, 'x') + " compute", std::string(513, 'x') + " compute", "=" + tok + " compute",
        tok + "=x compute", tok + "\x01 compute", std::string("")}) {
    absl::StatusOr<std::vector<auth::TokenEntry>> t = auth::ParseTokenFile(bad, "tokens.txt");
    ASSERT_FALSE(t.ok()) << bad;
    EXPECT_EQ(t.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(t.status().message().find("tokens.txt"), std::string::npos) << t.status();
    EXPECT_EQ(t.status().message().find(tok), std::string::npos) << t.status();
  }
}

TEST(ClientToken, ReadBearerTokenFileTakesOneTokenAndNothingElse) {
  char tmpl[] = "/tmp/fusedctl-token-XXXXXX";
  const int fd = mkstemp(tmpl);
  ASSERT_GE(fd, 0);
  close(fd);
  const std::string path = tmpl;
  const std::string token = RandomToken();
  WriteFile(path, "  " + token + "\r\n");
  absl::StatusOr<std::string> t = client::ReadBearerTokenFile(path);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(*t, token);
  for (const std::string& bad : {std::string("\n \n"), token + " " + token, token + "\n# comment\n"}) {
    WriteFile(path, bad);
    t = client::ReadBearerTokenFile(path);
    ASSERT_FALSE(t.ok()) << bad;
    EXPECT_EQ(t.status().code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(t.status().message().find(token), std::string::npos) << t.status();
  }
  unlink(path.c_str());
  EXPECT_EQ(client::ReadBearerTokenFile(path).status().code(), StatusCode::kInvalidArgument);
  // The client refuses a token that cannot travel as a header value.
  ClientOptions o;
  o.bearer_token = token + "\n";
  EXPECT_EQ(FusedLayerClient::Connect("127.0.0.1:1", o).status().code(), StatusCode::kInvalidArgument);
}

TEST(IdentityFile, ParsesSpiffeIdsSubjectsRightsCommentsAndCrlf) {
  absl::StatusOr<std::vector<auth::IdentityEntry>> e = auth::ParseIdentityFile(
      "# comment\r\n\r\n  spiffe://td.example/ns/a/sa/b   compute\r\n"
      "subject:CN=loader,O=Acme Inc\tadmin,compute\n",
      "ids");
  ASSERT_TRUE(e.ok()) << e.status();
  ASSERT_EQ(e->size(), 2u);
  EXPECT_EQ((*e)[0].kind, auth::IdentityEntry::Kind::kSpiffeId);
  EXPECT_EQ((*e)[0].value, "spiffe://td.example/ns/a/sa/b");
  EXPECT_EQ((*e)[0].rights, auth::kRightCompute);
  EXPECT_EQ((*e)[1].kind, auth::IdentityEntry::Kind::kSubject);
  EXPECT_EQ((*e)[1].value, "CN=loader,O=Acme Inc");
  EXPECT_EQ((*e)[1].rights, auth::kRightCompute | auth::kRightAdmin);
}

TEST(IdentityFile, RejectsMalformedLinesNamingTheLine) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"spiffe://td/x\n", "ids:1: expected `<identity> <rights>`"},
      {"spiffe://td/x root\n", "ids:1: unknown right 'root'"},
      {"# c\nCN=x compute\n", "ids:2: an identity starts with spiffe://"},
      {"spiffe:// compute\n", "ids:1: a SPIFFE ID is"},
      {"spiffe:///path compute\n", "ids:1: a SPIFFE ID is"},
      {"spiffe://td/a b compute\n", "ids:1: a SPIFFE ID is"},
      {"subject: compute\n", "ids:1: subject:<distinguished name>"},
      {"subject:noequals compute\n", "ids:1: subject:<distinguished name>"},
      {"subject:CN=a\x01 compute\n", "ids:1: identity has characters outside printable ASCII"},
      {"spiffe://td/x compute\nspiffe://td/x admin\n", "ids:2: identity already listed"},
      {"subject:CN=" + std::string(3000, 'a') + " compute\n", "ids:1: identity has 3011 characters"},
      {"# nothing\n", "ids: no identities"},
  };
  for (const auto& [contents, expected] : cases) {
    absl::StatusOr<std::vector<auth::IdentityEntry>> e = auth::ParseIdentityFile(contents, "ids");
    ASSERT_FALSE(e.ok()) << expected;
    EXPECT_EQ(e.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(e.status().message().find(expected), std::string::npos) << e.status() << " / want " << expected;
  }
  // The same identity as a SPIFFE ID and as a subject are different identities.
  EXPECT_TRUE(auth::ParseIdentityFile("spiffe://td/x compute\nsubject:CN=spiffe://td/x admin\n", "ids").ok());
}

TEST(TokenAuth, MethodRights) {
  uint8_t r = 0xff;
  for (const char* m : {"MhcSeam", "SwaNormQuant", "GetServerInfo", "ListWeightSets", "RegisterSystemSharedMemory",
                        "SystemSharedMemoryStatus", "UnregisterSystemSharedMemory", "OpenResidualSession",
                        "ListResidualSessions", "CloseResidualSession"}) {
    ASSERT_TRUE(auth::RightForMethod(std::string("/fusedlayer.v1.FusedLayer/") + m, &r)) << m;
    EXPECT_EQ(r, auth::kRightCompute) << m;
  }
  for (const char* m : {"LoadWeights", "CommitWeightSets", "UnloadWeightSet"}) {
    ASSERT_TRUE(auth::RightForMethod(std::string("/fusedlayer.v1.FusedLayer/") + m, &r)) << m;
    EXPECT_EQ(r, auth::kRightAdmin) << m;
  }
  for (const char* open : {"/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch",
                           "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"}) {
    r = 0xff;
    ASSERT_TRUE(auth::RightForMethod(open, &r)) << open;
    EXPECT_EQ(r, auth::kRightNone) << open;
  }
  EXPECT_FALSE(auth::RightForMethod("/fusedlayer.v1.FusedLayer/Shutdown", &r));
  EXPECT_FALSE(auth::RightForMethod("/other.Service/MhcSeam", &r));
  EXPECT_FALSE(auth::RightForMethod("", &r));
}

TEST(TransportSecurity, LocalOnlyAddresses) {
  for (const char* a : {"127.0.0.1:50051", "127.1.2.3:0", "localhost:50051", "[::1]:50051", "unix:/tmp/fl.sock"}) {
    EXPECT_TRUE(auth::IsLocalOnlyAddress(a)) << a;
  }
  for (const char* a : {"0.0.0.0:50051", "[::]:50051", "10.0.0.7:50051", "128.0.0.1:1", "127.0.0:1",
                        "127.0.0.256:1", "myhost:50051", "localhost.example.com:1", "[::1:50051"}) {
    EXPECT_FALSE(auth::IsLocalOnlyAddress(a)) << a;
  }
}

}  // namespace
}  // namespace fusedlayer::testing
