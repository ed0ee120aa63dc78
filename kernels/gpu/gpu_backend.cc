// The GPU backend (CUDA or HIP, one source): device memory, synchronous copies on the backend's
// stream, and the mHC / SWA launchers timed with events; lanes (backend.h) with their own streams,
// scratch and events for the server's pipelined serving path; page-locked staging memory.
#include <dlfcn.h>

#include <algorithm>
#include <cstring>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <string>

#include "absl/strings/str_cat.h"
#include "fusedlayer/backend.h"
#include "gpu_backend_factory.h"
#include "gpu_context.h"
#include "gpu_runtime.h"
#include "mhc_launch.h"
#include "swa_launch.h"
#include "swa_kernel_launch.h"


namespace fusedlayer {
namespace {

using gpu::GpuContext;

static_assert(sizeof(gpuIpcMemHandle_t) == kIpcHandleBytes);

// The device allocation that contains `p` (its first byte and size), from the driver: the bounds of
// an opened IPC handle are never taken from the client. The runtime API has no such query on CUDA,
// so the driver's cuMemGetAddressRange is looked up in libcuda (loaded already: the runtime uses it).
absl::Status AllocationRange(const void* p, const char** base, size_t* bytes) {
#if FL_HIP
  hipDeviceptr_t b = nullptr;
  if (hipError_t err = hipMemGetAddressRange(&b, bytes, const_cast<void*>(p)); err != hipSuccess) {
    (void)hipGetLastError();
    return absl::InternalError(absl::StrCat("hipMemGetAddressRange: ", hipGetErrorString(err)));
  }
  *base = static_cast<const char*>(b);
  return absl::OkStatus();
#else
  using GetAddressRange = int (*)(unsigned long long*, size_t*, unsigned long long);  // CUresult, CUdeviceptr
  static const GetAddressRange fn = [] {
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD);
    if (lib == nullptr) lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    return lib == nullptr ? nullptr : reinterpret_cast<GetAddressRange>(dlsym(lib, "cuMemGetAddressRange_v2"));
  }();
  if (fn == nullptr) return absl::InternalError("cuMemGetAddressRange_v2 not found in libcuda.so.1");
  unsigned long long b = 0;
  if (int err = fn(&b, bytes, reinterpret_cast<unsigned long long>(p)); err != 0) {
    return absl::InternalError(absl::StrCat("cuMemGetAddressRange failed (CUresult ", err, ")"));
  }
  *base = reinterpret_cast<const char*>(b);
  return absl::OkStatus();
#endif
}

class GpuEvent {
 public:
  GpuEvent() = default;
  ~GpuEvent() {
    if (ev_ != nullptr) (void)gpuEventDestroy(ev_);
  }
  GpuEvent(const GpuEvent&) = delete;
  GpuEvent& operator=(const GpuEvent&) = delete;
  absl::Status Init() { return gpu::GpuStatus(gpuEventCreate(&ev_), "event create"); }
  // An event used only to wait on (no timestamps: cheaper to record).
  absl::Status InitNoTiming() {
    return gpu::GpuStatus(gpuEventCreateWithFlags(&ev_, gpuEventDisableTiming), "event create");
  }
  gpuEvent_t get() const { return ev_; }

