// GPU lanes (backend.h, Lane): the serving path's stream-ordered copies through page-locked staging
// and one event wait per request, on several lanes at once, give bitwise the outputs of the same
// request on the backend's default context (same kernels, same device). Also: kernel time comes
// from the lane's events, invalid arguments are refused at enqueue and the lane serves the next
// request. Skips where no GPU is present (like every suite in tests/gpu). Written against the
// public Backend interface only; the staging here is the test's own, not the server's.
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "fusedlayer/backend.h"
#include "gtest/gtest.h"
#include "test_util.h"

namespace fusedlayer {
namespace {

using ::fusedlayer::testing::MakeRng;
using ::fusedlayer::testing::RandomBf16;
using ::fusedlayer::testing::RandomFloat;
using ::fusedlayer::testing::RandomValue;

constexpr int kN = 4;
constexpr int64_t kC = 7168;

struct MhcSet {
  MhcHyperParams hp;
  std::vector<float> fn, scale, base;
  std::vector<uint16_t> g;
  std::unique_ptr<PreparedMhcWeights> prepared;
};

// One request's host tensors: inputs, and outputs poisoned (NaN / 0xffff).
struct Request {
  int64_t T = 0;
  std::vector<uint16_t> x, r, nr, y;
  std::vector<float> post, comb, pre, npre, npost, ncomb;
  // The args over `base` + offsets (host: base = nullptr, offsets = real pointers).
  MhcArgs Args() {
    MhcArgs a;
    a.stage = MhcStage::kSeam;
    a.mode = MhcMode::kShifted;
    a.tokens = T;
    a.x = TensorView::Contiguous(x.data(), DType::kBF16, {T, kC});
    a.residual = TensorView::Contiguous(r.data(), DType::kBF16, {T, kN, kC});
    a.post_mix = TensorView::Contiguous(post.data(), DType::kFP32, {T, kN});
    a.comb_mix = TensorView::Contiguous(comb.data(), DType::kFP32, {T, kN, kN});
    a.pre_mix = TensorView::Contiguous(pre.data(), DType::kFP32, {T, kN});
    a.new_residual = TensorView::Contiguous(nr.data(), DType::kBF16, {T, kN, kC});
    a.new_pre_mix = TensorView::Contiguous(npre.data(), DType::kFP32, {T, kN});
    a.new_post_mix = TensorView::Contiguous(npost.data(), DType::kFP32, {T, kN});
    a.new_comb_mix = TensorView::Contiguous(ncomb.data(), DType::kFP32, {T, kN, kN});
    a.y = TensorView::Contiguous(y.data(), DType::kBF16, {T, kC});
    return a;
  }
  void Poison() {
    std::fill(nr.begin(), nr.end(), 0xffff);
    std::fill(y.begin(), y.end(), 0xffff);
    for (auto* v : {&npre, &npost, &ncomb}) std::fill(v->begin(), v->end(), NAN);
  }
};

Request MakeRequest(std::mt19937_64& rng, int64_t T) {
  Request q;
  q.T = T;
  q.x = RandomBf16(rng, size_t(T) * kC);
  q.r = RandomBf16(rng, size_t(T) * kN * kC);
  q.post = RandomFloat(rng, size_t(T) * kN, 0.05f, 2.0f);
  q.comb = RandomFloat(rng, size_t(T) * kN * kN, 0.01f, 1.0f);
  q.pre = RandomFloat(rng, size_t(T) * kN, 0.01f, 1.0f);
  q.nr.resize(size_t(T) * kN * kC);
  q.y.resize(size_t(T) * kC);
  q.npre.resize(size_t(T) * kN);
  q.npost.resize(size_t(T) * kN);
  q.ncomb.resize(size_t(T) * kN * kN);
  q.Poison();
  return q;
}

// The views of `a` in order: inputs first (5), then outputs (5).
std::vector<TensorView*> Views(MhcArgs& a) {
  return {&a.x, &a.residual, &a.post_mix, &a.comb_mix, &a.pre_mix,
          &a.new_residual, &a.new_pre_mix, &a.new_post_mix, &a.new_comb_mix, &a.y};
}
constexpr size_t kInputs = 5;
size_t Bytes(const TensorView& v) { return size_t(v.numel()) * DTypeSize(v.dtype); }

// The default context, synchronously: device buffers, copies, RunMhc.
absl::Status RunDefault(Backend& be, const PreparedMhcWeights& w, Request& q, Path path) {
  MhcArgs host = q.Args(), dev = host;
  std::vector<DeviceBuffer> bufs;
  std::vector<TensorView*> hv = Views(host), dv = Views(dev);
  for (size_t i = 0; i < hv.size(); ++i) {
    auto b = be.Allocate(Bytes(*hv[i]));
    if (!b.ok()) return b.status();
    dv[i]->data = b->data();
    if (i < kInputs) {
      if (absl::Status s = be.CopyToDevice(dv[i]->data, hv[i]->data, Bytes(*hv[i])); !s.ok()) return s;
    }
    bufs.push_back(std::move(*b));
  }
  auto r = be.RunMhc(w, dev, path);
  if (!r.ok()) return r.status();
  for (size_t i = kInputs; i < hv.size(); ++i) {
    if (absl::Status s = be.CopyToHost(hv[i]->data, dv[i]->data, Bytes(*hv[i])); !s.ok()) return s;
  }
  return absl::OkStatus();
}

// On a lane: one pinned block and one device block for all tensors, async copies, one Wait.
absl::StatusOr<RunStats> RunLane(Backend& be, Lane& lane, const PreparedMhcWeights& w, Request& q, Path path) {
  MhcArgs host = q.Args(), dev = host;
  std::vector<TensorView*> hv = Views(host), dv = Views(dev);
  std::vector<size_t> offset;
  size_t total = 0;
  for (TensorView* v : hv) {
    offset.push_back(total);
    total += (Bytes(*v) + 255) / 256 * 256;
  }
  auto staging = be.AllocateHostStaging(total);
  if (!staging.ok()) return staging.status();
  auto device = lane.Allocate(total);
  if (!device.ok()) return device.status();
  char* st = static_cast<char*>(staging->data());
  char* d = static_cast<char*>(device->data());
  std::memset(st, 0xA5, total);  // stale bytes a missing wait would leave in the outputs
  for (size_t i = 0; i < hv.size(); ++i) {
    dv[i]->data = d + offset[i];
    if (i < kInputs) {
      std::memcpy(st + offset[i], hv[i]->data, Bytes(*hv[i]));
      if (absl::Status s = lane.EnqueueCopyToDevice(d + offset[i], st + offset[i], Bytes(*hv[i])); !s.ok()) return s;
    }
  }
  absl::Status launched = lane.EnqueueMhc(w, dev, path);
  for (size_t i = kInputs; launched.ok() && i < hv.size(); ++i) {
    launched = lane.EnqueueCopyToHost(st + offset[i], d + offset[i], Bytes(*hv[i]));
  }
  absl::StatusOr<RunStats> waited = lane.Wait();  // always: the copies in may still read `st`
  if (!launched.ok()) return launched;
  if (!waited.ok()) return waited;
  for (size_t i = kInputs; i < hv.size(); ++i) std::memcpy(hv[i]->data, st + offset[i], Bytes(*hv[i]));
  return waited;
}

class GpuLanesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto be = CreateBackend("auto");
    if (!be.ok() || (*be)->kind() == "cpu") GTEST_SKIP() << "no GPU backend on this machine";
    backend_ = std::move(*be);
    ASSERT_GT(backend_->max_lanes(), 1);
    auto rng = MakeRng(77);
    set_.hp.hc_mult = kN;
    set_.hp.hidden = kC;
    const int M = set_.hp.num_mixes();
    const int64_t K = set_.hp.flat_width();
    set_.fn.resize(size_t(M) * K);
    for (auto& f : set_.fn) f = RandomValue(rng, 1.0f / std::sqrt(float(K)), 8.0f);
    set_.scale = RandomFloat(rng, 3, 0.5f, 2.0f);
    set_.base = RandomFloat(rng, M, -1.0f, 1.0f);
    set_.g = RandomBf16(rng, kC, 1.0f, 4.0f);
    MhcWeightsHost h;
    h.fn = TensorView::Contiguous(set_.fn.data(), DType::kFP32, {M, K});
    h.scale = TensorView::Contiguous(set_.scale.data(), DType::kFP32, {3});
    h.base = TensorView::Contiguous(set_.base.data(), DType::kFP32, {M});
    h.norm_weight = TensorView::Contiguous(set_.g.data(), DType::kBF16, {kC});
    auto w = backend_->PrepareMhc(set_.hp, h);
    ASSERT_TRUE(w.ok()) << w.status();
    set_.prepared = std::move(*w);
  }
  void TearDown() override {
    set_.prepared.reset();
    backend_.reset();
  }
  std::unique_ptr<Backend> backend_;
  MhcSet set_;
};

