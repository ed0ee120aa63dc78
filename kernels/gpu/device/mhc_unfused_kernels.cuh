// Unfused mHC kernels (every n in 1..8, every C): the chain vLLM runs as separate passes.
//   MhcPostKernel      R' = Post(x, R, post, comb) (+ aux), elementwise over 8-channel vecs.
//   MhcBroadcastKernel first stage: R_0 = e on every stream.
//   MhcMixesKernel     per-split partials of the mixes GEMM and of sum(R'^2) (split over C by a
//                      function of C only; fp32 FMA), reduced in fixed order by MhcFinalizeKernel.
// Included by mhc_launch.cu only.
#pragma once

#include "device/mhc_device_math.cuh"

namespace fusedlayer::gpu::mhc {

struct PostParams {
  const uint16_t* x;          // [T, C]
  const uint16_t* residual;   // [T, n, C]
  const float* post_mix;      // [T, n]
  const float* comb_mix;      // [T, n, n]
  uint16_t* new_residual;     // [T, n, C]
  uint16_t* aux;              // [T, C] or null
  int64_t tokens;
  int64_t C;
};

template <int N, bool kVec>
__global__ void __launch_bounds__(256) MhcPostKernel(PostParams p) {
  const int64_t nvec = (p.C + 7) / 8;
  const int64_t total = p.tokens * nvec;
  for (int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = idx / nvec;
    const int64_t c0 = (idx - t * nvec) * 8;
    const int count = int(p.C - c0 < 8 ? p.C - c0 : 8);
    float post[N], comb[N][N];
#pragma unroll
    for (int j = 0; j < N; ++j) post[j] = p.post_mix[t * N + j];
#pragma unroll
    for (int i = 0; i < N; ++i)
#pragma unroll
      for (int j = 0; j < N; ++j) comb[j][i] = p.comb_mix[(t * N + i) * N + j];  // comb[j][i]: column j
    float x[8], r[N][8];
    Load8<kVec>(p.x + t * p.C + c0, count, x);
#pragma unroll
    for (int i = 0; i < N; ++i) Load8<kVec>(p.residual + (t * N + i) * p.C + c0, count, r[i]);
    float out[N][8];
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      float col[N];
#pragma unroll
      for (int i = 0; i < N; ++i) col[i] = r[i][e];
#pragma unroll
      for (int j = 0; j < N; ++j) out[j][e] = PostElement<N>(x[e], col, post[j], comb[j]);
    }
#pragma unroll
    for (int j = 0; j < N; ++j) Store8<kVec>(p.new_residual + (t * N + j) * p.C + c0, count, out[j]);
    if (p.aux != nullptr) {
      float a[8];
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        float col[N];
#pragma unroll
        for (int j = 0; j < N; ++j) col[j] = out[j][e];
        a[e] = AuxElement<N>(col);
      }
      Store8<kVec>(p.aux + t * p.C + c0, count, a);
    }
  }
}

// new_residual[t][j][c] = e[t][c] for every stream j (bit copy).
__global__ void __launch_bounds__(256) MhcBroadcastKernel(const uint16_t* __restrict__ e, uint16_t* __restrict__ out,
                                                          int64_t tokens, int n, int64_t C) {
  const int64_t total = tokens * n * C;
  for (int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += int64_t(gridDim.x) * blockDim.x) {
    const int64_t c = idx % C;
    const int64_t t = idx / (int64_t(n) * C);
    out[idx] = e[t * C + c];
  }
}

// Width (channels) of one split of the unfused mixes GEMM: a function of C only (batch invariance).
inline constexpr int kMixSplitChannels = 512;
inline constexpr int kMixThreads = 256;

// Tokens per CTA: enough accumulators to reuse each fn load several times, few enough to stay in
// registers (TT * M <= 96).
__host__ __device__ constexpr int MixTokensPerCta(int m) {
  return 96 / m < 1 ? 1 : (96 / m > 8 ? 8 : 96 / m);
}

struct MixesParams {
  const uint16_t* residual;  // R' (seam) or e (first), streams `stream_stride` elements apart
  int64_t token_stride;      // elements between tokens (n*C for R', C for e)
  int64_t stream_stride;     // C
  const float* fn_t;         // fp32 [NS*C, M] (first stage: fn summed over streams, [C, M])
  float* partials;           // [T, nsplit, M + 1]
  int64_t tokens;
  int64_t C;
  int nsplit;
};

// One CTA: split s (channels [s*512, s*512+512) of every stream) of TT tokens. Thread l owns the
// channels l and l+256 of the split; its k order is fixed, then a warp butterfly and a sequential
// sum over warps: the order depends on C only, never on T or the token's position.
template <int NS, int M, int TT>
__global__ void __launch_bounds__(kMixThreads) MhcMixesKernel(MixesParams p) {
  constexpr int kWarps = kMixThreads / kWarpSize;
  __shared__ float red[kWarps][TT][M + 1];
  const int split = blockIdx.x;
  const int64_t t0 = int64_t(blockIdx.y) * TT;
  float acc[TT][M + 1];
#pragma unroll
  for (int tt = 0; tt < TT; ++tt)
#pragma unroll
    for (int o = 0; o <= M; ++o) acc[tt][o] = 0.0f;
  const int64_t c_begin = int64_t(split) * kMixSplitChannels;
  const int64_t c_end = c_begin + kMixSplitChannels < p.C ? c_begin + kMixSplitChannels : p.C;
  for (int64_t c = c_begin + threadIdx.x; c < c_end; c += kMixThreads) {
#pragma unroll
    for (int j = 0; j < NS; ++j) {
      const float* f = p.fn_t + (j * p.C + c) * M;
      float fv[M];
#pragma unroll
      for (int o = 0; o < M; ++o) fv[o] = f[o];
#pragma unroll
      for (int tt = 0; tt < TT; ++tt) {
        const int64_t t = t0 + tt;
        const float v = t < p.tokens ? Bf16ToFloat(p.residual[t * p.token_stride + j * p.stream_stride + c]) : 0.0f;
#pragma unroll
        for (int o = 0; o < M; ++o) acc[tt][o] = __fmaf_rn(v, fv[o], acc[tt][o]);
        acc[tt][M] = __fmaf_rn(v, v, acc[tt][M]);
      }
    }
  }
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
#pragma unroll
  for (int tt = 0; tt < TT; ++tt)
#pragma unroll
    for (int o = 0; o <= M; ++o) {
      float v = acc[tt][o];
#pragma unroll
      for (int m = kWarpSize / 2; m > 0; m >>= 1) v = __fadd_rn(v, ShflXor(v, m));
      if (lane == 0) red[warp][tt][o] = v;
    }
  __syncthreads();
  for (int i = threadIdx.x; i < TT * (M + 1); i += kMixThreads) {
    const int tt = i / (M + 1), o = i % (M + 1);
    const int64_t t = t0 + tt;
    if (t >= p.tokens) continue;
    float s = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) s = __fadd_rn(s, red[w][tt][o]);
    p.partials[(t * p.nsplit + split) * (M + 1) + o] = s;
  }
}

}  // namespace fusedlayer::gpu::mhc
