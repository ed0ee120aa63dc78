// Hardening of the server's edges: its --help, requests (and LoadWeights chunks) whose bytes do not
// parse, the memory limit its defaults are derived from, the descriptors that shared-memory regions
// hold open, and a listener that accepts again after the process ran out of descriptors.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <random>
#include <regex>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/byte_budget.h"
#include "gmock/gmock.h"
#include "google/protobuf/descriptor.h"
#include "grpcpp/generic/generic_stub.h"
#include "gtest/gtest.h"
#include "server_process.h"
#include "server_test_env.h"

#ifndef FUSEDLAYER_SERVER_BINARY
#error "FUSEDLAYER_SERVER_BINARY must point at the fusedlayer_server executable"
#endif

namespace fusedlayer::testing {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

// ---- --help ------------------------------------------------------------------------------------

TEST(ServerHelp, ListsTheServersFlagsByPurposeAndExitsZero) {
  std::string out;
  ASSERT_EQ(RunToEnd(FUSEDLAYER_SERVER_BINARY, {"--help"}, &out), 0) << out;
  EXPECT_THAT(out, Not(HasSubstr("No flags matched"))) << out;
  // Each flag with its help text, under its group's heading.
  EXPECT_THAT(out, HasSubstr("--address")) << out;
  EXPECT_THAT(out, HasSubstr("gRPC listen address")) << out;
  EXPECT_THAT(out, HasSubstr("--allow_shared_memory")) << out;
  EXPECT_THAT(out, HasSubstr("accept RegisterSystemSharedMemory")) << out;
  const size_t serving = out.find("\nServing:\n");
  const size_t shared_memory = out.find("\nSystem shared memory:\n");
  ASSERT_NE(serving, std::string::npos) << out;
  ASSERT_NE(shared_memory, std::string::npos) << out;
  EXPECT_LT(serving, out.find("--address")) << out;
  EXPECT_LT(shared_memory, out.find("--allow_shared_memory")) << out;
  EXPECT_LT(out.find("--address"), shared_memory) << out;
}

// ---- requests whose bytes are not a valid message ------------------------------------------------

// Sends `messages` as the request messages of `method` (any kind: unary takes one, client
// streaming any number) and returns the call's status and, when it succeeded, its response bytes.
grpc::Status CallWithRawMessages(const std::shared_ptr<grpc::Channel>& channel, const std::string& method,
                                 const std::vector<std::string>& messages, std::string* response_bytes = nullptr) {
  grpc::GenericStub stub(channel);
  grpc::CompletionQueue cq;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  auto call = stub.PrepareCall(&ctx, method, &cq);
  auto next = [&cq](void* expected) {
    void* tag = nullptr;
    bool ok = false;
    EXPECT_TRUE(cq.Next(&tag, &ok));
    EXPECT_EQ(tag, expected);
    return ok;
  };
  int tags[5];
  call->StartCall(&tags[0]);
  next(&tags[0]);
  for (const std::string& bytes : messages) {
    grpc::Slice slice(bytes);
    grpc::ByteBuffer request(&slice, 1);
    call->Write(request, &tags[1]);
    if (!next(&tags[1])) break;  // the server finished the call early
  }
  call->WritesDone(&tags[2]);
  next(&tags[2]);
  grpc::ByteBuffer response;
  call->Read(&response, &tags[3]);
  const bool got_response = next(&tags[3]);
  grpc::Status status;
  call->Finish(&status, &tags[4]);
  next(&tags[4]);
  cq.Shutdown();
  void* tag = nullptr;
  bool ok = false;
  while (cq.Next(&tag, &ok)) {
  }
  if (response_bytes != nullptr && got_response) {
    std::vector<grpc::Slice> slices;
    EXPECT_TRUE(response.Dump(&slices).ok());
    response_bytes->clear();
    for (const grpc::Slice& sl : slices) response_bytes->append(reinterpret_cast<const char*>(sl.begin()), sl.size());
  }
  return status;
}

grpc::Status CallWithRawBytes(const std::shared_ptr<grpc::Channel>& channel, const std::string& method,
                              const std::string& bytes) {
  return CallWithRawMessages(channel, method, {bytes});
}

std::string Varint(uint64_t v) {
  std::string out;
  do {
    out.push_back(static_cast<char>((v & 0x7f) | (v > 0x7f ? 0x80 : 0)));
    v >>= 7;
  } while (v != 0);
  return out;
}

TEST(UndecodableRequests, EveryRpcAnswersInvalidArgumentWithAMessageAndTheServerKeepsServing) {
  server::ServerConfig config = TestConfig();
  config.allow_shared_memory = true;
  auto ts = TestServer::Start(config);
  ASSERT_NE(ts, nullptr);
  const google::protobuf::ServiceDescriptor* service =
      google::protobuf::DescriptorPool::generated_pool()->FindServiceByName("fusedlayer.v1.FusedLayer");
  ASSERT_NE(service, nullptr);
  ASSERT_GE(service->method_count(), 15);
  int utf8_cases = 0;
  for (int i = 0; i < service->method_count(); ++i) {
    const google::protobuf::MethodDescriptor* m = service->method(i);
    const std::string method = absl::StrCat("/", service->full_name(), "/", m->name());
    // Field 1, length-delimited, 255 bytes announced and none sent (truncated); field 1 with wire
    // type 7 (no such wire type). Neither is a valid message of any type.
    std::vector<std::pair<std::string, std::string>> garbage = {{"truncated", std::string("\x0a\xff\x01", 3)},
                                                                {"bad wire type", std::string("\x0f", 1)}};
    // A string field holding invalid UTF-8 (proto3 strings must be UTF-8).
    const google::protobuf::Descriptor* input = m->input_type();
    for (int f = 0; f < input->field_count(); ++f) {
      if (input->field(f)->type() != google::protobuf::FieldDescriptor::TYPE_STRING) continue;
      garbage.emplace_back("invalid UTF-8 in " + input->field(f)->name(),
                           Varint(static_cast<uint64_t>(input->field(f)->number()) << 3 | 2) + std::string("\x02\xc3\x28", 3));
      ++utf8_cases;
      break;
    }
    for (const auto& [what, bytes] : garbage) {
      const grpc::Status s = CallWithRawBytes(ts->channel(), method, bytes);
      EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << method << " (" << what << "): " << s.error_message();
      EXPECT_FALSE(s.error_message().empty()) << method << " (" << what << ")";
      // A unary request's refusal names the type it failed to parse as (the compute RPCs' wording).
      if (!m->client_streaming()) {
        EXPECT_THAT(s.error_message(), HasSubstr("the request is not a valid " + input->full_name()))
            << method << " (" << what << ")";
      }
    }
  }
  EXPECT_GE(utf8_cases, 10);  // the name- and key-carrying requests
  // Still serving, on the same connection and a new one.
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  v1::ListWeightSetsResponse list;
  EXPECT_TRUE(ts->stub().ListWeightSets(&ctx, {}, &list).ok());
  int serving = 0;
  EXPECT_TRUE(HealthCheck(MakeChannel(ts->server().port()), "", &serving).ok());
  EXPECT_EQ(serving, 1);
}

// gRPC reports a streamed message it cannot parse as the end of the stream: LoadWeights (a raw
// method) parses each chunk itself, so a garbage chunk is never read as a complete upload.
TEST(UndecodableRequests, AGarbageLoadWeightsChunkIsInvalidArgumentNamingItAndLoadsNothing) {
  auto ts = TestServer::Start(TestConfig());
  ASSERT_NE(ts, nullptr);
  std::mt19937_64 rng(::testing::UnitTest::GetInstance()->random_seed());
  const server::PackedWeightSet set = MakeWeightSet(rng, "garbage/chunk", MhcSetSpec{}, std::nullopt);
  const std::string method = "/fusedlayer.v1.FusedLayer/LoadWeights";
  auto chunk = [&](bool header, size_t from, size_t bytes) {
    v1::WeightChunk c;
    if (header) *c.mutable_header() = set.first;
    c.set_data(set.second.substr(from, bytes));
    return c.SerializeAsString();
  };
  const size_t half = set.second.size() / 2;
  const std::string garbage("\x0a\xff\x01", 3);  // field 1 announces 255 bytes, none follow
  const std::vector<std::pair<std::string, std::vector<std::string>>> streams = {
      // After the header, before the payload is complete.
      {"after the header", {chunk(true, 0, half), garbage, chunk(false, half, set.second.size() - half)}},
      // After the last payload byte: before, the upload was taken as complete and the set published.
      {"after the payload", {chunk(true, 0, half), chunk(false, half, set.second.size() - half), garbage}},
  };
  for (const auto& [what, messages] : streams) {
    const grpc::Status s = CallWithRawMessages(ts->channel(), method, messages);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << what << ": " << s.error_message();
    EXPECT_THAT(s.error_message(), HasSubstr("weight set 'garbage/chunk': chunk ")) << what;
    EXPECT_THAT(s.error_message(), HasSubstr("is not a valid fusedlayer.v1.WeightChunk message")) << what;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    v1::ListWeightSetsResponse list;
    ASSERT_TRUE(ts->stub().ListWeightSets(&ctx, {}, &list).ok());
    for (const v1::WeightSetInfo& info : list.weight_sets()) EXPECT_NE(info.name(), "garbage/chunk") << what;
  }
  // The same stream without the garbage loads, through the raw method too (the response parses).
  std::string response;
  const grpc::Status ok = CallWithRawMessages(
      ts->channel(), method, {chunk(true, 0, half), chunk(false, half, set.second.size() - half)}, &response);
  ASSERT_TRUE(ok.ok()) << ok.error_message();
  v1::WeightSetInfo info;
  ASSERT_TRUE(info.ParseFromString(response));
  EXPECT_EQ(info.name(), "garbage/chunk");
}

// ---- the memory limit the defaults are derived from ------------------------------------------------

// A fake cgroup file system under a temporary directory: root() stands for /sys/fs/cgroup, and
// proc_file() for /proc/self/cgroup.
class FakeCgroups {
 public:
  FakeCgroups() {
    char dir[] = "/tmp/fusedlayer-cgroup-XXXXXX";
    EXPECT_NE(mkdtemp(dir), nullptr);
    base_ = dir;
    std::filesystem::create_directories(base_ + "/sys");
  }
  ~FakeCgroups() { std::filesystem::remove_all(base_); }
  std::string root() const { return base_ + "/sys"; }
  std::string proc_file() const { return base_ + "/cgroup"; }
  void Membership(const std::string& text) const { std::ofstream(proc_file()) << text; }
  // Writes `text` to root()/relative, making its directories.
  void Write(const std::string& relative, const std::string& text) const { WriteUnderBase("sys/" + relative, text); }
  // The same relative to the temporary directory, outside root().
  void WriteUnderBase(const std::string& relative, const std::string& text) const {
    const std::filesystem::path path = base_ + "/" + relative;
    std::filesystem::create_directories(path.parent_path());
    std::ofstream(path) << text;
  }

