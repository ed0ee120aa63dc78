// A manifest loads all of its sets or none, through both doors: `fusedctl load MANIFEST [--replace]`
// against a running fusedlayer_server (staged uploads + CommitWeightSets), and
// fusedlayer_server --weights_manifest at startup. A set that cannot be read (a tensor missing from
// its file, a truncated shard) or that the server refuses leaves every set as it was, the sets
// before it in the manifest included; the error carries its gRPC code.
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <regex>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "server_process.h"
#include "server_test_env.h"
#include "test_util.h"
#include "weights/export.h"

#ifndef FUSEDLAYER_SERVER_BINARY
#error "FUSEDLAYER_SERVER_BINARY must point at the fusedlayer_server executable"
#endif
#ifndef FUSEDCTL_BINARY
#error "FUSEDCTL_BINARY must point at the fusedctl executable"
#endif

namespace fusedlayer::testing {
namespace {

namespace stdfs = std::filesystem;

class ManifestDir {
 public:
  ManifestDir() {
    std::string tmpl = (stdfs::temp_directory_path() / "fusedlayer_manifest_XXXXXX").string();
    EXPECT_NE(::mkdtemp(tmpl.data()), nullptr);
    path_ = tmpl;
  }
  ~ManifestDir() {
    std::error_code ec;
    stdfs::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

std::string ReadText(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}
void WriteText(const std::string& path, const std::string& text) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f << text;
}

// Three small sets "m/a", "m/b", "m/c" (random values: each call gives other payloads, so other
// sha256s) exported with a manifest into `dir`; returns the manifest path.
std::string ExportVersion(std::mt19937_64& rng, const ManifestDir& dir, const std::vector<std::string>& names) {
  std::vector<server::PackedWeightSet> sets;
  for (const std::string& name : names) sets.push_back(MakeWeightSet(rng, name, MhcSetSpec{}, SwaSetSpec{}));
  absl::StatusOr<std::string> manifest = server::ExportWeightSets(dir.path(), sets);
  EXPECT_TRUE(manifest.ok()) << manifest.status();
  return manifest.ok() ? *manifest : std::string();
}

// name -> sha256 of the loaded sets.
std::map<std::string, std::string> Loaded(int port) {
  auto stub = v1::FusedLayer::NewStub(MakeChannel(port));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  v1::ListWeightSetsResponse list;
  const grpc::Status s = stub->ListWeightSets(&ctx, {}, &list);
  EXPECT_TRUE(s.ok()) << s.error_message();
  std::map<std::string, std::string> out;
  for (const v1::WeightSetInfo& ws : list.weight_sets()) out[ws.name()] = ws.sha256();
  return out;
}

// A running server started with --weights_manifest=`manifest`; port() its gRPC port.
class RunningServer {
 public:
  explicit RunningServer(const std::string& manifest)
      : p_(FUSEDLAYER_SERVER_BINARY, {"--backend=cpu", "--cpu_threads=2", "--address=127.0.0.1:0", "--metrics_address=",
                                      "--weights_manifest=" + manifest}) {
    const std::string serving = p_.ReadUntil(std::regex("serving fusedlayer\\.v1\\.FusedLayer .*\\(port ([0-9]+)\\)"));
    std::smatch match;
    if (std::regex_search(serving, match, std::regex("\\(port ([0-9]+)\\)"))) port_ = std::stoi(match[1]);
  }
  ~RunningServer() {
    if (port_ > 0) kill(p_.pid(), SIGTERM);
  }
  int port() const { return port_; }
  std::string log() const { return p_.log(); }