 private:
  gpuEvent_t ev_ = nullptr;
};

// The device's default stream-ordered pool, keeping freed memory for reuse (release threshold =
// unlimited), or null when the runtime has none or FUSEDLAYER_NO_GPU_STAGING_POOL=1 (see
// GpuBackend::InitStagingPool).
gpuMemPool_t StreamOrderedPool(int device) {
  if (const char* off = std::getenv("FUSEDLAYER_NO_GPU_STAGING_POOL"); off != nullptr && std::string(off) == "1") {
    return nullptr;
  }
  gpuMemPool_t pool = nullptr;
  if (gpuDeviceGetDefaultMemPool(&pool, device) != gpuSuccess || pool == nullptr) {
    (void)gpuGetLastError();
    return nullptr;
  }
  uint64_t keep_all = ~uint64_t{0};
  if (gpuMemPoolSetAttribute(pool, gpuMemPoolAttrReleaseThreshold, &keep_all) != gpuSuccess) {
    (void)gpuGetLastError();
    return nullptr;
  }
  return pool;
}

absl::StatusOr<DeviceBuffer> PlainDeviceBuffer(size_t bytes) {
  auto mem = gpu::GpuAlloc(bytes);
  if (!mem.ok()) return mem.status();
  return DeviceBuffer(mem->release(), bytes, [](void* p) { (void)gpuFree(p); });
}

// Device memory for request tensors, stream-ordered on `stream` when `pool` is set: allocation and
// release are queue operations on the stream (no driver call, no device-wide sync); the release of
// a buffer is ordered after the work queued on the stream before it.
absl::StatusOr<DeviceBuffer> StreamOrderedBuffer(size_t bytes, gpuMemPool_t pool, gpuStream_t stream) {
  if (bytes == 0) return DeviceBuffer();
  if (pool == nullptr) return PlainDeviceBuffer(bytes);
  void* p = nullptr;
  gpuError_t err = gpuMallocAsync(&p, bytes, stream);
  if (err == gpuErrorMemoryAllocation) {
    // The pool may hold free blocks too fragmented for this size: give them back, retry once.
    (void)gpuGetLastError();
    (void)gpuStreamSynchronize(stream);
    (void)gpuMemPoolTrimTo(pool, 0);
    err = gpuMallocAsync(&p, bytes, stream);
  }
  if (err != gpuSuccess) {
    (void)gpuGetLastError();
    if (err == gpuErrorMemoryAllocation) {
      return absl::ResourceExhaustedError(absl::StrCat("device memory: ", bytes, " bytes for a request buffer"));
    }
    // Anything else (e.g. a size the pool refuses outright): the plain allocator decides.
    return PlainDeviceBuffer(bytes);
  }
  return DeviceBuffer(p, bytes, [stream](void* q) { (void)gpuFreeAsync(q, stream); });
}

// A lane: its own GpuContext (stream, scratch blocks, cuBLASLt state), timing events around the
// op, and one more event that Wait() synchronises on. Driven by one thread at a time (its
// executor worker); lanes run concurrently with each other and with the backend's default context.
//
// Lifetimes: the events and the stream live as long as the lane; the destructor waits for the
// stream (GpuContext's destructor) before anything it owns is freed. Staging and device memory
// are the caller's (backend.h): it keeps them until Wait() returns.
class GpuLane final : public Lane {
 public:
  GpuLane(std::unique_ptr<GpuContext> ctx, gpuMemPool_t pool, int64_t fused_max_tokens)
      : ctx_(std::move(ctx)), pool_(pool), fused_max_tokens_(fused_max_tokens) {}
  // Queued work (a caller that never waited) finishes before the events and the stream go.
  ~GpuLane() override { (void)gpuStreamSynchronize(ctx_->stream); }

  absl::Status Init() {
    if (absl::Status s = start_.Init(); !s.ok()) return s;
    if (absl::Status s = stop_.Init(); !s.ok()) return s;
    return done_.InitNoTiming();
  }

  // A lane runs one request at a time (LaneStaging allocates once per call and frees after its
  // Wait), so the lane keeps that buffer for its next request instead of a gpuMallocAsync and a
  // gpuFreeAsync per call: ~14 us of runtime calls per call on the lane's thread under CUPTI on the
  // H200. Up to
  // kKeptBufferBytes; a larger request, or one while the kept buffer is out, allocates as before.
  absl::StatusOr<DeviceBuffer> Allocate(size_t bytes) override {
    if (absl::Status s = Bind(); !s.ok()) return s;
    if (bytes == 0 || bytes > kKeptBufferBytes || kept_out_) return StreamOrderedBuffer(bytes, pool_, ctx_->stream);
    if (kept_.bytes() < bytes) {
      kept_.Reset();  // stream-ordered: after the work queued before it
      size_t grow = size_t{1} << 20;
      while (grow < bytes) grow *= 2;
      absl::StatusOr<DeviceBuffer> bigger = StreamOrderedBuffer(std::min(grow, kKeptBufferBytes), pool_, ctx_->stream);
      if (!bigger.ok()) return bigger.status();
      kept_ = std::move(*bigger);
    }
    kept_out_ = true;
    // Given back, not freed: the next request's work is queued on this stream after this one's.
    return DeviceBuffer(kept_.data(), bytes, [this](void*) { kept_out_ = false; });
  }
  absl::Status EnqueueCopyToDevice(void* dst, const void* src, size_t bytes) override {
    return Enqueue(dst, src, bytes, gpuMemcpyHostToDevice, "copy to device");
  }
  absl::Status EnqueueCopyToHost(void* dst, const void* src, size_t bytes) override {
    return Enqueue(dst, src, bytes, gpuMemcpyDeviceToHost, "copy to host");
  }
  absl::Status EnqueueMhc(const PreparedMhcWeights& weights, const MhcArgs& args, Path path) override {
    return Timed([&] {
      return gpu::LaunchMhcGpu(static_cast<const gpu::GpuMhcWeights&>(weights), args, path, *ctx_, fused_max_tokens_);
    });
  }
  absl::Status EnqueueSwa(const PreparedSwaWeights& weights, const SwaArgs& args, Path path) override {
    return Timed([&] {
      return gpu::LaunchSwaGpu(static_cast<const gpu::GpuSwaWeights&>(weights), args, path, *ctx_, fused_max_tokens_);
    });
  }

