// CUDA shared memory across two processes on one GPU (server/transport/cuda_shared_memory.h): this
// test process is the client (the compute library's GPU backend allocates and exports its buffers,
// client/lib/cuda_shared_memory.h) and a fusedlayer_server child process on the same GPU opens them by
// their IPC handles; cudaIpcOpenMemHandle refuses a handle of its own process, so the two
// processes are the only real test. The same flows without a GPU: tests/server/cuda_shared_memory_e2e_test.cc.
//
//  - mHC (T = 1 and 64, fused and unfused) and SWA (M = 64) through CUDA shared memory, bitwise the
//    same request over TCP, outputs poisoned on the device before every call and read right after
//    the response (the contract: the kernels completed before it was sent);
//  - a client process that registers a region and exits without unregistering (its allocation
//    freed by the driver): the server keeps serving, bitwise, and the region can be unregistered;
//  - with --cuda_shared_memory_idle_seconds, such a region expires and the dead client's GPU
//    memory, held until then by the server's opening, comes back (the device's free memory);
//  - call rings (server/ring/, client/lib/call_ring.h) with the tensors in CUDA shared memory: mHC
//    (T = 1 and 64, both paths) and SWA (M = 64) ring calls bitwise the same request over TCP, the
//    outputs poisoned before every call and read right after its completion.
//
// The server binary: $FUSEDLAYER_SERVER, else fusedlayer_server next to this executable (the device
// bundle), else the build tree's.
#include <unistd.h>

#include "absl/strings/str_cat.h"

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <random>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include "client/lib/call_ring.h"
#include "client/lib/cuda_shared_memory.h"
#include "client/lib/fusedlayer_client.h"
#include "client/lib/random_inputs.h"
#include "client/lib/shared_memory.h"
#include "fusedlayer/backend.h"
#include "gpu_runtime.h"
#include "gtest/gtest.h"
#include "server_process.h"

