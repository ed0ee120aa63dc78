// GPU implementation of the mHC seam (spec/mhc.md): weight preparation, the fused-path capability
// query and the launcher. The launcher only enqueues work on ctx.stream (no synchronisation), so
// it can be captured into a CUDA/HIP graph; the backend adds events and the sync.
//
// Paths (kernels in mhc_*.cuh, host code in mhc_launch.cu):
//   unfused (every n in 1..8, every C): post kernel -> mixes GEMM partials -> finalize kernel
//     (fixed-order split reduction, sigmoid gates + Sinkhorn, collapse + RMSNorm). The mixes GEMM
//     is the fused pass's tensor-core code in GEMM-only mode where the fused path exists (n = 4,
//     C % 128 == 0, CUDA sm_80+), else an fp32 FMA kernel split over 512-channel slices.
//   fused (n = 4, C % 128 == 0, CUDA sm_80+): one pass over R and x per 128-channel chunk and 16-
//     or 32-token tile (post, aux, shifted collapse, mixes on tensor cores with fn split into two
//     bf16 parts, per-chunk partials), then the same finalize kernel (programmatic dependent launch).
//     (A one-launch variant with a per-token-tile barrier measured slower at every decode size:
//     kernels/gpu/DESIGN.md.)
//   Every reduction order depends on C only, so results are batch invariant; where both paths run,
//   they agree bit for bit (new_residual, mixes, y in both modes).
// Launch overlap: every pass and the finalize are launched with programmatic dependent launch
// (gpu_runtime.h). Each kernel reads only weights (fn, norm_weight, scale, base: written once by
// PrepareMhcGpu, synchronously) before its GridDependencyWait and lets its dependent in only after
// it, so seams back to back on ctx.stream (a model's layers, or a graph of them) overlap launches
// and weight fetches, never activations (tests/gpu: ChainedLayersBackToBackMatchLayerByLayer).
// Graph capture: the first call for a shape grows ctx.Workspace (a gpuMalloc), so run each shape
// once eagerly before capturing it.
#pragma once

#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "fusedlayer/backend.h"
#include "gpu_context.h"

namespace fusedlayer::gpu {

class GpuMhcWeights final : public PreparedMhcWeights {
 public:
  const MhcHyperParams& params() const override { return params_; }
  bool has_norm_weight() const override { return norm_weight != nullptr; }
  size_t resident_bytes() const override { return resident_bytes_; }

  MhcHyperParams params_;
  GpuMemory fn_t;          // fp32 [K, M]: fn transposed (unfused FMA GEMM reads M values per k)
  GpuMemory fn_first_t;    // fp32 [C, M]: sum over streams of fn (first stage: R_0 = e broadcast)
  GpuMemory scale;         // fp32 [3]
  GpuMemory base;          // fp32 [M]
  GpuMemory norm_weight;   // bf16 [C], null when absent
  // Fused path (n = 4, C % 128 == 0): fn split into hi + lo bf16 parts and laid out as mma.sync
  // m16n8k16 B fragments, per 32-channel group: [C/32][8 k16-steps][3 n-tiles][32 lanes][4 words]
  // = (hi b0, hi b1, lo b0, lo b1), each word a bf16 pair. Same for the first stage (fn summed over
  // streams, 2 k16-steps). 4 bytes per fn element (the TF32 hi/lo layout before it was 8).
  GpuMemory fn_frag;
  GpuMemory fn_first_frag;
  size_t resident_bytes_ = 0;
};

// Validates `params` and the host weights (InvalidArgument naming the tensor), derives the layouts
// above on the host and uploads them once.
absl::StatusOr<std::unique_ptr<GpuMhcWeights>> PrepareMhcGpu(const MhcHyperParams& params,
                                                              const MhcWeightsHost& weights, GpuContext& ctx);

// Fused-path limits: hc_mult != 4 -> hc_mult_unsupported; C % 128 != 0 -> hidden_size_unsupported;
// T > fused_max_tokens -> too_many_tokens; no bf16 mma.sync (HIP, or CUDA below sm_80) ->
// device_arch_unsupported. capture_aux, first, head and both modes are supported.
FusedSupport MhcFusedSupportGpu(const GpuMhcWeights& weights, const MhcShapeQuery& query, const GpuContext& ctx,
                                int64_t fused_max_tokens);

// Validates `args` (ValidateMhcArgs: InvalidArgument, nothing launched), checks the fused path is
// supported (FailedPrecondition), then enqueues the kernels on ctx.stream and returns without
// synchronising. T = 0 launches nothing. A workspace that cannot be allocated is
// ResourceExhausted with nothing launched (the backend reports workspace_unavailable and may rerun
// unfused); launch failures are Internal.
absl::Status LaunchMhcGpu(const GpuMhcWeights& weights, const MhcArgs& args, Path path, GpuContext& ctx,
                          int64_t fused_max_tokens);

}  // namespace fusedlayer::gpu