  absl::Status EnqueueHostWrite(uint32_t* host_word, uint32_t value) override {
    if (absl::Status s = Bind(); !s.ok()) return s;
    absl::Status s = gpu::GpuStatus(gpuStreamWriteValue32(ctx_->stream, host_word, value), "stream write of a host word");
    if (!s.ok()) (void)gpuGetLastError();
    return s;
  }

  absl::StatusOr<RunStats> Wait() override {
    const bool timed = timed_;
    timed_ = false;
    // One event of this lane: waits for this stream's work only, never the whole device.
    absl::Status s = gpu::GpuStatus(gpuEventRecord(done_.get(), ctx_->stream), "event record");
    if (s.ok()) s = gpu::GpuStatus(gpuEventSynchronize(done_.get()), "lane work");
    if (!s.ok()) {
      (void)gpuGetLastError();  // a non-sticky error must not fail the lane's next request
      return absl::InternalError(s.message());
    }
    RunStats stats;
    if (timed) {
      float ms = 0.0f;
      if (absl::Status t = gpu::GpuStatus(gpuEventElapsedTime(&ms, start_.get(), stop_.get()), "event time"); !t.ok()) {
        (void)gpuGetLastError();
        return absl::InternalError(t.message());
      }
      stats.kernel_seconds = double(ms) * 1e-3;
    }
    return stats;
  }

 private:
  // The runtime's current device is per thread, and a lane's worker may be any thread.
  absl::Status Bind() { return gpu::GpuStatus(gpuSetDevice(ctx_->device), "gpuSetDevice"); }

  absl::Status Enqueue(void* dst, const void* src, size_t bytes, decltype(gpuMemcpyHostToDevice) kind,
                       const char* what) {
    if (bytes == 0) return absl::OkStatus();
    if (absl::Status s = Bind(); !s.ok()) return s;
    absl::Status s = gpu::GpuStatus(gpuMemcpyAsync(dst, src, bytes, kind, ctx_->stream), what);
    if (!s.ok()) (void)gpuGetLastError();
    return s;
  }

  // Enqueues `launch` (validation, then kernels) between the timing events; no wait here.
  template <typename Fn>
  absl::Status Timed(Fn&& launch) {
    if (absl::Status s = Bind(); !s.ok()) return s;
    if (absl::Status s = gpu::GpuStatus(gpuEventRecord(start_.get(), ctx_->stream), "event record"); !s.ok()) {
      return absl::InternalError(s.message());
    }
    absl::Status launched = launch();
    if (absl::Status s = gpu::GpuStatus(gpuEventRecord(stop_.get(), ctx_->stream), "event record"); !s.ok()) {
      return absl::InternalError(s.message());
    }
    timed_ = launched.ok();
    return launched;
  }

  static constexpr size_t kKeptBufferBytes = size_t{64} << 20;

  std::unique_ptr<GpuContext> ctx_;
  const gpuMemPool_t pool_;
  const int64_t fused_max_tokens_;
  GpuEvent start_, stop_, done_;
  bool timed_ = false;  // an op was enqueued since the last Wait
  // The request buffer kept between requests (Allocate); declared after ctx_, so it is freed
  // (stream-ordered) while the stream still exists.
  DeviceBuffer kept_;
  bool kept_out_ = false;  // handed to a request and not given back yet
};

class GpuBackend final : public Backend {
 public:
  GpuBackend(std::unique_ptr<GpuContext> ctx, const BackendOptions& options)
      : ctx_(std::move(ctx)), fused_max_tokens_(options.fused_max_tokens) {}

  absl::Status Init() {
    if (absl::Status s = start_.Init(); !s.ok()) return s;
    if (absl::Status s = stop_.Init(); !s.ok()) return s;
    InitStagingPool();
    return absl::OkStatus();
  }