namespace fusedlayer::testing {
namespace {

using client::ClientCudaSharedMemory;
using client::FusedLayerClient;

std::string ServerBinary() {
  if (const char* e = std::getenv("FUSEDLAYER_SERVER"); e != nullptr) return e;
  const std::filesystem::path next = std::filesystem::read_symlink("/proc/self/exe").parent_path() / "fusedlayer_server";
  if (std::filesystem::exists(next)) return next.string();
  return FUSEDLAYER_SERVER_BINARY;
}

int PortOf(const std::string& line) {
  std::smatch m;
  return std::regex_search(line, m, std::regex("\\(port ([0-9]+)\\)")) ? std::stoi(m[1]) : 0;
}

std::vector<std::string> ServerFlags(std::vector<std::string> extra) {
  std::vector<std::string> flags = {"--backend=cuda", "--demo_weights", "--allow_cuda_shared_memory",
                                    "--address=127.0.0.1:0", "--metrics_address=127.0.0.1:0", "--allow_call_rings",
                                    absl::StrCat("--call_ring_socket=/tmp/fl-gpu-ring-", ::getpid(), "-",
                                                 std::random_device{}())};
  flags.insert(flags.end(), extra.begin(), extra.end());
  return flags;
}

// A CUDA-backend server child process with the demo weights and CUDA shared memory on (and `extra`
// flags), and a client.
struct GpuServer {
  explicit GpuServer(std::vector<std::string> extra = {}) : process(ServerBinary(), ServerFlags(std::move(extra))) {
    port = PortOf(process.ReadUntil(std::regex("serving fusedlayer\\.v1\\.FusedLayer .*\\(port [0-9]+\\)")));
    if (port == 0) return;
    absl::StatusOr<std::unique_ptr<FusedLayerClient>> c = FusedLayerClient::Connect(absl::StrCat("127.0.0.1:", port));
    if (c.ok()) client = std::move(*c);
  }
  ServerProcess process;
  int port = 0;
  std::unique_ptr<FusedLayerClient> client;
};

Backend& ClientGpu() {
  static std::unique_ptr<Backend> gpu = [] {
    absl::StatusOr<std::unique_ptr<Backend>> b = CreateBackend("cuda", {});
    return b.ok() ? std::move(*b) : nullptr;
  }();
  return *gpu;
}

bool HaveGpu() {
  absl::StatusOr<std::unique_ptr<Backend>> probe = CreateBackend("cuda", {});
  return probe.ok();
}

// Every output tensor's bytes, dtype and shape equal, and the same path.
template <typename Response>
void ExpectSameOutputs(const Response& got, const Response& want) {
  const google::protobuf::Descriptor* d = Response::descriptor();
  const google::protobuf::Reflection* r = Response::GetReflection();
  for (int i = 0; i < d->field_count(); ++i) {
    const google::protobuf::FieldDescriptor* f = d->field(i);
    if (f->message_type() != v1::Tensor::descriptor()) continue;
    ASSERT_EQ(r->HasField(got, f), r->HasField(want, f)) << f->name();
    const auto& g = static_cast<const v1::Tensor&>(r->GetMessage(got, f));
    const auto& w = static_cast<const v1::Tensor&>(r->GetMessage(want, f));
    EXPECT_EQ(g.dtype(), w.dtype()) << f->name();
    EXPECT_EQ(g.shape_size(), w.shape_size()) << f->name();
    EXPECT_TRUE(g.data() == w.data()) << f->name() << ": bytes differ";
  }
  EXPECT_EQ(got.report().path(), want.report().path());
}

void Poison(const ClientCudaSharedMemory& region, const google::protobuf::RepeatedPtrField<v1::OutputPlacement>& ps) {
  for (const v1::OutputPlacement& p : ps) {
    const std::string nan(p.cuda_shared_memory().byte_size(), '\xff');
    ASSERT_TRUE(
        ClientGpu().CopyToDevice(region.device_data() + p.cuda_shared_memory().offset(), nan.data(), nan.size()).ok());
  }
}

TEST(CudaIpc, MhcAndSwaThroughCudaSharedMemoryAreBitwiseTcp) {
  if (!HaveGpu()) GTEST_SKIP() << "no GPU";
  GpuServer s;
  ASSERT_NE(s.client, nullptr) << s.process.ReadAll();
  absl::StatusOr<v1::GetServerInfoResponse> info = s.client->GetServerInfo();
  ASSERT_TRUE(info.ok());
  ASSERT_TRUE(info->cuda_shared_memory_enabled());
  absl::StatusOr<v1::WeightSetInfo> ws = s.client->FindWeightSet("v4-pro/demo");
  ASSERT_TRUE(ws.ok()) << ws.status();
  std::mt19937_64 rng(std::random_device{}());
  for (int64_t T : {int64_t{1}, int64_t{64}}) {
    for (auto path : {v1::PATH_PREFERENCE_REQUIRE_FUSED, v1::PATH_PREFERENCE_FORCE_UNFUSED}) {
      SCOPED_TRACE(::testing::Message() << "mHC T " << T << " path " << path);
      absl::StatusOr<v1::MhcSeamRequest> req =
          client::RandomMhcRequest(ws->mhc(), {.weight_set = "v4-pro/demo", .tokens = T, .path = path}, rng);
      ASSERT_TRUE(req.ok());
      absl::StatusOr<v1::MhcSeamResponse> tcp = s.client->MhcSeam(*req);
      ASSERT_TRUE(tcp.ok()) << tcp.status();
      absl::StatusOr<std::unique_ptr<ClientCudaSharedMemory>> region = ClientCudaSharedMemory::Create(
          *s.client, ClientGpu(), client::MhcRequestSharedBytes(*req, ws->mhc()));
      ASSERT_TRUE(region.ok()) << region.status();
      v1::MhcSeamRequest by_ref = *req;
      ASSERT_TRUE((*region)->Prepare(by_ref, ws->mhc()).ok());
      for (int call = 0; call < 3; ++call) {
        Poison(**region, by_ref.output_placements());
        absl::StatusOr<v1::MhcSeamResponse> got = s.client->MhcSeam(by_ref);
        ASSERT_TRUE(got.ok()) << got.status();
        EXPECT_LT(got->ByteSizeLong(), 4096u);
        ASSERT_TRUE((*region)->Fetch(*got).ok());
        ExpectSameOutputs(*got, *tcp);
      }
    }
  }
  absl::StatusOr<v1::SwaNormQuantRequest> swa =
      client::RandomSwaRequest(ws->swa(), {.weight_set = "v4-pro/demo", .tokens = 64}, rng);
  ASSERT_TRUE(swa.ok());
  absl::StatusOr<v1::SwaNormQuantResponse> tcp = s.client->SwaNormQuant(*swa);
  ASSERT_TRUE(tcp.ok()) << tcp.status();
  absl::StatusOr<std::unique_ptr<ClientCudaSharedMemory>> region = ClientCudaSharedMemory::Create(
      *s.client, ClientGpu(), client::SwaRequestSharedBytes(*swa, ws->swa(), ws->wq_b_rows()));
  ASSERT_TRUE(region.ok()) << region.status();
  v1::SwaNormQuantRequest by_ref = *swa;
  ASSERT_TRUE((*region)->Prepare(by_ref, ws->swa(), ws->wq_b_rows()).ok());
  Poison(**region, by_ref.output_placements());
  absl::StatusOr<v1::SwaNormQuantResponse> got = s.client->SwaNormQuant(by_ref);
  ASSERT_TRUE(got.ok()) << got.status();
  ASSERT_TRUE((*region)->Fetch(*got).ok());
  ExpectSameOutputs(*got, *tcp);
  // A handle of nothing is refused by the driver, and the server keeps serving.
  EXPECT_EQ(s.client->RegisterCudaSharedMemory("junk", std::string(64, '\x5a'), 0, 0, 64).code(),
            absl::StatusCode::kInvalidArgument);
  got = s.client->SwaNormQuant(by_ref);
  ASSERT_TRUE(got.ok()) << got.status();
}

// Ring calls with CUDA IPC tensors: the completion is stored by the GPU stream after the kernels
// that wrote the outputs (kRingCompletedByDevice), so the outputs read right after it are the
// call's, bitwise those of the same request over TCP.
TEST(CudaIpc, RingCallsThroughCudaSharedMemoryAreBitwiseTcp) {
  if (!HaveGpu()) GTEST_SKIP() << "no GPU";
  GpuServer s;
  ASSERT_NE(s.client, nullptr) << s.process.ReadAll();
  absl::StatusOr<v1::WeightSetInfo> ws = s.client->FindWeightSet("v4-pro/demo");
  ASSERT_TRUE(ws.ok()) << ws.status();
  std::mt19937_64 rng(std::random_device{}());
  const std::vector<std::string> sets = {"v4-pro/demo"};
  for (int64_t T : {int64_t{1}, int64_t{64}}) {
    for (auto path : {v1::PATH_PREFERENCE_REQUIRE_FUSED, v1::PATH_PREFERENCE_FORCE_UNFUSED}) {
      SCOPED_TRACE(::testing::Message() << "ring mHC T " << T << " path " << path);
      absl::StatusOr<v1::MhcSeamRequest> req =
          client::RandomMhcRequest(ws->mhc(), {.weight_set = "v4-pro/demo", .tokens = T, .path = path}, rng);
      ASSERT_TRUE(req.ok());
      absl::StatusOr<v1::MhcSeamResponse> tcp = s.client->MhcSeam(*req);
      ASSERT_TRUE(tcp.ok()) << tcp.status();
      absl::StatusOr<std::unique_ptr<ClientCudaSharedMemory>> region = ClientCudaSharedMemory::Create(
          *s.client, ClientGpu(), client::MhcRequestSharedBytes(*req, ws->mhc()));
      ASSERT_TRUE(region.ok()) << region.status();
      v1::MhcSeamRequest by_ref = *req;
      ASSERT_TRUE((*region)->Prepare(by_ref, ws->mhc()).ok());
      absl::StatusOr<v1::MhcSeamResponse> shaped = s.client->MhcSeam(by_ref);  // the outputs' shapes
      ASSERT_TRUE(shaped.ok()) << shaped.status();
      v1::CallRingRegion bound;
      bound.set_name((*region)->region_name());
      bound.set_cuda(true);
      absl::StatusOr<std::unique_ptr<client::CallRing>> ring = client::CallRing::Open(*s.client, {sets, {bound}, 1});
      ASSERT_TRUE(ring.ok()) << ring.status();
      absl::StatusOr<wire::RingCallDescriptor> call = client::RingCallOf(by_ref, sets, {bound});
      ASSERT_TRUE(call.ok()) << call.status();
      for (int n = 0; n < 3; ++n) {
        Poison(**region, by_ref.output_placements());
        client::RingCallResult r = (*ring)->Call(0, *call);
        ASSERT_TRUE(r.status.ok()) << r.status;
        EXPECT_EQ(r.path, tcp->report().path());
        EXPECT_EQ(r.fallback_reason, tcp->report().fallback_reason());
        EXPECT_TRUE(r.completed_by_device);
        EXPECT_EQ(r.kernel_seconds, 0);  // not known when the record was written
        EXPECT_GT(r.server_seconds, 0);
        v1::MhcSeamResponse got = *shaped;
        ASSERT_TRUE((*region)->Fetch(got).ok());
        ExpectSameOutputs(got, *tcp);
      }
    }
  }
  absl::StatusOr<v1::SwaNormQuantRequest> swa =
      client::RandomSwaRequest(ws->swa(), {.weight_set = "v4-pro/demo", .tokens = 64}, rng);
  ASSERT_TRUE(swa.ok());
  absl::StatusOr<v1::SwaNormQuantResponse> tcp = s.client->SwaNormQuant(*swa);
  ASSERT_TRUE(tcp.ok()) << tcp.status();
  absl::StatusOr<std::unique_ptr<ClientCudaSharedMemory>> region = ClientCudaSharedMemory::Create(
      *s.client, ClientGpu(), client::SwaRequestSharedBytes(*swa, ws->swa(), ws->wq_b_rows()));
  ASSERT_TRUE(region.ok()) << region.status();
  v1::SwaNormQuantRequest by_ref = *swa;
  ASSERT_TRUE((*region)->Prepare(by_ref, ws->swa(), ws->wq_b_rows()).ok());
  absl::StatusOr<v1::SwaNormQuantResponse> shaped = s.client->SwaNormQuant(by_ref);
  ASSERT_TRUE(shaped.ok()) << shaped.status();
  v1::CallRingRegion bound;
  bound.set_name((*region)->region_name());
  bound.set_cuda(true);
  absl::StatusOr<std::unique_ptr<client::CallRing>> ring = client::CallRing::Open(*s.client, {sets, {bound}, 1});
  ASSERT_TRUE(ring.ok()) << ring.status();
  absl::StatusOr<wire::RingCallDescriptor> call = client::RingCallOf(by_ref, sets, {bound});
  ASSERT_TRUE(call.ok()) << call.status();
  Poison(**region, by_ref.output_placements());
  client::RingCallResult r = (*ring)->Call(0, *call);
  ASSERT_TRUE(r.status.ok()) << r.status;
  EXPECT_TRUE(r.completed_by_device);
  v1::SwaNormQuantResponse got = *shaped;
  ASSERT_TRUE((*region)->Fetch(got).ok());
  ExpectSameOutputs(got, *tcp);
}

// The child process of the tests below (this executable with --ipc_child=PORT[,MiB]): registers a
// region of a fresh allocation of MiB (default 8) holding `x` of the request the parent sends,
// prints "registered", and exits without unregistering.
int RunChild(int port, size_t mib) {
  absl::StatusOr<std::unique_ptr<FusedLayerClient>> c = FusedLayerClient::Connect(absl::StrCat("127.0.0.1:", port));
  if (!c.ok()) return 2;
  absl::StatusOr<IpcExportedBuffer> mem = ClientGpu().AllocateIpcExportable(mib << 20);
  if (!mem.ok()) return 3;
  std::string x(mib << 20, '\0');
  std::mt19937_64 rng(7);
  for (size_t i = 0; i < x.size(); i += 2) x[i + 1] = static_cast<char>(0x3c + rng() % 4), x[i] = static_cast<char>(rng());
  if (!ClientGpu().CopyToDevice(mem->buffer.data(), x.data(), x.size()).ok()) return 4;
  if (!(*c)->RegisterCudaSharedMemory("orphan", mem->handle, ClientGpu().device_index(), 0, x.size()).ok()) return 5;
  std::printf("registered\n");
  std::fflush(stdout);
  _exit(0);  // no unregister, no free: the driver frees this process's memory
}

TEST(CudaIpc, AClientThatDiesHoldingARegionLeavesTheServerServing) {
  if (!HaveGpu()) GTEST_SKIP() << "no GPU";
  GpuServer s;
  ASSERT_NE(s.client, nullptr) << s.process.ReadAll();
  absl::StatusOr<v1::WeightSetInfo> ws = s.client->FindWeightSet("v4-pro/demo");
  ASSERT_TRUE(ws.ok()) << ws.status();
  {
    ServerProcess child(std::filesystem::read_symlink("/proc/self/exe").string(),
                        {absl::StrCat("--ipc_child=", s.port)});
    ASSERT_FALSE(child.ReadUntil(std::regex("registered")).empty()) << child.ReadAll();
    EXPECT_EQ(child.Wait(), 0);
  }
  std::mt19937_64 rng(std::random_device{}());
  absl::StatusOr<v1::MhcSeamRequest> req =
      client::RandomMhcRequest(ws->mhc(), {.weight_set = "v4-pro/demo", .tokens = 64}, rng);
  ASSERT_TRUE(req.ok());
  absl::StatusOr<v1::MhcSeamResponse> tcp = s.client->MhcSeam(*req);
  ASSERT_TRUE(tcp.ok()) << tcp.status();
  // The dead client's region as x (the same anonymous identity): whatever the driver did with the
  // memory, the answer is a status, never a crash of the server.
  v1::MhcSeamRequest orphan = *req;
  v1::SharedMemoryRef* ref = orphan.mutable_x()->mutable_cuda_shared_memory();
  ref->set_region("orphan");
  ref->set_offset(0);
  ref->set_byte_size(req->x().data().size());
  absl::StatusOr<v1::MhcSeamResponse> after = s.client->MhcSeam(orphan);
  std::printf("request on the dead client's region: %s\n", after.status().ToString().c_str());
  // Still serving, bitwise.
  absl::StatusOr<v1::MhcSeamResponse> again = s.client->MhcSeam(*req);
  ASSERT_TRUE(again.ok()) << again.status() << "\n" << s.process.ReadAll();
  ExpectSameOutputs(*again, *tcp);
  absl::StatusOr<v1::UnregisterCudaSharedMemoryResponse> gone = s.client->UnregisterCudaSharedMemory("orphan");
  ASSERT_TRUE(gone.ok()) << gone.status();
  EXPECT_EQ(gone->unregistered(), 1u);
  again = s.client->MhcSeam(*req);
  ASSERT_TRUE(again.ok()) << again.status();
  ExpectSameOutputs(*again, *tcp);
}

// The device's free memory, as the driver reports it to this process.
size_t FreeDeviceBytes() {
  size_t free_bytes = 0, total = 0;
  EXPECT_EQ(gpuMemGetInfo(&free_bytes, &total), gpuSuccess);
  return free_bytes;
}

// --cuda_shared_memory_idle_seconds: the region of a client that died without unregistering is
// unregistered once unused for the idle time, and the server's opening of the client's allocation
// closes with it. Until then that GPU memory stays allocated (the opening holds it after the
// client's exit); after, the driver frees it: the device's free memory comes back.
TEST(CudaIpc, ADeadClientsRegionExpiresAndItsGpuMemoryComesBack) {
  if (!HaveGpu()) GTEST_SKIP() << "no GPU";
  GpuServer s({"--cuda_shared_memory_idle_seconds=2"});
  ASSERT_NE(s.client, nullptr) << s.process.ReadAll();
  constexpr size_t kMiB = 1024;
  const size_t before = FreeDeviceBytes();
  {
    ServerProcess child(std::filesystem::read_symlink("/proc/self/exe").string(),
                        {absl::StrCat("--ipc_child=", s.port, ",", kMiB)});
    ASSERT_FALSE(child.ReadUntil(std::regex("registered")).empty()) << child.ReadAll();
    EXPECT_EQ(child.Wait(), 0);
  }
  // The client is gone; its 1 GiB is not: the server's opening holds it.
  const size_t held = FreeDeviceBytes();
  EXPECT_LT(held + (kMiB << 20) / 2, before) << "free " << before << " -> " << held;
  absl::StatusOr<v1::CudaSharedMemoryStatusResponse> listed = s.client->CudaSharedMemoryStatus();
  ASSERT_TRUE(listed.ok()) << listed.status();
  EXPECT_EQ(listed->regions_size(), 1);
  // Unused for 2 s: unregistered (checked every 0.5 s), the opening closed, the memory freed.
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  size_t after = held;
  while (std::chrono::steady_clock::now() < until) {
    listed = s.client->CudaSharedMemoryStatus();
    ASSERT_TRUE(listed.ok()) << listed.status();
    after = FreeDeviceBytes();
    if (listed->regions_size() == 0 && after + (kMiB << 20) / 2 > before) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_EQ(listed->regions_size(), 0);
  EXPECT_GT(after + (kMiB << 20) / 2, before) << "free " << before << " -> " << held << " -> " << after;
  std::printf("device free memory: %zu MiB before the client, %zu MiB after it died, %zu MiB after expiry\n",
              before >> 20, held >> 20, after >> 20);
  // Still serving.
  absl::StatusOr<v1::WeightSetInfo> ws = s.client->FindWeightSet("v4-pro/demo");
  ASSERT_TRUE(ws.ok()) << ws.status();
  std::mt19937_64 rng(std::random_device{}());
  absl::StatusOr<v1::MhcSeamRequest> req =
      client::RandomMhcRequest(ws->mhc(), {.weight_set = "v4-pro/demo", .tokens = 8}, rng);
  ASSERT_TRUE(req.ok());
  EXPECT_TRUE(s.client->MhcSeam(*req).ok());
}

}  // namespace
}  // namespace fusedlayer::testing

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], "--ipc_child=", 12) == 0) {
      const char* mib = std::strchr(argv[i] + 12, ',');
      return fusedlayer::testing::RunChild(std::atoi(argv[i] + 12), mib != nullptr ? std::atoll(mib + 1) : 8);
    }
  }
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
