// GPU implementation of the SWA op (spec/swa.md): weight preparation, the fused-path capability
// query and the launcher. The launcher only enqueues work on ctx.stream (no synchronisation), so
// it can be captured into a CUDA/HIP graph; the backend adds events and the sync.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "fusedlayer/backend.h"
#include "gpu_context.h"
#include "swa_kernel_launch.h"
#include "wq_b_cublaslt.h"

namespace fusedlayer::gpu {

class GpuSwaWeights final : public PreparedSwaWeights {
 public:
  const SwaHyperParams& params() const override { return params_; }
  size_t resident_bytes() const override { return resident_bytes_; }
  std::string wq_b_implementation() const override { return wq_b_impl_detail; }

  SwaHyperParams params_;
  GpuMemory q_norm;      // bf16 [Q]
  GpuMemory kv_norm;     // bf16 [D]
  GpuMemory wq_b;        // fp8 [N, Q] (absent without wq_b)
  GpuMemory wq_b_scale;  // fp32 [N/128, Q/128]
  size_t resident_bytes_ = 0;

  // The wq_b GEMM, fixed per weight set at load so that every M takes the same implementation
  // and algorithm (batch invariance): cuBLASLt block-scaled FP8 with a pinned algorithm (CUDA,
  // e4m3fn, when one algorithm is valid for every row count), else our kernel (swa_wq_b_launch.cu:
  // HIP, e4m3fnuz, or cuBLASLt unavailable; logged at load).
  enum class WqbImpl { kNone, kOwnKernel, kCublasLt };
  WqbImpl wq_b_impl = WqbImpl::kNone;
  std::string wq_b_impl_detail;  // the pinned algorithm, or why our kernel serves this set
  WqbLtPlan wq_b_lt;             // valid for kCublasLt
};

// Validates the host weights against `params` (InvalidArgument) and uploads them once.
absl::StatusOr<std::unique_ptr<GpuSwaWeights>> PrepareSwaGpu(const SwaHyperParams& params,
                                                              const SwaWeightsHost& weights, GpuContext& ctx);

// The fused kernel handles every Q and D (rows up to 2048 + 1024 wide stay in registers, wider
// rows are streamed twice); its only limit is the operator's token cap.
FusedSupport SwaFusedSupportGpu(const GpuSwaWeights& weights, const SwaShapeQuery& query, const GpuContext& ctx,
                                int64_t fused_max_tokens);

// Validates `args` (InvalidArgument, nothing launched), checks the fused path is supported
// (FailedPrecondition), then enqueues the kernels on ctx.stream. Launch failures are Internal;
// a missing unfused workspace is ResourceExhausted.
// The wq_b projection of a prepared weight set, q_proj[tokens, N] from the fp8 q and its scales
// (either layout), through the set's implementation. Enqueues only (the launcher's last step; the
// benchmark times it alone). Invalid alignment for the pinned algorithm is InvalidArgument.
absl::Status LaunchWqbProjection(const GpuSwaWeights& weights, const uint8_t* q_fp8, const float* q_scale,
                                 const SwaScaleLayout& layout, uint16_t* q_proj, int64_t tokens, GpuContext& ctx);

absl::Status LaunchSwaGpu(const GpuSwaWeights& weights, const SwaArgs& args, Path path, GpuContext& ctx,
                          int64_t fused_max_tokens);

}  // namespace fusedlayer::gpu
