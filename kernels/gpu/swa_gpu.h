// GPU implementation of the SWA op (spec/swa.md): weight preparation, the fused-path capability
// query and the launcher. The launcher only enqueues work on ctx.stream (no synchronisation), so
// it can be captured into a CUDA/HIP graph; the backend adds events and the sync.
#pragma once

#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "fusedlayer/backend.h"
#include "gpu_context.h"

namespace fusedlayer::gpu {

class GpuSwaWeights final : public PreparedSwaWeights {
 public:
  const SwaHyperParams& params() const override { return params_; }
  size_t resident_bytes() const override { return resident_bytes_; }

  SwaHyperParams params_;
  GpuMemory q_norm;      // bf16 [Q]
  GpuMemory kv_norm;     // bf16 [D]
  GpuMemory wq_b;        // fp8 [N, Q] (absent without wq_b)
  GpuMemory wq_b_scale;  // fp32 [N/128, Q/128]
  size_t resident_bytes_ = 0;
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
absl::Status LaunchSwaGpu(const GpuSwaWeights& weights, const SwaArgs& args, Path path, GpuContext& ctx,
                          int64_t fused_max_tokens);

}  // namespace fusedlayer::gpu
