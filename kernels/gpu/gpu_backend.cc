// The GPU backend (CUDA or HIP, one source): device memory, synchronous copies on the backend's
// stream, and the mHC / SWA launchers timed with events.
#include <cstdlib>
#include <memory>
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

class GpuEvent {
 public:
  GpuEvent() = default;
  ~GpuEvent() {
    if (ev_ != nullptr) (void)gpuEventDestroy(ev_);
  }
  GpuEvent(const GpuEvent&) = delete;
  GpuEvent& operator=(const GpuEvent&) = delete;
  absl::Status Init() { return gpu::GpuStatus(gpuEventCreate(&ev_), "event create"); }
  gpuEvent_t get() const { return ev_; }

 private:
  gpuEvent_t ev_ = nullptr;
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

  // A request's staging buffers. With the stream-ordered pool (see InitStagingPool) allocation and
  // release are queue operations on the backend's stream: no driver allocation and, unlike
  // gpuFree, no device-wide synchronisation per buffer. Without it, plain gpuMalloc / gpuFree.
  absl::StatusOr<DeviceBuffer> Allocate(size_t bytes) override {
    if (bytes == 0) return DeviceBuffer();
    if (!pool_) return PlainBuffer(bytes);
    void* p = nullptr;
    gpuError_t err = gpuMallocAsync(&p, bytes, ctx_->stream);
    if (err == gpuErrorMemoryAllocation) {
      // The pool may hold free blocks too fragmented for this size: give them back, retry once.
      (void)gpuGetLastError();
      (void)gpuStreamSynchronize(ctx_->stream);
      (void)gpuMemPoolTrimTo(pool_, 0);
      err = gpuMallocAsync(&p, bytes, ctx_->stream);
    }
    if (err != gpuSuccess) {
      (void)gpuGetLastError();
      if (err == gpuErrorMemoryAllocation) {
        return absl::ResourceExhaustedError(absl::StrCat("device memory: ", bytes, " bytes for a request buffer"));
      }
      // Anything else (e.g. a size the pool refuses outright): the plain allocator decides.
      return PlainBuffer(bytes);
    }
    gpuStream_t stream = ctx_->stream;
    return DeviceBuffer(p, bytes, [stream](void* q) { (void)gpuFreeAsync(q, stream); });
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
    auto w = gpu::PrepareMhcGpu(params, weights, *ctx_);
    if (!w.ok()) return w.status();
    return std::unique_ptr<PreparedMhcWeights>(std::move(*w));
  }
  FusedSupport MhcFusedSupport(const PreparedMhcWeights& weights, const MhcShapeQuery& query) const override {
    return gpu::MhcFusedSupportGpu(static_cast<const gpu::GpuMhcWeights&>(weights), query, *ctx_,
                                   fused_max_tokens_);
  }
  absl::StatusOr<RunStats> RunMhc(const PreparedMhcWeights& weights, const MhcArgs& args, Path path) override {
    return Timed([&] {
      return gpu::LaunchMhcGpu(static_cast<const gpu::GpuMhcWeights&>(weights), args, path, *ctx_,
                               fused_max_tokens_);
    });
  }

  // ---- SWA ----------------------------------------------------------------------------------
  absl::StatusOr<std::unique_ptr<PreparedSwaWeights>> PrepareSwa(const SwaHyperParams& params,
                                                                 const SwaWeightsHost& weights) override {
    auto w = gpu::PrepareSwaGpu(params, weights, *ctx_);
    if (!w.ok()) return w.status();
    return std::unique_ptr<PreparedSwaWeights>(std::move(*w));
  }
  FusedSupport SwaFusedSupport(const PreparedSwaWeights& weights, const SwaShapeQuery& query) const override {
    return gpu::SwaFusedSupportGpu(static_cast<const gpu::GpuSwaWeights&>(weights), query, *ctx_,
                                   fused_max_tokens_);
  }
  absl::StatusOr<RunStats> RunSwa(const PreparedSwaWeights& weights, const SwaArgs& args, Path path) override {
    return Timed([&] {
      return gpu::LaunchSwaGpu(static_cast<const gpu::GpuSwaWeights&>(weights), args, path, *ctx_,
                               fused_max_tokens_);
    });
  }

 private:
  static absl::StatusOr<DeviceBuffer> PlainBuffer(size_t bytes) {
    auto mem = gpu::GpuAlloc(bytes);
    if (!mem.ok()) return mem.status();
    return DeviceBuffer(mem->release(), bytes, [](void* p) { (void)gpuFree(p); });
  }

  // Request buffers come from the device's default stream-ordered pool, which keeps freed memory
  // for reuse instead of returning it to the driver at every synchronisation (release threshold =
  // unlimited). What it retains is bounded by the largest request's tensors: the executor runs one
  // job at a time on this device. Measured reason: per-request gpuMalloc + gpuFree (which waits
  // for the whole device) was most of a small SWA request's executor time (BENCHMARKS.md). A
  // runtime without stream-ordered pools keeps plain allocation.
  // FUSEDLAYER_NO_GPU_STAGING_POOL=1 keeps plain allocation (like PyTorch's
  // PYTORCH_NO_CUDA_MEMORY_CACHING): for A/B measurement, or a driver whose pools misbehave.
  void InitStagingPool() {
    if (const char* off = std::getenv("FUSEDLAYER_NO_GPU_STAGING_POOL"); off != nullptr && std::string(off) == "1") {
      return;
    }
    gpuMemPool_t pool = nullptr;
    if (gpuDeviceGetDefaultMemPool(&pool, ctx_->device) != gpuSuccess || pool == nullptr) {
      (void)gpuGetLastError();
      return;
    }
    uint64_t keep_all = ~uint64_t{0};
    if (gpuMemPoolSetAttribute(pool, gpuMemPoolAttrReleaseThreshold, &keep_all) != gpuSuccess) {
      (void)gpuGetLastError();
      return;
    }
    pool_ = pool;
  }

  absl::Status Copy(void* dst, const void* src, size_t bytes, decltype(gpuMemcpyHostToDevice) kind,
                    const char* what) {
    if (bytes == 0) return absl::OkStatus();
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
  gpuMemPool_t pool_ = nullptr;  // null: plain gpuMalloc / gpuFree
  const int64_t fused_max_tokens_;
  GpuEvent start_, stop_;
};

}  // namespace

std::string_view GpuBackendKind() {
#if FL_HIP
  return "hip";
#else
  return "cuda";
#endif
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
