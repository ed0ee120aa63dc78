// CUDA shared-memory transport end to end (server/transport/cuda_shared_memory.h,
// client/lib/cuda_shared_memory.h), in CI without a GPU: in-process servers on the lane test backend,
// whose IPC handles name its own device blocks (tests/server/lane_test_backend.h), so the server's
// code cannot tell them from another process's. The same flows on an H200 across two processes:
// tests/gpu/cuda_ipc_e2e_test.cc.
//
//  - outputs bitwise equal to the same request over TCP, for every mHC stage / aux / path and SWA
//    layout, with the output ranges poisoned before every call, and no tensor byte copied between
//    host and device by the server (the kernels use the client's buffers where they lie);
//  - every bad registration and reference, with its status code, and the server still serving;
//  - off, or on the CPU backend: FAILED_PRECONDITION;
//  - ownership across two bearer tokens, limits per identity, the gauges;
//  - one opening per handle, closed when its last region is unregistered, or expires unused
//    (--cuda_shared_memory_idle_seconds);
//  - drain with requests in flight.
#include <chrono>
#include <cstring>
#include <mutex>
#include <random>
#include <thread>
#include <string>
#include <vector>

#include "client/lib/cuda_shared_memory.h"
#include "client/lib/fusedlayer_client.h"
#include "client/lib/shared_memory.h"
#include "client_for.h"
#include "gtest/gtest.h"
#include "lane_test_backend.h"
#include "server_test_env.h"
#include "test_util.h"
#include "two_token_file.h"