  std::string_view kind() const override { return GpuBackendKind(); }
  std::string device_name() const override { return ctx_->name; }
  std::string arch() const override { return ctx_->arch; }
  bool host_accessible() const override { return false; }

  // A request's device buffers on the default context (warm-up, shadow runs; the serving path
  // allocates on its lane). Stream-ordered on the default stream when the pool is available.
  absl::StatusOr<DeviceBuffer> Allocate(size_t bytes) override {
    std::lock_guard<std::mutex> lock(default_mu_);
    if (absl::Status s = BindDevice(); !s.ok()) return s;
    return StreamOrderedBuffer(bytes, pool_, ctx_->stream);
  }

  // Page-locked host memory for the lanes' staging (pooled and bounded by the server). Freeing
  // it (gpuFreeHost) synchronises with the device: the pool frees only blocks no lane is using.
  absl::StatusOr<DeviceBuffer> AllocateHostStaging(size_t bytes) override {
    if (bytes == 0) return DeviceBuffer();
    void* p = nullptr;
    if (gpuError_t err = gpuHostAlloc(&p, bytes); err != gpuSuccess) {
      (void)gpuGetLastError();
      return absl::ResourceExhaustedError(
          absl::StrCat("page-locked host memory: ", bytes, " bytes: ", gpuGetErrorString(err)));
    }
    return DeviceBuffer(p, bytes, [](void* q) { (void)gpuFreeHost(q); });
  }

  // A client's shared-memory mapping, locked once at registration (server/transport/shared_memory.h).
  // The driver pins the pages from the kernel (get_user_pages): pages missing from a shrunk object
  // fail the call here, they do not fault the process.
  absl::StatusOr<DeviceBuffer> PageLockHostMemory(void* p, size_t bytes) override {
    if (bytes == 0) return DeviceBuffer();
    if (gpuError_t err = gpuHostRegister(p, bytes); err != gpuSuccess) {
      (void)gpuGetLastError();
      return absl::FailedPreconditionError(
          absl::StrCat("page-locking ", bytes, " bytes of host memory: ", gpuGetErrorString(err)));
    }
    return DeviceBuffer(p, bytes, [](void* q) { (void)gpuHostUnregister(q); });
  }

  int device_index() const override { return ctx_->device; }

  absl::StatusOr<IpcExportedBuffer> AllocateIpcExportable(size_t bytes) override {
    if (bytes == 0) return absl::InvalidArgumentError("an exportable allocation needs at least one byte");
    if (gpuError_t err = gpuSetDevice(ctx_->device); err != gpuSuccess) return gpu::GpuStatus(err, "set device");
    void* p = nullptr;
    if (gpuError_t err = gpuMalloc(&p, bytes); err != gpuSuccess) {
      (void)gpuGetLastError();
      return absl::ResourceExhaustedError(absl::StrCat("device memory: ", bytes, " bytes: ", gpuGetErrorString(err)));
    }
    IpcExportedBuffer out{DeviceBuffer(p, bytes, [](void* q) { (void)gpuFree(q); }), std::string()};
    gpuIpcMemHandle_t h;
    if (gpuError_t err = gpuIpcGetMemHandle(&h, p); err != gpuSuccess) {
      (void)gpuGetLastError();
      return absl::InternalError(absl::StrCat("exporting an IPC handle: ", gpuGetErrorString(err)));
    }
    out.handle.assign(reinterpret_cast<const char*>(&h), sizeof(h));
    return out;
  }

  absl::StatusOr<DeviceBuffer> ImportIpcMemory(std::string_view handle) override {
    if (handle.size() != sizeof(gpuIpcMemHandle_t)) {
      return absl::InvalidArgumentError(
          absl::StrCat("an IPC handle is ", sizeof(gpuIpcMemHandle_t), " bytes, got ", handle.size()));
    }
    if (gpuError_t err = gpuSetDevice(ctx_->device); err != gpuSuccess) return gpu::GpuStatus(err, "set device");
    gpuIpcMemHandle_t h;
    std::memcpy(&h, handle.data(), sizeof(h));
    void* p = nullptr;
    if (gpuError_t err = gpuIpcOpenMemHandle(&p, h); err != gpuSuccess) {
      (void)gpuGetLastError();  // not sticky: a handle the driver refuses leaves the context usable
      return absl::InvalidArgumentError(absl::StrCat("the driver refused the IPC handle: ", gpuGetErrorString(err)));
    }
    const char* base = nullptr;
    size_t bytes = 0;
    absl::Status s = AllocationRange(p, &base, &bytes);
    if (s.ok() && base != p) s = absl::InternalError("an opened IPC handle does not start its allocation");
    if (!s.ok()) {
      (void)gpuIpcCloseMemHandle(p);
      return s;
    }
    return DeviceBuffer(p, bytes, [](void* q) { (void)gpuIpcCloseMemHandle(q); });
  }

