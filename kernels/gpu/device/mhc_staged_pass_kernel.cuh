// Staged fused mHC pass (n = 4, C % 128 == 0, CUDA sm_80+): the arithmetic of MhcFusedPassKernel
// (mhc_fused_kernel.cuh), bit for bit, with each CTA's work split into phases on different warps.
// It serves the fused path at 2 <= T <= 1024 (mhc_launch.cu); the register-resident pass keeps
// T = 1, T > 1024 and the unfused path's GEMM-only pass, where it measured faster.
//
// Why (bench/gpu/MHC_GPU_NOTES.md, "Staged round", session 7): at decode sizes the register-resident
// pass is latency-bound (ncu, C = 7168, T = 64: 159 registers, 1.74 active and 0.23 eligible warps
// per scheduler), and leaving its global stores out made the whole seam 3 us faster at T = 64 and
// 40 us at T = 1024: its lanes write R', aux and z as 64-byte pieces of 8 token rows (the MMA
// fragment layout). Here
//   phase 0 (every thread, first): cp.async of the chunk's B fragments (fn as bf16 hi/lo, 48 KB)
//           into shared memory, overlapping the data loads and the post arithmetic;
//   phase A (8 warps per 16-token tile, one token row x 8 channels per thread, each warp two rows x
//           the chunk's 128 channels: whole 128-byte lines): loads x and R, post, stores R', aux and z,
//           leaves R' in shared memory as the MMA A words the old kernel's lane held, and reduces the
//           sums of squares over each 32-channel quad with the old butterfly;
//   phase B (4 warps per tile, warp w = quad w % 4, issuing on sub-partition w % 4): A and B from
//           shared memory, the old MMA chain in the old k order;
//   then the 4 quads' values are added with ChunkSum into the chunk partial, as before.
// Every value that reaches the partials, R', aux and y is computed by the same operations in the
// same order as in MhcFusedPassKernel, so the launcher may choose between them by T (batch invariance)
// and the unfused path's GEMM-only pass agrees bit for bit (both are tested on the H200).
//
// Thread roles in phase A: thread i of tile mt has row = i / 16 (h = row / 8, g = row % 8) and
// vec = i % 16 (quad = vec / 4, tq = vec % 4): the old kernel's lane (g, tq) of warp `quad`,
// fragment half h, i.e. token mt*16 + row and channels quad*32 + tq*8 .. +7 of the chunk.
// Included by mhc_launch.cu only.
#pragma once

#include "device/mhc_device_math.cuh"
#include "device/mhc_fused_kernel.cuh"

namespace fusedlayer::gpu::mhc {

#if !FL_HIP
inline constexpr int kStagedThreadsPerTile = 256;  // 8 warps: 4 quads x 2 fragment halves

// Shared memory of one CTA (dynamic): B fragments, staged A words, the reduction buffer and the
// mixing coefficients. Bytes, for the launcher's attribute.
template <bool kFirst, int kTiles>
struct StagedSmem {
  static constexpr int kStreams = kFirst ? 1 : 4;
  static constexpr int kSteps = kStreams * 2;
  static constexpr int kFrag = 4 * kSteps * 3 * 32;              // uint4: 4 quads x steps x 3 n-tiles x 32 lanes
  static constexpr int kA = kTiles * 4 * 2 * kStreams * 32;       // uint4: tiles x quads x halves x streams x lanes
  static constexpr int kRed = 4 * 16 * kTiles * kFusedPartialStride;  // floats
  static constexpr int kCoef = 16 * kTiles * 24;                  // floats
  static constexpr size_t kBytes = size_t(kFrag + kA) * 16 + size_t(kRed + kCoef) * 4;
};

__device__ __forceinline__ void CpAsync16(void* smem, const void* gmem) {
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem));
}
__device__ __forceinline__ void CpAsyncWaitAll() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

