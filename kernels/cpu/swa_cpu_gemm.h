// The wq_b projection on the CPU: a block-scaled FP8 GEMM (spec/swa.md "Optional projection"),
//   out[m, n] = bf16_rne( sum_kb As[m, kb] * Bs[n / 128, kb] * sum_{k in kb} fp8(A[m, k]) * fp8(B[n, k]) ),
// fp32 accumulation. Each output's accumulation order is fixed (k in order within a block, blocks in
// order), independent of M, the tiling and the thread split.
#pragma once

#include <cstdint>

#include "fusedlayer/numeric.h"
#include "thread_pool.h"

namespace fusedlayer::cpu::swa {

struct GemmA {
  const uint8_t* codes = nullptr;  // [M, K] fp8, row stride K
  const float* scale = nullptr;    // As(m, kb) = scale[m * scale_row + kb * scale_col]
  int64_t scale_row = 0, scale_col = 0;
};

struct GemmB {
  const uint8_t* codes = nullptr;  // [N, K] fp8, K-contiguous
  const float* scale = nullptr;    // [N / 128, K / 128]
};

// M tokens, N outputs (multiple of 128), K (multiple of 128). out: bf16 [M, N].
void BlockScaledFp8Gemm(const GemmA& a, const GemmB& b, int64_t M, int64_t N, int64_t K, Fp8Format fmt,
                        uint16_t* out, ThreadPool& pool);

}  // namespace fusedlayer::cpu::swa