  int max_lanes() const override { return 16; }
  absl::StatusOr<std::unique_ptr<Lane>> CreateLane() override {
    auto ctx = ctx_->CreateSibling();
    if (!ctx.ok()) return ctx.status();
    auto lane = std::make_unique<GpuLane>(std::move(*ctx), pool_, fused_max_tokens_);
    if (absl::Status s = lane->Init(); !s.ok()) return s;
    return std::unique_ptr<Lane>(std::move(lane));
  }

  absl::Status CopyToDevice(void* dst, const void* src, size_t bytes) override {
    return Copy(dst, src, bytes, gpuMemcpyHostToDevice, "copy to device");
  }
  absl::Status CopyToHost(void* dst, const void* src, size_t bytes) override {
    return Copy(dst, src, bytes, gpuMemcpyDeviceToHost, "copy to host");
  }

  // ---- mHC ----------------------------------------------------------------------------------
  absl::StatusOr<std::unique_ptr<PreparedMhcWeights>> PrepareMhc(const MhcHyperParams& params,
                                                                 const MhcWeightsHost& weights) override {
    std::lock_guard<std::mutex> lock(default_mu_);
    if (absl::Status s = BindDevice(); !s.ok()) return s;
    auto w = gpu::PrepareMhcGpu(params, weights, *ctx_);
    if (!w.ok()) return w.status();
    return std::unique_ptr<PreparedMhcWeights>(std::move(*w));
  }
  FusedSupport MhcFusedSupport(const PreparedMhcWeights& weights, const MhcShapeQuery& query) const override {
    return gpu::MhcFusedSupportGpu(static_cast<const gpu::GpuMhcWeights&>(weights), query, *ctx_,
                                   fused_max_tokens_);
  }
  absl::StatusOr<RunStats> RunMhc(const PreparedMhcWeights& weights, const MhcArgs& args, Path path) override {
    std::lock_guard<std::mutex> lock(default_mu_);
    if (absl::Status s = BindDevice(); !s.ok()) return s;
    return Timed([&] {
      return gpu::LaunchMhcGpu(static_cast<const gpu::GpuMhcWeights&>(weights), args, path, *ctx_,
                               fused_max_tokens_);
    });
  }

  // ---- SWA ----------------------------------------------------------------------------------
  absl::StatusOr<std::unique_ptr<PreparedSwaWeights>> PrepareSwa(const SwaHyperParams& params,
                                                                 const SwaWeightsHost& weights) override {
    std::lock_guard<std::mutex> lock(default_mu_);
    if (absl::Status s = BindDevice(); !s.ok()) return s;
    auto w = gpu::PrepareSwaGpu(params, weights, *ctx_);
    if (!w.ok()) return w.status();
    return std::unique_ptr<PreparedSwaWeights>(std::move(*w));
  }
  FusedSupport SwaFusedSupport(const PreparedSwaWeights& weights, const SwaShapeQuery& query) const override {
    return gpu::SwaFusedSupportGpu(static_cast<const gpu::GpuSwaWeights&>(weights), query, *ctx_,
                                   fused_max_tokens_);
  }
  absl::StatusOr<RunStats> RunSwa(const PreparedSwaWeights& weights, const SwaArgs& args, Path path) override {
    std::lock_guard<std::mutex> lock(default_mu_);
    if (absl::Status s = BindDevice(); !s.ok()) return s;
    return Timed([&] {
      return gpu::LaunchSwaGpu(static_cast<const gpu::GpuSwaWeights&>(weights), args, path, *ctx_,
                               fused_max_tokens_);
    });
  }

 private:
  // Request buffers come from the device's default stream-ordered pool, which keeps freed memory
  // for reuse instead of returning it to the driver at every synchronisation (release threshold =
  // unlimited). What it retains is bounded by the largest tensors of the requests running at once
  // (one per lane, and the default context's). Measured reason: per-request gpuMalloc + gpuFree (which waits
  // for the whole device) was most of a small SWA request's executor time (BENCHMARKS.md). A
  // runtime without stream-ordered pools keeps plain allocation.
  // FUSEDLAYER_NO_GPU_STAGING_POOL=1 keeps plain allocation (like PyTorch's
  // PYTORCH_NO_CUDA_MEMORY_CACHING): for A/B measurement, or a driver whose pools misbehave.
  void InitStagingPool() { pool_ = StreamOrderedPool(ctx_->device); }