// Template flags as MhcFusedPassKernel's (kFirst, kShifted, kHasPre, kAux, kMix, kGemmOnly); kTiles
// m16 token tiles per CTA (256 threads each). kMinBlocks: resident CTAs per SM to budget registers for.
template <bool kFirst, bool kShifted, bool kHasPre, bool kAux, bool kMix, bool kGemmOnly, int kTiles, int kMinBlocks>
__global__ void __launch_bounds__(kStagedThreadsPerTile * kTiles, kMinBlocks) MhcStagedPassKernel(FusedParams p) {
  static_assert(!kGemmOnly || (kMix && !kShifted && !kAux), "the GEMM-only pass writes partials only");
  LaunchDependents();  // see MhcFusedPassKernel
  constexpr int N = 4;
  using Smem = StagedSmem<kFirst, kTiles>;
  constexpr int kStreams = Smem::kStreams;
  constexpr int kSteps = Smem::kSteps;
  constexpr int kThreads = kStagedThreadsPerTile * kTiles;
  constexpr int kTileTokens = 16 * kTiles;

  extern __shared__ __align__(16) unsigned char smem_raw[];
  uint4* frag_s = reinterpret_cast<uint4*>(smem_raw);                 // [quad][step][nt][lane]
  uint4* a_s = frag_s + Smem::kFrag;                                   // [mt][quad][h][stream][lane]
  float* red = reinterpret_cast<float*>(a_s + Smem::kA);               // [quad][row][stride]
  float* coef = red + Smem::kRed;                                      // [row][24]
  auto red_at = [&](int quad, int row, int q) -> float& {
    return red[(quad * kTileTokens + row) * kFusedPartialStride + q];
  };

  const int chunk = blockIdx.y, nchunk = gridDim.y;
  const int64_t tok_base = int64_t(blockIdx.x) * kTileTokens;
  const int64_t C = p.C;

  // Phase 0: the chunk's B fragments (4 consecutive quads of the host layout are contiguous).
  if constexpr (kMix) {
    const uint4* src = p.frag + size_t(chunk) * Smem::kFrag;  // 4 consecutive quads: contiguous
    for (int i = threadIdx.x; i < Smem::kFrag; i += kThreads) CpAsync16(frag_s + i, src + i);
  }

  const int mt = threadIdx.x / kStagedThreadsPerTile, ti = threadIdx.x % kStagedThreadsPerTile;
  // A warp covers two token rows x the chunk's 128 channels; lanes lane ^ 1, lane ^ 2 are the same
  // row's neighbours in the quad (the butterfly below).
  const int lane = ti % 32, quad = (ti % 16) / 4, tq = ti % 4, h = (ti / 16) / 8, g = (ti / 16) % 8;
  const int mma_lane = g * 4 + tq;  // the lane of the old kernel's warp `quad` that held this row
  const int row = mt * 16 + h * 8 + g;
  const int64_t t = tok_base + row;
  const bool valid = t < p.tokens;
  const int64_t c0 = int64_t(chunk * 4 + quad) * 32 + tq * 8;

  uint4 raw_x = make_uint4(0, 0, 0, 0), raw_r[N];
  if (valid) {
    if (kFirst || !kGemmOnly) raw_x = *reinterpret_cast<const uint4*>(p.x + t * C + c0);
    if constexpr (!kFirst) {
#pragma unroll
      for (int i = 0; i < N; ++i) raw_r[i] = *reinterpret_cast<const uint4*>(p.residual + (t * N + i) * C + c0);
    }
  }

  if constexpr (!kFirst && !kGemmOnly) {
    for (int i = threadIdx.x; i < kTileTokens * 24; i += kThreads) {
      const int r = i / 24, q = i % 24;
      const int64_t tt = tok_base + r;
      float v = 0.0f;
      if (tt < p.tokens) {
        if (q < 4) v = p.post_mix[tt * N + q];
        else if (q < 20) v = p.comb_mix[tt * N * N + (q - 4)];
        else if (kHasPre) v = p.pre_mix[tt * N + (q - 20)];
      }
      coef[r * 24 + q] = v;
    }
    __syncthreads();
  }

  // Phase A: one token row x 8 channels x 4 streams per thread (PassRow, as in MhcFusedPassKernel).
  uint4 rq[kStreams];
  float sq_r = 0.0f, sq_z = 0.0f;
  if (!valid) {
#pragma unroll
    for (int j = 0; j < kStreams; ++j) rq[j] = make_uint4(0, 0, 0, 0);
  } else {
    PassRow<kFirst, kShifted, kHasPre, kAux, kMix, kGemmOnly>(p, t, c0, coef + row * 24, raw_x, raw_r, rq, sq_r, sq_z);
  }
  if constexpr (kMix) {
#pragma unroll
    for (int j = 0; j < kStreams; ++j) a_s[(((mt * 4 + quad) * 2 + h) * kStreams + j) * 32 + mma_lane] = rq[j];
  }
  // Sums of squares over the quad's 4 lanes: the old kernel's butterfly, same operand order.
  sq_r = __fadd_rn(sq_r, __shfl_xor_sync(0xffffffffu, sq_r, 1));
  sq_r = __fadd_rn(sq_r, __shfl_xor_sync(0xffffffffu, sq_r, 2));
  sq_z = __fadd_rn(sq_z, __shfl_xor_sync(0xffffffffu, sq_z, 1));
  sq_z = __fadd_rn(sq_z, __shfl_xor_sync(0xffffffffu, sq_z, 2));
  if (tq == 0) {
    red_at(quad, row, 24) = sq_r;
    red_at(quad, row, 25) = sq_z;
  }
  if constexpr (kMix) CpAsyncWaitAll();
  __syncthreads();

  // Phase B: warp w < 4 * kTiles runs quad w % 4 of m-tile w / 4 (MhcFusedPassKernel's MMA chain).
  const int warp = threadIdx.x / 32;
  if (kMix && warp < 4 * kTiles) {
    const int bq = warp % 4, bmt = warp / 4;
    float acc[3][4];
#pragma unroll
    for (int nt = 0; nt < 3; ++nt)
#pragma unroll
      for (int q = 0; q < 4; ++q) acc[nt][q] = 0.0f;
    const uint4* fq = frag_s + bq * kSteps * 3 * 32 + lane;
    const uint4* aq = a_s + ((bmt * 4 + bq) * 2) * kStreams * 32 + lane;
#pragma unroll
    for (int s = 0; s < kSteps; ++s) {
      const int j = s / 2, u = s % 2;
      const uint4 lo = aq[(0 * kStreams + j) * 32], hi = aq[(1 * kStreams + j) * 32];
      const uint32_t a0 = (&lo.x)[2 * u], a2 = (&lo.x)[2 * u + 1];
      const uint32_t a1 = (&hi.x)[2 * u], a3 = (&hi.x)[2 * u + 1];
#pragma unroll
      for (int nt = 0; nt < 3; ++nt) {
        const uint4 b = fq[(s * 3 + nt) * 32];
        MmaBf16(acc[nt], a0, a1, a2, a3, b.x, b.y);  // hi
        MmaBf16(acc[nt], a0, a1, a2, a3, b.z, b.w);  // lo
      }
    }
    const int bg = lane / 4, btq = lane % 4;
#pragma unroll
    for (int nt = 0; nt < 3; ++nt) {
      const int o = nt * 8 + 2 * btq;
      red_at(bq, bmt * 16 + bg, o) = acc[nt][0];
      red_at(bq, bmt * 16 + bg, o + 1) = acc[nt][1];
      red_at(bq, bmt * 16 + 8 + bg, o) = acc[nt][2];
      red_at(bq, bmt * 16 + 8 + bg, o + 1) = acc[nt][3];
    }
  } else if (!kMix && warp < 4 * kTiles) {
    // Head stage: no mixes; the partials' dot entries are never read, but keep them defined.
    for (int i = lane; i < 16 * 24; i += 32) red_at(warp % 4, (warp / 4) * 16 + i / 24, i % 24) = 0.0f;
  }
  __syncthreads();
  for (int i = threadIdx.x; i < kTileTokens * kFusedPartialStride; i += kThreads) {
    const int r = i / kFusedPartialStride, q = i % kFusedPartialStride;
    const int64_t tt = tok_base + r;
    if (tt >= p.tokens) continue;
    p.partials[(tt * nchunk + chunk) * kFusedPartialStride + q] =
        ChunkSum(red_at(0, r, q), red_at(1, r, q), red_at(2, r, q), red_at(3, r, q));
  }
}
#endif  // !FL_HIP

}  // namespace fusedlayer::gpu::mhc