 private:
  std::string base_;
};

// The server says at start which limit its defaults come from and where it read it: the same limit
// and file this test process (a sibling in the same cgroup) reads, and the defaults derived from it.
TEST(CgroupMemoryLimit, TheServerLogsTheLimitItReadAndWhereAtStart) {
  const server::MemoryLimit here = server::AvailableMemory();
  ServerProcess p(FUSEDLAYER_SERVER_BINARY, {"--backend=cpu", "--cpu_threads=1", "--address=127.0.0.1:0",
                                            "--metrics_address=127.0.0.1:0"});
  const std::string line = p.ReadUntil(std::regex("memory: [0-9]+ bytes \\([^)]*\\); defaults from it: .*"));
  ASSERT_FALSE(line.empty()) << p.log();
  std::smatch m;
  ASSERT_TRUE(std::regex_search(line, m, std::regex("memory: ([0-9]+) bytes \\(([^)]*)\\)")));
  EXPECT_EQ(std::stoull(m[1]), here.bytes) << line;
  EXPECT_EQ(m[2].str(), here.source.empty() ? "unknown: defaults assume 16 GiB" : here.source) << line;
  EXPECT_THAT(line, HasSubstr("--max_inflight_bytes "));
  EXPECT_THAT(line, HasSubstr("--residual_session_total_bytes "));
  ASSERT_FALSE(p.ReadUntil(std::regex("serving fusedlayer\\.v1\\.FusedLayer")).empty()) << p.log();
  ASSERT_EQ(kill(p.pid(), SIGTERM), 0);
  const std::string log = p.ReadAll();
  EXPECT_EQ(p.Wait(), 0) << log;
}

TEST(CgroupMemoryLimit, V2TakesTheSmallestLimitOnThePathFromTheProcessCgroupUp) {
  FakeCgroups fake;
  fake.Membership("0::/user.slice/user-1000.slice/session-3.scope\n");
  fake.Write("cgroup.controllers", "cpu memory\n");  // the root has no memory.max
  fake.Write("user.slice/memory.max", "max\n");
  fake.Write("user.slice/user-1000.slice/memory.max", "1073741824\n");
  fake.Write("user.slice/user-1000.slice/session-3.scope/memory.max", "4294967296\n");
  const server::MemoryLimit limit = server::CgroupMemoryLimit(fake.root(), fake.proc_file());
  EXPECT_EQ(limit.bytes, uint64_t{1} << 30);
  EXPECT_EQ(limit.source, fake.root() + "/user.slice/user-1000.slice/memory.max");
}

TEST(CgroupMemoryLimit, V2InsideACgroupNamespaceReadsTheRoot) {
  FakeCgroups fake;
  fake.Membership("0::/\n");
  fake.Write("memory.max", "2147483648\n");
  const server::MemoryLimit limit = server::CgroupMemoryLimit(fake.root(), fake.proc_file());
  EXPECT_EQ(limit.bytes, uint64_t{2} << 30);
  EXPECT_EQ(limit.source, fake.root() + "/memory.max");
}

TEST(CgroupMemoryLimit, V1ReadsTheMemoryHierarchyOfTheProcess) {
  FakeCgroups fake;
  fake.Membership("12:cpu,cpuacct:/system.slice/app.service\n7:memory:/system.slice/app.service\n0::/\n");
  fake.Write("memory/memory.limit_in_bytes", "9223372036854771712\n");  // v1's "unlimited"
  fake.Write("memory/system.slice/memory.limit_in_bytes", "9223372036854771712\n");
  fake.Write("memory/system.slice/app.service/memory.limit_in_bytes", "536870912\n");
  // A cpu hierarchy file of the same name must not count.
  fake.Write("cpu,cpuacct/system.slice/app.service/memory.limit_in_bytes", "1024\n");
  const server::MemoryLimit limit = server::CgroupMemoryLimit(fake.root(), fake.proc_file());
  EXPECT_EQ(limit.bytes, uint64_t{512} << 20);
  EXPECT_EQ(limit.source, fake.root() + "/memory/system.slice/app.service/memory.limit_in_bytes");
}

TEST(CgroupMemoryLimit, V1PathMissingUnderTheMountFallsBackToItsAncestors) {
  // A v1 container without a cgroup namespace: /proc/self/cgroup names the host's path, and the
  // container's own cgroup is mounted at the hierarchy's root.
  FakeCgroups fake;
  fake.Membership("4:memory:/docker/0123abcd\n");
  fake.Write("memory/memory.limit_in_bytes", "268435456\n");
  const server::MemoryLimit limit = server::CgroupMemoryLimit(fake.root(), fake.proc_file());
  EXPECT_EQ(limit.bytes, uint64_t{256} << 20);
  EXPECT_EQ(limit.source, fake.root() + "/memory/memory.limit_in_bytes");
}

TEST(CgroupMemoryLimit, NoLimitWhenEveryLevelSaysMaxOrHasNoFile) {
  FakeCgroups fake;
  fake.Membership("0::/a/b\n");
  fake.Write("a/memory.max", "max\n");
  fake.Write("a/b/cgroup.procs", "1\n");  // no memory.max at this level
  EXPECT_EQ(server::CgroupMemoryLimit(fake.root(), fake.proc_file()).bytes, 0u);
  // No membership file at all (no /proc): nothing is read, nothing is guessed.
  FakeCgroups no_proc;
  no_proc.Write("memory.max", "max\n");
  EXPECT_EQ(server::CgroupMemoryLimit(no_proc.root(), no_proc.proc_file()).bytes, 0u);
}

TEST(CgroupMemoryLimit, AMembershipPathCannotLeaveTheRoot) {
  FakeCgroups fake;
  fake.Membership("0::/../outside\n");
  fake.Write("memory.max", "max\n");
  fake.WriteUnderBase("outside/memory.max", "1024\n");
  EXPECT_EQ(server::CgroupMemoryLimit(fake.root(), fake.proc_file()).bytes, 0u);
}

// ---- descriptors held by shared-memory regions ---------------------------------------------------

// A POSIX shared-memory object for the test's regions, removed at the end.
class ShmObject {
 public:
  explicit ShmObject(size_t bytes) {
    key_ = absl::StrCat("/fusedlayer-fd-test-", getpid(), "-", std::chrono::steady_clock::now().time_since_epoch().count());
    const int fd = shm_open(key_.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    EXPECT_GE(fd, 0);
    EXPECT_EQ(ftruncate(fd, static_cast<off_t>(bytes)), 0);
    close(fd);
  }
  ~ShmObject() { shm_unlink(key_.c_str()); }
  const std::string& key() const { return key_; }

 private:
  std::string key_;
};

grpc::Status RegisterRegion(v1::FusedLayer::Stub& stub, const std::string& name, const std::string& key) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  v1::RegisterSystemSharedMemoryRequest request;
  request.set_name(name);
  request.set_key(key);
  request.set_offset(0);
  request.set_byte_size(4096);
  v1::RegisterSystemSharedMemoryResponse response;
  return stub.RegisterSystemSharedMemory(&ctx, request, &response);
}

TEST(DescriptorBudget, RegionsBeyondItAreResourceExhaustedAndNewConnectionsStillGetIn) {
  ShmObject object(4096);
  // Soft limit 192, hard limit 384: the server raises the soft limit to 384 at start and keeps the
  // default reserve of 256 for everything else, so the regions of all identities may hold 128.
  ServerProcess p("/bin/sh", {"-c", "ulimit -S -n 192 && ulimit -H -n 384 && exec \"$0\" \"$@\"",
                              FUSEDLAYER_SERVER_BINARY, "--backend=cpu", "--cpu_threads=1", "--address=127.0.0.1:0",
                              "--metrics_address=127.0.0.1:0", "--allow_shared_memory",
                              "--shared_memory_max_regions=4096"});
  const std::string metrics = p.ReadUntil(std::regex("metrics on http://.*\\(port ([0-9]+)\\)"));
  ASSERT_FALSE(metrics.empty()) << p.log();
  std::smatch metrics_match;
  ASSERT_TRUE(std::regex_search(metrics, metrics_match, std::regex("\\(port ([0-9]+)\\)")));
  const int metrics_port = std::stoi(metrics_match[1]);
  const std::string serving = p.ReadUntil(std::regex("serving fusedlayer\\.v1\\.FusedLayer .*\\(port ([0-9]+)\\)"));
  ASSERT_FALSE(serving.empty()) << p.log();
  std::smatch match;
  ASSERT_TRUE(std::regex_search(serving, match, std::regex("\\(port ([0-9]+)\\)")));
  const int port = std::stoi(match[1]);
  EXPECT_THAT(p.log(), HasSubstr("descriptor")) << p.log();

  auto stub = v1::FusedLayer::NewStub(MakeChannel(port));
  int registered = 0;
  grpc::Status refused;
  for (; registered < 1000; ++registered) {
    refused = RegisterRegion(*stub, absl::StrCat("r", registered), object.key());
    if (!refused.ok()) break;
  }
  EXPECT_EQ(registered, 128);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << refused.error_message();
  EXPECT_THAT(refused.error_message(), HasSubstr("descriptor budget of 128")) << refused.error_message();

  const std::string scrape = HttpGet(metrics_port, "/metrics");
  EXPECT_EQ(MetricValue(scrape, "fusedlayer_shared_memory_region_budget"), 128.0) << scrape;
  EXPECT_EQ(MetricValue(scrape, "fusedlayer_shared_memory_regions"), 128.0) << scrape;

  // The listener still accepts: a new connection is served.
  int status = 0;
  const grpc::Status health = HealthCheck(MakeChannel(port), "", &status);
  EXPECT_TRUE(health.ok()) << health.error_message();
  EXPECT_EQ(status, 1);

  // Unregistering gives a descriptor back.
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    v1::UnregisterSystemSharedMemoryRequest request;
    request.set_name("r0");
    v1::UnregisterSystemSharedMemoryResponse response;
    ASSERT_TRUE(stub->UnregisterSystemSharedMemory(&ctx, request, &response).ok());
  }
  const grpc::Status again = RegisterRegion(*stub, "again", object.key());
  EXPECT_TRUE(again.ok()) << again.error_message();
  EXPECT_EQ(RegisterRegion(*stub, "one-more", object.key()).error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);