TEST_F(GpuLanesTest, LanesAreBitwiseTheDefaultContextAndOverlap) {
  constexpr int kLanes = 4, kPerLane = 6;
  std::vector<std::unique_ptr<Lane>> lanes;
  for (int i = 0; i < kLanes; ++i) {
    auto lane = backend_->CreateLane();
    ASSERT_TRUE(lane.ok()) << lane.status();
    lanes.push_back(std::move(*lane));
  }
  for (Path path : {Path::kFused, Path::kUnfused}) {
    SCOPED_TRACE(PathName(path));
    // Fresh inputs per request (T = 64, the decode seam of BENCHMARKS.md, and T = 1), with the
    // expected outputs from the default context.
    auto rng = MakeRng(path == Path::kFused ? 1 : 2);
    std::vector<Request> want, got;
    for (int i = 0; i < kLanes * kPerLane; ++i) {
      want.push_back(MakeRequest(rng, i % 3 == 0 ? 1 : 64));
      ASSERT_TRUE(RunDefault(*backend_, *set_.prepared, want.back(), path).ok());
      got.push_back(want.back());
      got.back().Poison();
    }
    std::vector<absl::Status> status(got.size());
    std::vector<double> kernel(got.size(), -1);
    std::vector<std::thread> threads;
    for (int l = 0; l < kLanes; ++l) {
      threads.emplace_back([&, l] {
        for (int k = 0; k < kPerLane; ++k) {
          const size_t i = size_t(l) * kPerLane + size_t(k);
          auto r = RunLane(*backend_, *lanes[l], *set_.prepared, got[i], path);
          status[i] = r.status();
          if (r.ok()) kernel[i] = r->kernel_seconds;
        }
      });
    }
    for (auto& t : threads) t.join();
    for (size_t i = 0; i < got.size(); ++i) {
      SCOPED_TRACE(i);
      ASSERT_TRUE(status[i].ok()) << status[i];
      EXPECT_GT(kernel[i], 0.0);  // from the lane's events around the kernels
      EXPECT_EQ(std::memcmp(got[i].nr.data(), want[i].nr.data(), got[i].nr.size() * 2), 0) << "new_residual";
      EXPECT_EQ(std::memcmp(got[i].y.data(), want[i].y.data(), got[i].y.size() * 2), 0) << "y";
      EXPECT_EQ(std::memcmp(got[i].npre.data(), want[i].npre.data(), got[i].npre.size() * 4), 0) << "new_pre_mix";
      EXPECT_EQ(std::memcmp(got[i].npost.data(), want[i].npost.data(), got[i].npost.size() * 4), 0) << "new_post_mix";
      EXPECT_EQ(std::memcmp(got[i].ncomb.data(), want[i].ncomb.data(), got[i].ncomb.size() * 4), 0) << "new_comb_mix";
    }
  }
}

