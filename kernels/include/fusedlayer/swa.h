// The SWA attention-input op (spec/swa.md): q/kv RMSNorm + q FP8 1x128 group quant, optionally
// followed by the wq_b block-scaled FP8 projection.
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "fusedlayer/numeric.h"
#include "fusedlayer/tensor.h"

namespace fusedlayer {

enum class ScaleFormat : uint8_t { kFp32 = 0, kUe8m0 = 1 };
// kRowMajor: q_scale is [M, G]. kColumnMajorTma: q_scale is stored as [G, align(M, 4)] (DeepGEMM's
// MN-major TMA-aligned layout); s(m, g) lives at g * align(M, 4) + m; the padding rows
// m in [M, align(M,4)) are written as 0 so the output is fully defined.
enum class ScaleLayout : uint8_t { kRowMajor = 0, kColumnMajorTma = 1 };
const char* ScaleFormatName(ScaleFormat f);  // "fp32", "ue8m0"
const char* ScaleLayoutName(ScaleLayout l);  // "row_major", "column_major_tma"
const char* Fp8FormatName(Fp8Format f);      // "e4m3fn", "e4m3fnuz"

inline constexpr int64_t kSwaGroup = 128;  // quant group and wq_b block size
inline int64_t AlignTo4(int64_t m) { return (m + 3) / 4 * 4; }

struct SwaHyperParams {
  int64_t q_rank = 0;    // Q, multiple of 128
  int64_t head_dim = 0;  // D
  float eps = 1e-6f;
  Fp8Format fp8_format = Fp8Format::kE4M3FN;
  ScaleFormat scale_format = ScaleFormat::kFp32;
  ScaleLayout scale_layout = ScaleLayout::kRowMajor;
  int64_t wq_b_rows = 0;  // N of the optional projection; 0 = no wq_b (N multiple of 128)

  int64_t groups() const { return q_rank / kSwaGroup; }
  bool has_wq_b() const { return wq_b_rows > 0; }
  absl::Status Validate() const;
};

struct SwaWeightsHost {
  TensorView q_norm;      // bf16 [Q]
  TensorView kv_norm;     // bf16 [D]
  TensorView wq_b;        // fp8 [N, Q] in fp8_format, K-contiguous (optional)
  TensorView wq_b_scale;  // fp32 [N/128, Q/128] multiplicative dequant scales (with wq_b)
};

// One call. M = tokens (0 allowed).
struct SwaArgs {
  int64_t tokens = 0;
  TensorView qr_kv;    // bf16 [M, Q + D], row stride >= Q + D (TensorView::Strided2D)
  TensorView q_fp8;    // fp8 [M, Q]
  TensorView q_scale;  // fp32 [M, G] (row-major) or [G, align(M,4)] (column-major TMA)
  TensorView kv;       // bf16 [M, D]
  TensorView q_proj;   // bf16 [M, N] when the weight set has wq_b, else empty

  // Set by a caller that ran ValidateSwaArgs on exactly these arguments (the server, when it
  // decodes a request): the backends' launch prologue (launch_prologue.h) does not check them again.
  bool contract_checked = false;
};

struct SwaShapeQuery {
  int64_t tokens = 0;
};

absl::Status ValidateSwaArgs(const SwaHyperParams& params, const SwaArgs& args);

}  // namespace fusedlayer