  ASSERT_EQ(kill(p.pid(), SIGTERM), 0);
  const std::string log = p.ReadAll();
  EXPECT_EQ(p.Wait(), 0) << log;
}

// Whatever takes the descriptors (here: connections that never speak), the TCP listener accepts
// again once some are free. gRPC 1.51's own listener stopped for good at the first EMFILE.
// UndefinedBehaviorSanitizer's vptr check probes an object's vtable through a pipe: in a process with
// no descriptors left every probe fails and reports "object has invalid vptr" for a sound object. In
// the sanitizer build (UBSAN_OPTIONS set) the server below therefore goes on after a report, and the
// test accepts that one report and no other (every other check, and AddressSanitizer, still end it).
void ExpectNoSanitizerReportButOutOfDescriptorVptrProbes(const std::string& log) {
  std::istringstream lines(log);
  std::string line, next;
  while (std::getline(lines, line)) {
    if (line.find("runtime error:") == std::string::npos) continue;
    std::getline(lines, next);
    EXPECT_THAT(next, HasSubstr("object has invalid vptr")) << line;
  }
  EXPECT_THAT(log, Not(HasSubstr("ERROR: AddressSanitizer")));
}

TEST(DescriptorBudget, ATcpListenerAcceptsAgainAfterTheProcessRanOutOfDescriptors) {
  ServerProcess p("/bin/sh", {"-c",
                              "if [ -n \"$UBSAN_OPTIONS\" ]; then export UBSAN_OPTIONS=\"$UBSAN_OPTIONS:halt_on_error=0\"; fi"
                              " && ulimit -S -n 96 && ulimit -H -n 96 && exec \"$0\" \"$@\"",
                              FUSEDLAYER_SERVER_BINARY, "--backend=cpu", "--cpu_threads=1", "--address=127.0.0.1:0",
                              "--metrics_address=127.0.0.1:0"});
  const std::string serving = p.ReadUntil(std::regex("serving fusedlayer\\.v1\\.FusedLayer .*\\(port ([0-9]+)\\)"));
  ASSERT_FALSE(serving.empty()) << p.log();
  std::smatch match;
  ASSERT_TRUE(std::regex_search(serving, match, std::regex("\\(port ([0-9]+)\\)")));
  const int port = std::stoi(match[1]);

  // More connections than the server has descriptors: it accepts until accept4 fails with EMFILE.
  std::vector<int> idle;
  for (int i = 0; i < 160; ++i) {
    const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    ASSERT_GE(fd, 0);
    sockaddr_in sa{};
    sa.sin_family = AF_INET;
    sa.sin_port = htons(static_cast<uint16_t>(port));
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ASSERT_EQ(::connect(fd, reinterpret_cast<const sockaddr*>(&sa), sizeof(sa)), 0) << std::strerror(errno);
    idle.push_back(fd);
  }
  ASSERT_FALSE(p.ReadUntil(std::regex("accept.*Too many open files")).empty()) << p.log();
  for (int fd : idle) ::close(fd);  // the server's ends close as gRPC reads their EOF

  // A new client is served (before: DEADLINE_EXCEEDED, the listener had stopped).
  int status = 0;
  const grpc::Status health = HealthCheck(MakeChannel(port), "", &status);
  EXPECT_TRUE(health.ok()) << health.error_message() << "\n" << p.log();
  EXPECT_EQ(status, 1);
  ASSERT_FALSE(p.ReadUntil(std::regex("listener: accepting again")).empty()) << p.log();

  ASSERT_EQ(kill(p.pid(), SIGTERM), 0);
  const std::string log = p.ReadAll();
  EXPECT_EQ(p.Wait(), 0) << log;
  ExpectNoSanitizerReportButOutOfDescriptorVptrProbes(log);
}

}  // namespace
}  // namespace fusedlayer::testing
