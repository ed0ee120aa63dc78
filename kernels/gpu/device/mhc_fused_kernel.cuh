// Fused mHC pass (n = 4, C % 128 == 0, CUDA sm_80+): reads R and x once and writes R', aux, the
// shifted collapse z (into y, rescaled by MhcFinalizeKernel) and per-chunk partials of the mixes
// GEMM and of the two sums of squares.
//
// CTA = 4 warps = 128 channels (one 32-channel quad per warp) x 16*kTiles tokens (kTiles m16 tiles
// per warp). Lane (g, t) = (lane / 4, lane % 4) owns channels quad*32 + t*8 .. +7 of tokens g, g+8
// of each tile: exactly the rows and k-columns of its mma.sync m16n8k16 A fragments, so R' goes from
// the post arithmetic to the tensor cores without shared memory (packed bf16 pairs as they are
// stored). The mixes run as bf16 MMAs with fp32 accumulation and fn split into hi + lo bf16 parts
// (prepared on the host): R' is bf16, hence exact, hi + lo carries 16 significant bits of fn (split
// error <= 2^-16 |fn| per element, random in sign), and the two MMAs give dot products far inside
// the mixes tolerance (kernels/gpu/DESIGN.md). B fragments are loaded once per warp and
// used for every tile. The chunk partial is the fixed-order sum of the 4 warps' values, so the
// reduction order is a function of C only.
// Included by mhc_launch.cu only.
#pragma once

#include "device/mhc_device_math.cuh"
#include "device/mhc_finalize_kernel.cuh"
#include "device/mhc_tuning.h"

