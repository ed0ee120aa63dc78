// The GPU backend (CUDA or HIP, one source): device memory, synchronous copies on the backend's
// stream, and the mHC / SWA launchers timed with events.
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "fusedlayer/backend.h"
#include "gpu_backend_factory.h"
#include "gpu_context.h"
#include "gpu_runtime.h"
#include "mhc_gpu.h"
#include "swa_gpu.h"
#include "swa_kernels.h"


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
    return stop_.Init();
  }

  std::string_view kind() const override { return GpuBackendKind(); }
  std::string device_name() const override { return ctx_->name; }
  std::string arch() const override { return ctx_->arch; }
  bool host_accessible() const override { return false; }

  absl::StatusOr<DeviceBuffer> Allocate(size_t bytes) override {
    if (bytes == 0) return DeviceBuffer();
    auto mem = gpu::GpuAlloc(bytes);
    if (!mem.ok()) return mem.status();
    return DeviceBuffer(mem->release(), bytes, [](void* p) { (void)gpuFree(p); });
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