namespace fusedlayer::testing {
namespace {

using absl::StatusCode;
using client::ClientCudaSharedMemory;
using client::FusedLayerClient;
using server::PackedWeightSet;

server::ServerConfig CudaShmConfig() {
  server::ServerConfig c = TestConfig();
  c.allow_cuda_shared_memory = true;
  c.device_lanes = 1;
  return c;
}

// A server on the lane test backend with CUDA shared memory on; `device` is its backend, which the
// test also uses as "the client's GPU" (to allocate exportable memory and copy to and from it).
struct IpcServer {
  std::unique_ptr<TestServer> ts;
  LaneTestBackend* device = nullptr;
  std::shared_ptr<LaneTestBackend::Control> control;
  std::unique_ptr<FusedLayerClient> client;
};
IpcServer StartIpcServer(std::vector<PackedWeightSet> sets, server::ServerConfig cfg = CudaShmConfig(),
                         const std::string& token = "") {
  auto backend = std::make_unique<LaneTestBackend>(8);
  IpcServer s;
  s.device = backend.get();
  s.control = backend->control();
  s.ts = TestServer::Start(cfg, std::move(backend), std::move(sets));
  if (s.ts != nullptr) s.client = ClientFor(*s.ts, token);
  return s;
}

v1::SharedMemoryRef Ref(const std::string& region, uint64_t offset, uint64_t bytes) {
  v1::SharedMemoryRef r;
  r.set_region(region);
  r.set_offset(offset);
  r.set_byte_size(bytes);
  return r;
}

// The backend's open IPC handles once they reach `want`, or after 10 s. A call's server-side state,
// and the regions it holds, is released just after its response is sent (the reactor's OnDone), so
// right after a response a handle whose last region went may still be open for a moment.
int64_t OpenIpcHandlesOnceSettled(const LaneTestBackend::Control& control, int64_t want) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (control.open_ipc_handles.load() != want && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return control.open_ipc_handles.load();
}

// Output ranges to NaN bits (0xFF) in device memory, so a missing write cannot pass for a correct one.
void PoisonOutputs(Backend& device, const ClientCudaSharedMemory& region,
                   const google::protobuf::RepeatedPtrField<v1::OutputPlacement>& ps) {
  for (const v1::OutputPlacement& p : ps) {
    ASSERT_TRUE(p.has_cuda_shared_memory());
    const std::string nan(p.cuda_shared_memory().byte_size(), '\xff');
    ASSERT_TRUE(device.CopyToDevice(region.device_data() + p.cuda_shared_memory().offset(), nan.data(), nan.size()).ok());
  }
}

v1::MhcConfig MhcConfigOf(const MhcRequestSpec& spec) {
  v1::MhcConfig c;
  c.set_hc_mult(spec.hc_mult);
  c.set_hidden(spec.hidden);
  return c;
}

// ---- bitwise equality with TCP ------------------------------------------------------------------

TEST(CudaSharedMemory, MhcOutputsEqualTcpBitwiseAndNoTensorByteIsCopied) {
  std::mt19937_64 rng = MakeRng(91);
  const PackedWeightSet set = MakeWeightSet(rng, "ipc/mhc", MhcSetSpec{.hc_mult = 4, .hidden = 320}, std::nullopt);
  IpcServer s = StartIpcServer({set});
  ASSERT_NE(s.client, nullptr);
  for (const MhcVariant& k : kMhcVariants) {
    for (int64_t T : {int64_t{1}, int64_t{7}, int64_t{300}}) {
      for (auto pref : {v1::PATH_PREFERENCE_AUTO, v1::PATH_PREFERENCE_FORCE_UNFUSED}) {
        SCOPED_TRACE(::testing::Message() << "stage " << k.stage << " mode " << k.mode << " aux " << k.aux << " T "
                                          << T << " pref " << pref);
        const MhcRequestSpec spec{4, 320, T, k.stage, k.mode, k.pre_mix, k.aux};
        v1::MhcSeamRequest req = MakeMhcRequest(rng, "ipc/mhc", spec);
        req.set_path_preference(pref);
        absl::StatusOr<v1::MhcSeamResponse> tcp = s.client->MhcSeam(req);
        ASSERT_TRUE(tcp.ok()) << tcp.status();

        absl::StatusOr<std::unique_ptr<ClientCudaSharedMemory>> region = ClientCudaSharedMemory::Create(
            *s.client, *s.device, client::MhcRequestSharedBytes(req, MhcConfigOf(spec)));
        ASSERT_TRUE(region.ok()) << region.status();
        v1::MhcSeamRequest by_ref = req;
        ASSERT_TRUE((*region)->Prepare(by_ref, MhcConfigOf(spec)).ok());
        EXPECT_LT(by_ref.ByteSizeLong(), 2048u);  // no tensor bytes in the message
        EXPECT_TRUE(by_ref.x().has_cuda_shared_memory());
        PoisonOutputs(*s.device, **region, by_ref.output_placements());
        s.control->copies_to_device = 0;
        s.control->copies_to_host = 0;
        const int64_t lane_kernels = s.control->lane_kernels.load();
        absl::StatusOr<v1::MhcSeamResponse> got = s.client->MhcSeam(by_ref);
        ASSERT_TRUE(got.ok()) << got.status();
        // The kernels ran on the lane, on the client's memory: nothing staged, nothing copied.
        EXPECT_GT(s.control->lane_kernels.load(), lane_kernels);
        EXPECT_EQ(s.control->copies_to_device.load(), 0);
        EXPECT_EQ(s.control->copies_to_host.load(), 0);
        EXPECT_LT(got->ByteSizeLong(), 4096u);
        EXPECT_TRUE(got->y().has_cuda_shared_memory());
        EXPECT_TRUE(got->y().data().empty());
        EXPECT_EQ(got->y().shape_size(), 2);
        EXPECT_EQ(got->report().path(), tcp->report().path());
        EXPECT_EQ(got->report().batch_requests(), 1u);
        // Read right after the response: the contract says the kernels completed before it was sent.
        ASSERT_TRUE((*region)->Fetch(*got).ok());
        ExpectMhcEqual(*got, *tcp);
        ExpectSameOutputsPresent(*got, *tcp);
      }
    }
  }
}

TEST(CudaSharedMemory, SwaOutputsEqualTcpBitwiseForEveryLayout) {
  std::mt19937_64 rng = MakeRng(92);
  const auto& cases = kSwaLayoutVariants;
  std::vector<PackedWeightSet> sets;
  for (size_t k = 0; k < std::size(cases); ++k) {
    sets.push_back(MakeWeightSet(rng, "ipc/swa" + std::to_string(k), std::nullopt, cases[k].first));
  }
  IpcServer s = StartIpcServer(sets);
  ASSERT_NE(s.client, nullptr);
  for (size_t k = 0; k < std::size(cases); ++k) {
    const auto& [spec, extra] = cases[k];
    const std::string name = "ipc/swa" + std::to_string(k);
    absl::StatusOr<v1::WeightSetInfo> info = s.client->FindWeightSet(name);
    ASSERT_TRUE(info.ok()) << info.status();
    for (int64_t M : {int64_t{1}, int64_t{6}, int64_t{130}}) {
      SCOPED_TRACE(::testing::Message() << name << " M " << M);
      v1::SwaNormQuantRequest req = MakeSwaRequest(rng, name, M, spec.q_rank + spec.head_dim + extra);
      absl::StatusOr<v1::SwaNormQuantResponse> tcp = s.client->SwaNormQuant(req);
      ASSERT_TRUE(tcp.ok()) << tcp.status();
      absl::StatusOr<std::unique_ptr<ClientCudaSharedMemory>> region = ClientCudaSharedMemory::Create(
          *s.client, *s.device, client::SwaRequestSharedBytes(req, info->swa(), info->wq_b_rows()));
      ASSERT_TRUE(region.ok()) << region.status();
      v1::SwaNormQuantRequest by_ref = req;
      ASSERT_TRUE((*region)->Prepare(by_ref, info->swa(), info->wq_b_rows()).ok());
      PoisonOutputs(*s.device, **region, by_ref.output_placements());
      s.control->copies_to_device = 0;
      s.control->copies_to_host = 0;
      absl::StatusOr<v1::SwaNormQuantResponse> got = s.client->SwaNormQuant(by_ref);
      ASSERT_TRUE(got.ok()) << got.status();
      EXPECT_EQ(s.control->copies_to_device.load(), 0);
      EXPECT_EQ(s.control->copies_to_host.load(), 0);
      EXPECT_TRUE(got->q_fp8().has_cuda_shared_memory());
      ASSERT_TRUE((*region)->Fetch(*got).ok());
      ExpectSwaEqual(*got, *tcp);
      ExpectSameOutputsPresent(*got, *tcp);
    }
  }
}

// Inline inputs and CUDA shared-memory ones mix in one request: the inline ones are staged to the
// device as usual, the others pass through; outputs left inline come back in the response.
TEST(CudaSharedMemory, InlineAndDeviceTensorsMixInOneRequest) {
  std::mt19937_64 rng = MakeRng(93);
  const PackedWeightSet set = MakeWeightSet(rng, "ipc/mix", MhcSetSpec{.hc_mult = 4, .hidden = 320}, std::nullopt);
  IpcServer s = StartIpcServer({set});
  ASSERT_NE(s.client, nullptr);
  const v1::MhcSeamRequest req = MakeMhcRequest(rng, "ipc/mix", {.hc_mult = 4, .hidden = 320, .tokens = 5});
  absl::StatusOr<v1::MhcSeamResponse> tcp = s.client->MhcSeam(req);
  ASSERT_TRUE(tcp.ok()) << tcp.status();
  absl::StatusOr<IpcExportedBuffer> mem = s.device->AllocateIpcExportable(1 << 20);
  ASSERT_TRUE(mem.ok());
  ASSERT_TRUE(s.client->RegisterCudaSharedMemory("mix", mem->handle, 0, 0, 1 << 20).ok());
  char* dev = static_cast<char*>(mem->buffer.data());
  v1::MhcSeamRequest by_ref = req;
  ASSERT_TRUE(s.device->CopyToDevice(dev, req.residual().data().data(), req.residual().data().size()).ok());
  *by_ref.mutable_residual()->mutable_cuda_shared_memory() = Ref("mix", 0, req.residual().data().size());
  const uint64_t y_at = 1 << 19, y_bytes = tcp->y().data().size();
  v1::OutputPlacement* p = by_ref.add_output_placements();
  p->set_output("y");
  *p->mutable_cuda_shared_memory() = Ref("mix", y_at, y_bytes);
  absl::StatusOr<v1::MhcSeamResponse> got = s.client->MhcSeam(by_ref);
  ASSERT_TRUE(got.ok()) << got.status();
  ASSERT_TRUE(got->y().has_cuda_shared_memory());
  std::string y(y_bytes, '\0');
  ASSERT_TRUE(s.device->CopyToHost(y.data(), dev + y_at, y_bytes).ok());
  EXPECT_EQ(y, tcp->y().data());
  got->mutable_y()->set_data(y);
  ExpectMhcEqual(*got, *tcp);
}

// ---- bad registrations and references ----------------------------------------------------------------

TEST(CudaSharedMemory, EveryBadRegistrationAndReferenceHasItsStatusAndTheServerKeepsServing) {
  std::mt19937_64 rng = MakeRng(94);
  const PackedWeightSet set = MakeWeightSet(rng, "ipc/bad", MhcSetSpec{.hc_mult = 4, .hidden = 320}, std::nullopt);
  IpcServer s = StartIpcServer({set});
  ASSERT_NE(s.client, nullptr);
  FusedLayerClient& c = *s.client;
  constexpr uint64_t kBytes = 1 << 20;
  absl::StatusOr<IpcExportedBuffer> mem = s.device->AllocateIpcExportable(kBytes);
  ASSERT_TRUE(mem.ok());
  const std::string& h = mem->handle;

  // Registrations.
  auto expect_register = [&](StatusCode code, const std::string& name, const std::string& handle, int device,
                             uint64_t offset, uint64_t bytes, const char* why) {
    absl::Status st = c.RegisterCudaSharedMemory(name, handle, device, offset, bytes);
    EXPECT_EQ(st.code(), code) << why << ": " << st;
  };
  expect_register(StatusCode::kInvalidArgument, "bad/name", h, 0, 0, 64, "name with a slash");
  expect_register(StatusCode::kInvalidArgument, "", h, 0, 0, 64, "empty name");
  expect_register(StatusCode::kInvalidArgument, "r", h.substr(0, 63), 0, 0, 64, "short handle");
  expect_register(StatusCode::kInvalidArgument, "r", std::string(64, '\0'), 0, 0, 64, "a handle of nothing");
  expect_register(StatusCode::kInvalidArgument, "r", h, 1, 0, 64, "another GPU");
  expect_register(StatusCode::kInvalidArgument, "r", h, 0, 0, 0, "zero bytes");
  expect_register(StatusCode::kInvalidArgument, "r", h, 0, 32, 64, "misaligned offset");
  expect_register(StatusCode::kInvalidArgument, "r", h, 0, UINT64_MAX - 63, 128, "offset + size overflows");
  expect_register(StatusCode::kInvalidArgument, "r", h, 0, 0, kBytes + 64, "past the allocation");
  expect_register(StatusCode::kInvalidArgument, "r", h, 0, kBytes - 64, 128, "straddles the allocation's end");
  EXPECT_EQ(s.control->open_ipc_handles.load(), 0);  // every failed opening was closed again
  ASSERT_TRUE(c.RegisterCudaSharedMemory("r", h, 0, 4096, kBytes - 4096).ok());
  expect_register(StatusCode::kAlreadyExists, "r", h, 0, 0, 64, "the name again");

  // References (the region starts 4096 bytes into the allocation).
  const v1::MhcSeamRequest req = MakeMhcRequest(rng, "ipc/bad", {.hc_mult = 4, .hidden = 320, .tokens = 3});
  const uint64_t x_bytes = req.x().data().size(), r_bytes = req.residual().data().size();
  auto with_x = [&](const v1::SharedMemoryRef& ref) {
    v1::MhcSeamRequest r = req;
    *r.mutable_x()->mutable_cuda_shared_memory() = ref;
    return r;
  };
  auto expect_call = [&](StatusCode code, const v1::MhcSeamRequest& r, const char* why) {
    absl::StatusOr<v1::MhcSeamResponse> got = c.MhcSeam(r);
    EXPECT_EQ(got.status().code(), code) << why << ": " << got.status();
  };
  expect_call(StatusCode::kNotFound, with_x(Ref("nope", 0, x_bytes)), "unknown region");
  expect_call(StatusCode::kInvalidArgument, with_x(Ref("bad name", 0, x_bytes)), "bad region name");
  expect_call(StatusCode::kInvalidArgument, with_x(Ref("r", kBytes - 4096 - 64, x_bytes)), "runs past the region");
  expect_call(StatusCode::kInvalidArgument, with_x(Ref("r", UINT64_MAX - 63, x_bytes)), "offset overflows");
  expect_call(StatusCode::kInvalidArgument, with_x(Ref("r", 96, x_bytes)), "misaligned");
  expect_call(StatusCode::kInvalidArgument, with_x(Ref("r", 0, x_bytes - 2)), "byte_size is not the shape's");
  {
    v1::MhcSeamRequest r = with_x(Ref("r", 0, x_bytes));
    r.set_verify(true);
    expect_call(StatusCode::kInvalidArgument, r, "verify needs inline tensors");
  }
  {
    // An output over an input: the kernels would read what they write.
    v1::MhcSeamRequest r = req;
    *r.mutable_residual()->mutable_cuda_shared_memory() = Ref("r", 0, r_bytes);
    v1::OutputPlacement* p = r.add_output_placements();
    p->set_output("new_residual");
    *p->mutable_cuda_shared_memory() = Ref("r", 64, r_bytes);
    expect_call(StatusCode::kInvalidArgument, r, "output overlaps input");
  }
  {
    v1::MhcSeamRequest r = req;
    v1::OutputPlacement* p = r.add_output_placements();
    p->set_output("y");
    *p->mutable_cuda_shared_memory() = Ref("r", 0, x_bytes);
    p = r.add_output_placements();
    p->set_output("new_residual");
    *p->mutable_cuda_shared_memory() = Ref("r", x_bytes - 64, r_bytes);
    expect_call(StatusCode::kInvalidArgument, r, "two outputs overlap");
  }
  {
    v1::MhcSeamRequest r = req;
    v1::OutputPlacement* p = r.add_output_placements();
    p->set_output("y");
    *p->mutable_cuda_shared_memory() = Ref("r", 0, x_bytes + 2);
    expect_call(StatusCode::kInvalidArgument, r, "output byte_size");
  }
  // Still serving, and the region still works.
  absl::StatusOr<v1::MhcSeamResponse> tcp = c.MhcSeam(req);
  ASSERT_TRUE(tcp.ok()) << tcp.status();
  ASSERT_TRUE(s.device->CopyToDevice(static_cast<char*>(mem->buffer.data()) + 4096, req.x().data().data(), x_bytes).ok());
  absl::StatusOr<v1::MhcSeamResponse> got = c.MhcSeam(with_x(Ref("r", 0, x_bytes)));
  ASSERT_TRUE(got.ok()) << got.status();
  ExpectMhcEqual(*got, *tcp);
  // A region unregistered while nothing uses it: its name is gone, its handle closed.
  absl::StatusOr<v1::UnregisterCudaSharedMemoryResponse> gone = c.UnregisterCudaSharedMemory("r");
  ASSERT_TRUE(gone.ok());
  EXPECT_EQ(gone->freed_bytes(), kBytes - 4096);
  expect_call(StatusCode::kNotFound, with_x(Ref("r", 0, x_bytes)), "unregistered");
  EXPECT_EQ(OpenIpcHandlesOnceSettled(*s.control, 0), 0);  // once the last call that used it is done
}

TEST(CudaSharedMemory, OffOrWithoutAGpuIsFailedPrecondition) {
  std::mt19937_64 rng = MakeRng(95);
  const PackedWeightSet set = MakeWeightSet(rng, "ipc/off", MhcSetSpec{.hc_mult = 4, .hidden = 320}, std::nullopt);
  const v1::MhcSeamRequest req = MakeMhcRequest(rng, "ipc/off", {.hc_mult = 4, .hidden = 320, .tokens = 2});
  v1::MhcSeamRequest by_ref = req;
  *by_ref.mutable_x()->mutable_cuda_shared_memory() = Ref("r", 0, req.x().data().size());
  // Off (the default), on a backend that could: nothing is opened.
  server::ServerConfig off = CudaShmConfig();
  off.allow_cuda_shared_memory = false;
  IpcServer s = StartIpcServer({set}, off);
  ASSERT_NE(s.client, nullptr);
  absl::StatusOr<IpcExportedBuffer> mem = s.device->AllocateIpcExportable(4096);
  ASSERT_TRUE(mem.ok());
  absl::Status st = s.client->RegisterCudaSharedMemory("r", mem->handle, 0, 0, 4096);
  EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition) << st;
  EXPECT_NE(st.message().find("--allow_cuda_shared_memory"), std::string::npos) << st;
  EXPECT_EQ(s.client->CudaSharedMemoryStatus().status().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(s.client->UnregisterCudaSharedMemory("").status().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(s.client->MhcSeam(by_ref).status().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(s.control->open_ipc_handles.load(), 0);
  absl::StatusOr<v1::GetServerInfoResponse> info = s.client->GetServerInfo();
  ASSERT_TRUE(info.ok());
  EXPECT_FALSE(info->cuda_shared_memory_enabled());

  // On, on the CPU backend: no GPU to open a handle on.
  server::ServerConfig on = TestConfig();
  on.allow_cuda_shared_memory = true;
  auto cpu = TestServer::Start(on, nullptr, {set});
  ASSERT_NE(cpu, nullptr);
  auto c = ClientFor(*cpu);
  st = c->RegisterCudaSharedMemory("r", mem->handle, 0, 0, 4096);
  EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition) << st;
  EXPECT_NE(st.message().find("GPU backend"), std::string::npos) << st;
  EXPECT_EQ(c->MhcSeam(by_ref).status().code(), StatusCode::kFailedPrecondition);
  info = c->GetServerInfo();
  ASSERT_TRUE(info.ok());
  EXPECT_FALSE(info->cuda_shared_memory_enabled());
  EXPECT_EQ(info->device_id(), -1);
  absl::StatusOr<v1::MhcSeamResponse> still = c->MhcSeam(req);
  EXPECT_TRUE(still.ok()) << still.status();
}

// Two regions on one handle share one opening; it is closed when the last of them goes and the last
// request using it completed.
TEST(CudaSharedMemory, AHandleIsOpenedOnceAndClosedWithItsLastRegion) {
  std::mt19937_64 rng = MakeRng(96);
  IpcServer s = StartIpcServer({});
  ASSERT_NE(s.client, nullptr);
  absl::StatusOr<IpcExportedBuffer> mem = s.device->AllocateIpcExportable(1 << 16);
  ASSERT_TRUE(mem.ok());
  ASSERT_TRUE(s.client->RegisterCudaSharedMemory("a", mem->handle, 0, 0, 4096).ok());
  ASSERT_TRUE(s.client->RegisterCudaSharedMemory("b", mem->handle, 0, 4096, 4096).ok());
  EXPECT_EQ(s.control->open_ipc_handles.load(), 1);
  absl::StatusOr<v1::CudaSharedMemoryStatusResponse> listed = s.client->CudaSharedMemoryStatus();
  ASSERT_TRUE(listed.ok());
  ASSERT_EQ(listed->regions_size(), 2);
  EXPECT_EQ(listed->regions(1).name(), "b");
  EXPECT_EQ(listed->regions(1).offset(), 4096u);
  EXPECT_EQ(listed->regions(1).device_id(), 0);
  EXPECT_EQ(MetricValue(s.ts->Scrape(), "fusedlayer_cuda_shared_memory_regions"), 2.0);
  ASSERT_TRUE(s.client->UnregisterCudaSharedMemory("a").ok());
  EXPECT_EQ(s.control->open_ipc_handles.load(), 1);
  ASSERT_TRUE(s.client->UnregisterCudaSharedMemory("b").ok());
  EXPECT_EQ(s.control->open_ipc_handles.load(), 0);
  // Registered again: opened again.
  ASSERT_TRUE(s.client->RegisterCudaSharedMemory("a", mem->handle, 0, 0, 4096).ok());
  EXPECT_EQ(s.control->open_ipc_handles.load(), 1);
  absl::StatusOr<v1::UnregisterCudaSharedMemoryResponse> all = s.client->UnregisterCudaSharedMemory("");
  ASSERT_TRUE(all.ok());
  EXPECT_EQ(all->unregistered(), 1u);
  EXPECT_EQ(s.control->open_ipc_handles.load(), 0);
  const std::string scrape = s.ts->Scrape();
  EXPECT_EQ(MetricValue(scrape, "fusedlayer_cuda_shared_memory_regions"), 0.0);
  EXPECT_EQ(MetricValue(scrape, "fusedlayer_cuda_shared_memory_registered_bytes"), 0.0);
}

// --cuda_shared_memory_idle_seconds: a region no request uses (its client died without
// unregistering, and the server's opening keeps the client's allocation alive) is unregistered
// after the idle time, and the opening closes with it; a region requests use stays.
TEST(CudaSharedMemory, ARegionNoRequestUsesIsUnregisteredAndItsOpeningClosed) {
  std::mt19937_64 rng = MakeRng(101);
  const PackedWeightSet set = MakeWeightSet(rng, "ipc/idle", MhcSetSpec{.hc_mult = 4, .hidden = 256}, std::nullopt);
  server::ServerConfig cfg = CudaShmConfig();
  cfg.cuda_shared_memory_idle_seconds = 2;
  IpcServer s = StartIpcServer({set}, cfg);
  ASSERT_NE(s.client, nullptr);
  const MhcRequestSpec spec{.hc_mult = 4, .hidden = 256, .tokens = 1};
  const v1::MhcSeamRequest req = MakeMhcRequest(rng, "ipc/idle", spec);
  absl::StatusOr<v1::MhcSeamResponse> tcp = s.client->MhcSeam(req);
  ASSERT_TRUE(tcp.ok()) << tcp.status();

  absl::StatusOr<IpcExportedBuffer> dead = s.device->AllocateIpcExportable(1 << 16);
  absl::StatusOr<IpcExportedBuffer> used = s.device->AllocateIpcExportable(1 << 16);
  ASSERT_TRUE(dead.ok() && used.ok());
  const auto before_dead = std::chrono::steady_clock::now();
  ASSERT_TRUE(s.client->RegisterCudaSharedMemory("dead", dead->handle, 0, 0, 1 << 16).ok());
  ASSERT_TRUE(s.client->RegisterCudaSharedMemory("used", used->handle, 0, 0, 1 << 16).ok());
  EXPECT_EQ(s.control->open_ipc_handles.load(), 2);
  // x in "used" (the rest inline), called every 250 ms (a gap of 2 s would be a call 7x slower than
  // that, even under a sanitizer); "dead" never. Until "dead" is gone: not before its idle time,
  // and within a bound.
  const std::string& x = req.x().data();
  ASSERT_TRUE(s.device->CopyToDevice(static_cast<char*>(used->buffer.data()), x.data(), x.size()).ok());
  v1::MhcSeamRequest by_ref = req;
  *by_ref.mutable_x()->mutable_cuda_shared_memory() = Ref("used", 0, x.size());
  by_ref.mutable_x()->clear_data();
  absl::StatusOr<v1::CudaSharedMemoryStatusResponse> listed;
  const auto give_up = before_dead + std::chrono::seconds(20);
  do {
    absl::StatusOr<v1::MhcSeamResponse> got = s.client->MhcSeam(by_ref);
    ASSERT_TRUE(got.ok()) << got.status();
    ExpectMhcEqual(*got, *tcp);
    std::this_thread::sleep_for(std::chrono::milliseconds(250));
    listed = s.client->CudaSharedMemoryStatus();
    ASSERT_TRUE(listed.ok());
  } while (listed->regions_size() == 2 && std::chrono::steady_clock::now() < give_up);
  EXPECT_GE(std::chrono::steady_clock::now() - before_dead, std::chrono::seconds(2));  // not early
  ASSERT_EQ(listed->regions_size(), 1);
  EXPECT_EQ(listed->regions(0).name(), "used");
  EXPECT_EQ(s.control->open_ipc_handles.load(), 1);  // the dead client's allocation is let go
  v1::MhcSeamRequest on_dead = by_ref;
  *on_dead.mutable_x()->mutable_cuda_shared_memory() = Ref("dead", 0, x.size());
  const absl::Status gone = s.client->MhcSeam(on_dead).status();
  EXPECT_EQ(gone.code(), StatusCode::kNotFound) << gone;
  EXPECT_NE(gone.message().find("--cuda_shared_memory_idle_seconds"), std::string::npos) << gone;
  const std::string scrape = s.ts->Scrape();
  EXPECT_EQ(MetricValue(scrape, "fusedlayer_cuda_shared_memory_regions_expired_total"), 1.0);
  EXPECT_EQ(MetricValue(scrape, "fusedlayer_cuda_shared_memory_regions"), 1.0);
}

// Outputs the kernels write in the client's device buffers are neither sent nor held by the server:
// a call whose outputs alone are over the send limit (--max_message_bytes), or over what
// --max_inflight_bytes admits, runs by reference and is bitwise the library's answer; the same call
// with its outputs inline is refused before running, naming the limit.
TEST(CudaSharedMemory, PlacedOutputsCountAgainstNeitherTheSendLimitNorAdmission) {
  std::mt19937_64 rng = MakeRng(99);
  const PackedWeightSet set = MakeWeightSet(rng, "ipc/big", MhcSetSpec{.hc_mult = 4, .hidden = 320}, std::nullopt);
  Reference ref(set);
  const MhcRequestSpec spec{.hc_mult = 4, .hidden = 320, .tokens = 64, .capture_aux = true};  // outputs ~250 KB
  server::ServerConfig send_limited = CudaShmConfig();
  send_limited.max_message_bytes = 64 << 10;
  server::ServerConfig admission_limited = CudaShmConfig();
  admission_limited.max_inflight_bytes = 128 << 10;
  for (const auto& [cfg, limit] : {std::pair{send_limited, "--max_message_bytes"},
                                   std::pair{admission_limited, "--max_inflight_bytes"}}) {
    SCOPED_TRACE(limit);
    IpcServer s = StartIpcServer({set}, cfg);
    ASSERT_NE(s.client, nullptr);
    const v1::MhcSeamRequest req = MakeMhcRequest(rng, "ipc/big", spec);
    const v1::MhcSeamResponse want = ref.RunMhc(req, Path::kFused);
    ASSERT_GT(want.ByteSizeLong(), 128u << 10);
    absl::StatusOr<std::unique_ptr<ClientCudaSharedMemory>> region =
        ClientCudaSharedMemory::Create(*s.client, *s.device, client::MhcRequestSharedBytes(req, MhcConfigOf(spec)));
    ASSERT_TRUE(region.ok()) << region.status();
    v1::MhcSeamRequest by_ref = req;
    ASSERT_TRUE((*region)->Prepare(by_ref, MhcConfigOf(spec)).ok());
    PoisonOutputs(*s.device, **region, by_ref.output_placements());
    absl::StatusOr<v1::MhcSeamResponse> got = s.client->MhcSeam(by_ref);
    ASSERT_TRUE(got.ok()) << got.status();
    ASSERT_TRUE((*region)->Fetch(*got).ok());
    ExpectMhcEqual(*got, want);

    v1::MhcSeamRequest outputs_inline = by_ref;  // inputs still by reference: a small request
    outputs_inline.clear_output_placements();
    absl::StatusOr<v1::MhcSeamResponse> refused = s.client->MhcSeam(outputs_inline);
    EXPECT_EQ(refused.status().code(), StatusCode::kResourceExhausted) << refused.status();
    EXPECT_NE(refused.status().message().find(limit), absl::string_view::npos) << refused.status();
  }
}

// Drain completes the requests in flight on CUDA shared memory (their kernels held on the lane when
// the drain begins), bitwise; their regions are still open until they finish.
TEST(CudaSharedMemory, DrainCompletesRequestsInFlight) {
  std::mt19937_64 rng = MakeRng(98);
  const PackedWeightSet set = MakeWeightSet(rng, "ipc/drain", MhcSetSpec{.hc_mult = 4, .hidden = 320}, std::nullopt);
  IpcServer s = StartIpcServer({set});
  ASSERT_NE(s.client, nullptr);
  const MhcRequestSpec spec{.hc_mult = 4, .hidden = 320, .tokens = 3};
  constexpr int kRequests = 3;
  std::vector<v1::MhcSeamRequest> requests(kRequests);
  std::vector<v1::MhcSeamResponse> want;
  std::vector<std::unique_ptr<ClientCudaSharedMemory>> regions;
  for (int i = 0; i < kRequests; ++i) {
    const v1::MhcSeamRequest req = MakeMhcRequest(rng, "ipc/drain", spec);
    absl::StatusOr<v1::MhcSeamResponse> tcp = s.client->MhcSeam(req);
    ASSERT_TRUE(tcp.ok()) << tcp.status();
    want.push_back(*tcp);
    absl::StatusOr<std::unique_ptr<ClientCudaSharedMemory>> region =
        ClientCudaSharedMemory::Create(*s.client, *s.device, client::MhcRequestSharedBytes(req, MhcConfigOf(spec)));
    ASSERT_TRUE(region.ok()) << region.status();
    requests[i] = req;
    ASSERT_TRUE((*region)->Prepare(requests[i], MhcConfigOf(spec)).ok());
    PoisonOutputs(*s.device, **region, requests[i].output_placements());
    regions.push_back(*std::move(region));
  }
  const int64_t kernels = s.control->KernelsEnqueued();
  std::vector<absl::StatusOr<v1::MhcSeamResponse>> got(kRequests, absl::UnknownError("not run"));
  s.control->Hold();
  std::vector<std::thread> callers;
  for (int i = 0; i < kRequests; ++i) callers.emplace_back([&, i] { got[i] = s.client->MhcSeam(requests[i]); });
  s.control->WaitForKernelsEnqueued(kernels + 1);  // one on the lane, held there
  // The others are inside the server too before the drain begins (admitted: they must complete).
  WaitForInflightRequests(*s.ts, kRequests);
  std::thread drain([&] { s.ts->server().Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(30)); });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));  // let the drain begin (not asserted)
  s.control->Release();
  for (std::thread& t : callers) t.join();
  drain.join();
  for (int i = 0; i < kRequests; ++i) {
    ASSERT_TRUE(got[i].ok()) << got[i].status();
    ASSERT_TRUE(regions[i]->Fetch(*got[i]).ok());
    ExpectMhcEqual(*got[i], want[i]);
  }
}