namespace fusedlayer::gpu::mhc {

inline constexpr int kFusedChunkChannels = 128;
inline constexpr int kFusedTileTokens = 32;  // at kTiles = 2; 16 at kTiles = 1
inline constexpr int kFusedThreads = 128;
inline constexpr int kFusedPartialStride = 26;  // 24 dots, sum R'^2, sum z^2

struct FusedParams {
  const uint16_t* x;          // [T, C]; the embedding e in the first stage
  const uint16_t* residual;   // [T, 4, C] (unused in the first stage)
  const float* post_mix;      // [T, 4]
  const float* comb_mix;      // [T, 4, 4]
  const float* pre_mix;       // [T, 4] or null (shifted mode: stream 0)
  const uint4* frag;          // prepared B fragments (fn_frag or fn_first_frag): bf16 hi/lo pairs
  uint16_t* new_residual;     // [T, 4, C]
  uint16_t* y;                // [T, C]: z (shifted mode), rescaled later
  uint16_t* aux;              // [T, C] or null
  float* partials;            // [T, C/128, 26]
  int64_t tokens;
  int64_t C;
};

#if !FL_HIP
// D += A * B on the tensor cores, bf16 operands, fp32 accumulation (m16n8k16).
__device__ __forceinline__ void MmaBf16(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                        uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// The pass's 16-byte output stores, each one st.global.v4 instruction. Written as plain uint4 stores,
// nvcc emitted four 32-bit stores for each (found in the PTX; ncu on the persistent pass, C = 7168,
// T = 4096: 58% of its global sectors "excessive", since a warp's 32-bit store of 2 rows x 256 B
// touches as many sectors as the 16-byte one). R' and aux are not read again by this op and are far
// larger than L2 at large T: stored evict-first (.cs), so z, which the finalize kernel reads back,
// and the partials keep their place in L2; z is stored with the default (write-back) policy.
__device__ __forceinline__ void StoreStreaming16(uint16_t* p, const uint4& v) { __stcs(reinterpret_cast<uint4*>(p), v); }
__device__ __forceinline__ void StoreReread16(uint16_t* p, const uint4& v) { __stwb(reinterpret_cast<uint4*>(p), v); }

// One token row x 8 channels of the pass (t < p.tokens): post (or the first stage's broadcast, or the
// GEMM-only pass's read of R'), the stores of R', aux and z, R' as packed bf16 pairs (the MMA A words,
// `rq`) and this lane's sums of squares of R' and z. Shared by MhcFusedPassKernel and
// MhcStagedPassKernel (mhc_staged_pass_kernel.cuh), so the two give the same bits by construction.
// `cf`: the row's 24 mixing coefficients (post[4], comb[16], pre[4]; unused in the first stage and
// the GEMM-only pass).
template <bool kFirst, bool kShifted, bool kHasPre, bool kAux, bool kMix, bool kGemmOnly>
__device__ __forceinline__ void PassRow(const FusedParams& p, int64_t t, int64_t c0, const float* cf,
                                        const uint4& raw_x, const uint4 (&raw_r)[4], uint4 (&rq)[kFirst ? 1 : 4],
                                        float& sq_r, float& sq_z) {
  constexpr int N = 4;
  constexpr int kStreams = kFirst ? 1 : N;
  const int64_t C = p.C;
  float out[N][8];
  if constexpr (kFirst) {
    Unpack8(raw_x, out[0]);
    rq[0] = raw_x;
    if constexpr (!kGemmOnly) {
#pragma unroll
      for (int j = 0; j < N; ++j) StoreStreaming16(p.new_residual + (t * N + j) * C + c0, raw_x);
    }
#pragma unroll
    for (int j = 1; j < N; ++j)
#pragma unroll
      for (int e = 0; e < 8; ++e) out[j][e] = out[0][e];
  } else if constexpr (kGemmOnly) {
#pragma unroll
    for (int j = 0; j < N; ++j) {
      rq[j] = raw_r[j];
      Unpack8(raw_r[j], out[j]);
    }
  } else {
    float post[N], comb[N][N];
#pragma unroll
    for (int j = 0; j < N; ++j) post[j] = cf[j];
#pragma unroll
    for (int i = 0; i < N; ++i)
#pragma unroll
      for (int j = 0; j < N; ++j) comb[j][i] = cf[4 + i * N + j];
    float x[8], r[N][8];
    Unpack8(raw_x, x);
#pragma unroll
    for (int i = 0; i < N; ++i) Unpack8(raw_r[i], r[i]);
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      float col[N];
#pragma unroll
      for (int i = 0; i < N; ++i) col[i] = r[i][e];
#pragma unroll
      for (int j = 0; j < N; ++j) out[j][e] = PostElement<N>(x[e], col, post[j], comb[j]);
    }
#pragma unroll
    for (int j = 0; j < N; ++j) {
      rq[j] = Pack8(out[j]);
      StoreStreaming16(p.new_residual + (t * N + j) * C + c0, rq[j]);
    }
    if constexpr (kAux) {
      float a[8];
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        float col[N];
#pragma unroll
        for (int j = 0; j < N; ++j) col[j] = out[j][e];
        a[e] = AuxElement<N>(col);
      }
      StoreStreaming16(p.aux + t * C + c0, Pack8(a));
    }
  }
  if constexpr (kMix) {
    float s = 0.0f;
#pragma unroll
    for (int j = 0; j < kStreams; ++j)
#pragma unroll
      for (int e = 0; e < 8; ++e) s = __fmaf_rn(out[j][e], out[j][e], s);
    sq_r = s;
  }
  if constexpr (kShifted) {
    float z[8];
    if (kHasPre && !kFirst) {
      float pre[N];
#pragma unroll
      for (int j = 0; j < N; ++j) pre[j] = cf[20 + j];
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        float col[N];
#pragma unroll
        for (int j = 0; j < N; ++j) col[j] = out[j][e];
        z[e] = CollapseElement<N>(col, pre);
      }
    } else {
#pragma unroll
      for (int e = 0; e < 8; ++e) z[e] = out[0][e];  // pre_mix absent: stream 0, bit for bit
    }
    StoreReread16(p.y + t * C + c0, Pack8(z));
    sq_z = VecSumSq(z);
  }
}

