// The mHC finalize kernel, shared by both paths: reduces the split partials in a fixed order
// (split 0, 1, 2, ...), computes the mixes (sigmoid gates, Sinkhorn) and y = RMSNorm(Collapse).
//
// Grid (1-D): blocks [0, T) are "y blocks", one token each; blocks [T, T + ceil(T / mix_warps))
// are "mix blocks", one warp per token (warps 0..mix_warps-1), each running the token's ~1 us of
// serial Sinkhorn math. The two kinds run concurrently, so Sinkhorn overlaps the bandwidth work of
// the y blocks. In normal mode
// both kinds compute pre from the same partials with the same code (ComputePre), so the collapse
// uses exactly the bits written to new_pre_mix.
// Included by mhc_launch.cu only.
#pragma once

#include "device/mhc_device_math.cuh"

namespace fusedlayer::gpu::mhc {

inline constexpr int kFinalizeThreads = 256;
inline constexpr int kFinalizeWarps = kFinalizeThreads / kWarpSize;
// Blocks per SM that the large-T instances of the finalize are compiled for (__launch_bounds__): at
// large T the y blocks stream z and y (or R' and y) at a bandwidth set by how many are resident,
// and the decode instance's 128 registers (the mix warps' 64-wide split batch) allow only 2 of them
// per SM. The large-T instances batch the split loads 16 wide (same adds, same order) to fit 64
// registers at 4 blocks (rescale; ptxas spills 32 bytes at n = 4) or 85 at 3 (collapse: R' of 4
// streams per vector). Measured at C = 7168, T = 4096: 4 and 3 are the fastest (kernels/gpu/DESIGN.md).
inline constexpr int kFinalizeRescaleMinBlocks = 4;
inline constexpr int kFinalizeCollapseMinBlocks = 3;

enum class YSource : int {
  kCollapseGiven = 0,  // collapse R' with pre_mix (shifted / head), or stream 0 when pre_mix is null
  kCollapseNew = 1,    // collapse R' with the new pre mix (normal mode)
  kRescaleZ = 2,       // z is already in y (fused shifted): only rescale, sum(z^2) from the partials
};

struct FinalizeParams {
  const float* partials;   // [T, nsplit, stride]: M dots, sum R'^2, (sum z^2)
  int nsplit;
  int stride;
  float k_count;           // elements behind sum R'^2 (n*C; C in the first stage)
  const float* scale;      // [3]
  const float* base;       // [M]
  MixHyper hyper;
  bool has_mixes;          // false in the head stage
  YSource y_source;
  const float* pre_mix;    // [T, n] or null
  const uint16_t* new_residual;  // [T, n, C] (R' for the collapse)
  const uint16_t* norm_weight;   // [C] or null (y = z)
  uint16_t* y;             // [T, C]
  float* new_pre;          // [T, n]
  float* new_post;         // [T, n]
  float* new_comb;         // [T, n, n]
  int64_t tokens;
  int64_t C;
  int mix_warps;           // tokens per mix block (1..kFinalizeWarps), a launch choice: same bits
  // Let the next kernel on the stream (programmatic dependent launch: the next seam's pass) become
  // resident and fetch its weights while this one runs. The launcher sets it only for a grid small
  // enough to leave most SMs free (mhc_launch.cu, kFinalizeEarlyTriggerSmsPerBlock).
  bool launch_dependents_early;
};

__device__ __forceinline__ void WarpSync() {
#if !FL_HIP
  __syncwarp();
#endif
}

// Sum over splits in split order, from 0. Loads go out kBatch at a time (one L2 round trip per
// kBatch splits instead of one per split); the adds stay sequential, so the batch size never changes
// a bit. 64 covers every DeepSeek C on the fused path (C / 128 = 32, 40, 56 splits) in one round
// trip: the mix warp's reduction sits on the decode-size critical path, and the second round trip of
// 32-wide batches cost C = 5120 and 7168 ~1-1.3 us per call (bench_mhc_gpu, 2026-11-29). The
// large-T instance of the finalize uses 16: there the mix warps are off the critical path and the
// 64 registers of the wide batch would halve the y blocks' occupancy (kFinalizeRescaleMinBlocks).
template <int kBatch = 64>
__device__ __forceinline__ float ReduceSplits(const float* __restrict__ p, int nsplit, int stride) {
  float s = 0.0f;
  for (int i = 0; i < nsplit; i += kBatch) {
    float v[kBatch];
#pragma unroll
    for (int k = 0; k < kBatch; ++k) v[k] = i + k < nsplit ? p[(i + k) * stride] : 0.0f;
#pragma unroll
    for (int k = 0; k < kBatch; ++k)
      if (i + k < nsplit) s = __fadd_rn(s, v[k]);
  }
  return s;
}

// The mixes of one token (n = 4) on one warp, from its split partials `part` ([nsplit][stride]: 24
// dots, sum R'^2): fixed-order split reduction (one lane per output), then the Sinkhorn on every
// lane in registers (CombSinkhornRegs4) and the 8 gates on lanes 0..7, one gate per lane, in the
// same straight-line code so the scheduler can overlap the two chains (the gates used to run on
// lane 0 after the Sinkhorn). Each gate is ComputePre's / ComputePost's expression for its index,
// so new_pre_mix keeps the bits that normal mode's y blocks collapse with. `dsum` is 25 floats of
// shared memory owned by the warp. Must be called by all lanes of the warp.
template <int kSplitBatch>
__device__ __forceinline__ void MixWarp4(const float* part, int nsplit, int stride, float k_count, const float* scale,
                                         const float* base, const MixHyper& hyper, float* dsum, int64_t t,
                                         float* new_pre, float* new_post, float* new_comb, int lane) {
  constexpr int N = 4, M = N * (N + 2);
  for (int o = lane; o <= M; o += kWarpSize) dsum[o] = ReduceSplits<kSplitBatch>(part + o, nsplit, stride);
  WarpSync();
  const float r = RsqrtMean(dsum[M], k_count, hyper.hc_norm_eps);
  const int g = lane & (2 * N - 1);  // lanes 0..3: pre[g]; 4..7: post[g - 4] (others: duplicates)
  const float gate = Sigmoid(MixLogit(r, dsum[g], g < N ? scale[0] : scale[1], base[g]));
  const float gate_out = g < N ? __fadd_rn(gate, hyper.hc_pre_eps) : __fmul_rn(gate, hyper.post_scale);
  const float P = CombSinkhornRegs4(dsum, r, scale, base, hyper, lane);
  if (lane < N * N) new_comb[t * N * N + lane] = P;
  if (lane < N) new_pre[t * N + lane] = gate_out;
  else if (lane < 2 * N) new_post[t * N + lane - N] = gate_out;
  WarpSync();  // dsum may be reused by the warp's next token
}

// kMinBlocks: 2 (decode sizes: the mix chain's latency first, one L2 round trip for the splits) or
// more (large T: occupancy first). Same arithmetic, same bits.
template <int N, bool kVec, int kMinBlocks>
__global__ void __launch_bounds__(kFinalizeThreads, kMinBlocks) MhcFinalizeKernel(FinalizeParams p) {
  constexpr int M = N * (N + 2);
  constexpr int kSplitBatch = kMinBlocks > 2 ? 16 : 64;
  __shared__ float dsum[kFinalizeWarps][M + 1];
  __shared__ float pre_s[N];
  __shared__ float rho_s;
  extern __shared__ float dyn[];  // y blocks: [nvec] vec sums, then [nchunk] chunk sums

  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const int64_t T = p.tokens, C = p.C;
  // Launched with programmatic dependent launch, so this block may start while the pass still
  // runs. The decode instance first fetches the weights it reads after the wait: a y block warms L2
  // with norm_weight; a mix block copies scale and base into shared memory, so the gates and the
  // Sinkhorn logits, on the decode-size critical path, read them there instead of from L2 after
  // the split reduction. The large-T instances do neither (thousands of blocks would only repeat
  // L2 hits, and there the mix warps are off the critical path). Then wait for the pass's writes,
  // and only then let the next kernel in (a trigger before the wait chains: see MhcFusedPassKernel).
  __shared__ float mix_weights_s[3 + M];  // scale[3], base[M] (decode instance, mix blocks)
  const float* scale = p.scale;
  const float* base = p.base;
  if constexpr (kMinBlocks == 2) {
    if (int64_t(blockIdx.x) < T) {
      if (p.norm_weight != nullptr) {
        const unsigned char* g = reinterpret_cast<const unsigned char*>(p.norm_weight);
        for (int64_t l = threadIdx.x; l < (C * 2 + 127) / 128; l += kFinalizeThreads) PrefetchWeightL2(g + l * 128);
      }
    } else if (p.has_mixes) {
      if (threadIdx.x < 3 + M) mix_weights_s[threadIdx.x] = threadIdx.x < 3 ? p.scale[threadIdx.x] : p.base[threadIdx.x - 3];
      __syncthreads();
      scale = mix_weights_s;
      base = mix_weights_s + 3;
    }
  }
  GridDependencyWait();
  // Only the decode instance may trigger early (the launcher asks for it only for grids of a few
  // dozen blocks, far below the large-T instances' threshold). Keeping the branch out of the
  // large-T instances keeps their code as it was: with it, the normal-mode collapse instance ran
  // 3-4% slower in ncu at T = 4096 with the same registers.
  if constexpr (kMinBlocks == 2) {
    if (p.launch_dependents_early) LaunchDependents();
  }

  if (int64_t(blockIdx.x) >= T) {
    // ---- mix block: one warp per token ----
    const int64_t t = (int64_t(blockIdx.x) - T) * p.mix_warps + warp;
    if (warp >= p.mix_warps || t >= T) return;
    const float* part = p.partials + t * p.nsplit * p.stride;
    if constexpr (N == 4 && kWarpSize >= 16) {
      // The whole warp runs the Sinkhorn (CombSinkhornRegs4) and the gates.
      MixWarp4<kSplitBatch>(part, p.nsplit, p.stride, p.k_count, scale, base, p.hyper, dsum[warp], t, p.new_pre,
                            p.new_post, p.new_comb, lane);
    } else {
      for (int o = lane; o <= M; o += kWarpSize)
        dsum[warp][o] = ReduceSplits<kSplitBatch>(part + o, p.nsplit, p.stride);
      WarpSync();
      if (lane == 0) {
        float pre[N], post[N], comb[N * N];
        ComputePre<N>(dsum[warp], dsum[warp][M], p.k_count, scale, base, p.hyper, pre);
        ComputePostComb<N>(dsum[warp], dsum[warp][M], p.k_count, scale, base, p.hyper, post, comb);
#pragma unroll
        for (int j = 0; j < N; ++j) {
          p.new_pre[t * N + j] = pre[j];
          p.new_post[t * N + j] = post[j];
        }
#pragma unroll
        for (int i = 0; i < N * N; ++i) p.new_comb[t * N * N + i] = comb[i];
      }
    }
    return;
  }

  // ---- y block: token t ----
  const int64_t t = blockIdx.x;
  const int64_t nvec = (C + 7) / 8;
  const int64_t nchunk = (C + 127) / 128;
  float* vsum = dyn;
  float* csum = dyn + nvec;
  uint16_t* yt = p.y + t * C;
  const float* part = p.partials + t * p.nsplit * p.stride;

  if (p.y_source == YSource::kRescaleZ) {
    if (p.norm_weight == nullptr) return;  // y is the un-normalised collapse, already written
    // Stage the per-split sums in shared memory with one load per thread (one round trip), then
    // add them in split order on one thread.
    for (int i = threadIdx.x; i < p.nsplit; i += kFinalizeThreads) vsum[i] = part[int64_t(i) * p.stride + M + 1];
    __syncthreads();
    if (threadIdx.x == 0) {
      float s = 0.0f;
      for (int i = 0; i < p.nsplit; ++i) s = __fadd_rn(s, vsum[i]);
      rho_s = RsqrtMean(s, float(C), p.hyper.norm_eps);
    }
    __syncthreads();
  } else {
    float coef[N];
    bool stream0 = false;
    if (p.y_source == YSource::kCollapseNew) {
      if (warp == 0) {
        for (int o = lane; o <= M; o += kWarpSize)
          if (o < N || o == M) dsum[0][o] = ReduceSplits<kSplitBatch>(part + o, p.nsplit, p.stride);
        WarpSync();
        if (lane == 0) ComputePre<N>(dsum[0], dsum[0][M], p.k_count, p.scale, p.base, p.hyper, pre_s);
      }
      __syncthreads();
#pragma unroll
      for (int j = 0; j < N; ++j) coef[j] = pre_s[j];
    } else if (p.pre_mix != nullptr) {
#pragma unroll
      for (int j = 0; j < N; ++j) coef[j] = p.pre_mix[t * N + j];
    } else {
      stream0 = true;
#pragma unroll
      for (int j = 0; j < N; ++j) coef[j] = 0.0f;
    }
    const uint16_t* rt = p.new_residual + t * N * C;
    // G vecs per thread per iteration with every load issued before the first use: the loop body
    // is latency-bound at decode sizes, and the compiler cannot hoist loads past the y stores. The
    // loads are held as loaded (Bf16x8) until used.
    constexpr int G = N <= 2 ? 4 : (N <= 4 ? 2 : 1);
    for (int64_t base = threadIdx.x; base < nvec; base += int64_t(G) * kFinalizeThreads) {
      Bf16x8<kVec> r[G][N];
#pragma unroll
      for (int k = 0; k < G; ++k) {
        const int64_t v = base + int64_t(k) * kFinalizeThreads;
        const int64_t c0 = v * 8;
        const int count = v < nvec ? int(C - c0 < 8 ? C - c0 : 8) : 0;
        if (count == 0) continue;
#pragma unroll
        for (int j = 0; j < N; ++j)
          if (j == 0 || !stream0) r[k][j] = Load8Raw<kVec>(rt + j * C + c0, count);
      }
#pragma unroll
      for (int k = 0; k < G; ++k) {
        const int64_t v = base + int64_t(k) * kFinalizeThreads;
        if (v >= nvec) continue;
        const int64_t c0 = v * 8;
        const int count = int(C - c0 < 8 ? C - c0 : 8);
        float z[8];
        if (stream0) {
          Widen8<kVec>(r[k][0], z);
        } else {
          float rf[N][8];
#pragma unroll
          for (int j = 0; j < N; ++j) Widen8<kVec>(r[k][j], rf[j]);
#pragma unroll
          for (int e = 0; e < 8; ++e) {
            float col[N];
#pragma unroll
            for (int j = 0; j < N; ++j) col[j] = rf[j][e];
            z[e] = e < count ? CollapseElement<N>(col, coef) : 0.0f;
          }
        }
        Store8<kVec>(yt + c0, count, z);
        vsum[v] = VecSumSq(z);
      }
    }
    if (p.norm_weight == nullptr) return;
    __syncthreads();
    for (int64_t k = threadIdx.x; k < nchunk; k += kFinalizeThreads) {
      float q[4];
#pragma unroll
      for (int qq = 0; qq < 4; ++qq) {
        const int64_t v0 = (k * 4 + qq) * 4;
        float pv[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) pv[i] = v0 + i < nvec ? vsum[v0 + i] : 0.0f;
        q[qq] = QuadSum(pv[0], pv[1], pv[2], pv[3]);
      }
      csum[k] = ChunkSum(q[0], q[1], q[2], q[3]);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      float s = 0.0f;
      for (int64_t k = 0; k < nchunk; ++k) s = __fadd_rn(s, csum[k]);
      rho_s = RsqrtMean(s, float(C), p.hyper.norm_eps);
    }
    __syncthreads();
  }

  // Normalise in place: each thread rescales the vecs it (or the fused pass) wrote; 4 vecs per
  // iteration, loads first (see above).
  const float rho = rho_s;
  constexpr int G2 = 4;
  for (int64_t base = threadIdx.x; base < nvec; base += int64_t(G2) * kFinalizeThreads) {
    Bf16x8<kVec> zr[G2], gr[G2];
#pragma unroll
    for (int k = 0; k < G2; ++k) {
      const int64_t v = base + int64_t(k) * kFinalizeThreads;
      if (v >= nvec) continue;
      const int64_t c0 = v * 8;
      const int count = int(C - c0 < 8 ? C - c0 : 8);
      zr[k] = Load8Raw<kVec>(yt + c0, count);
      gr[k] = Load8Raw<kVec>(p.norm_weight + c0, count);
    }
#pragma unroll
    for (int k = 0; k < G2; ++k) {
      const int64_t v = base + int64_t(k) * kFinalizeThreads;
      if (v >= nvec) continue;
      const int64_t c0 = v * 8;
      const int count = int(C - c0 < 8 ? C - c0 : 8);
      float z[8], gw[8];
      Widen8<kVec>(zr[k], z);
      Widen8<kVec>(gr[k], gw);
#pragma unroll
      for (int e = 0; e < 8; ++e) z[e] = NormElement(z[e], rho, gw[e]);
      Store8<kVec>(yt + c0, count, z);
    }
  }
}

}  // namespace fusedlayer::gpu::mhc