// ---- ownership and limits ---------------------------------------------------------------------------

class CudaSharedMemoryTokens : public TwoTokenFile {};

TEST_F(CudaSharedMemoryTokens, ARegionBelongsToTheTokenThatRegisteredIt) {
  std::mt19937_64 rng = MakeRng(97);
  const PackedWeightSet set = MakeWeightSet(rng, "ipc/own", MhcSetSpec{.hc_mult = 4, .hidden = 320}, std::nullopt);
  server::ServerConfig cfg = CudaShmConfig();
  cfg.auth_tokens_file = file_;
  IpcServer s = StartIpcServer({set}, cfg, token_a_);
  ASSERT_NE(s.client, nullptr);
  FusedLayerClient& a = *s.client;
  auto b = ClientFor(*s.ts, token_b_), nobody = ClientFor(*s.ts);
  absl::StatusOr<IpcExportedBuffer> mem_a = s.device->AllocateIpcExportable(1 << 16);
  absl::StatusOr<IpcExportedBuffer> mem_b = s.device->AllocateIpcExportable(1 << 16);
  ASSERT_TRUE(mem_a.ok() && mem_b.ok());
  ASSERT_TRUE(a.RegisterCudaSharedMemory("mine", mem_a->handle, 0, 0, 1 << 16).ok());
  EXPECT_EQ(nobody->RegisterCudaSharedMemory("x", mem_b->handle, 0, 0, 64).code(), StatusCode::kUnauthenticated);

  // B cannot see, use or remove A's region; the answer is the one for a name never registered.
  absl::StatusOr<v1::CudaSharedMemoryStatusResponse> listed = b->CudaSharedMemoryStatus();
  ASSERT_TRUE(listed.ok());
  EXPECT_EQ(listed->regions_size(), 0);
  EXPECT_EQ(b->CudaSharedMemoryStatus("mine").status().code(), StatusCode::kNotFound);
  EXPECT_EQ(b->UnregisterCudaSharedMemory("mine").status().code(), StatusCode::kNotFound);
  const v1::MhcSeamRequest req = MakeMhcRequest(rng, "ipc/own", {.hc_mult = 4, .hidden = 320, .tokens = 2});
  ASSERT_TRUE(s.device->CopyToDevice(mem_a->buffer.data(), req.x().data().data(), req.x().data().size()).ok());
  v1::MhcSeamRequest by_ref = req;
  *by_ref.mutable_x()->mutable_cuda_shared_memory() = Ref("mine", 0, req.x().data().size());
  EXPECT_EQ(b->MhcSeam(by_ref).status().code(), StatusCode::kNotFound);
  // B may not register A's allocation under a name of its own either.
  absl::Status taken = b->RegisterCudaSharedMemory("theirs", mem_a->handle, 0, 0, 64);
  EXPECT_EQ(taken.code(), StatusCode::kPermissionDenied) << taken;
  // Names are per identity.
  ASSERT_TRUE(b->RegisterCudaSharedMemory("mine", mem_b->handle, 0, 0, 1 << 16).ok());

  absl::StatusOr<v1::MhcSeamResponse> got = a.MhcSeam(by_ref);
  ASSERT_TRUE(got.ok()) << got.status();
  absl::StatusOr<v1::MhcSeamResponse> tcp = a.MhcSeam(req);
  ASSERT_TRUE(tcp.ok());
  ExpectMhcEqual(*got, *tcp);
  absl::StatusOr<v1::UnregisterCudaSharedMemoryResponse> all = a.UnregisterCudaSharedMemory("");
  ASSERT_TRUE(all.ok());
  EXPECT_EQ(all->unregistered(), 1u);
  // Once A let go, B may take the allocation.
  EXPECT_TRUE(b->RegisterCudaSharedMemory("theirs", mem_a->handle, 0, 0, 64).ok());
}