// kFirst: R' = e on every stream (layer 0). kShifted: write z = Collapse(R', pre_mix or stream 0)
// into y and its sum of squares. kMix: compute the mixes partials (not in the head stage).
// kGemmOnly: the unfused path's mixes GEMM: R' is read from `residual` (already written by the
// post kernel; in the first stage e is read from `x`) and nothing but the partials is written. The
// partials are then bit-identical to the fused pass's, so both paths produce the same mixes and
// the same normal-mode y.
//
// kTiles (1 or 2): m16 tiles per warp. One tile halves each warp's serial work (decode sizes, where
// a CTA's 4 warps are alone on their SM); two tiles reuse each B fragment twice (large T). Every
// token's arithmetic is the same either way (each m-tile is its own MMA chain with the same k order),
// so the choice may depend on T without breaking batch invariance.
//
// kMinBlocks (> 0): minimum resident CTAs per SM for this instance's register budget instead of
// the defaults in mhc_tuning.h (mhc_launch.cu runs a 4-CTA/SM 16-token instance when the grid exceeds one wave
// of the default instance). Register allocation only: the arithmetic and its order are unchanged.
template <bool kFirst, bool kShifted, bool kHasPre, bool kAux, bool kMix, bool kGemmOnly = false, int kTiles = 2,
          int kMinBlocks = 0>
