// The wq_b projection of the SWA op: a block-scaled FP8 GEMM, q_proj = bf16(dequant(A) dequant(B)^T)
// with 1x128 activation scales and 128x128 weight scales (spec/swa.md "Optional projection").
//
// On CUDA, e4m3fn weight sets use cuBLASLt instead (wq_b_cublaslt.cc, chosen per weight set at load in
// swa_launch.cc); this kernel serves HIP, e4m3fnuz, and sets for which no single cuBLASLt algorithm is
// valid for every M. The file also holds LaunchWqbPack, the cuBLASLt path's operand staging.
//
// A portable CUDA-core kernel (one source for CUDA and HIP; CDNA2 has no FP8 matrix unit): fp8
// codes are decoded through a 256-entry table in shared memory, products accumulate in fp32 over
// each 128-wide K block, and the block's partial sum is scaled by As[m,kb] * Bs[n/128,kb] before it
// joins the running fp32 sum, exactly the contract's formula. Tiles: 64x64 outputs per 256-thread
// block, 4x4 per thread, K staged 32 at a time.
//
// Device code only; the launchers are in ../swa_wq_b_launch.cu.
#pragma once

// The runtime header first: under hipcc it provides the intrinsics numeric.h uses.
#include "gpu_runtime.h"
#include "swa_kernel_launch.h"

#include <cstdint>

#include "fusedlayer/numeric.h"

namespace fusedlayer::gpu::swa_wq_b {

constexpr int kBM = 64, kBN = 64, kBK = 32, kKBlock = 128, kThreads = 256;
static_assert(kKBlock % kBN == 0, "a block's columns must share one weight-scale row");

// Decodes 8 fp8 codes (one thread's share of a tile row) into the transposed fp32 tile.
__device__ __forceinline__ void StageCodes(const uint8_t* src, bool valid, bool vec, const float* lut,
                                           float (*tile)[kBM + 4], int row, int col) {
  uint8_t c[8];
  if (!valid) {
#pragma unroll
    for (int j = 0; j < 8; ++j) c[j] = 0;
  } else if (vec) {
    const uint2 u = *reinterpret_cast<const uint2*>(src);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      c[j] = uint8_t(u.x >> (8 * j));
      c[4 + j] = uint8_t(u.y >> (8 * j));
    }
  } else {
#pragma unroll
    for (int j = 0; j < 8; ++j) c[j] = src[j];
  }
#pragma unroll
  for (int j = 0; j < 8; ++j) tile[col + j][row] = valid ? lut[c[j]] : 0.0f;
}

__global__ void __launch_bounds__(kThreads) WqbGemmKernel(const uint8_t* a, const float* a_scale,
                                                         SwaScaleLayout a_layout, const uint8_t* b,
                                                         const float* b_scale, uint16_t* out, int64_t M, int N,
                                                         int K, Fp8Format fmt, bool a_vec) {
  __shared__ float lut[256];
  __shared__ float as[kBK][kBM + 4];  // [k][m], padded against bank conflicts
  __shared__ float bs[kBK][kBN + 4];  // [k][n]
  const int tid = int(threadIdx.x);
  lut[tid] = Fp8ToFloat(fp8_bits(tid), fmt);  // kThreads == 256 codes

  const int64_t m0 = int64_t(blockIdx.y) * kBM;
  const int n0 = int(blockIdx.x) * kBN;
  const int tx = tid % 16, ty = tid / 16;
  const int ld_row = tid / 4, ld_col = (tid % 4) * 8;  // 64 rows x 32 codes per stage
  const int kblocks = K / kKBlock;
  const int nb = n0 / kKBlock;

  float acc[4][4] = {};
  for (int kb = 0; kb < kblocks; ++kb) {
    float part[4][4] = {};
    for (int ks = 0; ks < kKBlock; ks += kBK) {
      const int k0 = kb * kKBlock + ks;
      __syncthreads();  // previous stage consumed (and, first time, the table written)
      const int64_t am = m0 + ld_row;
      StageCodes(a + am * K + k0 + ld_col, am < M, a_vec, lut, as, ld_row, ld_col);
      StageCodes(b + int64_t(n0 + ld_row) * K + k0 + ld_col, true, true, lut, bs, ld_row, ld_col);
      __syncthreads();
#pragma unroll 8
      for (int kk = 0; kk < kBK; ++kk) {
        float av[4], bv[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) av[i] = as[kk][ty + 16 * i];
#pragma unroll
        for (int j = 0; j < 4; ++j) bv[j] = bs[kk][tx + 16 * j];
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
          for (int j = 0; j < 4; ++j) part[i][j] = fmaf(av[i], bv[j], part[i][j]);
      }
    }
    const float bsc = b_scale[int64_t(nb) * kblocks + kb];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int64_t m = m0 + ty + 16 * i;
      const float asc = m < M ? a_scale[m * a_layout.m_stride + int64_t(kb) * a_layout.g_stride] : 0.0f;
      const float s = asc * bsc;
#pragma unroll
      for (int j = 0; j < 4; ++j) acc[i][j] += s * part[i][j];
    }
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int64_t m = m0 + ty + 16 * i;
    if (m >= M) continue;
#pragma unroll
    for (int j = 0; j < 4; ++j) out[m * N + n0 + tx + 16 * j] = FloatToBf16(acc[i][j]);
  }
}

// Grid-stride over the three regions of WqbPackParams (main scales, tail scales, tail codes).
__global__ void WqbPackKernel(WqbPackParams p) {
  const int G = p.k / kKBlock;
  const int64_t n_main = p.main_scale != nullptr ? int64_t(G) * p.main_rows : 0;
  const int64_t n_tail = p.tail_scale != nullptr ? int64_t(G) * 4 : 0;
  const int64_t n_a = p.tail_a != nullptr ? int64_t(4) * p.k : 0;
  const int64_t total = n_main + n_tail + n_a;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    if (i < n_main) {
      const int64_t chunk = i / (int64_t(G) * p.chunk_rows);
      const int64_t r0 = chunk * p.chunk_rows;
      const int64_t rc = p.main_rows - r0 < p.chunk_rows ? p.main_rows - r0 : p.chunk_rows;
      const int64_t local = i - int64_t(G) * r0;
      const int64_t g = local / rc, m = r0 + local % rc;
      p.main_scale[i] = p.a_scale[m * p.layout.m_stride + g * p.layout.g_stride];
    } else if (i < n_main + n_tail) {
      const int64_t t = i - n_main;
      const int64_t g = t / 4, m = p.tail_row0 + t % 4;
      p.tail_scale[t] = m < p.tokens ? p.a_scale[m * p.layout.m_stride + g * p.layout.g_stride] : 0.0f;
    } else {
      const int64_t t = i - n_main - n_tail;
      const int64_t m = p.tail_row0 + t / p.k;
      p.tail_a[t] = m < p.tokens ? p.a[p.tail_row0 * p.k + t] : uint8_t(0);
    }
  }
}

}  // namespace fusedlayer::gpu::swa_wq_b
