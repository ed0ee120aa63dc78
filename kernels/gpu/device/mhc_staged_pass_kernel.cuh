// Staged fused mHC pass (n = 4, C % 128 == 0, CUDA sm_80+): the arithmetic of MhcFusedPassKernel
// (mhc_fused_kernel.cuh), bit for bit, with each CTA's work split into phases on different warps.
// It serves the fused path at 2 <= T <= 1024 where its grid fits one wave, and its persistent form
// (MhcPersistentPassKernel, below) where the grid would not (mhc_launch.cu); the register-resident
// pass keeps T = 1, the rest of T > 1024 and the unfused path's GEMM-only pass.
//
// Why (kernels/gpu/DESIGN.md): at decode sizes the register-resident
// pass is latency-bound (ncu, C = 7168, T = 64: 159 registers, 1.74 active and 0.23 eligible warps
// per scheduler), and leaving its global stores out made the whole seam 3 us faster at T = 64 and
// 40 us at T = 1024: its lanes write R', aux and z as 64-byte pieces of 8 token rows (the MMA
// fragment layout; most of that cost turned out to be nvcc splitting each 16-byte store into four
// 32-bit ones, since fixed: StoreStreaming16 in mhc_fused_kernel.cuh). Here
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

// The phases of one 16-token tile, shared by MhcStagedPassKernel (one tile per CTA) and
// MhcPersistentPassKernel (a CTA loops over tiles): both kernels give the same bits because they run
// these functions. Shared memory: frag_s [quad][step][nt][lane] (B fragments), a_s
// [quad][h][stream][lane] (A words), red [quad][row][stride] (per-quad values), coef [row][24].
struct StagedTileSmem {
  const uint4* frag_s;
  uint4* a_s;
  float* red;
  const float* coef;
};

// The mixing coefficient q of token tt (0 for a token past the end): post[4], comb[16], pre[4].
template <bool kHasPre>
__device__ __forceinline__ float StagedCoef(const FusedParams& p, int64_t tt, int q) {
  constexpr int N = 4;
  if (tt >= p.tokens) return 0.0f;
  if (q < 4) return p.post_mix[tt * N + q];
  if (q < 20) return p.comb_mix[tt * N * N + (q - 4)];
  return kHasPre ? p.pre_mix[tt * N + (q - 20)] : 0.0f;
}

// Thread i of a tile: row = i / 16 (h = row / 8, g = row % 8), vec = i % 16 (quad = vec / 4,
// tq = vec % 4): the old kernel's lane (g, tq) of warp `quad`, fragment half h.
struct StagedLane {
  int quad, tq, h, g, row;
  __device__ __forceinline__ explicit StagedLane(int ti)
      : quad((ti % 16) / 4), tq(ti % 4), h((ti / 16) / 8), g((ti / 16) % 8), row(ti / 16) {}
  __device__ __forceinline__ int64_t Channel(int chunk) const { return int64_t(chunk * 4 + quad) * 32 + tq * 8; }
};

// The row's loads: x (unless the GEMM-only pass reads R' alone) and the 4 residual streams.
template <bool kFirst, bool kGemmOnly>
__device__ __forceinline__ void StagedLoadRow(const FusedParams& p, int64_t t, int64_t c0, uint4& raw_x,
                                              uint4 (&raw_r)[4]) {
  constexpr int N = 4;
  if (kFirst || !kGemmOnly) raw_x = *reinterpret_cast<const uint4*>(p.x + t * p.C + c0);
  if constexpr (!kFirst) {
#pragma unroll
    for (int i = 0; i < N; ++i) raw_r[i] = *reinterpret_cast<const uint4*>(p.residual + (t * N + i) * p.C + c0);
  }
}