__global__ void __launch_bounds__(kFusedThreads, kMinBlocks > 0 ? kMinBlocks
                                                 : kTiles == 1  ? FL_MHC_TILE16_MIN_BLOCKS
                                                                : 3)
    MhcFusedPassKernel(FusedParams p) {
  static_assert(!kGemmOnly || (kMix && !kShifted && !kAux), "the GEMM-only pass writes partials only");
  constexpr int N = 4;
  constexpr int kStreams = kFirst ? 1 : N;   // distinct streams feeding the GEMM
  constexpr int kSteps = kStreams * 2;       // k16 steps per warp: 8 channels x streams per lane / 4
  // B fragments in flight ahead of the step that uses them. 16-token tiles (decode sizes, a CTA's
  // warps alone on their SM) request the first kAhead steps right after the data loads, so the fn
  // round trip overlaps the HBM round trip of R and x; 32-token tiles keep the registers.
  constexpr bool kEarlyB = kTiles == 1 && FL_MHC_EARLY_B;
  constexpr int kAhead = (kEarlyB ? 4 : 2) < kSteps ? (kEarlyB ? 4 : 2) : kSteps;
  constexpr int kTileTokens = 16 * kTiles;
  __shared__ float red[4][kTileTokens][kFusedPartialStride];

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, tq = lane % 4;
  // Token tiles vary fastest across the grid, so CTAs resident together mostly share a chunk and
  // its B fragments hit in L1/L2.
  const int chunk = blockIdx.y, nchunk = gridDim.y;
  const int quad = chunk * 4 + warp;
  const int64_t c0 = int64_t(quad) * 32 + tq * 8;
  const int64_t tok_base = int64_t(blockIdx.x) * kTileTokens;
  const int64_t C = p.C;

  // B fragments: fn as bf16 hi + lo parts, laid out per (32-channel quad, k16 step, n-tile, lane)
  // by the host (mhc_launch.cu BuildFragments), read with ld.global.nc (L2-resident weights). They
  // are weights, so they are requested before GridDependencyWait: while the previous kernel on the
  // stream finishes (programmatic dependent launch), the warp's fragments of every step go to L2
  // and, with kEarlyB, the first kAhead steps to registers.
  const uint4* frag = p.frag + size_t(quad) * kSteps * 3 * 32 + lane;
  uint4 bq[kSteps][3];  // compile-time indices only: a register lives from its load to its MMA
  // Only the first token tile's CTAs prefetch: the others of the chunk then hit the same lines in L2,
  // and at large T (many waves, all past the wait) a prefetch per CTA would only double fn's L2
  // traffic (measured: the unfused chain +8% at C = 7168 T = 1024).
  if constexpr (kMix) {
    if (blockIdx.x == 0) {
      constexpr int kFragLines = kSteps * 3 * 32 * 16 / 128;
      const unsigned char* frag_bytes = reinterpret_cast<const unsigned char*>(frag - lane);
      for (int l = lane; l < kFragLines; l += 32) PrefetchWeightL2(frag_bytes + l * 128);
    }
    if constexpr (kEarlyB) {
#pragma unroll
      for (int s = 0; s < kAhead; ++s)
#pragma unroll
        for (int nt = 0; nt < 3; ++nt) bq[s][nt] = __ldg(frag + (s * 3 + nt) * 32);
    }
  }
  GridDependencyWait();  // x, R and the mixes may come from the previous kernel
  // Now let the finalize (programmatic dependent launch) become resident; its GridDependencyWait
  // still waits for this whole grid. Not before this kernel's own wait: a trigger there would let
  // the finalize in, which lets the next seam's pass in, and so on, until every later kernel of a
  // graph sat resident and waiting (measured: +15% at C = 7168 T = 16).
  LaunchDependents();

  // Row r = mt*16 + h*8 + g of the CTA's token tile: m-tile mt, fragment half h.
  uint4 raw_x[kTiles][2], raw_r[kTiles][2][N];
#pragma unroll
  for (int mt = 0; mt < kTiles; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t t = tok_base + mt * 16 + h * 8 + g;
      if (t < p.tokens) {
        if (kFirst || !kGemmOnly) raw_x[mt][h] = *reinterpret_cast<const uint4*>(p.x + t * C + c0);
        if constexpr (!kFirst) {
#pragma unroll
          for (int i = 0; i < N; ++i)
            raw_r[mt][h][i] = *reinterpret_cast<const uint4*>(p.residual + (t * N + i) * C + c0);
        }
      }
    }

  // The tile's mixing coefficients (post[4], comb[16], pre[4] per token) go through shared memory:
  // one cooperative load round, overlapping the data loads above, instead of a dependent round of
  // scalar loads per token inside the arithmetic below.
  __shared__ float coef[kTileTokens][24];
  if constexpr (!kFirst && !kGemmOnly) {
    for (int i = threadIdx.x; i < kTileTokens * 24; i += kFusedThreads) {
      const int row = i / 24, q = i % 24;
      const int64_t t = tok_base + row;
      float v = 0.0f;
      if (t < p.tokens) {
        if (q < 4) v = p.post_mix[t * N + q];
        else if (q < 20) v = p.comb_mix[t * N * N + (q - 4)];
        else if (kHasPre) v = p.pre_mix[t * N + (q - 20)];
      }
      coef[row][q] = v;
    }
    __syncthreads();
  }

  uint4 rq[kTiles][2][kStreams];  // R' packed as bf16 pairs: the A operands as they are
  float sq_r[kTiles][2], sq_z[kTiles][2];
#pragma unroll
  for (int mt = 0; mt < kTiles; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t t = tok_base + mt * 16 + h * 8 + g;
      sq_r[mt][h] = 0.0f;
      sq_z[mt][h] = 0.0f;
      if (t >= p.tokens) {
#pragma unroll
        for (int j = 0; j < kStreams; ++j) rq[mt][h][j] = make_uint4(0, 0, 0, 0);
        continue;
      }
      PassRow<kFirst, kShifted, kHasPre, kAux, kMix, kGemmOnly>(p, t, c0, coef[mt * 16 + h * 8 + g], raw_x[mt][h],
                                                              raw_r[mt][h], rq[mt][h], sq_r[mt][h], sq_z[mt][h]);
    }

  // Mixes: acc[mt][nt] is the m16n8 tile (tokens of m-tile mt) x (outputs nt*8 .. nt*8+7).
  float acc[kTiles][3][4];
#pragma unroll
  for (int mt = 0; mt < kTiles; ++mt)
#pragma unroll
    for (int nt = 0; nt < 3; ++nt)
#pragma unroll
      for (int q = 0; q < 4; ++q) acc[mt][nt][q] = 0.0f;
  if constexpr (kMix) {
    // B fragments straight from global memory (L2-resident weights). Staging them in shared memory
    // with cp.async was measured (TF32 layout): no gain at decode sizes, and the 96 KB per CTA halved
    // occupancy at large T.
    if constexpr (!kEarlyB) {
#pragma unroll
      for (int s = 0; s < kAhead; ++s)
#pragma unroll
        for (int nt = 0; nt < 3; ++nt) bq[s][nt] = __ldg(frag + (s * 3 + nt) * 32);
    }
#pragma unroll
    for (int s = 0; s < kSteps; ++s) {
      const int j = s / 2, u = s % 2;  // stream, 4-channel half of the lane's 8 channels
      if (s + kAhead < kSteps) {
#pragma unroll
        for (int nt = 0; nt < 3; ++nt) bq[s + kAhead][nt] = __ldg(frag + ((s + kAhead) * 3 + nt) * 32);
      }
#pragma unroll
      for (int mt = 0; mt < kTiles; ++mt) {
        // A (m16n8k16, bf16 pairs): a0/a2 = token g, MMA k 2t..2t+1 / 2t+8..2t+9 = channels
        // t*8 + 4u + {0,1} / {2,3}; a1/a3 the same for token g + 8. R' is packed bf16 already.
        const uint32_t a0 = (&rq[mt][0][j].x)[2 * u], a2 = (&rq[mt][0][j].x)[2 * u + 1];
        const uint32_t a1 = (&rq[mt][1][j].x)[2 * u], a3 = (&rq[mt][1][j].x)[2 * u + 1];
#pragma unroll
        for (int nt = 0; nt < 3; ++nt) {
          MmaBf16(acc[mt][nt], a0, a1, a2, a3, bq[s][nt].x, bq[s][nt].y);  // hi
          MmaBf16(acc[mt][nt], a0, a1, a2, a3, bq[s][nt].z, bq[s][nt].w);  // lo
        }
      }
    }
  }

  // Sums of squares over the quad: butterfly over the 4 lanes of a row (the canonical quad order
  // (p0 + p1) + (p2 + p3) for z), then one lane per row writes.
#pragma unroll
  for (int mt = 0; mt < kTiles; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float a = sq_r[mt][h], z = sq_z[mt][h];
      a = __fadd_rn(a, __shfl_xor_sync(0xffffffffu, a, 1));
      a = __fadd_rn(a, __shfl_xor_sync(0xffffffffu, a, 2));
      z = __fadd_rn(z, __shfl_xor_sync(0xffffffffu, z, 1));
      z = __fadd_rn(z, __shfl_xor_sync(0xffffffffu, z, 2));
      const int row = mt * 16 + h * 8 + g;
      if (tq == 0) {
        red[warp][row][24] = a;
        red[warp][row][25] = z;
      }
    }
#pragma unroll
  for (int mt = 0; mt < kTiles; ++mt)
#pragma unroll
    for (int nt = 0; nt < 3; ++nt) {
      const int o = nt * 8 + 2 * tq;
      red[warp][mt * 16 + g][o] = acc[mt][nt][0];
      red[warp][mt * 16 + g][o + 1] = acc[mt][nt][1];
      red[warp][mt * 16 + 8 + g][o] = acc[mt][nt][2];
      red[warp][mt * 16 + 8 + g][o + 1] = acc[mt][nt][3];
    }
  __syncthreads();
  for (int i = threadIdx.x; i < kTileTokens * kFusedPartialStride; i += kFusedThreads) {
    const int row = i / kFusedPartialStride, q = i % kFusedPartialStride;
    const int64_t t = tok_base + row;
    if (t >= p.tokens) continue;
    p.partials[(t * nchunk + chunk) * kFusedPartialStride + q] =
        ChunkSum(red[0][row][q], red[1][row][q], red[2][row][q], red[3][row][q]);
  }
}
#endif  // !FL_HIP

}  // namespace fusedlayer::gpu::mhc
