// Raw kernel launchers of the SWA op, shared by swa_launch.cc, the GPU tests and the benchmark.
// Pointers are device pointers; every launcher enqueues on `stream` and returns the launch error.
#pragma once

#include <cstdint>

// gpu_runtime.h first: under hipcc, numeric.h's device intrinsics come from <hip/hip_runtime.h>.
#include "gpu_runtime.h"
#include "fusedlayer/numeric.h"

namespace fusedlayer::gpu {

// Where scale s(m, g) lives: q_scale[m * m_stride + g * g_stride]. Row-major: (G, 1);
// DeepGEMM column-major TMA-aligned: (1, align(M, 4)), with rows [M, align(M,4)) zero-filled.
struct SwaScaleLayout {
  int64_t m_stride = 0;
  int64_t g_stride = 1;
  int64_t padded_rows = 0;  // align(M,4) for the column-major layout (padding zeroed), else M
};

struct SwaRowParams {
  const uint16_t* qr_kv = nullptr;  // bf16 [M, Q + D], rows `row_stride` elements apart
  int64_t row_stride = 0;
  int64_t tokens = 0;
  int q_rank = 0;    // Q
  int head_dim = 0;  // D
  const uint16_t* q_norm = nullptr;   // bf16 [Q]
  const uint16_t* kv_norm = nullptr;  // bf16 [D]
  float eps = 1e-6f;
  uint16_t* kv = nullptr;             // bf16 [M, D]
  // Fused: q codes and scales written from the fp32 normalised value.
  uint8_t* q_fp8 = nullptr;           // [M, Q]
  float* q_scale = nullptr;
  SwaScaleLayout scale_layout;
  Fp8Format fp8_format = Fp8Format::kE4M3FN;
  bool ue8m0 = false;
  // Unfused norm step: the bf16-rounded q half (dense [M, Q]); q_fp8/q_scale unused.
  uint16_t* q_bf16 = nullptr;
  // Launch with programmatic dependent launch (CUDA sm_90+; ignored elsewhere). The kernels wait
  // for the previous grid before touching memory either way; false only for measurements.
  bool pdl = true;
  // Largest M launched one row per block (the small-M kernel); -1: 8 x multiprocessors. Tuning only.
  int64_t wide_rows_max = -1;
};

// Whether this binary holds code the current device can run (gpuErrorInvalidDeviceFunction or
// "no kernel image" otherwise, e.g. an sm_90a build on an sm_80 GPU).
gpuError_t ProbeSwaKernelImage();

// One launch: q and kv RMSNorm, q FP8 1x128 group quant straight from fp32 (single rounding).
gpuError_t LaunchSwaFusedRows(const SwaRowParams& p, int sm_count, gpuStream_t stream);
// The unfused chain: RMSNorm writing bf16 q (p.q_bf16) and kv, then a separate group quant of
// the bf16 q. kv and the q-half normalisation are computed by the same code as the fused kernel,
// so kv is bitwise equal between the two paths.
gpuError_t LaunchSwaNormRows(const SwaRowParams& p, int sm_count, gpuStream_t stream);
gpuError_t LaunchSwaGroupQuant(const uint16_t* q_bf16, int64_t tokens, int q_rank, uint8_t* q_fp8, float* q_scale,
                               const SwaScaleLayout& layout, Fp8Format fmt, bool ue8m0, gpuStream_t stream,
                               bool pdl = true);

// q_proj[m, n] = bf16( sum_kb As[m,kb] * Bs[n/128,kb] * sum_{k in kb} fp8(A[m,k]) fp8(B[n,k]) ),
// fp32 accumulation. A = q codes [M, K] (K = Q), B = wq_b codes [N, K], Bs [N/128, K/128].
// Our CUDA-core kernel: the fallback and HIP implementation (swa_launch.cc picks per weight set).
gpuError_t LaunchWqbGemm(const uint8_t* a, const float* a_scale, const SwaScaleLayout& a_layout, const uint8_t* b,
                         const float* b_scale, uint16_t* out, int64_t tokens, int n, int k, Fp8Format fmt,
                         gpuStream_t stream);

// Operand staging for a library GEMM that wants the activation scales as [G][rows] (rows
// contiguous) per call and whole multiples of 4 rows (cuBLASLt block-scaled FP8, wq_b_cublaslt.cc).
// One launch writes, from (a, a_scale, layout) of `tokens` rows with k = Q columns (G = k/128):
//   main_scale (if not null): rows [0, main_rows) in chunks of chunk_rows: chunk c (rows
//     [r0, r0 + rc)) at main_scale[G * r0 + g * rc + j] = s(r0 + j, g);
//   tail_scale (if not null): [G][4], tail_scale[g * 4 + j] = s(tail_row0 + j, g), 0 for rows >= tokens;
//   tail_a (if not null): [4][k] codes of rows [tail_row0, tail_row0 + 4), zero bytes for rows >= tokens.
struct WqbPackParams {
  const uint8_t* a = nullptr;
  const float* a_scale = nullptr;
  SwaScaleLayout layout;
  int64_t tokens = 0;
  int k = 0;
  float* main_scale = nullptr;
  int64_t main_rows = 0;
  int64_t chunk_rows = 0;
  float* tail_scale = nullptr;
  int64_t tail_row0 = 0;
  uint8_t* tail_a = nullptr;
};
gpuError_t LaunchWqbPack(const WqbPackParams& p, gpuStream_t stream);

}  // namespace fusedlayer::gpu
