// Fused versus unfused: pure functions that judge each output of one request by the contract's
// fused-vs-unfused tolerance (spec/mhc.md and spec/swa.md, "Equality and tolerance"; the rule of
// every output and why it is what it is: docs/shadow.md). They work on host copies of the outputs
// (the response tensors), so the same comparator serves the CPU, CUDA and HIP backends.
//
// Every output of the request is compared; a missing or malformed tensor on either side (wrong
// dtype, shape or byte length) is a mismatch of that output, as is a NaN where the other path has
// anything but the same bits.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "fusedlayer/mhc.h"
#include "fusedlayer/swa.h"
#include "fusedlayer/v1/fusedlayer.pb.h"

namespace fusedlayer::server::shadow {

struct OutputComparison {
  std::string output;             // response field name: "new_residual", "y", "q_fp8", ...
  bool mismatch = false;
  double max_abs_diff = 0;        // of the decoded values (fp8: the code values, not dequantized)
  int64_t max_ulp_distance = 0;   // ulps of the output's dtype (fp8: code steps)
  int64_t differing_elements = 0; // elements whose bits differ
  int64_t total_elements = 0;
  std::string rule;               // the tolerance applied
  std::string detail;             // the first violation, when mismatch
};

struct Comparison {
  std::vector<OutputComparison> outputs;
  bool mismatch() const;
  // "new_residual(max_abs_diff=0.0078, max_ulp=1), y(...)" over the mismatching outputs.
  std::string MismatchSummary() const;
};

// The mHC outputs present for the stage: new_residual, new_pre_mix / new_post_mix / new_comb_mix
// (seam, first), y, aux (capture_aux). `params` (hc_mult, hidden, norm_eps) and `norm_weight` (the
// weight set's g as bf16 bits [C], WeightSet::mhc_norm_weight; empty when the set has none) are
// what the normal-mode y rule needs besides the unfused outputs: its element-wise bound is derived
// from the unfused R' and pre' (docs/shadow.md).
Comparison CompareMhc(const MhcHyperParams& params, const std::vector<uint16_t>& norm_weight, MhcStage stage,
                      MhcMode mode, bool capture_aux, const v1::MhcSeamResponse& fused,
                      const v1::MhcSeamResponse& unfused);

// The SWA outputs: q_fp8, q_scale, kv, q_proj (when the weight set has wq_b). `tokens` = M.
// `wq_b_row_abs_max` (N values, WeightSet::swa_wq_b_row_abs_max): max_k |dequant(wq_b)[n, k]|, which
// bounds how far the two paths' different q inputs can move q_proj.
Comparison CompareSwa(const SwaHyperParams& params, int64_t tokens, const std::vector<float>& wq_b_row_abs_max,
                      const v1::SwaNormQuantResponse& fused, const v1::SwaNormQuantResponse& unfused);

// Differing q codes allowed with fp32 scales among n: the spec's 3% is a large-sample rate
// ("about 2% of codes differ"), so a decode-size request (one row of Q codes) gets the binomial
// upper tail on top: 3% of n + 5 standard deviations of Binomial(n, 3%) (a false alarm below
// 1e-6 per comparison at the spec's rate); it converges to 3% for large n.
int64_t AllowedDifferingCodes(int64_t n);

// Tolerance constants (docs/shadow.md derives them).
inline constexpr double kMixAbsTol = 2 * 1e-5;          // 2 x the spec's absolute mixes tolerance
inline constexpr double kMixRelTol = 2 * 1e-4;          // 2 x the spec's relative mixes tolerance
inline constexpr double kNormalYBoundFactor = 2;        // normal-mode y: twice the element-wise bound ...
inline constexpr int64_t kNormalYFractionUlp = 2;       // ... and <= 2 bf16 ulp
inline constexpr double kNormalYFraction = 0.998;       // ... on >= 99.8% (twice the contract's 1 ulp on 99.9%)
inline constexpr double kQCodeFraction = 0.03;          // fp32 scales: <= 3% of q codes differ
inline constexpr double kScaleRelTol = 1.0 / 256;       // fp32 q_scale: relative 2^-8
inline constexpr double kDequantRelTol = 0.125;         // UE8M0: dequantized values, relative 2^-3
inline constexpr double kQProjAbsTol = 2 * 0.125;       // q_proj: 2 x the spec's absolute tolerance
inline constexpr double kQProjRelTol = 2 * 0.01;        // q_proj: 2 x the spec's relative tolerance
                                                        // (+ the q-difference term, compare.cc)

v1::OutputComparison ToProto(const OutputComparison& c);

}  // namespace fusedlayer::server::shadow