 private:
  ServerProcess p_;
  int port_ = 0;
};

int Fusedctl(int port, std::vector<std::string> args, std::string* out) {
  args.insert(args.begin(), "--target=127.0.0.1:" + std::to_string(port));
  return RunToEnd(FUSEDCTL_BINARY, args, out);
}

// The manifest's entry "m/b" names a tensor its file does not have.
void DropTensorOfSecondSet(const std::string& manifest) {
  std::string json = ReadText(manifest);
  const std::string from = "\"tensor\": \"mhc.base\"";
  // The second occurrence: m/b's (the export writes the sets in order).
  size_t at = json.find(from);
  ASSERT_NE(at, std::string::npos) << json;
  at = json.find(from, at + 1);
  ASSERT_NE(at, std::string::npos) << json;
  json.replace(at, from.size(), "\"tensor\": \"mhc.base_missing\"");
  WriteText(manifest, json);
}

// m/b's shard loses its last bytes.
void TruncateSecondShard(const ManifestDir& dir) {
  const std::string shard = (stdfs::path(dir.path()) / "m_b.safetensors").string();
  ASSERT_TRUE(stdfs::exists(shard)) << shard;
  stdfs::resize_file(shard, stdfs::file_size(shard) - 100);
}

TEST(ManifestLoad, FusedctlLoadReplacesAllSetsOrNone) {
  std::mt19937_64 rng = MakeRng();
  const std::vector<std::string> names = {"m/a", "m/b", "m/c"};
  ManifestDir v1_dir, v2_dir, missing_dir, truncated_dir;
  const std::string v1 = ExportVersion(rng, v1_dir, names);
  const std::string v2 = ExportVersion(rng, v2_dir, names);
  const std::string missing = ExportVersion(rng, missing_dir, names);
  const std::string truncated = ExportVersion(rng, truncated_dir, names);
  DropTensorOfSecondSet(missing);
  TruncateSecondShard(truncated_dir);

  RunningServer server(v1);
  ASSERT_GT(server.port(), 0) << server.log();
  const std::map<std::string, std::string> before = Loaded(server.port());
  ASSERT_EQ(before.size(), 3u);

  std::string out;
  // Set 2 of 3 names a tensor its file lacks: NOT_FOUND, and m/a (uploaded before it) is not replaced.
  EXPECT_EQ(Fusedctl(server.port(), {"load", missing, "--replace"}, &out), 1) << out;
  EXPECT_NE(out.find("fusedctl: error: NOT_FOUND: "), std::string::npos) << out;
  EXPECT_NE(out.find("mhc.base_missing"), std::string::npos) << out;
  EXPECT_EQ(Loaded(server.port()), before) << out;

  // Set 2's shard is truncated: DATA_LOSS, nothing replaced.
  EXPECT_EQ(Fusedctl(server.port(), {"load", truncated, "--replace"}, &out), 1) << out;
  EXPECT_NE(out.find("fusedctl: error: DATA_LOSS: "), std::string::npos) << out;
  EXPECT_EQ(Loaded(server.port()), before) << out;

  // Refused by the server after other sets were staged: "n/x" and "n/y" are new, "m/c" is loaded
  // and the load does not replace. ALREADY_EXISTS, and neither new set becomes visible.
  ManifestDir mixed_dir;
  const std::string mixed = ExportVersion(rng, mixed_dir, {"n/x", "n/y", "m/c"});
  EXPECT_EQ(Fusedctl(server.port(), {"load", mixed}, &out), 1) << out;
  EXPECT_NE(out.find("fusedctl: error: ALREADY_EXISTS: "), std::string::npos) << out;
  EXPECT_NE(out.find("m/c"), std::string::npos) << out;
  EXPECT_EQ(Loaded(server.port()), before) << out;

  // A sound manifest replaces every set.
  ASSERT_EQ(Fusedctl(server.port(), {"load", v2, "--replace"}, &out), 0) << out;
  const std::map<std::string, std::string> after = Loaded(server.port());
  ASSERT_EQ(after.size(), 3u) << out;
  for (const std::string& name : names) EXPECT_NE(after.at(name), before.at(name)) << name << " not replaced";
}

// The staging RPCs themselves: staged sets are invisible until the commit, a discard drops them, a
// stage commits once, and a commit refused for one set publishes none.
TEST(ManifestLoad, StagedSetsAreInvisibleUntilCommitted) {
  std::mt19937_64 rng = MakeRng();
  ManifestDir dir;
  const std::string manifest = ExportVersion(rng, dir, {"m/a"});
  RunningServer server(manifest);
  ASSERT_GT(server.port(), 0) << server.log();
  auto stub = v1::FusedLayer::NewStub(MakeChannel(server.port()));
  auto stage_set = [&](const std::string& name, const std::string& stage, bool replace) {
    server::PackedWeightSet set = MakeWeightSet(rng, name, MhcSetSpec{}, std::nullopt);
    set.first.set_stage(stage);
    v1::WeightSetInfo info;
    return LoadWeights(*stub, set, &info, 1 << 16, replace);
  };
  auto commit = [&](const std::string& stage, bool discard, v1::CommitWeightSetsResponse* response) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    v1::CommitWeightSetsRequest request;
    request.set_stage(stage);
    request.set_discard(discard);
    return stub->CommitWeightSets(&ctx, request, response);
  };
  const std::map<std::string, std::string> before = Loaded(server.port());