  // The runtime's current device is per thread: the default context's work (warm-ups, uploads,
  // shadow runs, session blocks) may come from any thread, on a server of several GPUs one that
  // last drove another GPU, so every entry point makes this one current first.
  absl::Status BindDevice() const { return gpu::GpuStatus(gpuSetDevice(ctx_->device), "gpuSetDevice"); }

  absl::Status Copy(void* dst, const void* src, size_t bytes, decltype(gpuMemcpyHostToDevice) kind,
                    const char* what) {
    if (bytes == 0) return absl::OkStatus();
    std::lock_guard<std::mutex> lock(default_mu_);
    if (absl::Status s = BindDevice(); !s.ok()) return s;
    if (absl::Status s = gpu::GpuStatus(gpuMemcpyAsync(dst, src, bytes, kind, ctx_->stream), what); !s.ok()) {
      return s;
    }
    // Synchronous semantics: the data is in place when the call returns.
    return gpu::GpuStatus(gpuStreamSynchronize(ctx_->stream), what);
  }

  // Runs `launch` (validation, then enqueue) between two events, waits, and reports the device
  // time. A validation error has enqueued nothing and is returned as is; runtime errors that
  // surface at the sync (a faulting kernel) are Internal.
  template <typename Fn>
  absl::StatusOr<RunStats> Timed(Fn&& launch) {
    if (absl::Status s = gpu::GpuStatus(gpuEventRecord(start_.get(), ctx_->stream), "event record"); !s.ok()) {
      return absl::InternalError(s.message());
    }
    absl::Status launched = launch();
    if (absl::Status s = gpu::GpuStatus(gpuEventRecord(stop_.get(), ctx_->stream), "event record"); !s.ok()) {
      return absl::InternalError(s.message());
    }
    if (absl::Status s = gpu::GpuStatus(gpuEventSynchronize(stop_.get()), "kernel execution"); !s.ok()) {
      return absl::InternalError(s.message());
    }
    if (!launched.ok()) return launched;
    float ms = 0.0f;
    if (absl::Status s = gpu::GpuStatus(gpuEventElapsedTime(&ms, start_.get(), stop_.get()), "event time");
        !s.ok()) {
      return absl::InternalError(s.message());
    }
    RunStats stats;
    stats.kernel_seconds = double(ms) * 1e-3;
    return stats;
  }

  std::unique_ptr<GpuContext> ctx_;
  gpuMemPool_t pool_ = nullptr;  // null: plain gpuMalloc / gpuFree (shared with the lanes)
  const int64_t fused_max_tokens_;
  GpuEvent start_, stop_;
  // The default context (ctx_'s stream, scratch and events) is single-threaded: the methods that
  // use it take this (backend.h). Lanes have their own and never take it.
  std::mutex default_mu_;
};

}  // namespace

std::string_view GpuBackendKind() {
#if FL_HIP
  return "hip";
#else
  return "cuda";
#endif
}

int GpuDeviceCount() {
  int count = 0;
  if (gpuGetDeviceCount(&count) != gpuSuccess) {
    (void)gpuGetLastError();
    return 0;
  }
  return count;
}

absl::StatusOr<std::unique_ptr<Backend>> CreateGpuBackend(const BackendOptions& options) {
  auto ctx = GpuContext::Create(options.device_index);
  if (!ctx.ok()) return ctx.status();
  // The library is compiled for FUSEDLAYER_CUDA_ARCHS / FUSEDLAYER_HIP_ARCHS only: on any other
  // device no kernel could launch, so the backend is unavailable (auto falls back to the CPU).
  if (gpuError_t err = gpu::ProbeSwaKernelImage(); err != gpuSuccess) {
    (void)gpuGetLastError();
    return absl::UnavailableError(absl::StrCat("GPU ", (*ctx)->name, " (", (*ctx)->arch,
                                               ") cannot run this build's kernels: ", gpuGetErrorString(err)));
  }
  auto backend = std::make_unique<GpuBackend>(std::move(*ctx), options);
  if (absl::Status s = backend->Init(); !s.ok()) return absl::UnavailableError(s.message());
  return std::unique_ptr<Backend>(std::move(backend));
}

}  // namespace fusedlayer
