// Per-token row kernels of the CPU SWA op (spec/swa.md): RMSNorm of the q and kv halves and the
// FP8 1x128 group quant. Each function handles a contiguous range of tokens and touches only those
// tokens' rows, so a token's outputs never depend on which other tokens share the call (batch
// invariance) nor on the thread that ran it.
#pragma once

#include <cstdint>

#include "fusedlayer/numeric.h"
#include "fusedlayer/swa.h"

namespace fusedlayer::cpu::swa {

// Where the outputs of one call live. Scales are addressed as scale[m * scale_row + g * scale_col]
// so one kernel serves the row-major [M, G] and the column-major TMA [G, align(M, 4)] layouts.
struct QuantOut {
  uint8_t* codes = nullptr;   // [M, Q] fp8 codes, row stride Q
  float* scale = nullptr;
  int64_t scale_row = 0;
  int64_t scale_col = 0;
};

struct RowParams {
  int64_t Q = 0, D = 0;
  float eps = 0;
  Fp8Format fp8 = Fp8Format::kE4M3FN;
  ScaleFormat scale_format = ScaleFormat::kFp32;
  const uint16_t* q_norm = nullptr;   // [Q] bf16
  const uint16_t* kv_norm = nullptr;  // [D] bf16
};

// Fused path, tokens [m0, m1): normalises both halves of each row of `x` (row stride x_stride,
// q = columns [0, Q), kv = [Q, Q + D)); writes kv = bf16(y) and quantizes q straight from the fp32
// y (single rounding).
void FusedNormQuantRows(const RowParams& p, const uint16_t* x, int64_t x_stride, int64_t m0, int64_t m1,
                        const QuantOut& q, uint16_t* kv);

// Unfused norm kernel, tokens [m0, m1): writes kv = bf16(y_kv) and the bf16 q = bf16(y_q) into
// q_bf16 ([M, Q], row stride Q).
void NormRowsBf16(const RowParams& p, const uint16_t* x, int64_t x_stride, int64_t m0, int64_t m1,
                  uint16_t* q_bf16, uint16_t* kv);

// Unfused quant kernel, tokens [m0, m1): quantizes the bf16 rows of q_bf16 ([M, Q], row stride Q).
void QuantRowsBf16(const RowParams& p, const uint16_t* q_bf16, int64_t m0, int64_t m1, const QuantOut& q);

}  // namespace fusedlayer::cpu::swa
