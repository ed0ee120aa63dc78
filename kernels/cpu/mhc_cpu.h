// CPU implementation of the mHC op (spec/mhc.md), fused and unfused paths.
#pragma once

#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "fusedlayer/backend.h"
#include "thread_pool.h"

namespace fusedlayer::cpu {

// Host copies of one weight set's mHC weights.
class CpuMhcWeights final : public PreparedMhcWeights {
 public:
  const MhcHyperParams& params() const override { return params_; }
  bool has_norm_weight() const override { return !norm_weight_.empty(); }
  size_t resident_bytes() const override;

  MhcHyperParams params_;
  std::vector<float> fn_;               // [M, K]
  std::vector<float> scale_;            // [3]
  std::vector<float> base_;             // [M]
  std::vector<uint16_t> norm_weight_;   // [C] bf16 bits, empty when absent
};

absl::StatusOr<std::unique_ptr<CpuMhcWeights>> PrepareMhcCpu(const MhcHyperParams& params,
                                                              const MhcWeightsHost& weights);
FusedSupport MhcFusedSupportCpu(const CpuMhcWeights& weights, const MhcShapeQuery& query,
                                int64_t fused_max_tokens);
// Validates, then runs `path` (FailedPrecondition if fused is requested but unsupported).
absl::Status RunMhcCpu(const CpuMhcWeights& weights, const MhcArgs& args, Path path, int64_t fused_max_tokens,
                       ThreadPool& pool);

// Allows (default) or forbids the AVX-512 form of the mixes GEMM, so tests can compare it bitwise
// with the generic form. Returns whether this build and CPU have the AVX-512 form at all.
bool SetMhcCpuAvx512ForTesting(bool allow);

}  // namespace fusedlayer::cpu