// Phase A of thread `ti` (0..255) for token t = tok_base + ln.row: PassRow (post, stores), the row's
// A words into a_s, and the quad's sums of squares by the old kernel's butterfly (same operand order).
template <bool kFirst, bool kShifted, bool kHasPre, bool kAux, bool kMix, bool kGemmOnly>
__device__ __forceinline__ void StagedPhaseA(const FusedParams& p, const StagedTileSmem& sm, const StagedLane& ln,
                                             int64_t t, int64_t c0, const uint4& raw_x, const uint4 (&raw_r)[4]) {
  constexpr int kStreams = kFirst ? 1 : 4;
  const bool valid = t < p.tokens;
  uint4 rq[kStreams];
  float sq_r = 0.0f, sq_z = 0.0f;
  if (!valid) {
#pragma unroll
    for (int j = 0; j < kStreams; ++j) rq[j] = make_uint4(0, 0, 0, 0);
  } else {
    PassRow<kFirst, kShifted, kHasPre, kAux, kMix, kGemmOnly>(p, t, c0, sm.coef + ln.row * 24, raw_x, raw_r, rq, sq_r,
                                                              sq_z);
  }
  if constexpr (kMix) {
    const int mma_lane = ln.g * 4 + ln.tq;  // the lane of the old kernel's warp `quad` that held this row
#pragma unroll
    for (int j = 0; j < kStreams; ++j) sm.a_s[((ln.quad * 2 + ln.h) * kStreams + j) * 32 + mma_lane] = rq[j];
  }
  sq_r = __fadd_rn(sq_r, __shfl_xor_sync(0xffffffffu, sq_r, 1));
  sq_r = __fadd_rn(sq_r, __shfl_xor_sync(0xffffffffu, sq_r, 2));
  sq_z = __fadd_rn(sq_z, __shfl_xor_sync(0xffffffffu, sq_z, 1));
  sq_z = __fadd_rn(sq_z, __shfl_xor_sync(0xffffffffu, sq_z, 2));
  if (ln.tq == 0) {
    sm.red[(ln.quad * 16 + ln.row) * kFusedPartialStride + 24] = sq_r;
    sm.red[(ln.quad * 16 + ln.row) * kFusedPartialStride + 25] = sq_z;
  }
}

// Phase B of warp `warp` < 4 (quad `warp`): the old kernel's MMA chain in the old k order, A and B
// from shared memory, the 24 dots of the tile's 16 rows into red.
template <bool kFirst, bool kMix>
__device__ __forceinline__ void StagedPhaseB(const StagedTileSmem& sm, int warp, int lane) {
  constexpr int kStreams = kFirst ? 1 : 4;
  constexpr int kSteps = kStreams * 2;
  const int bq = warp;
  auto red_at = [&](int row, int q) -> float& { return sm.red[(bq * 16 + row) * kFusedPartialStride + q]; };
  if constexpr (kMix) {
    float acc[3][4];
#pragma unroll
    for (int nt = 0; nt < 3; ++nt)
#pragma unroll
      for (int q = 0; q < 4; ++q) acc[nt][q] = 0.0f;
    const uint4* fq = sm.frag_s + bq * kSteps * 3 * 32 + lane;
    const uint4* aq = sm.a_s + bq * 2 * kStreams * 32 + lane;
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
      red_at(bg, o) = acc[nt][0];
      red_at(bg, o + 1) = acc[nt][1];
      red_at(8 + bg, o) = acc[nt][2];
      red_at(8 + bg, o + 1) = acc[nt][3];
    }
  } else {
    // Head stage: no mixes; the partials' dot entries are never read, but keep them defined.
    for (int i = lane; i < 16 * 24; i += 32) red_at(i / 24, i % 24) = 0.0f;
  }
}

// The chunk partials of the tile's valid rows: the fixed-order sum of the 4 quads' values.
__device__ __forceinline__ void StagedWritePartials(const FusedParams& p, const float* red, int64_t tok_base,
                                                    int chunk, int nchunk, int ti, int nthreads) {
  for (int i = ti; i < 16 * kFusedPartialStride; i += nthreads) {
    const int r = i / kFusedPartialStride, q = i % kFusedPartialStride;
    const int64_t tt = tok_base + r;
    if (tt >= p.tokens) continue;
    auto at = [&](int quad) { return red[(quad * 16 + r) * kFusedPartialStride + q]; };
    p.partials[(tt * nchunk + chunk) * kFusedPartialStride + q] = ChunkSum(at(0), at(1), at(2), at(3));
  }
}

