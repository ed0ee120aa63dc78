// The mHC seam op (spec/mhc.md): shifted post + delayed pre + RMSNorm, plus the `first` (layer 0)
// and `head` (after the last sublayer) stages. Parameter and argument structs only; backends
// implement them (backend.h).
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "fusedlayer/tensor.h"

namespace fusedlayer {

// Hyper-parameters, part of a weight set (spec/mhc.md "Hyper-parameters").
struct MhcHyperParams {
  int hc_mult = 4;          // n, residual streams (1..8 on the unfused path)
  int64_t hidden = 0;       // C
  float hc_norm_eps = 1e-6f;
  float norm_eps = 1e-6f;
  float hc_pre_eps = 1e-6f;
  float sinkhorn_eps = 1e-6f;
  float post_scale = 2.0f;
  int sinkhorn_iters = 20;  // >= 1

  int num_mixes() const { return hc_mult * (hc_mult + 2); }  // M = n(n+2)
  int64_t flat_width() const { return hc_mult * hidden; }    // K = n*C
  absl::Status Validate() const;  // InvalidArgument on n outside 1..8, C <= 0, iters < 1, eps < 0
};

// Weights as host tensors, handed to Backend::PrepareMhc once per weight set.
struct MhcWeightsHost {
  TensorView fn;           // fp32 [M, K]; rows 0..n-1 pre, n..2n-1 post, 2n+n*i+j comb[i][j]
  TensorView scale;        // fp32 [3]: alpha pre, post, comb
  TensorView base;         // fp32 [M]
  TensorView norm_weight;  // bf16 [C], optional (empty view: y is the un-normalised collapse)
};

enum class MhcMode : uint8_t { kShifted = 0, kNormal = 1 };
enum class MhcStage : uint8_t { kSeam = 0, kFirst = 1, kHead = 2 };
const char* MhcModeName(MhcMode m);    // "shifted", "normal"
const char* MhcStageName(MhcStage s);  // "seam", "first", "head"

// One call. All views live in the backend's memory. T = tokens (0 allowed: nothing is launched).
//
//               inputs                                      outputs
//   seam:  x[T,C], residual[T,n,C], post_mix[T,n],     new_residual[T,n,C], new_pre_mix[T,n],
//          comb_mix[T,n,n], pre_mix[T,n] (shifted,     new_post_mix[T,n], new_comb_mix[T,n,n],
//          optional: absent = stream 0)                y[T,C], aux[T,C] (if capture_aux)
//   first: x = embedding e [T,C]                        new_residual (= e on every stream),
//                                                       new_pre/post/comb_mix, y
//   head:  x, residual, post_mix, comb_mix,             new_residual, y
//          pre_mix (optional: absent = stream 0)
// Unused views are left empty. Normal mode ignores pre_mix (y uses the new pre mix).
struct MhcArgs {
  MhcStage stage = MhcStage::kSeam;
  MhcMode mode = MhcMode::kShifted;
  bool capture_aux = false;
  int64_t tokens = 0;

  TensorView x, residual, post_mix, comb_mix, pre_mix;
  TensorView new_residual, new_pre_mix, new_post_mix, new_comb_mix, y, aux;

  // Set by a caller that ran ValidateMhcArgs on exactly these arguments (the server, when it
  // decodes a request): the backends' launch prologue (launch_prologue.h) does not check them again.
  bool contract_checked = false;
};

// What a capability query needs to know about a request (no memory).
struct MhcShapeQuery {
  MhcStage stage = MhcStage::kSeam;
  MhcMode mode = MhcMode::kShifted;
  bool capture_aux = false;
  int64_t tokens = 0;
};

// Shape/dtype validation of `args` against `params`, shared by all backends (and by the server
// before it allocates anything). InvalidArgument names the offending tensor.
absl::Status ValidateMhcArgs(const MhcHyperParams& params, bool has_norm_weight, const MhcArgs& args);

}  // namespace fusedlayer
