// fp64 reference of the mHC seam (spec/mhc.md), written from the spec alone (it shares no code with
// any backend). It rounds to bf16 exactly where the contract does, and otherwise computes in double:
//   - Post is computed in fp32 with the contract's FMA order (the contract fixes it: new_residual
//     must be bitwise equal everywhere), then rounded once to bf16.
//   - The collapse z = bf16(fma chain over j) is also a contract-fixed fp32 chain on fp32 inputs
//     (pre_mix or the fp32 pre' output), so it is computed that way too.
//   - Sums of squares, the mixes GEMM, sigmoids, Sinkhorn, RMSNorm statistics and the final
//     products are double; the mixes are returned unrounded (double) for tolerance checks.
//   - The intermediates of y (the bf16 collapse z and the RMSNorm factor rho) are returned too:
//     the normal-mode y tolerance is written in terms of them (spec "Equality and tolerance").
#pragma once

#include <cstdint>
#include <vector>

#include "fusedlayer/mhc.h"

namespace fusedlayer::testing {

struct MhcRefWeights {
  std::vector<float> fn;              // [M, K]
  std::vector<float> scale;           // [3]
  std::vector<float> base;            // [M]
  std::vector<uint16_t> norm_weight;  // [C] bf16, empty = absent
};

struct MhcRefInputs {
  MhcStage stage = MhcStage::kSeam;
  MhcMode mode = MhcMode::kShifted;
  bool capture_aux = false;
  int64_t tokens = 0;
  std::vector<uint16_t> x;         // [T, C] (the embedding for `first`)
  std::vector<uint16_t> residual;  // [T, n, C]
  std::vector<float> post_mix;     // [T, n]
  std::vector<float> comb_mix;     // [T, n, n]
  std::vector<float> pre_mix;      // [T, n], empty = absent (stream 0)
};

struct MhcRefOutputs {
  std::vector<uint16_t> new_residual;  // [T, n, C]
  std::vector<double> new_pre_mix;     // [T, n]   (not for head)
  std::vector<double> new_post_mix;    // [T, n]
  std::vector<double> new_comb_mix;    // [T, n, n]
  std::vector<uint16_t> y;             // [T, C]
  std::vector<uint16_t> z;             // [T, C] the collapse bf16(sum_j p[j] R'[j][c]) that y normalises
  std::vector<double> rho;             // [T]    1 / sqrt(mean(z^2) + norm_eps); 1 without a norm weight
  std::vector<uint16_t> aux;           // [T, C] when capture_aux
};

MhcRefOutputs MhcReference(const MhcHyperParams& params, const MhcRefWeights& w, const MhcRefInputs& in);

}  // namespace fusedlayer::testing