// Template flags as MhcFusedPassKernel's (kFirst, kShifted, kHasPre, kAux, kMix, kGemmOnly); kTiles
// m16 token tiles per CTA (256 threads each). kMinBlocks: resident CTAs per SM to budget registers for.
template <bool kFirst, bool kShifted, bool kHasPre, bool kAux, bool kMix, bool kGemmOnly, int kTiles, int kMinBlocks>
__global__ void __launch_bounds__(kStagedThreadsPerTile * kTiles, kMinBlocks) MhcStagedPassKernel(FusedParams p) {
  static_assert(!kGemmOnly || (kMix && !kShifted && !kAux), "the GEMM-only pass writes partials only");
  using Smem = StagedSmem<kFirst, kTiles>;
  constexpr int kStreams = Smem::kStreams;
  constexpr int kThreads = kStagedThreadsPerTile * kTiles;
  constexpr int kTileTokens = 16 * kTiles;

  extern __shared__ __align__(16) unsigned char smem_raw[];
  uint4* frag_s = reinterpret_cast<uint4*>(smem_raw);                 // [quad][step][nt][lane]
  uint4* a_s = frag_s + Smem::kFrag;                                   // [mt][quad][h][stream][lane]
  float* red = reinterpret_cast<float*>(a_s + Smem::kA);               // [mt][quad][row][stride]
  float* coef = red + Smem::kRed;                                      // [mt][row][24]

  const int chunk = blockIdx.y, nchunk = gridDim.y;
  const int64_t tok_base = int64_t(blockIdx.x) * kTileTokens;

  // Phase 0: the chunk's B fragments (4 consecutive quads of the host layout are contiguous). They
  // are weights, so the copy starts before GridDependencyWait, while the previous kernel on the
  // stream finishes (programmatic dependent launch).
  if constexpr (kMix) {
    const uint4* src = p.frag + size_t(chunk) * Smem::kFrag;
    for (int i = threadIdx.x; i < Smem::kFrag; i += kThreads) CpAsync16(frag_s + i, src + i);
  }
  GridDependencyWait();  // x, R and the mixes may come from the previous kernel
  LaunchDependents();    // after the wait, never before: see MhcFusedPassKernel

  const int mt = threadIdx.x / kStagedThreadsPerTile, ti = threadIdx.x % kStagedThreadsPerTile;
  const int lane = ti % 32;
  const StagedLane ln(ti);
  const int64_t mt_base = tok_base + mt * 16;
  const int64_t t = mt_base + ln.row;
  const int64_t c0 = ln.Channel(chunk);
  const StagedTileSmem sm{frag_s, a_s + mt * 4 * 2 * kStreams * 32, red + mt * 4 * 16 * kFusedPartialStride,
                          coef + mt * 16 * 24};

  uint4 raw_x = make_uint4(0, 0, 0, 0), raw_r[4];
  if (t < p.tokens) StagedLoadRow<kFirst, kGemmOnly>(p, t, c0, raw_x, raw_r);

  if constexpr (!kFirst && !kGemmOnly) {
    for (int i = threadIdx.x; i < kTileTokens * 24; i += kThreads) coef[i] = StagedCoef<kHasPre>(p, tok_base + i / 24, i % 24);
    __syncthreads();
  }

  StagedPhaseA<kFirst, kShifted, kHasPre, kAux, kMix, kGemmOnly>(p, sm, ln, t, c0, raw_x, raw_r);
  if constexpr (kMix) CpAsyncWaitAll();
  __syncthreads();

  // Phase B: warps 0..3 of each tile's 8.
  const int warp = ti / 32;
  if (warp < 4) StagedPhaseB<kFirst, kMix>(sm, warp, lane);
  __syncthreads();
  StagedWritePartials(p, sm.red, mt_base, chunk, nchunk, ti, kStagedThreadsPerTile);
}