// The byte limit counts what a registration keeps open in the server: the handle's whole
// allocation, once per handle, however small its regions (a 64-byte region of a large allocation,
// then exit, must not leave the server holding the allocation beyond the limit).
TEST_F(CudaSharedMemoryTokens, LimitsArePerIdentityAndTheGaugesFollow) {
  server::ServerConfig cfg = CudaShmConfig();
  cfg.auth_tokens_file = file_;
  cfg.cuda_shared_memory_max_regions = 2;
  cfg.cuda_shared_memory_max_bytes = 1 << 17;
  IpcServer s = StartIpcServer({}, cfg, token_a_);
  ASSERT_NE(s.client, nullptr);
  FusedLayerClient& a = *s.client;
  auto b = ClientFor(*s.ts, token_b_);
  absl::StatusOr<IpcExportedBuffer> mem = s.device->AllocateIpcExportable(1 << 16);
  absl::StatusOr<IpcExportedBuffer> other = s.device->AllocateIpcExportable(1 << 17);
  absl::StatusOr<IpcExportedBuffer> huge = s.device->AllocateIpcExportable(1 << 18);
  ASSERT_TRUE(mem.ok() && other.ok() && huge.ok());
  ASSERT_TRUE(a.RegisterCudaSharedMemory("r1", mem->handle, 0, 0, 4096).ok());
  ASSERT_TRUE(a.RegisterCudaSharedMemory("r2", mem->handle, 0, 4096, 4096).ok());
  absl::Status third = a.RegisterCudaSharedMemory("r3", mem->handle, 0, 8192, 4096);
  EXPECT_EQ(third.code(), StatusCode::kResourceExhausted) << third;
  EXPECT_NE(third.message().find("--cuda_shared_memory_max_regions"), std::string::npos);
  std::string scrape = s.ts->Scrape();
  EXPECT_EQ(MetricValue(scrape, "fusedlayer_cuda_shared_memory_regions"), 2.0);
  EXPECT_EQ(MetricValue(scrape, "fusedlayer_cuda_shared_memory_registered_bytes"), 8192.0);

  // 64 bytes of a 256 KiB allocation: the allocation is over B's 128 KiB.
  absl::Status too_big = b->RegisterCudaSharedMemory("small", huge->handle, 0, 0, 64);
  EXPECT_EQ(too_big.code(), StatusCode::kResourceExhausted) << too_big;
  EXPECT_NE(too_big.message().find("--cuda_shared_memory_max_bytes"), std::string::npos);
  // A 128 KiB allocation fills B's budget with its first region; a second region of it costs nothing
  // more, a region of any other allocation does.
  ASSERT_TRUE(b->RegisterCudaSharedMemory("big", other->handle, 0, 0, 64).ok());
  EXPECT_TRUE(b->RegisterCudaSharedMemory("more", other->handle, 0, 1 << 16, 64).ok());
  ASSERT_TRUE(b->UnregisterCudaSharedMemory("more").ok());
  EXPECT_EQ(b->RegisterCudaSharedMemory("more", mem->handle, 0, 0, 64).code(), StatusCode::kPermissionDenied);
  // A's budget is its own: its 64 KiB allocation is charged once, across r1 and r2.
  ASSERT_TRUE(a.UnregisterCudaSharedMemory("r1").ok());
  EXPECT_TRUE(a.RegisterCudaSharedMemory("r3", mem->handle, 0, 8192, 4096).ok());
  scrape = s.ts->Scrape();
  EXPECT_EQ(MetricValue(scrape, "fusedlayer_cuda_shared_memory_regions"), 3.0);
  EXPECT_EQ(MetricValue(scrape, "fusedlayer_cuda_shared_memory_registered_bytes"), 8192.0 + 64.0);
  EXPECT_EQ(s.control->open_ipc_handles.load(), 2);
  // B's last region of its allocation goes: the budget is back for another allocation.
  ASSERT_TRUE(b->UnregisterCudaSharedMemory("big").ok());
  absl::StatusOr<IpcExportedBuffer> next = s.device->AllocateIpcExportable(1 << 17);
  ASSERT_TRUE(next.ok());
  EXPECT_TRUE(b->RegisterCudaSharedMemory("next", next->handle, 0, 0, 64).ok());
}

}  // namespace
}  // namespace fusedlayer::testing
