// CPU implementation of the SWA op (spec/swa.md), fused and unfused paths, with the optional wq_b
// block-scaled FP8 projection.
#pragma once

#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "fusedlayer/backend.h"
#include "thread_pool.h"

namespace fusedlayer::cpu {

class CpuSwaWeights final : public PreparedSwaWeights {
 public:
  const SwaHyperParams& params() const override { return params_; }
  size_t resident_bytes() const override;
  std::string wq_b_implementation() const override {
    return params_.has_wq_b() ? "CPU reference GEMM (swa_cpu_gemm.cc)" : "";
  }

  SwaHyperParams params_;
  std::vector<uint16_t> q_norm_;      // [Q] bf16 bits
  std::vector<uint16_t> kv_norm_;     // [D] bf16 bits
  std::vector<uint8_t> wq_b_;         // [N, Q] fp8 codes (empty without wq_b)
  std::vector<float> wq_b_scale_;     // [N/128, Q/128]
};

absl::StatusOr<std::unique_ptr<CpuSwaWeights>> PrepareSwaCpu(const SwaHyperParams& params,
                                                              const SwaWeightsHost& weights);
FusedSupport SwaFusedSupportCpu(const CpuSwaWeights& weights, const SwaShapeQuery& query,
                                int64_t fused_max_tokens);
absl::Status RunSwaCpu(const CpuSwaWeights& weights, const SwaArgs& args, Path path, int64_t fused_max_tokens,
                       ThreadPool& pool);

}  // namespace fusedlayer::cpu
