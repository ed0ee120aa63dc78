// The CPU backend: host memory, a thread pool over token blocks, and the CPU kernels of both ops.
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <new>

#include "absl/strings/str_cat.h"
#include "fusedlayer/backend.h"
#include "mhc_cpu.h"
#include "swa_cpu.h"
#include "thread_pool.h"

namespace fusedlayer {
namespace {

class CpuBackend final : public Backend {
 public:
  explicit CpuBackend(const BackendOptions& options)
      : pool_(options.num_threads), fused_max_tokens_(options.fused_max_tokens) {}

  std::string_view kind() const override { return "cpu"; }
  std::string device_name() const override { return absl::StrCat("cpu (", pool_.num_threads(), " threads)"); }
  std::string arch() const override {
#if defined(__x86_64__)
    return "x86_64";
#elif defined(__aarch64__)
    return "aarch64";
#else
    return "unknown";
#endif
  }
  bool host_accessible() const override { return true; }

  absl::StatusOr<DeviceBuffer> Allocate(size_t bytes) override {
    if (bytes == 0) return DeviceBuffer();
    // 64-byte alignment: cache lines and the widest vector loads.
    void* p = std::aligned_alloc(64, (bytes + 63) / 64 * 64);
    if (p == nullptr) {
      return absl::ResourceExhaustedError(absl::StrCat("host allocation of ", bytes, " bytes failed"));
    }
    return DeviceBuffer(p, bytes, [](void* q) { std::free(q); });
  }
  absl::Status CopyToDevice(void* dst, const void* src, size_t bytes) override {
    if (bytes) std::memcpy(dst, src, bytes);
    return absl::OkStatus();
  }
  absl::Status CopyToHost(void* dst, const void* src, size_t bytes) override {
    if (bytes) std::memcpy(dst, src, bytes);
    return absl::OkStatus();
  }

  absl::StatusOr<std::unique_ptr<PreparedMhcWeights>> PrepareMhc(const MhcHyperParams& params,
                                                                 const MhcWeightsHost& weights) override {
    auto w = cpu::PrepareMhcCpu(params, weights);
    if (!w.ok()) return w.status();
    return std::unique_ptr<PreparedMhcWeights>(std::move(*w));
  }
  FusedSupport MhcFusedSupport(const PreparedMhcWeights& weights, const MhcShapeQuery& query) const override {
    return cpu::MhcFusedSupportCpu(static_cast<const cpu::CpuMhcWeights&>(weights), query, fused_max_tokens_);
  }
  absl::StatusOr<RunStats> RunMhc(const PreparedMhcWeights& weights, const MhcArgs& args, Path path) override {
    return Timed([&] { return cpu::RunMhcCpu(static_cast<const cpu::CpuMhcWeights&>(weights), args, path, fused_max_tokens_, pool_); });
  }

  absl::StatusOr<std::unique_ptr<PreparedSwaWeights>> PrepareSwa(const SwaHyperParams& params,
                                                                 const SwaWeightsHost& weights) override {
    auto w = cpu::PrepareSwaCpu(params, weights);
    if (!w.ok()) return w.status();
    return std::unique_ptr<PreparedSwaWeights>(std::move(*w));
  }
  FusedSupport SwaFusedSupport(const PreparedSwaWeights& weights, const SwaShapeQuery& query) const override {
    return cpu::SwaFusedSupportCpu(static_cast<const cpu::CpuSwaWeights&>(weights), query, fused_max_tokens_);
  }
  absl::StatusOr<RunStats> RunSwa(const PreparedSwaWeights& weights, const SwaArgs& args, Path path) override {
    return Timed([&] { return cpu::RunSwaCpu(static_cast<const cpu::CpuSwaWeights&>(weights), args, path, fused_max_tokens_, pool_); });
  }

 private:
  template <typename Fn>
  static absl::StatusOr<RunStats> Timed(Fn&& fn) {
    const auto t0 = std::chrono::steady_clock::now();
    absl::Status s = fn();
    if (!s.ok()) return s;
    RunStats stats;
    stats.kernel_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return stats;
  }

  cpu::ThreadPool pool_;
  const int64_t fused_max_tokens_;
};

}  // namespace

std::unique_ptr<Backend> CreateCpuBackend(const BackendOptions& options) {
  return std::make_unique<CpuBackend>(options);
}

}  // namespace fusedlayer