  ASSERT_TRUE(stage_set("s/x", "stage-1", false).ok());
  ASSERT_TRUE(stage_set("m/a", "stage-1", true).ok());
  EXPECT_EQ(stage_set("s/x", "stage-1", false).error_code(), grpc::StatusCode::ALREADY_EXISTS);
  EXPECT_EQ(Loaded(server.port()), before) << "a staged set is visible before its commit";
  v1::CommitWeightSetsResponse response;
  ASSERT_TRUE(commit("stage-1", false, &response).ok());
  ASSERT_EQ(response.weight_sets_size(), 2);
  EXPECT_EQ(response.weight_sets(0).name(), "m/a");
  EXPECT_EQ(response.weight_sets(1).name(), "s/x");
  std::map<std::string, std::string> now = Loaded(server.port());
  EXPECT_EQ(now.size(), 2u);
  EXPECT_NE(now.at("m/a"), before.at("m/a"));
  EXPECT_EQ(now.at("m/a"), response.weight_sets(0).sha256());
  // Consumed: a second commit of the same stage finds nothing.
  EXPECT_EQ(commit("stage-1", false, &response).error_code(), grpc::StatusCode::NOT_FOUND);

  // Discarded: nothing published.
  ASSERT_TRUE(stage_set("s/y", "stage-2", false).ok());
  ASSERT_TRUE(commit("stage-2", true, &response).ok());
  EXPECT_EQ(response.weight_sets_size(), 0);
  EXPECT_EQ(Loaded(server.port()), now);

  // A staged copy of a loaded name without replace is refused at its upload already.
  EXPECT_EQ(stage_set("m/a", "stage-3", false).error_code(), grpc::StatusCode::ALREADY_EXISTS);
  // "s/late" is loaded directly between its staging and the commit, which then publishes nothing:
  // ALREADY_EXISTS naming it, and "s/z", staged before it, stays invisible.
  ASSERT_TRUE(stage_set("s/z", "stage-3", false).ok());
  ASSERT_TRUE(stage_set("s/late", "stage-3", false).ok());
  ASSERT_TRUE(stage_set("s/late", "", false).ok());
  now = Loaded(server.port());
  ASSERT_EQ(now.count("s/late"), 1u);
  const grpc::Status refused = commit("stage-3", false, &response);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::ALREADY_EXISTS) << refused.error_message();
  EXPECT_NE(refused.error_message().find("s/late"), std::string::npos) << refused.error_message();
  EXPECT_EQ(Loaded(server.port()), now);
  EXPECT_EQ(now.count("s/z"), 0u);
}

// --weights_manifest at startup: a manifest whose second set cannot be read stops the server before
// it serves, with one line naming the manifest, the set, the tensor and the code, and no set loaded.
TEST(ManifestLoad, StartupManifestIsAllOrNothing) {
  std::mt19937_64 rng = MakeRng();
  for (const bool truncate : {false, true}) {
    SCOPED_TRACE(truncate ? "truncated shard" : "missing tensor");
    ManifestDir dir;
    const std::string manifest = ExportVersion(rng, dir, {"m/a", "m/b", "m/c"});
    if (truncate) {
      TruncateSecondShard(dir);
    } else {
      DropTensorOfSecondSet(manifest);
    }
    ServerProcess p(FUSEDLAYER_SERVER_BINARY, {"--backend=cpu", "--cpu_threads=2", "--address=127.0.0.1:0",
                                               "--metrics_address=", "--weights_manifest=" + manifest});
    const std::string log = p.ReadAll();
    EXPECT_EQ(p.Wait(), 1) << log;
    EXPECT_NE(log.find("--weights_manifest=" + manifest), std::string::npos) << log;
    EXPECT_NE(log.find(truncate ? "DATA_LOSS" : "NOT_FOUND"), std::string::npos) << log;
    // The bad set (missing tensor) or the bad shard (truncated) is named.
    EXPECT_NE(log.find(truncate ? "m_b.safetensors" : "mhc.base_missing"), std::string::npos) << log;
    // m/a, read before the bad set, was never loaded, and the server never listened.
    EXPECT_EQ(log.find("loaded weight set"), std::string::npos) << log;
    EXPECT_EQ(log.find("serving fusedlayer.v1.FusedLayer"), std::string::npos) << log;
  }
}

}  // namespace
}  // namespace fusedlayer::testing