// Persistent staged pass (large T): the same tile phases, but each CTA loads a chunk's B fragments
// (48 KB) once and loops over many 16-token tiles of that chunk, with the next tile's x, R and
// mixing coefficients loaded into registers while the current tile is computed.
//
// Why (DESIGN.md): at T >= 1024 the one-tile-per-CTA kernels reload
// their chunk's B fragments from L2 for every 16 or 32 tokens (at T = 4096, C = 7168, the staged
// pass moves more bytes from L2 for fn than from HBM for the activations) and keep only one tile's
// loads in flight per CTA, so HBM idles between a CTA's load and its stores. Here the work items
// are (chunk, tile) pairs in chunk-major order, split into equal contiguous ranges over one wave of
// CTAs: a CTA meets one or two chunks, and each item's arithmetic is the one-tile kernel's, so the
// launcher may choose either by T (batch invariance).
template <bool kFirst, bool kShifted, bool kHasPre, bool kAux, bool kMix, int kMinBlocks>
__global__ void __launch_bounds__(kStagedThreadsPerTile, kMinBlocks) MhcPersistentPassKernel(FusedParams p) {
  using Smem = StagedSmem<kFirst, 1>;
  constexpr int kThreads = kStagedThreadsPerTile;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  uint4* frag_s = reinterpret_cast<uint4*>(smem_raw);
  uint4* a_s = frag_s + Smem::kFrag;
  float* red = reinterpret_cast<float*>(a_s + Smem::kA);
  float* coef = red + Smem::kRed;
  const StagedTileSmem sm{frag_s, a_s, red, coef};

  const int ti = threadIdx.x, lane = ti % 32, warp = ti / 32;
  const StagedLane ln(ti);
  const int nchunk = int(p.C / kFusedChunkChannels);
  const int64_t ntiles = (p.tokens + 15) / 16;
  const int64_t items = ntiles * nchunk;
  const int64_t per_cta = (items + gridDim.x - 1) / gridDim.x;
  const int64_t first = int64_t(blockIdx.x) * per_cta;
  const int64_t last = first + per_cta < items ? first + per_cta : items;
  // A thread's two coefficient slots of the tile (16 rows x 24 = 384 values over 256 threads).
  constexpr int kCoefPerThread = (16 * 24 + kThreads - 1) / kThreads;

  // Item -> (chunk, first token of its tile): chunk-major.
  auto chunk_of = [&](int64_t item) { return int(item / ntiles); };
  auto tok_base_of = [&](int64_t item) { return (item % ntiles) * 16; };
  auto load_item = [&](int64_t item, uint4& rx, uint4 (&rr)[4], float (&cf)[kCoefPerThread]) {
    const int chunk = chunk_of(item);
    const int64_t tok_base = tok_base_of(item);
    const int64_t t = tok_base + ln.row;
    if (t < p.tokens) StagedLoadRow<kFirst, false>(p, t, ln.Channel(chunk), rx, rr);
    if constexpr (!kFirst) {
#pragma unroll
      for (int k = 0; k < kCoefPerThread; ++k) {
        const int i = ti + k * kThreads;
        cf[k] = i < 16 * 24 ? StagedCoef<kHasPre>(p, tok_base + i / 24, i % 24) : 0.0f;
      }
    }
  };

  GridDependencyWait();  // programmatic dependent launch: x, R and the mixes may come from the previous kernel
  LaunchDependents();    // after the wait, never before: see MhcFusedPassKernel
  uint4 raw_x = make_uint4(0, 0, 0, 0), raw_r[4];
  float cf[kCoefPerThread];
  if (first < last) load_item(first, raw_x, raw_r, cf);
  int frag_chunk = -1;
  for (int64_t item = first; item < last; ++item) {
    const int chunk = chunk_of(item);
    const int64_t tok_base = tok_base_of(item);
    // The next item's loads go out now and land while this one is computed.
    uint4 next_x = make_uint4(0, 0, 0, 0), next_r[4];
    float next_cf[kCoefPerThread];
    if (item + 1 < last) load_item(item + 1, next_x, next_r, next_cf);

    // Safe to overwrite frag_s, coef, a_s and red: every thread passed the previous item's last
    // barrier, after which only the partials' reads of red remain, and those finish before any
    // thread reaches this item's first barrier below, which precedes every write of red.
    const bool new_chunk = kMix && chunk != frag_chunk;
    if (new_chunk) {
      const uint4* src = p.frag + size_t(chunk) * Smem::kFrag;
      for (int i = ti; i < Smem::kFrag; i += kThreads) CpAsync16(frag_s + i, src + i);
      frag_chunk = chunk;
    }
    if constexpr (!kFirst) {
#pragma unroll
      for (int k = 0; k < kCoefPerThread; ++k)
        if (ti + k * kThreads < 16 * 24) coef[ti + k * kThreads] = cf[k];
    }
    __syncthreads();
    const int64_t t = tok_base + ln.row;
    StagedPhaseA<kFirst, kShifted, kHasPre, kAux, kMix, false>(p, sm, ln, t, ln.Channel(chunk), raw_x, raw_r);
    if (new_chunk) CpAsyncWaitAll();
    __syncthreads();
    if (warp < 4) StagedPhaseB<kFirst, kMix>(sm, warp, lane);
    __syncthreads();
    StagedWritePartials(p, red, tok_base, chunk, nchunk, ti, kThreads);

    raw_x = next_x;
#pragma unroll
    for (int i = 0; i < 4; ++i) raw_r[i] = next_r[i];
#pragma unroll
    for (int k = 0; k < kCoefPerThread; ++k) cf[k] = next_cf[k];
  }
}
#endif  // !FL_HIP

}  // namespace fusedlayer::gpu::mhc