TEST_F(GpuLanesTest, InvalidArgumentsAreRefusedAtEnqueueAndTheLaneServesTheNextRequest) {
  auto lane = backend_->CreateLane();
  ASSERT_TRUE(lane.ok()) << lane.status();
  auto rng = MakeRng(5);
  Request q = MakeRequest(rng, 8);
  MhcArgs bad = q.Args();
  bad.x.shape[1] = kC - 1;  // hidden size of another set
  EXPECT_TRUE(absl::IsInvalidArgument((*lane)->EnqueueMhc(*set_.prepared, bad, Path::kFused)));
  auto empty = (*lane)->Wait();
  ASSERT_TRUE(empty.ok()) << empty.status();
  EXPECT_EQ(empty->kernel_seconds, 0.0);  // nothing was enqueued
  Request want = q;
  ASSERT_TRUE(RunDefault(*backend_, *set_.prepared, want, Path::kFused).ok());
  auto r = RunLane(*backend_, **lane, *set_.prepared, q, Path::kFused);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(std::memcmp(q.nr.data(), want.nr.data(), q.nr.size() * 2), 0);
  EXPECT_EQ(std::memcmp(q.y.data(), want.y.data(), q.y.size() * 2), 0);
}

// What the server's page-locked shared-memory regions rely on (server/transport/shared_memory.h):
// a lane copies to and from a MAP_SHARED mapping of a POSIX shared-memory object locked with
// PageLockHostMemory by DMA, bitwise; after the object's owner truncates it, copies through the
// locked mapping still complete (the locked pages stay allocated) and nothing faults; and locking
// a mapping that reaches past the object's end is an error, not a SIGBUS.
TEST_F(GpuLanesTest, PageLockedSharedMemoryIsCopiedByDmaAndATruncatedObjectNeverFaults) {
  const std::string key = "/fl-gpu-lanes-" + std::to_string(::getpid());
  const int fd = ::shm_open(key.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
  ASSERT_GE(fd, 0);
  ::shm_unlink(key.c_str());  // the descriptor keeps the object
  constexpr size_t kBytes = size_t{4} << 20;
  ASSERT_EQ(::ftruncate(fd, kBytes), 0);
  {  // The client's view: the bytes it writes.
    void* client = ::mmap(nullptr, kBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    ASSERT_NE(client, MAP_FAILED);
    for (size_t i = 0; i < kBytes; ++i) static_cast<unsigned char*>(client)[i] = static_cast<unsigned char>(i * 131 + 7);
    ::munmap(client, kBytes);
  }
  void* server = ::mmap(nullptr, kBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ASSERT_NE(server, MAP_FAILED);
  {
    absl::StatusOr<DeviceBuffer> locked = backend_->PageLockHostMemory(server, kBytes);
    ASSERT_TRUE(locked.ok()) << locked.status();
    auto lane = backend_->CreateLane();
    ASSERT_TRUE(lane.ok()) << lane.status();
    auto dev = (*lane)->Allocate(kBytes);
    ASSERT_TRUE(dev.ok()) << dev.status();
    auto back = backend_->AllocateHostStaging(kBytes);
    ASSERT_TRUE(back.ok()) << back.status();
    std::memset(back->data(), 0, kBytes);
    ASSERT_TRUE((*lane)->EnqueueCopyToDevice(dev->data(), server, kBytes).ok());
    ASSERT_TRUE((*lane)->EnqueueCopyToHost(back->data(), dev->data(), kBytes).ok());
    ASSERT_TRUE((*lane)->Wait().ok());
    const auto* got = static_cast<const unsigned char*>(back->data());
    for (size_t i = 0; i < kBytes; i += 4093) ASSERT_EQ(got[i], static_cast<unsigned char>(i * 131 + 7)) << i;

    // The owner truncates the object: the server's CPU must not touch `server` now, its DMA may.
    ASSERT_EQ(::ftruncate(fd, 0), 0);
    ASSERT_TRUE((*lane)->EnqueueCopyToDevice(dev->data(), server, kBytes).ok());
    ASSERT_TRUE((*lane)->EnqueueCopyToHost(server, dev->data(), kBytes).ok());
    absl::StatusOr<RunStats> after = (*lane)->Wait();
    EXPECT_TRUE(after.ok()) << after.status();
  }  // unlocked
  ::munmap(server, kBytes);

  // A mapping past the object's end: the lock fails cleanly (its pages cannot be pinned).
  ASSERT_EQ(::ftruncate(fd, 65536), 0);
  void* past = ::mmap(nullptr, kBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ASSERT_NE(past, MAP_FAILED);
  absl::StatusOr<DeviceBuffer> refused = backend_->PageLockHostMemory(past, kBytes);
  EXPECT_FALSE(refused.ok());
  refused = absl::UnknownError("dropped");  // unlock (if it did lock) before the unmap
  ::munmap(past, kBytes);
  ::close(fd);
}

}  // namespace
}  // namespace fusedlayer
