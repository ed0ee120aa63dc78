// fp64 reference of the mHC seam (spec/mhc.md), written from the spec alone (it shares no code with
// any backend). It rounds to bf16 exactly where the contract does, and otherwise computes in double:
//   - Post is computed in fp32 with the contract's FMA order (the contract fixes it: new_residual
//     must be bitwise equal everywhere), then rounded once to bf16.
//   - The collapse z = bf16(fma chain over j) is also a contract-fixed fp32 chain on fp32 inputs
//     (pre_mix or the fp32 pre' output), so it is computed that way too.
//   - Sums of squares, the mixes GEMM, sigmoids, Sinkhorn, RMSNorm statistics and the final
//     products are double; the mixes are returned unrounded (double) for tolerance checks.
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
  std::vector<uint16_t> aux;           // [T, C] when capture_aux
  // What the normal-mode y bound is made of (spec "Equality and tolerance"):
  std::vector<uint16_t> z;             // [T, C] the collapse, bf16 (before RMSNorm)
  std::vector<double> rho;             // [T] 1/rms of z; 1 when the norm weight is absent (y = z)
};

MhcRefOutputs MhcReference(const MhcHyperParams& params, const MhcRefWeights& w, const MhcRefInputs& in);

// Spacing of bf16 values at |b| (the gap to the next larger magnitude): 2^(e - 7) for a normal
// value with exponent e, 2^-133 for zero and subnormals.
double Bf16Ulp(uint16_t b);

// The normal-mode y clause of spec/mhc.md against `ref`, element by element:
//   |y[c] - ref.y[c]| <= factor * ( 2 ulp(ref.y[c]) + rho |g[c]| (ulp(z[c]) + sum_j (1e-5 + 1e-4 pre'[j]) |R'[j][c]|) )
// with z, rho, pre' and R' those of `ref` (g = 1 without a norm weight). factor = 1 for one path
// against the reference, 2 between two paths (the spec: "twice the bound"). Also counts the
// elements more than `ulp` bf16 ulps from `want` (the spec's ">= 99.9% within 1 ulp" clause is
// checked by the caller on that count). `want` is ref.y, or the other path's y.
struct NormalYCheck {
  int64_t elements = 0;
  int64_t beyond_bound = 0;    // must be 0
  int64_t beyond_ulp = 0;      // elements with ulp distance > `ulp`
  int64_t first_bad = -1;      // first element beyond the bound
  int64_t first_beyond_ulp = -1;  // first element more than `ulp` ulps from `want`
  int worst_ulp = 0;           // largest ulp distance seen
  double worst_use = 0;        // largest |diff| / bound (the fraction of the allowance used)
};
NormalYCheck CheckNormalModeY(const MhcHyperParams& params, const MhcRefWeights& w, const MhcRefOutputs& ref,
                              const std::vector<uint16_t>& got, const std::vector<uint16_t>& want, double factor,
                              int ulp);

}  // namespace fusedlayer::testing
