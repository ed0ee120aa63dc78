// System shared-memory transport end to end (server/transport/shared_memory.h, client/lib/shared_memory.h):
// in-process servers with --allow_shared_memory, regions created here with shm_open.
//
//  - outputs bitwise equal to the same request over TCP (fresh random inputs with outliers; the
//    output ranges poisoned before every call), for every mHC stage / aux / path and SWA layout;
//  - every bad reference and registration, with its status code, and the server still serving;
//  - ownership across two bearer tokens; limits per identity; the metrics gauges;
//  - a region whose object shrinks (between requests, and while a request is queued) or is
//    removed: FAILED_PRECONDITION, never a crash; a client that vanishes holding a region (freed by
//    unregistering all, by removing its object, or after --shared_memory_idle_seconds unused);
//  - drain with shared-memory requests in flight.
#include <fcntl.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <fstream>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "client/lib/fusedlayer_client.h"
#include "client_for.h"
#include "client/lib/shared_memory.h"
#include "gtest/gtest.h"
#include "lane_test_backend.h"
#include "server_test_env.h"
#include "test_util.h"
#include "two_token_file.h"

namespace fusedlayer::testing {
namespace {

using absl::StatusCode;
using client::ClientSharedMemory;
using client::FusedLayerClient;
using server::PackedWeightSet;

std::string RandomHex(int n) {
  std::random_device rd;
  static constexpr char kHex[] = "0123456789abcdef";
  std::string s;
  for (int i = 0; i < n; ++i) s.push_back(kHex[rd() % 16]);
  return s;
}

// A POSIX shared-memory object made by the test (what a client process makes), mapped here.
class TestObject {
 public:
  explicit TestObject(uint64_t bytes) : key_("/fl-test-" + RandomHex(24)), bytes_(bytes) {
    const int fd = ::shm_open(key_.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
    EXPECT_GE(fd, 0) << std::strerror(errno);
    EXPECT_EQ(::ftruncate(fd, static_cast<off_t>(bytes)), 0);
    void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    EXPECT_NE(p, MAP_FAILED);
    data_ = static_cast<char*>(p);
    fd_ = fd;
  }
  ~TestObject() {
    if (data_ != nullptr) ::munmap(data_, bytes_);
    if (fd_ >= 0) ::close(fd_);
    ::shm_unlink(key_.c_str());
  }
  const std::string& key() const { return key_; }
  char* data() const { return data_; }
  // What a hostile or buggy client can do at any time.
  void Truncate(uint64_t bytes) {
    if (data_ != nullptr) ::munmap(data_, bytes_);  // our own mapping would SIGBUS us, not the server
    data_ = nullptr;
    ASSERT_EQ(::ftruncate(fd_, static_cast<off_t>(bytes)), 0);
  }
  void Unlink() { ::shm_unlink(key_.c_str()); }

 private:
  std::string key_;
  uint64_t bytes_;
  int fd_ = -1;
  char* data_ = nullptr;
};

server::ServerConfig ShmConfig() {
  server::ServerConfig c = TestConfig();
  c.allow_shared_memory = true;
  return c;
}

v1::MhcConfig MhcConfigOf(const MhcRequestSpec& spec) {
  v1::MhcConfig c;
  c.set_hc_mult(spec.hc_mult);
  c.set_hidden(spec.hidden);
  return c;
}

// Output ranges to NaN bits (0xFF) so a missing write cannot pass for a correct one.
void PoisonOutputs(const ClientSharedMemory& shm, const google::protobuf::RepeatedPtrField<v1::OutputPlacement>& ps) {
  for (const v1::OutputPlacement& p : ps) {
    std::memset(shm.data() + p.shared_memory().offset(), 0xFF, p.shared_memory().byte_size());
  }
}

// A page-locked region is unlocked when the last in-flight reference lets go: the call's end, just
// after its response reached the client, so possibly a moment after the client unregistered it.
void ExpectPageLocksGo(const LaneTestBackend::Control& control) {
  for (int i = 0; i < 500 && control.page_locks.load() != 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  EXPECT_EQ(control.page_locks.load(), 0);
}

v1::SharedMemoryRef Ref(const std::string& region, uint64_t offset, uint64_t bytes) {
  v1::SharedMemoryRef r;
  r.set_region(region);
  r.set_offset(offset);
  r.set_byte_size(bytes);
  return r;
}

// A server on the lane test backend (one lane; device memory apart from the host's, copies only
// from page-locked blocks) with shared memory on and `set` loaded, its backend's counters and a client.
struct LaneShmServer {
  std::unique_ptr<TestServer> ts;
  std::shared_ptr<LaneTestBackend::Control> control;
  std::unique_ptr<FusedLayerClient> client;
};
LaneShmServer StartLaneShmServer(const PackedWeightSet& set, server::ServerConfig cfg = ShmConfig(),
                                 bool refuse_page_lock = false) {
  auto backend = std::make_unique<LaneTestBackend>(8);
  LaneShmServer s;
  s.control = backend->control();
  s.control->refuse_page_lock = refuse_page_lock;
  cfg.device_lanes = 1;
  s.ts = TestServer::Start(cfg, std::move(backend), {set});
  if (s.ts != nullptr) s.client = ClientFor(*s.ts);
  return s;
}

// Runs `by_ref` and expects TCP's answer `tcp` bitwise, with the same outputs present (those
// placed in `shm`, when given, fetched from there first).
void ExpectSameAsTcp(FusedLayerClient& c, const v1::MhcSeamRequest& by_ref, const v1::MhcSeamResponse& tcp,
                     ClientSharedMemory* shm = nullptr) {
  absl::StatusOr<v1::MhcSeamResponse> got = c.MhcSeam(by_ref);
  ASSERT_TRUE(got.ok()) << got.status();
  if (shm != nullptr) ASSERT_TRUE(shm->Fetch(*got).ok());
  ExpectMhcEqual(*got, tcp);
  ExpectSameOutputsPresent(*got, tcp);
}

// `req` with each of its mHC inputs written into `obj` and referenced in region `name`: the first
// at `first`, each next at next_offset(offset, bytes) of the one before.
template <typename NextOffset>
v1::MhcSeamRequest InputsByReference(const v1::MhcSeamRequest& req, TestObject& obj, const std::string& name,
                                     uint64_t first, NextOffset next_offset) {
  v1::MhcSeamRequest by_ref = req;
  uint64_t at = first;
  for (auto [ref, in] : {std::pair{by_ref.mutable_x(), &req.x()}, {by_ref.mutable_residual(), &req.residual()},
                         {by_ref.mutable_post_mix(), &req.post_mix()}, {by_ref.mutable_comb_mix(), &req.comb_mix()},
                         {by_ref.mutable_pre_mix(), &req.pre_mix()}}) {
    std::memcpy(obj.data() + at, in->data().data(), in->data().size());
    *ref->mutable_shared_memory() = Ref(name, at, in->data().size());
    ref->clear_data();
    at = next_offset(at, in->data().size());
  }
  return by_ref;
}

// ---- bitwise equality with TCP ------------------------------------------------------------------

TEST(SharedMemory, MhcOutputsEqualTcpBitwiseForEveryStageAndPath) {
  std::mt19937_64 rng = MakeRng(41);
  const PackedWeightSet set = MakeWeightSet(rng, "shm/mhc", MhcSetSpec{.hc_mult = 4, .hidden = 320}, std::nullopt);
  auto ts = TestServer::Start(ShmConfig(), nullptr, {set});
  ASSERT_NE(ts, nullptr);
  auto c = ClientFor(*ts);
  ASSERT_NE(c, nullptr);
  for (const MhcVariant& k : kMhcVariants) {
    for (int64_t T : {int64_t{0}, int64_t{1}, int64_t{7}}) {
      for (auto pref : {v1::PATH_PREFERENCE_AUTO, v1::PATH_PREFERENCE_FORCE_UNFUSED}) {
        SCOPED_TRACE(::testing::Message() << "stage " << k.stage << " mode " << k.mode << " aux " << k.aux << " T "
                                          << T << " pref " << pref);
        const MhcRequestSpec spec{4, 320, T, k.stage, k.mode, k.pre_mix, k.aux};
        v1::MhcSeamRequest req = MakeMhcRequest(rng, "shm/mhc", spec);
        req.set_path_preference(pref);
        absl::StatusOr<v1::MhcSeamResponse> tcp = c->MhcSeam(req);
        ASSERT_TRUE(tcp.ok()) << tcp.status();

        absl::StatusOr<std::unique_ptr<ClientSharedMemory>> shm =
            ClientSharedMemory::Create(*c, client::MhcRequestSharedBytes(req, MhcConfigOf(spec)));
        ASSERT_TRUE(shm.ok()) << shm.status();
        v1::MhcSeamRequest by_ref = req;
        ASSERT_TRUE((*shm)->Prepare(by_ref, MhcConfigOf(spec)).ok());
        EXPECT_LT(by_ref.ByteSizeLong(), 2048u);  // no tensor bytes in the message
        PoisonOutputs(**shm, by_ref.output_placements());
        absl::StatusOr<v1::MhcSeamResponse> got = c->MhcSeam(by_ref);
        ASSERT_TRUE(got.ok()) << got.status();
        // Outputs come as references with their shapes and dtypes; the report as usual.
        EXPECT_TRUE(got->y().has_shared_memory());
        EXPECT_TRUE(got->y().data().empty());
        EXPECT_EQ(got->y().shape_size(), 2);
        EXPECT_EQ(got->report().path(), tcp->report().path());
        ASSERT_TRUE((*shm)->Fetch(*got).ok());
        ExpectMhcEqual(*got, *tcp);
        ExpectSameOutputsPresent(*got, *tcp);
      }
    }
  }
}

// On a device backend (the lane test backend: device memory apart from the host's, copies only
// from page-locked blocks) the inputs are read from the region straight into a page-locked block
// and go to the device from there in one copy, however large (no staging memcpy, no chunks); the
// outputs are bitwise TCP's.
// Regions the backend does not page-lock (refused here; beyond --shared_memory_locked_bytes) are
// read with pread, into a page-locked block of the request pool.
TEST(SharedMemory, OnLanesInputsAreReadIntoPinnedMemoryAndCopiedFromThereInOneCopy) {
  std::mt19937_64 rng = MakeRng(43);
  const PackedWeightSet set = MakeWeightSet(rng, "shm/lanes", MhcSetSpec{.hc_mult = 4, .hidden = 320}, std::nullopt);
  LaneShmServer server = StartLaneShmServer(set, ShmConfig(), /*refuse_page_lock=*/true);
  ASSERT_NE(server.client, nullptr);
  for (int64_t T : {int64_t{1}, int64_t{7}, int64_t{600}}) {  // 600: R is 1.5 MB, x 0.4 MB
    SCOPED_TRACE(::testing::Message() << "T " << T);
    const MhcRequestSpec spec{.hc_mult = 4, .hidden = 320, .tokens = T};
    v1::MhcSeamRequest req = MakeMhcRequest(rng, "shm/lanes", spec);
    absl::StatusOr<v1::MhcSeamResponse> tcp = server.client->MhcSeam(req);
    ASSERT_TRUE(tcp.ok()) << tcp.status();
    absl::StatusOr<std::unique_ptr<ClientSharedMemory>> shm =
        ClientSharedMemory::Create(*server.client, client::MhcRequestSharedBytes(req, MhcConfigOf(spec)));
    ASSERT_TRUE(shm.ok()) << shm.status();
    v1::MhcSeamRequest by_ref = req;
    ASSERT_TRUE((*shm)->Prepare(by_ref, MhcConfigOf(spec)).ok());
    PoisonOutputs(**shm, by_ref.output_placements());
    server.control->copies_to_device = 0;
    ExpectSameAsTcp(*server.client, by_ref, *tcp, shm->get());
    EXPECT_EQ(server.control->copies_to_device.load(), 1);
  }
}

// Page-locked regions (a device backend with lanes): the inputs are not read at decode; the lane
// copies them to the device where they lie, in one copy. So bytes the client changes while the
// request waits at the lane are the ones the kernels see (pread at decode would have read the old
// ones): the outputs are bitwise TCP's for the new inputs. Outputs placed in the same region are
// copied back by the device where they lie, one copy each. The region is unlocked once
// unregistered. (The lane test backend's "DMA" is a CPU memcpy that accepts only staging or locked
// memory, so this also checks that nothing else copies from the region.)
TEST(SharedMemory, OnLanesInputsInAPageLockedRegionAreCopiedWhereTheyLie) {
  std::mt19937_64 rng = MakeRng(44);
  const PackedWeightSet set = MakeWeightSet(rng, "shm/locked", MhcSetSpec{.hc_mult = 4, .hidden = 320}, std::nullopt);
  LaneShmServer server = StartLaneShmServer(set);
  ASSERT_NE(server.client, nullptr);
  FusedLayerClient* const c = server.client.get();
  LaneTestBackend::Control* const control = server.control.get();
  for (int64_t T : {int64_t{1}, int64_t{7}, int64_t{600}}) {
    SCOPED_TRACE(::testing::Message() << "T " << T);
    const MhcRequestSpec spec{.hc_mult = 4, .hidden = 320, .tokens = T};
    const v1::MhcSeamRequest sent = MakeMhcRequest(rng, "shm/locked", spec);
    const v1::MhcSeamRequest seen = MakeMhcRequest(rng, "shm/locked", spec);  // what the region holds at the copy
    absl::StatusOr<v1::MhcSeamResponse> tcp = c->MhcSeam(seen);
    ASSERT_TRUE(tcp.ok()) << tcp.status();
    {
      absl::StatusOr<std::unique_ptr<ClientSharedMemory>> shm =
          ClientSharedMemory::Create(*c, client::MhcRequestSharedBytes(sent, MhcConfigOf(spec)));
      ASSERT_TRUE(shm.ok()) << shm.status();
      EXPECT_EQ(control->page_locks.load(), 1);
      v1::MhcSeamRequest by_ref = sent;
      ASSERT_TRUE((*shm)->Prepare(by_ref, MhcConfigOf(spec)).ok());
      PoisonOutputs(**shm, by_ref.output_placements());
      control->copies_to_device = 0;
      control->copies_to_host = 0;
      // Waiting for its kernel, not for any operation at the gate: the TCP call above may have left
      // an operation (a free) queued on the lane, which reaches the gate before this call is decoded.
      const int64_t kernels = control->KernelsEnqueued();
      control->Hold();
      absl::StatusOr<v1::MhcSeamResponse> got;
      std::thread caller([&] { got = c->MhcSeam(by_ref); });
      control->WaitForKernelsEnqueued(kernels + 1);  // decoded, queued on the lane, its copy to the device not yet run
      for (auto [ref, in] : {std::pair{&by_ref.x(), &seen.x()}, {&by_ref.residual(), &seen.residual()},
                             {&by_ref.post_mix(), &seen.post_mix()}, {&by_ref.comb_mix(), &seen.comb_mix()},
                             {&by_ref.pre_mix(), &seen.pre_mix()}}) {
        ASSERT_TRUE(ref->has_shared_memory());
        ASSERT_EQ(ref->shared_memory().byte_size(), in->data().size());
        std::memcpy((*shm)->data() + ref->shared_memory().offset(), in->data().data(), in->data().size());
      }
      control->Release();
      caller.join();
      ASSERT_TRUE(got.ok()) << got.status();
      EXPECT_EQ(control->copies_to_device.load(), 1);
      // Each output copied back by the device where it lies in the region (none through staging).
      EXPECT_EQ(control->copies_to_host.load(), by_ref.output_placements_size());
      ASSERT_TRUE((*shm)->Fetch(*got).ok());
      ExpectMhcEqual(*got, *tcp);
      ExpectSameOutputsPresent(*got, *tcp);
    }  // unregistered and removed
    ExpectPageLocksGo(*control);
  }
  EXPECT_EQ(MetricValue(ScrapeWhenIdle(*server.ts), "fusedlayer_shared_memory_locked_bytes"), 0.0);
}

// Page-locked regions: a shrunk or removed object is refused before the device copies anything
// (the CPU never touches the mapping: a SIGBUS here would kill the test), a request mixing inline
// and shared-memory inputs, or with inputs spread over a region, takes the pread path, and a
// region beyond --shared_memory_locked_bytes is not locked; all bitwise TCP.
TEST(SharedMemory, OnLanesPageLockedRegionsRefuseShrunkObjectsAndOtherLayoutsArePread) {
  std::mt19937_64 rng = MakeRng(45);
  const PackedWeightSet set = MakeWeightSet(rng, "shm/locked2", MhcSetSpec{.hc_mult = 4, .hidden = 320}, std::nullopt);
  server::ServerConfig cfg = ShmConfig();
  cfg.shared_memory_locked_bytes = uint64_t{1} << 20;
  LaneShmServer server = StartLaneShmServer(set, cfg);
  ASSERT_NE(server.client, nullptr);
  FusedLayerClient* const c = server.client.get();
  LaneTestBackend::Control* const control = server.control.get();
  const MhcRequestSpec spec{.hc_mult = 4, .hidden = 320, .tokens = 5};
  const v1::MhcSeamRequest req = MakeMhcRequest(rng, "shm/locked2", spec);
  absl::StatusOr<v1::MhcSeamResponse> tcp = c->MhcSeam(req);
  ASSERT_TRUE(tcp.ok()) << tcp.status();
  const uint64_t x_bytes = req.x().data().size();
  {  // In place; then shrunk after registration: refused before any copy, no crash, still serving.
    SCOPED_TRACE("In place; then shrunk after re");
    TestObject obj(uint64_t{64} << 10);
    ASSERT_TRUE(c->RegisterSystemSharedMemory("r", obj.key(), 0, uint64_t{64} << 10).ok());
    EXPECT_EQ(control->page_locks.load(), 1);
    // Every input by reference at 256-byte steps.
    const v1::MhcSeamRequest by_ref =
        InputsByReference(req, obj, "r", 4096, [](uint64_t at, uint64_t bytes) { return at + (bytes + 255) / 256 * 256; });
    control->copies_to_device = 0;
    ExpectSameAsTcp(*c, by_ref, *tcp);
    EXPECT_EQ(control->copies_to_device.load(), 1);
    obj.Truncate(4096);
    absl::Status s = c->MhcSeam(by_ref).status();
    EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s;
    ASSERT_TRUE(c->UnregisterSystemSharedMemory("r").ok());
  }
  {  // x alone by reference (the rest inline): read with pread, correct.
    SCOPED_TRACE("x alone by reference (the rest");
    TestObject obj(4096 + x_bytes);
    ASSERT_TRUE(c->RegisterSystemSharedMemory("r", obj.key(), 0, 4096 + x_bytes).ok());
    std::memcpy(obj.data() + 4096, req.x().data().data(), x_bytes);
    v1::MhcSeamRequest by_ref = req;
    *by_ref.mutable_x()->mutable_shared_memory() = Ref("r", 4096, x_bytes);
    by_ref.mutable_x()->clear_data();
    ExpectSameAsTcp(*c, by_ref, *tcp);
    ASSERT_TRUE(c->UnregisterSystemSharedMemory("r").ok());
  }
  {  // Every input by reference, but far apart in the region: the span is mostly gaps, so pread.
    SCOPED_TRACE("Every input by reference, but ");
    const uint64_t gap = uint64_t{256} << 10;
    TestObject obj(2 * gap + (uint64_t{1} << 16));
    ASSERT_TRUE(c->RegisterSystemSharedMemory("r", obj.key(), 0, 2 * gap + (uint64_t{1} << 16)).ok());
    const v1::MhcSeamRequest by_ref = InputsByReference(req, obj, "r", 0, [&](uint64_t at, uint64_t bytes) {
      return at + (at == 0 ? 2 * gap : (bytes + 4095) / 4096 * 4096);
    });
    ExpectSameAsTcp(*c, by_ref, *tcp);
    ASSERT_TRUE(c->UnregisterSystemSharedMemory("r").ok());
  }
  {  // Beyond the locked budget (1 MiB here): registered, not locked, read with pread.
    SCOPED_TRACE("Beyond the locked budget");
    ExpectPageLocksGo(*control);  // the regions above, once their calls let go
    const uint64_t bytes = uint64_t{2} << 20;
    TestObject obj(bytes);
    ASSERT_TRUE(c->RegisterSystemSharedMemory("big", obj.key(), 0, bytes).ok());
    EXPECT_EQ(control->page_locks.load(), 0);
    std::memcpy(obj.data(), req.x().data().data(), x_bytes);
    v1::MhcSeamRequest by_ref = req;
    *by_ref.mutable_x()->mutable_shared_memory() = Ref("big", 0, x_bytes);
    by_ref.mutable_x()->clear_data();
    ExpectSameAsTcp(*c, by_ref, *tcp);
    ASSERT_TRUE(c->UnregisterSystemSharedMemory("big").ok());
  }
  EXPECT_EQ(MetricValue(ScrapeWhenIdle(*server.ts), "fusedlayer_shared_memory_locked_bytes"), 0.0);
}

// Pinning faults in and locks every page of a region, so nothing is pinned before the registration
// is known to succeed, and the locked budget is taken before the pages are: a refused registration
// (name taken, the identity's limits) never locks its object, and registrations racing for the
// budget (each lock held 100 ms here, as a driver pinning a large region would) never lock more than
// it at once; the ones that do not fit are registered and read with pread.
TEST(SharedMemory, OnLanesRefusedOrRacingRegistrationsNeverPinBeyondTheLockedBudget) {
  std::mt19937_64 rng = MakeRng(46);
  const PackedWeightSet set = MakeWeightSet(rng, "shm/pin", MhcSetSpec{.hc_mult = 4, .hidden = 320}, std::nullopt);
  server::ServerConfig cfg = ShmConfig();
  const uint64_t bytes = uint64_t{64} << 10;
  cfg.shared_memory_locked_bytes = bytes;
  cfg.shared_memory_max_regions = 5;
  LaneShmServer server = StartLaneShmServer(set, cfg);
  ASSERT_NE(server.client, nullptr);
  FusedLayerClient* const c = server.client.get();
  LaneTestBackend::Control* const control = server.control.get();
  control->page_lock_delay_ms = 100;
  std::vector<std::unique_ptr<TestObject>> objects;
  for (int i = 0; i < 6; ++i) objects.push_back(std::make_unique<TestObject>(bytes));
  // Five at once, each alone within the budget: one is locked, the rest are read with pread.
  std::vector<absl::Status> statuses(5);
  std::vector<std::thread> threads;
  for (int i = 0; i < 5; ++i) {
    threads.emplace_back([&, i] {
      statuses[i] = c->RegisterSystemSharedMemory(absl::StrCat("r", i), objects[i]->key(), 0, bytes);
    });
  }
  for (std::thread& t : threads) t.join();
  for (int i = 0; i < 5; ++i) EXPECT_TRUE(statuses[i].ok()) << "r" << i << ": " << statuses[i];
  EXPECT_EQ(control->page_locks.load(), 1);
  EXPECT_EQ(control->max_page_locks.load(), 1);
  EXPECT_EQ(MetricValue(ScrapeWhenIdle(*server.ts), "fusedlayer_shared_memory_locked_bytes"), static_cast<double>(bytes));
  // Refused with the budget free: a sixth region (over --shared_memory_max_regions: 5), a name
  // taken. Neither may lock its object on the way to its status.
  for (int i = 0; i < 5; ++i) ASSERT_TRUE(c->UnregisterSystemSharedMemory(absl::StrCat("r", i)).ok());
  EXPECT_EQ(control->page_locks.load(), 0);
  for (int i = 0; i < 5; ++i) {
    ASSERT_TRUE(c->RegisterSystemSharedMemory(absl::StrCat("n", i), objects[i]->key(), 0, bytes / 8).ok());
  }
  EXPECT_EQ(control->page_locks.load(), 5);  // 5/8 of the budget
  control->max_page_locks = 5;
  absl::Status over = c->RegisterSystemSharedMemory("n5", objects[5]->key(), 0, bytes / 8);
  EXPECT_EQ(over.code(), StatusCode::kResourceExhausted) << over;
  absl::Status taken = c->RegisterSystemSharedMemory("n0", objects[5]->key(), 0, bytes / 8);
  EXPECT_EQ(taken.code(), StatusCode::kAlreadyExists) << taken;
  EXPECT_EQ(control->max_page_locks.load(), 5);
  EXPECT_EQ(control->page_locks.load(), 5);
  for (int i = 0; i < 5; ++i) ASSERT_TRUE(c->UnregisterSystemSharedMemory(absl::StrCat("n", i)).ok());
  EXPECT_EQ(MetricValue(ScrapeWhenIdle(*server.ts), "fusedlayer_shared_memory_locked_bytes"), 0.0);
}

// A locked region unregistered while a request still uses it stays pinned until that request is
// done (the lane copies its outputs back into it), so its bytes stay in --shared_memory_locked_bytes
// until then: a region registered meanwhile does not fit the budget and is read with pread, and
// never more than the budget is pinned at once. Once the request is done the budget is free again.
TEST(SharedMemory, OnLanesAnUnregisteredRegionInUseKeepsItsPinnedBytesUntilTheRequestEnds) {
  std::mt19937_64 rng = MakeRng(47);
  const PackedWeightSet set = MakeWeightSet(rng, "shm/held", MhcSetSpec{.hc_mult = 4, .hidden = 320}, std::nullopt);
  const MhcRequestSpec spec{.hc_mult = 4, .hidden = 320, .tokens = 7};
  const v1::MhcSeamRequest req = MakeMhcRequest(rng, "shm/held", spec);
  const uint64_t bytes = client::MhcRequestSharedBytes(req, MhcConfigOf(spec));
  server::ServerConfig cfg = ShmConfig();
  cfg.shared_memory_locked_bytes = bytes + bytes / 2;  // one region of `bytes`, not two
  LaneShmServer server = StartLaneShmServer(set, cfg);
  ASSERT_NE(server.client, nullptr);
  FusedLayerClient* const c = server.client.get();
  LaneTestBackend::Control* const control = server.control.get();
  absl::StatusOr<v1::MhcSeamResponse> tcp = c->MhcSeam(req);
  ASSERT_TRUE(tcp.ok()) << tcp.status();
  absl::StatusOr<v1::MhcSeamResponse> got;
  std::thread caller;
  absl::StatusOr<std::unique_ptr<ClientSharedMemory>> first = ClientSharedMemory::Create(*c, bytes);
  ASSERT_TRUE(first.ok()) << first.status();
  ASSERT_EQ(control->page_locks.load(), 1);
  v1::MhcSeamRequest first_ref = req;
  ASSERT_TRUE((*first)->Prepare(first_ref, MhcConfigOf(spec)).ok());
  // Its kernel, not any operation at the gate: the TCP call above may have left one queued.
  const int64_t kernels = control->KernelsEnqueued();
  control->Hold();
  caller = std::thread([&c, &got, &first_ref] { got = c->MhcSeam(first_ref); });
  control->WaitForKernelsEnqueued(kernels + 1);  // decoded, holding the region, queued on the lane
  // Unregistered (the object stays: the request writes its outputs there) while the request holds it.
  ASSERT_TRUE(c->UnregisterSystemSharedMemory((*first)->region_name()).ok());
  EXPECT_EQ(control->page_locks.load(), 1);  // still pinned: the lane will copy into it
  control->max_page_locks = 1;
  {
    absl::StatusOr<std::unique_ptr<ClientSharedMemory>> second = ClientSharedMemory::Create(*c, bytes);
    ASSERT_TRUE(second.ok()) << second.status();  // registered, read with pread
    EXPECT_EQ(control->max_page_locks.load(), 1);
    EXPECT_EQ(MetricValue(server.ts->Scrape(), "fusedlayer_shared_memory_locked_bytes"), static_cast<double>(bytes));
    control->Release();
    caller.join();
    ASSERT_TRUE(got.ok()) << got.status();
    ASSERT_TRUE((*first)->Fetch(*got).ok());
    ExpectMhcEqual(*got, *tcp);
    v1::MhcSeamRequest by_ref = req;
    ASSERT_TRUE((*second)->Prepare(by_ref, MhcConfigOf(spec)).ok());
    ExpectSameAsTcp(*c, by_ref, *tcp, second->get());
  }
  ExpectPageLocksGo(*control);
  EXPECT_EQ(MetricValue(ScrapeWhenIdle(*server.ts), "fusedlayer_shared_memory_locked_bytes"), 0.0);
  absl::StatusOr<std::unique_ptr<ClientSharedMemory>> third = ClientSharedMemory::Create(*c, bytes);
  ASSERT_TRUE(third.ok()) << third.status();
  EXPECT_EQ(control->page_locks.load(), 1);  // the budget is free again
}

TEST(SharedMemory, SwaOutputsEqualTcpBitwiseForEveryLayout) {
  std::mt19937_64 rng = MakeRng(42);
  auto ts = TestServer::Start(ShmConfig());
  ASSERT_NE(ts, nullptr);
  auto c = ClientFor(*ts);
  ASSERT_NE(c, nullptr);
  const auto& cases = kSwaLayoutVariants;
  int k = 0;
  for (const auto& [spec, extra] : cases) {
    const std::string name = "shm/swa" + std::to_string(k++);
    PackedWeightSet set = MakeWeightSet(rng, name, std::nullopt, spec);
    v1::WeightSetInfo info;
    ASSERT_TRUE(LoadWeights(ts->stub(), set, &info).ok());
    for (int64_t M : {int64_t{0}, int64_t{1}, int64_t{6}}) {
      SCOPED_TRACE(::testing::Message() << name << " M " << M);
      v1::SwaNormQuantRequest req = MakeSwaRequest(rng, name, M, spec.q_rank + spec.head_dim + extra);
      absl::StatusOr<v1::SwaNormQuantResponse> tcp = c->SwaNormQuant(req);
      ASSERT_TRUE(tcp.ok()) << tcp.status();
      absl::StatusOr<std::unique_ptr<ClientSharedMemory>> shm =
          ClientSharedMemory::Create(*c, client::SwaRequestSharedBytes(req, info.swa(), info.wq_b_rows()));
      ASSERT_TRUE(shm.ok()) << shm.status();
      v1::SwaNormQuantRequest by_ref = req;
      ASSERT_TRUE((*shm)->Prepare(by_ref, info.swa(), info.wq_b_rows()).ok());
      PoisonOutputs(**shm, by_ref.output_placements());
      absl::StatusOr<v1::SwaNormQuantResponse> got = c->SwaNormQuant(by_ref);
      ASSERT_TRUE(got.ok()) << got.status();
      EXPECT_TRUE(got->q_fp8().has_shared_memory());
      ASSERT_TRUE((*shm)->Fetch(*got).ok());
      ExpectSwaEqual(*got, *tcp);
      ExpectSameOutputsPresent(*got, *tcp);
    }
  }
}

// Inputs are read before outputs are written: new_residual may overwrite residual in place, and
// inline and shared-memory tensors mix in one request.
TEST(SharedMemory, OutputOverAnInputInPlaceAndMixedInlineTensors) {
  std::mt19937_64 rng = MakeRng(43);
  const PackedWeightSet set = MakeWeightSet(rng, "shm/mhc", MhcSetSpec{}, std::nullopt);
  auto ts = TestServer::Start(ShmConfig(), nullptr, {set});
  ASSERT_NE(ts, nullptr);
  auto c = ClientFor(*ts);
  const MhcRequestSpec spec{.tokens = 5};
  const v1::MhcSeamRequest req = MakeMhcRequest(rng, "shm/mhc", spec);
  absl::StatusOr<v1::MhcSeamResponse> tcp = c->MhcSeam(req);
  ASSERT_TRUE(tcp.ok()) << tcp.status();

  TestObject obj(1 << 20);
  ASSERT_TRUE(c->RegisterSystemSharedMemory("r", obj.key(), 0, 1 << 20).ok());
  const std::string& residual = req.residual().data();
  std::memcpy(obj.data(), residual.data(), residual.size());
  v1::MhcSeamRequest by_ref = req;
  *by_ref.mutable_residual()->mutable_shared_memory() = Ref("r", 0, residual.size());
  v1::OutputPlacement* p = by_ref.add_output_placements();
  p->set_output("new_residual");
  *p->mutable_shared_memory() = Ref("r", 0, residual.size());  // the same bytes as the input
  absl::StatusOr<v1::MhcSeamResponse> got = c->MhcSeam(by_ref);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_TRUE(got->new_residual().has_shared_memory());
  EXPECT_EQ(std::string(obj.data(), residual.size()), tcp->new_residual().data());
  EXPECT_EQ(got->y().data(), tcp->y().data());  // not placed: inline
}

// ---- bad references and registrations ---------------------------------------------------------------

TEST(SharedMemory, EveryBadReferenceHasItsStatusAndTheServerKeepsServing) {
  std::mt19937_64 rng = MakeRng(44);
  const PackedWeightSet set = MakeWeightSet(rng, "shm/mhc", MhcSetSpec{}, std::nullopt);
  auto ts = TestServer::Start(ShmConfig(), nullptr, {set});
  ASSERT_NE(ts, nullptr);
  auto c = ClientFor(*ts);
  const uint64_t kRegion = 1 << 16;
  TestObject obj(kRegion + 128);
  ASSERT_TRUE(c->RegisterSystemSharedMemory("r", obj.key(), 64, kRegion).ok());
  const v1::MhcSeamRequest req = MakeMhcRequest(rng, "shm/mhc", {.tokens = 3});
  const uint64_t x_bytes = req.x().data().size();  // 3 x 256 bf16
  auto with_x = [&](const v1::SharedMemoryRef& ref) {
    v1::MhcSeamRequest r = req;
    *r.mutable_x()->mutable_shared_memory() = ref;
    return c->MhcSeam(r).status();
  };
  auto expect = [](const absl::Status& s, StatusCode code, const std::string& fragment) {
    EXPECT_EQ(s.code(), code) << s;
    EXPECT_NE(s.message().find(fragment), std::string::npos) << s;
  };
  expect(with_x(Ref("nope", 0, x_bytes)), StatusCode::kNotFound, "no shared-memory region named 'nope'");
  expect(with_x(Ref("r", kRegion - 64, x_bytes)), StatusCode::kInvalidArgument, "outside shared-memory region");
  expect(with_x(Ref("r", UINT64_MAX - 63, x_bytes)), StatusCode::kInvalidArgument, "outside");
  expect(with_x(Ref("r", 64, UINT64_MAX)), StatusCode::kInvalidArgument, "byte_size");
  expect(with_x(Ref("r", 0, x_bytes - 2)), StatusCode::kInvalidArgument, "need");
  expect(with_x(Ref("r", 32, x_bytes)), StatusCode::kInvalidArgument, "not aligned");
  expect(with_x(Ref("bad/name", 0, x_bytes)), StatusCode::kInvalidArgument, "region name");
  {  // A shape no request of this size has, claiming more than any server admits: the shape's error.
    v1::MhcSeamRequest r = req;
    r.mutable_residual()->set_shape(0, int64_t{1} << 30);
    *r.mutable_residual()->mutable_shared_memory() = Ref("r", 0, uint64_t{1} << 50);
    expect(c->MhcSeam(r).status(), StatusCode::kInvalidArgument, "residual");
    r.mutable_x()->set_shape(1, int64_t{1} << 40);  // x: the token count is right, the width is not
    *r.mutable_x()->mutable_shared_memory() = Ref("r", 0, uint64_t{1} << 50);
    r.mutable_x()->clear_data();
    expect(c->MhcSeam(r).status(), StatusCode::kInvalidArgument, "'x'");
  }

  auto with_out = [&](std::vector<std::pair<std::string, v1::SharedMemoryRef>> outs, bool verify = false) {
    v1::MhcSeamRequest r = req;
    r.set_verify(verify);
    for (auto& [name, ref] : outs) {
      v1::OutputPlacement* p = r.add_output_placements();
      p->set_output(name);
      *p->mutable_shared_memory() = ref;
    }
    return c->MhcSeam(r).status();
  };
  expect(with_out({{"y", Ref("r", 0, x_bytes + 2)}}), StatusCode::kInvalidArgument, "the output is");
  expect(with_out({{"aux", Ref("r", 0, x_bytes)}}), StatusCode::kInvalidArgument, "does not produce");
  expect(with_out({{"y", Ref("r", 0, x_bytes)}, {"y", Ref("r", 4096, x_bytes)}}), StatusCode::kInvalidArgument,
         "twice");
  // new_pre_mix is 3 x 4 fp32 = 48 bytes: y at 0 and new_pre_mix at 64 overlap y's 1536 bytes.
  expect(with_out({{"y", Ref("r", 0, x_bytes)}, {"new_pre_mix", Ref("r", 64, 48)}}), StatusCode::kInvalidArgument,
         "overlap");
  expect(with_out({{"y", Ref("r", 0, x_bytes)}}, /*verify=*/true), StatusCode::kInvalidArgument, "verify");
  // Two regions of one object overlap too.
  ASSERT_TRUE(c->RegisterSystemSharedMemory("r2", obj.key(), 0, 4096).ok());
  expect(with_out({{"y", Ref("r", 0, x_bytes)}, {"new_pre_mix", Ref("r2", 128, 48)}}),
         StatusCode::kInvalidArgument, "overlap");

  // Still serving, and a good reference works.
  v1::MhcSeamRequest good = req;
  std::memcpy(obj.data() + 64, req.x().data().data(), x_bytes);
  *good.mutable_x()->mutable_shared_memory() = Ref("r", 0, x_bytes);
  absl::StatusOr<v1::MhcSeamResponse> ok = c->MhcSeam(good);
  ASSERT_TRUE(ok.ok()) << ok.status();
  absl::StatusOr<v1::MhcSeamResponse> tcp = c->MhcSeam(req);
  ASSERT_TRUE(tcp.ok());
  ExpectMhcEqual(*ok, *tcp);
}

TEST(SharedMemory, BadRegistrationsHaveTheirStatus) {
  auto ts = TestServer::Start(ShmConfig());
  ASSERT_NE(ts, nullptr);
  auto c = ClientFor(*ts);
  TestObject obj(8192);
  auto reg = [&](const std::string& name, const std::string& key, uint64_t offset, uint64_t bytes) {
    return c->RegisterSystemSharedMemory(name, key, offset, bytes).code();
  };
  EXPECT_EQ(reg("a", "/fl-test-does-not-exist-" + RandomHex(8), 0, 64), StatusCode::kNotFound);
  for (const std::string key : {"no-slash", "/", "/..", "/.hidden", "/a/b", "/../etc/passwd", "/x y"}) {
    EXPECT_EQ(reg("a", key, 0, 64), StatusCode::kInvalidArgument) << key;
  }
  for (const std::string& name : std::vector<std::string>{"", "a/b", std::string(129, 'n'), "sp ace"}) {
    EXPECT_EQ(reg(name, obj.key(), 0, 64), StatusCode::kInvalidArgument) << name;
  }
  {  // Not a shared-memory object: a FIFO or a directory under /dev/shm (and opening a FIFO must not block).
    const std::string fifo = "/fl-test-fifo-" + RandomHex(12), dir = "/fl-test-dir-" + RandomHex(12);
    ASSERT_EQ(::mkfifo(("/dev/shm" + fifo).c_str(), 0600), 0);
    ASSERT_EQ(::mkdir(("/dev/shm" + dir).c_str(), 0700), 0);
    EXPECT_EQ(reg("a", fifo, 0, 64), StatusCode::kInvalidArgument);
    EXPECT_NE(reg("a", dir, 0, 64), StatusCode::kOk);
    ::unlink(("/dev/shm" + fifo).c_str());
    ::rmdir(("/dev/shm" + dir).c_str());
  }
  EXPECT_EQ(reg("a", obj.key(), 0, 0), StatusCode::kInvalidArgument);           // empty
  EXPECT_EQ(reg("a", obj.key(), 0, 8193), StatusCode::kInvalidArgument);        // past the object's end
  EXPECT_EQ(reg("a", obj.key(), 8192, 64), StatusCode::kInvalidArgument);
  EXPECT_EQ(reg("a", obj.key(), 32, 64), StatusCode::kInvalidArgument);         // misaligned region
  EXPECT_EQ(reg("a", obj.key(), UINT64_MAX - 63, 128), StatusCode::kInvalidArgument);  // overflow
  EXPECT_EQ(reg("a", obj.key(), 0, 8192), StatusCode::kOk);
  EXPECT_EQ(reg("a", obj.key(), 0, 64), StatusCode::kAlreadyExists);
  EXPECT_EQ(c->SystemSharedMemoryStatus("b").status().code(), StatusCode::kNotFound);
  EXPECT_EQ(c->UnregisterSystemSharedMemory("b").status().code(), StatusCode::kNotFound);
  absl::StatusOr<v1::SystemSharedMemoryStatusResponse> st = c->SystemSharedMemoryStatus();
  ASSERT_TRUE(st.ok());
  ASSERT_EQ(st->regions_size(), 1);
  EXPECT_EQ(st->regions(0).name(), "a");
  EXPECT_EQ(st->regions(0).key(), obj.key());
  EXPECT_EQ(st->regions(0).byte_size(), 8192u);
}

TEST(SharedMemory, EverythingIsFailedPreconditionWhileDisabled) {
  std::mt19937_64 rng = MakeRng(45);
  const PackedWeightSet set = MakeWeightSet(rng, "shm/mhc", MhcSetSpec{}, std::nullopt);
  auto ts = TestServer::Start(TestConfig(), nullptr, {set});  // no --allow_shared_memory
  ASSERT_NE(ts, nullptr);
  auto c = ClientFor(*ts);
  TestObject obj(4096);
  absl::Status s = c->RegisterSystemSharedMemory("r", obj.key(), 0, 4096);
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find("--allow_shared_memory"), std::string::npos) << s;
  EXPECT_EQ(c->SystemSharedMemoryStatus().status().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(c->UnregisterSystemSharedMemory("").status().code(), StatusCode::kFailedPrecondition);
  v1::MhcSeamRequest req = MakeMhcRequest(rng, "shm/mhc", {.tokens = 2});
  *req.mutable_x()->mutable_shared_memory() = Ref("r", 0, 2 * 256 * 2);
  EXPECT_EQ(c->MhcSeam(req).status().code(), StatusCode::kFailedPrecondition);
  absl::StatusOr<v1::GetServerInfoResponse> info = c->GetServerInfo();
  ASSERT_TRUE(info.ok());
  EXPECT_FALSE(info->shared_memory_enabled());
}

// ---- identities, limits, metrics ----------------------------------------------------------------------

class SharedMemoryTokens : public TwoTokenFile {};

TEST_F(SharedMemoryTokens, ARegionBelongsToTheTokenThatRegisteredIt) {
  std::mt19937_64 rng = MakeRng(46);
  const PackedWeightSet set = MakeWeightSet(rng, "shm/mhc", MhcSetSpec{}, std::nullopt);
  server::ServerConfig cfg = ShmConfig();
  cfg.auth_tokens_file = file_;
  auto ts = TestServer::Start(cfg, nullptr, {set});
  ASSERT_NE(ts, nullptr);
  auto a = ClientFor(*ts, token_a_), b = ClientFor(*ts, token_b_), nobody = ClientFor(*ts);
  TestObject obj_a(1 << 16), obj_b(1 << 16);
  ASSERT_TRUE(a->RegisterSystemSharedMemory("mine", obj_a.key(), 0, 1 << 16).ok());
  EXPECT_EQ(nobody->RegisterSystemSharedMemory("x", obj_b.key(), 0, 64).code(), StatusCode::kUnauthenticated);

  // B cannot see, use or remove A's region; the answer is the one for a name never registered.
  absl::StatusOr<v1::SystemSharedMemoryStatusResponse> listed = b->SystemSharedMemoryStatus();
  ASSERT_TRUE(listed.ok());
  EXPECT_EQ(listed->regions_size(), 0);
  EXPECT_EQ(b->SystemSharedMemoryStatus("mine").status().code(), StatusCode::kNotFound);
  EXPECT_EQ(b->UnregisterSystemSharedMemory("mine").status().code(), StatusCode::kNotFound);
  absl::StatusOr<v1::UnregisterSystemSharedMemoryResponse> all = b->UnregisterSystemSharedMemory("");
  ASSERT_TRUE(all.ok());
  EXPECT_EQ(all->unregistered(), 0u);
  v1::MhcSeamRequest req = MakeMhcRequest(rng, "shm/mhc", {.tokens = 2});
  std::memcpy(obj_a.data(), req.x().data().data(), req.x().data().size());
  v1::MhcSeamRequest by_ref = req;
  *by_ref.mutable_x()->mutable_shared_memory() = Ref("mine", 0, req.x().data().size());
  EXPECT_EQ(b->MhcSeam(by_ref).status().code(), StatusCode::kNotFound);
  // B may not register A's object under a name of its own either.
  absl::Status taken = b->RegisterSystemSharedMemory("theirs", obj_a.key(), 0, 64);
  EXPECT_EQ(taken.code(), StatusCode::kPermissionDenied) << taken;
  // Names are per identity: B's own "mine" is a different region.
  ASSERT_TRUE(b->RegisterSystemSharedMemory("mine", obj_b.key(), 0, 1 << 16).ok());

  // A's region still works for A, and A's view is unchanged.
  absl::StatusOr<v1::MhcSeamResponse> got = a->MhcSeam(by_ref);
  ASSERT_TRUE(got.ok()) << got.status();
  absl::StatusOr<v1::MhcSeamResponse> tcp = a->MhcSeam(req);
  ASSERT_TRUE(tcp.ok());
  ExpectMhcEqual(*got, *tcp);
  ExpectSameOutputsPresent(*got, *tcp);
  listed = a->SystemSharedMemoryStatus();
  ASSERT_TRUE(listed.ok());
  ASSERT_EQ(listed->regions_size(), 1);
  EXPECT_EQ(listed->regions(0).key(), obj_a.key());
  all = a->UnregisterSystemSharedMemory("");
  ASSERT_TRUE(all.ok());
  EXPECT_EQ(all->unregistered(), 1u);
  EXPECT_EQ(all->freed_bytes(), uint64_t{1} << 16);
  // Once A let go, B may take the object.
  EXPECT_TRUE(b->RegisterSystemSharedMemory("theirs", obj_a.key(), 0, 64).ok());
}

TEST_F(SharedMemoryTokens, LimitsArePerIdentityAndTheGaugesFollow) {
  server::ServerConfig cfg = ShmConfig();
  cfg.auth_tokens_file = file_;
  cfg.shared_memory_max_regions = 2;
  cfg.shared_memory_max_bytes = 1 << 16;
  auto ts = TestServer::Start(cfg);
  ASSERT_NE(ts, nullptr);
  auto a = ClientFor(*ts, token_a_), b = ClientFor(*ts, token_b_);
  TestObject obj(1 << 17);
  ASSERT_TRUE(a->RegisterSystemSharedMemory("r1", obj.key(), 0, 4096).ok());
  ASSERT_TRUE(a->RegisterSystemSharedMemory("r2", obj.key(), 4096, 4096).ok());
  absl::Status third = a->RegisterSystemSharedMemory("r3", obj.key(), 8192, 4096);
  EXPECT_EQ(third.code(), StatusCode::kResourceExhausted) << third;
  EXPECT_NE(third.message().find("--shared_memory_max_regions"), std::string::npos);
  std::string scrape = ts->Scrape();
  EXPECT_EQ(MetricValue(scrape, "fusedlayer_shared_memory_regions"), 2.0);
  EXPECT_EQ(MetricValue(scrape, "fusedlayer_shared_memory_registered_bytes"), 8192.0);

  TestObject other(1 << 17);
  absl::Status too_big = b->RegisterSystemSharedMemory("big", other.key(), 0, (1 << 16) + 64);
  EXPECT_EQ(too_big.code(), StatusCode::kResourceExhausted) << too_big;
  EXPECT_NE(too_big.message().find("--shared_memory_max_bytes"), std::string::npos);
  ASSERT_TRUE(b->RegisterSystemSharedMemory("big", other.key(), 0, 1 << 16).ok());  // B's own budget
  EXPECT_EQ(b->RegisterSystemSharedMemory("more", other.key(), 1 << 16, 64).code(), StatusCode::kResourceExhausted);

  ASSERT_TRUE(a->UnregisterSystemSharedMemory("r1").ok());
  EXPECT_TRUE(a->RegisterSystemSharedMemory("r3", obj.key(), 8192, 4096).ok());
  scrape = ts->Scrape();
  EXPECT_EQ(MetricValue(scrape, "fusedlayer_shared_memory_regions"), 3.0);
  EXPECT_EQ(MetricValue(scrape, "fusedlayer_shared_memory_registered_bytes"), 8192.0 + 65536.0);
}

// ---- objects that shrink or vanish ------------------------------------------------------------------

// Blocks the device executor until released, so requests stay queued (after decode: inputs read).
class ExecutorGate {
 public:
  explicit ExecutorGate(TestServer& ts) {
    EXPECT_TRUE(ts.server()
                    .executor()
                    .SubmitControl([this](double) {
                      std::unique_lock<std::mutex> lock(mu_);
                      entered_ = true;
                      cv_.notify_all();
                      cv_.wait(lock, [this] { return open_; });
                    })
                    .ok());
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [this] { return entered_; });
  }
  ~ExecutorGate() { Open(); }
  void Open() {
    std::lock_guard<std::mutex> lock(mu_);
    open_ = true;
    cv_.notify_all();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool entered_ = false, open_ = false;
};

void WaitForQueued(TestServer& ts, size_t n) {
  for (int i = 0; i < 6000 && ts.server().queued_tasks() < n; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  ASSERT_GE(ts.server().queued_tasks(), n);
}

TEST(SharedMemory, AnObjectThatShrinksOrVanishesIsFailedPreconditionNeverACrash) {
  std::mt19937_64 rng = MakeRng(47);
  const PackedWeightSet set = MakeWeightSet(rng, "shm/mhc", MhcSetSpec{}, std::nullopt);
  auto ts = TestServer::Start(ShmConfig(), nullptr, {set});
  ASSERT_NE(ts, nullptr);
  auto c = ClientFor(*ts);
  const MhcRequestSpec spec{.tokens = 4};
  const v1::MhcSeamRequest req = MakeMhcRequest(rng, "shm/mhc", spec);
  absl::StatusOr<v1::MhcSeamResponse> tcp = c->MhcSeam(req);
  ASSERT_TRUE(tcp.ok());
  const uint64_t bytes = client::MhcRequestSharedBytes(req, MhcConfigOf(spec));

  {  // Shrunk between requests: the next one is refused, the region stays registered.
    TestObject obj(bytes);
    ASSERT_TRUE(c->RegisterSystemSharedMemory("r", obj.key(), 0, bytes).ok());
    v1::MhcSeamRequest by_ref = req;
    *by_ref.mutable_x()->mutable_shared_memory() = Ref("r", 0, req.x().data().size());
    std::memcpy(obj.data(), req.x().data().data(), req.x().data().size());
    ASSERT_TRUE(c->MhcSeam(by_ref).ok());
    obj.Truncate(64);
    absl::Status s = c->MhcSeam(by_ref).status();
    EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s;
    EXPECT_NE(s.message().find("shrank"), std::string::npos) << s;
    obj.Truncate(0);
    EXPECT_EQ(c->MhcSeam(by_ref).status().code(), StatusCode::kFailedPrecondition);
    ASSERT_TRUE(c->UnregisterSystemSharedMemory("r").ok());
  }
  {  // Shrunk while the request waits on the executor (its outputs not yet written).
    TestObject obj(bytes);
    ASSERT_TRUE(c->RegisterSystemSharedMemory("r", obj.key(), 0, bytes).ok());
    v1::MhcSeamRequest by_ref = req;
    v1::OutputPlacement* p = by_ref.add_output_placements();
    p->set_output("new_residual");
    *p->mutable_shared_memory() = Ref("r", 0, tcp->new_residual().data().size());
    absl::Status in_flight;
    {
      ExecutorGate gate(*ts);
      std::thread caller([&] { in_flight = c->MhcSeam(by_ref).status(); });
      WaitForQueued(*ts, 1);
      obj.Truncate(4096);
      gate.Open();
      caller.join();
    }
    EXPECT_EQ(in_flight.code(), StatusCode::kFailedPrecondition) << in_flight;
    ASSERT_TRUE(c->UnregisterSystemSharedMemory("r").ok());
  }
  {  // Removed (or replaced by a new object of the same name): refused, and the region is dropped.
    TestObject obj(bytes);
    ASSERT_TRUE(c->RegisterSystemSharedMemory("r", obj.key(), 0, bytes).ok());
    obj.Unlink();
    const int fd = ::shm_open(obj.key().c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);  // same name, new object
    ASSERT_GE(fd, 0);
    ASSERT_EQ(::ftruncate(fd, static_cast<off_t>(bytes)), 0);
    ::close(fd);
    v1::MhcSeamRequest by_ref = req;
    *by_ref.mutable_x()->mutable_shared_memory() = Ref("r", 0, req.x().data().size());
    absl::Status s = c->MhcSeam(by_ref).status();
    EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s;
    EXPECT_NE(s.message().find("removed or replaced"), std::string::npos) << s;
    EXPECT_EQ(c->SystemSharedMemoryStatus("r").status().code(), StatusCode::kNotFound);
  }
  // Still serving.
  absl::StatusOr<v1::MhcSeamResponse> again = c->MhcSeam(req);
  ASSERT_TRUE(again.ok());
  ExpectMhcEqual(*again, *tcp);
  EXPECT_EQ(MetricValue(ScrapeWhenIdle(*ts), "fusedlayer_shared_memory_regions"), 0.0);
}

// A client process that dies holding a region leaves what this test leaves: the registration and
// the object, unmapped, nobody to unregister. The region keeps counting for its identity until the
// identity unregisters (e.g. a restarted client's UnregisterSystemSharedMemory("")) or the object is
// removed (shm_unlink by anyone, a tmpfs cleanup), which the server notices at the next use, status
// or registration of that identity.
TEST(SharedMemory, ARegionOfAClientThatDiedIsFreedByUnregisterAllOrByRemovingItsObject) {
  server::ServerConfig cfg = ShmConfig();
  cfg.shared_memory_max_regions = 1;
  auto ts = TestServer::Start(cfg);
  ASSERT_NE(ts, nullptr);
  auto c = ClientFor(*ts);
  auto dead = std::make_unique<TestObject>(4096);
  ASSERT_TRUE(c->RegisterSystemSharedMemory("left-behind", dead->key(), 0, 4096).ok());
  dead->Truncate(4096);  // unmaps: the "process" is gone, its object and registration stay
  TestObject next(4096);
  EXPECT_EQ(c->RegisterSystemSharedMemory("next", next.key(), 0, 4096).code(), StatusCode::kResourceExhausted);
  absl::StatusOr<v1::UnregisterSystemSharedMemoryResponse> all = c->UnregisterSystemSharedMemory("");
  ASSERT_TRUE(all.ok());
  EXPECT_EQ(all->unregistered(), 1u);
  ASSERT_TRUE(c->RegisterSystemSharedMemory("next", next.key(), 0, 4096).ok());

  // Or: the object is removed; the next registration of that identity frees the slot by itself.
  auto gone = std::make_unique<TestObject>(4096);
  ASSERT_TRUE(c->UnregisterSystemSharedMemory("next").ok());
  ASSERT_TRUE(c->RegisterSystemSharedMemory("left-behind", gone->key(), 0, 4096).ok());
  gone.reset();  // unmapped and unlinked, never unregistered
  EXPECT_TRUE(c->RegisterSystemSharedMemory("next", next.key(), 0, 4096).ok());
  absl::StatusOr<v1::SystemSharedMemoryStatusResponse> st = c->SystemSharedMemoryStatus();
  ASSERT_TRUE(st.ok());
  ASSERT_EQ(st->regions_size(), 1);
  EXPECT_EQ(st->regions(0).name(), "next");
  EXPECT_EQ(MetricValue(ts->Scrape(), "fusedlayer_shared_memory_registered_bytes"), 4096.0);
}

// --shared_memory_idle_seconds: a region no request uses (its client died without unregistering)
// is unregistered after the idle time, as its identity would have: its slot and bytes come back,
// a reference to it is NOT_FOUND naming the flag, the counter says why; a region requests use
// stays. On the lane backend, so the expired region was page-locked and its lock is given back.
TEST(SharedMemory, ARegionNoRequestUsesIsUnregisteredAfterTheIdleTime) {
  std::mt19937_64 rng = MakeRng(53);
  const PackedWeightSet set = MakeWeightSet(rng, "shm/idle", MhcSetSpec{.hc_mult = 4, .hidden = 320}, std::nullopt);
  server::ServerConfig cfg = ShmConfig();
  cfg.shared_memory_idle_seconds = 2;
  cfg.shared_memory_max_regions = 2;
  cfg.shared_memory_locked_bytes = uint64_t{1} << 20;
  LaneShmServer server = StartLaneShmServer(set, cfg);
  ASSERT_NE(server.client, nullptr);
  FusedLayerClient* const c = server.client.get();
  const MhcRequestSpec spec{.hc_mult = 4, .hidden = 320, .tokens = 1};
  const v1::MhcSeamRequest req = MakeMhcRequest(rng, "shm/idle", spec);
  absl::StatusOr<v1::MhcSeamResponse> tcp = c->MhcSeam(req);
  ASSERT_TRUE(tcp.ok()) << tcp.status();

  TestObject dead(64 << 10), used(64 << 10);
  const auto before_dead = std::chrono::steady_clock::now();
  ASSERT_TRUE(c->RegisterSystemSharedMemory("dead", dead.key(), 0, 64 << 10).ok());
  ASSERT_TRUE(c->RegisterSystemSharedMemory("used", used.key(), 0, 64 << 10).ok());
  EXPECT_EQ(server.control->page_locks.load(), 2);
  dead.Truncate(64 << 10);  // unmaps: the "process" is gone, its object and registration stay
  const v1::MhcSeamRequest by_ref =
      InputsByReference(req, used, "used", 0, [](uint64_t at, uint64_t bytes) { return at + (bytes + 63) / 64 * 64; });
  // "used" is used every 250 ms (a gap of 2 s would be a call 7x slower than that, even under a
  // sanitizer); "dead" never. Until "dead" is gone: not before its idle time, and within a bound.
  absl::StatusOr<v1::SystemSharedMemoryStatusResponse> st;
  const auto give_up = before_dead + std::chrono::seconds(20);
  do {
    ExpectSameAsTcp(*c, by_ref, *tcp);
    std::this_thread::sleep_for(std::chrono::milliseconds(250));
    st = c->SystemSharedMemoryStatus();
    ASSERT_TRUE(st.ok());
  } while (st->regions_size() == 2 && std::chrono::steady_clock::now() < give_up);
  EXPECT_GE(std::chrono::steady_clock::now() - before_dead, std::chrono::seconds(2));  // not early
  ASSERT_EQ(st->regions_size(), 1);
  EXPECT_EQ(st->regions(0).name(), "used");
  EXPECT_EQ(server.control->page_locks.load(), 1);  // the dead client's mapping is unlocked
  v1::MhcSeamRequest on_dead = req;
  *on_dead.mutable_x()->mutable_shared_memory() = Ref("dead", 0, req.x().data().size());
  on_dead.mutable_x()->clear_data();
  const absl::Status gone = c->MhcSeam(on_dead).status();
  EXPECT_EQ(gone.code(), StatusCode::kNotFound) << gone;
  EXPECT_NE(gone.message().find("--shared_memory_idle_seconds"), std::string::npos) << gone;
  const std::string scrape = server.ts->Scrape();
  EXPECT_EQ(MetricValue(scrape, "fusedlayer_shared_memory_regions_expired_total"), 1.0);
  EXPECT_EQ(MetricValue(scrape, "fusedlayer_shared_memory_regions"), 1.0);
  EXPECT_EQ(MetricValue(scrape, "fusedlayer_shared_memory_registered_bytes"), double(64 << 10));
  // Its slot came back (at most 2 regions per identity here).
  TestObject next(4096);
  EXPECT_TRUE(c->RegisterSystemSharedMemory("next", next.key(), 0, 4096).ok());
  ExpectSameAsTcp(*c, by_ref, *tcp);
}

// Outputs placed in shared memory are not sent, so they do not count against the send limit
// (--max_message_bytes): a call whose inline response would be refused runs by reference, bitwise
// the library's answer, and the same call with its outputs inline is refused before running.
TEST(SharedMemory, PlacedOutputsAreNotBoundByTheSendLimit) {
  std::mt19937_64 rng = MakeRng(49);
  const PackedWeightSet set = MakeWeightSet(rng, "shm/big", MhcSetSpec{}, std::nullopt);
  server::ServerConfig cfg = ShmConfig();
  cfg.max_message_bytes = 64 << 10;
  auto ts = TestServer::Start(cfg, nullptr, {set});
  ASSERT_NE(ts, nullptr);
  auto c = ClientFor(*ts);
  const MhcRequestSpec spec{.tokens = 64, .capture_aux = true};
  const v1::MhcSeamRequest req = MakeMhcRequest(rng, "shm/big", spec);
  const v1::MhcSeamResponse want = Reference(set).RunMhc(req, Path::kFused);
  ASSERT_GT(want.ByteSizeLong(), static_cast<size_t>(cfg.max_message_bytes));
  absl::StatusOr<std::unique_ptr<ClientSharedMemory>> shm =
      ClientSharedMemory::Create(*c, client::MhcRequestSharedBytes(req, MhcConfigOf(spec)));
  ASSERT_TRUE(shm.ok()) << shm.status();
  v1::MhcSeamRequest by_ref = req;
  ASSERT_TRUE((*shm)->Prepare(by_ref, MhcConfigOf(spec)).ok());
  PoisonOutputs(**shm, by_ref.output_placements());
  absl::StatusOr<v1::MhcSeamResponse> got = c->MhcSeam(by_ref);
  ASSERT_TRUE(got.ok()) << got.status();
  ASSERT_TRUE((*shm)->Fetch(*got).ok());
  ExpectMhcEqual(*got, want);

  v1::MhcSeamRequest outputs_inline = by_ref;  // inputs still by reference: a small request
  outputs_inline.clear_output_placements();
  absl::StatusOr<v1::MhcSeamResponse> refused = c->MhcSeam(outputs_inline);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted) << refused.status();
  EXPECT_NE(refused.status().message().find("--max_message_bytes"), absl::string_view::npos) << refused.status();
}

// Drain (SIGTERM's path) with shared-memory requests queued: they complete, outputs in their regions.
TEST(SharedMemory, DrainCompletesQueuedSharedMemoryRequests) {
  std::mt19937_64 rng = MakeRng(48);
  const PackedWeightSet set = MakeWeightSet(rng, "shm/mhc", MhcSetSpec{}, std::nullopt);
  auto ts = TestServer::Start(ShmConfig(), nullptr, {set});
  ASSERT_NE(ts, nullptr);
  auto c = ClientFor(*ts);
  const MhcRequestSpec spec{.tokens = 3};
  constexpr int kRequests = 3;
  std::vector<v1::MhcSeamRequest> inline_requests, requests(kRequests);
  std::vector<v1::MhcSeamResponse> want;
  std::vector<std::unique_ptr<ClientSharedMemory>> objects;
  for (int i = 0; i < kRequests; ++i) {
    inline_requests.push_back(MakeMhcRequest(rng, "shm/mhc", spec));
    absl::StatusOr<v1::MhcSeamResponse> tcp = c->MhcSeam(inline_requests.back());
    ASSERT_TRUE(tcp.ok());
    want.push_back(*tcp);
    absl::StatusOr<std::unique_ptr<ClientSharedMemory>> shm =
        ClientSharedMemory::Create(*c, client::MhcRequestSharedBytes(inline_requests.back(), MhcConfigOf(spec)));
    ASSERT_TRUE(shm.ok());
    requests[i] = inline_requests.back();
    ASSERT_TRUE((*shm)->Prepare(requests[i], MhcConfigOf(spec)).ok());
    PoisonOutputs(**shm, requests[i].output_placements());
    objects.push_back(*std::move(shm));
  }
  std::vector<absl::StatusOr<v1::MhcSeamResponse>> got(kRequests, absl::UnknownError("not run"));
  {
    ExecutorGate gate(*ts);
    std::vector<std::thread> callers;
    for (int i = 0; i < kRequests; ++i) callers.emplace_back([&, i] { got[i] = c->MhcSeam(requests[i]); });
    WaitForQueued(*ts, kRequests);
    std::thread drain([&] { ts->server().Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(30)); });
    std::this_thread::sleep_for(std::chrono::milliseconds(50));  // let the drain begin (not asserted)
    gate.Open();
    for (std::thread& t : callers) t.join();
    drain.join();
  }
  for (int i = 0; i < kRequests; ++i) {
    ASSERT_TRUE(got[i].ok()) << got[i].status();
    ASSERT_TRUE(objects[i]->Fetch(*got[i]).ok());
    ExpectMhcEqual(*got[i], want[i]);
  }
  // The objects' destructors unregister against a stopped server: errors ignored, no crash.
  objects.clear();
}

}  // namespace
}  // namespace fusedlayer::testing
