// Device building blocks of the mHC seam shared by the fused and unfused kernels. Every rounding
// and every reduction order that the contract (spec/mhc.md) fixes is written once here, so the two
// paths agree bit for bit where the contract asks it (new_residual, shifted-mode y).
//
// Arithmetic is spelled with the _rn intrinsics: they forbid FMA contraction, so the compiler
// cannot fuse a multiply into an add differently in two inlining contexts.
#pragma once

#include <cstdint>

// gpu_runtime.h first: under hipcc, numeric.h's device branch needs the HIP intrinsics declared.
#include "gpu_runtime.h"
#include "fusedlayer/numeric.h"
#if !FL_HIP
#include <cuda_bf16.h>
#endif

namespace fusedlayer::gpu::mhc {

// Hyper-parameters as the kernels need them (MhcHyperParams without the shape).
struct MixHyper {
  float hc_norm_eps;
  float norm_eps;
  float hc_pre_eps;
  float sinkhorn_eps;
  float post_scale;
  int sinkhorn_iters;
};

// Entries of one split partial: M dot products, sum of squares of R', sum of squares of the
// shifted collapse z (fused shifted mode only).
__host__ __device__ constexpr int PartialStride(int m, bool with_zsq) { return m + 1 + (with_zsq ? 1 : 0); }

// ---- bf16 rounding and vectors ------------------------------------------------------------------------
// float(bf16_rne(f)). On CUDA the hardware conversion (cvt.rn.bf16.f32 / .bf16x2) replaces the
// integer sequence of numeric.h: bitwise identical for every non-NaN input (both round to nearest
// even, overflow to inf); a NaN comes out as the canonical 0x7fff instead of sign|0x7fc0. The post
// arithmetic is issue-bound at decode sizes, and this halves its instruction count. The GPU tests
// check the bits against numeric.h on random data with outliers.
__device__ __forceinline__ float RoundBf16(float f) {
#if FL_HIP
  return RoundToBf16(f);
#else
  return __uint_as_float(uint32_t(__bfloat16_as_ushort(__float2bfloat16_rn(f))) << 16);
#endif
}
__device__ __forceinline__ float Bf16Lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float Bf16Hi(uint32_t w) { return __uint_as_float(w & 0xffff0000u); }
__device__ __forceinline__ uint32_t PackBf16x2(float lo, float hi) {
#if FL_HIP
  return uint32_t(FloatToBf16(lo)) | (uint32_t(FloatToBf16(hi)) << 16);
#else
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);  // .x = lo in the low half
  return *reinterpret_cast<const uint32_t*>(&v);
#endif
}
__device__ __forceinline__ void Unpack8(const uint4& v, float f[8]) {
  f[0] = Bf16Lo(v.x); f[1] = Bf16Hi(v.x); f[2] = Bf16Lo(v.y); f[3] = Bf16Hi(v.y);
  f[4] = Bf16Lo(v.z); f[5] = Bf16Hi(v.z); f[6] = Bf16Lo(v.w); f[7] = Bf16Hi(v.w);
}
__device__ __forceinline__ uint4 Pack8(const float f[8]) {
  return make_uint4(PackBf16x2(f[0], f[1]), PackBf16x2(f[2], f[3]), PackBf16x2(f[4], f[5]), PackBf16x2(f[6], f[7]));
}

// Eight consecutive bf16 values starting at p, `count` (1..8) of them valid; missing ones read 0.
// kVec: p is 16-byte aligned and count == 8.
template <bool kVec>
__device__ __forceinline__ void Load8(const uint16_t* __restrict__ p, int count, float f[8]) {
  if constexpr (kVec) {
    Unpack8(*reinterpret_cast<const uint4*>(p), f);
  } else {
#pragma unroll
    for (int e = 0; e < 8; ++e) f[e] = e < count ? Bf16ToFloat(p[e]) : 0.0f;
  }
}
// Eight bf16 values held as loaded until they are used: the 16 bytes in 4 registers (kVec), or,
// for scalar loads, already widened. Kernels that keep several vectors of loads in flight use this
// instead of Load8, so each vector in flight costs 4 registers, not 8 (Widen8 gives the floats).
template <bool kVec>
struct Bf16x8 {
  float f[8];
};
template <>
struct Bf16x8<true> {
  uint4 v;
};
template <bool kVec>
__device__ __forceinline__ Bf16x8<kVec> Load8Raw(const uint16_t* __restrict__ p, int count) {
  Bf16x8<kVec> r;
  if constexpr (kVec) {
    r.v = *reinterpret_cast<const uint4*>(p);
  } else {
    Load8<false>(p, count, r.f);
  }
  return r;
}
template <bool kVec>
__device__ __forceinline__ void Widen8(const Bf16x8<kVec>& r, float f[8]) {
  if constexpr (kVec) {
    Unpack8(r.v, f);
  } else {
#pragma unroll
    for (int e = 0; e < 8; ++e) f[e] = r.f[e];
  }
}
template <bool kVec>
__device__ __forceinline__ void Store8(uint16_t* __restrict__ p, int count, const float f[8]) {
  if constexpr (kVec) {
    *reinterpret_cast<uint4*>(p) = Pack8(f);
  } else {
#pragma unroll
    for (int e = 0; e < 8; ++e)
      if (e < count) p[e] = FloatToBf16(f[e]);
  }
}

// ---- elementwise stages ---------------------------------------------------------------------------
// Post for destination stream j: v = x*post[j]; v = fma(R[i], comb[i][j], v) for i = 0..n-1; one
// bf16 rounding. Returns float(bf16_rne(v)).
template <int N>
__device__ __forceinline__ float PostElement(float x, const float (&r)[N], float post_j, const float (&comb_col)[N]) {
  float v = __fmul_rn(x, post_j);
#pragma unroll
  for (int i = 0; i < N; ++i) v = __fmaf_rn(r[i], comb_col[i], v);
  return RoundBf16(v);
}

// Collapse: z = bf16_rne(sum_j p[j] * R'[j]), fma in j order starting from 0.
template <int N>
__device__ __forceinline__ float CollapseElement(const float (&r)[N], const float (&p)[N]) {
  float z = 0.0f;
#pragma unroll
  for (int j = 0; j < N; ++j) z = __fmaf_rn(p[j], r[j], z);
  return RoundBf16(z);
}

// aux = bf16_rne((sum_j R'[j]) / n), summed in j order from 0.
template <int N>
__device__ __forceinline__ float AuxElement(const float (&r)[N]) {
  float s = 0.0f;
#pragma unroll
  for (int j = 0; j < N; ++j) s = __fadd_rn(s, r[j]);
  return RoundBf16(__fdiv_rn(s, float(N)));
}

// ---- the canonical order of the collapse's sum of squares -------------------------------------------
// Sum over c of z[c]^2, in an order fixed by C alone and shared by every kernel that computes it:
//   vec  v (channels 8v..8v+7): p_v = fma(z, z, p) over the channels in order, from 0;
//   quad q (vecs 4q..4q+3):     (p0 + p1) + (p2 + p3);
//   chunk k (quads 4k..4k+3):   ((q0 + q1) + q2) + q3;
//   total: chunks added in order, from 0.
// Missing vecs / quads at the end of C count as +0 (adding +0 to a sum of squares is exact).
__device__ __forceinline__ float VecSumSq(const float z[8]) {
  float p = 0.0f;
#pragma unroll
  for (int e = 0; e < 8; ++e) p = __fmaf_rn(z[e], z[e], p);
  return p;
}
__device__ __forceinline__ float QuadSum(float p0, float p1, float p2, float p3) {
  return __fadd_rn(__fadd_rn(p0, p1), __fadd_rn(p2, p3));
}
__device__ __forceinline__ float ChunkSum(float q0, float q1, float q2, float q3) {
  return __fadd_rn(__fadd_rn(__fadd_rn(q0, q1), q2), q3);
}

// RMSNorm scale: 1 / sqrt(sum / count + eps), IEEE-rounded at every step.
__device__ __forceinline__ float RsqrtMean(float sum, float count, float eps) {
  return __frcp_rn(__fsqrt_rn(__fadd_rn(__fdiv_rn(sum, count), eps)));
}
// y = bf16_rne((z * rho) * g).
__device__ __forceinline__ float NormElement(float z, float rho, float g) { return __fmul_rn(__fmul_rn(z, rho), g); }

// ---- mixes ----------------------------------------------------------------------------------------
// Reciprocal for the Sinkhorn normalisations, whose 2*iters dependent steps are the serial floor of
// the mixes. On CUDA the bare MUFU approximation (rel. error < 2^-22, deterministic) instead of the
// correctly rounded rcp.rn sequence: it shortens each step's dependency chain, and the error stays
// far inside the mixes tolerance (1e-5 + 1e-4|ref|) after 40 steps. Every kernel uses this one
// function, so the paths still agree bit for bit.
__device__ __forceinline__ float SinkhornRcp(float x) {
#if FL_HIP
  return __frcp_rn(x);
#else
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
#endif
}

// exp of the Sinkhorn's first step (a row's logits minus their maximum, so x <= 0). On CUDA the
// MUFU exp2 approximation after one multiply by log2(e) (__expf: at most 2 + floor(1.173|x|) ulp, a
// relative error that matters only where exp(x) is negligible beside the row's 1) instead of
// expf's range-reduced sequence. With the row's normalisation by one SinkhornRcp instead of four
// IEEE divisions (each a branch to a slow path), the first step lost 16 branch regions from the mix
// warp's serial chain: the seam -0.4..-0.5 us at every C for T <= 128 on an H100, and it stays
// far inside the mixes tolerance, as the later steps do. The gates keep expf and a correctly
// rounded 1 / x (Sigmoid): pre is collapsed into normal mode's y.
__device__ __forceinline__ float SinkhornExp(float x) {
#if FL_HIP
  return expf(x);
#else
  return __expf(x);
#endif
}

// 1 / (1 + exp(-a)) as the correctly rounded reciprocal: the same bits as the IEEE division
// 1.0f / x (checked for all 2^32 inputs on an H100: bench/experiments/rcp_vs_div_check) with a
// shorter sequence on the gates' chain (the seam -0.03..-0.14 us at T <= 128 on an H100).
__device__ __forceinline__ float Sigmoid(float a) { return __frcp_rn(__fadd_rn(1.0f, expf(-a))); }

// a[o] = (r * d[o]) * alpha[g(o)] + b[o].
__device__ __forceinline__ float MixLogit(float r, float d, float alpha, float b) {
  return __fadd_rn(__fmul_rn(__fmul_rn(r, d), alpha), b);
}

// pre[j] from the reduced dot products d[0..N-1] and the sum of squares S over K elements. Used by
// both the kernel that writes new_pre_mix and the one that collapses with it (normal mode), so the
// two see the same bits.
template <int N>
__device__ __forceinline__ void ComputePre(const float* d, float S, float K, const float* scale, const float* base,
                                           const MixHyper& h, float* pre) {
  const float r = RsqrtMean(S, K, h.hc_norm_eps);
  const float alpha = scale[0];
#pragma unroll
  for (int j = 0; j < N; ++j) pre[j] = __fadd_rn(Sigmoid(MixLogit(r, d[j], alpha, base[j])), h.hc_pre_eps);
}

// post[j] = sigmoid(a[n + j]) * post_scale.
template <int N>
__device__ __forceinline__ void ComputePost(const float* d, float S, float K, const float* scale, const float* base,
                                            const MixHyper& h, float* post) {
  const float r = RsqrtMean(S, K, h.hc_norm_eps);
#pragma unroll
  for (int j = 0; j < N; ++j) post[j] = __fmul_rn(Sigmoid(MixLogit(r, d[N + j], scale[1], base[N + j])), h.post_scale);
}

// comb for n = 4 on every lane of a warp, in registers (each lane runs the whole 4 x 4 Sinkhorn;
// the caller stores lane l's P[l / 4][l % 4], lanes 16..31 mirror 0..15). The order of every
// operation is the one of the xor-butterfly version this replaced (bench/experiments/sinkhorn_bits_check):
// row sums (P[i][0] + P[i][1]) + (P[i][2] + P[i][3]), column sums (P[0][j] + P[1][j]) + (P[2][j] +
// P[3][j]), row max max(max(a, b), max(c, d)); IEEE add and fmaxf commute, so each lane of the
// butterfly held exactly these bits. Why registers: a butterfly normalisation is 2 dependent
// shuffles (~25 cycles each) + adds + rcp + mul, ~80 cycles, and the 2 * sinkhorn_iters of them
// were the longest serial chain of the finalize kernel at decode sizes; without shuffles a
// normalisation is 3 adds, a MUFU rcp and a mul (~35 cycles, 36 instructions per lane).
// `r` = RsqrtMean(S, K, hc_norm_eps).
__device__ __forceinline__ float CombSinkhornRegs4(const float* d, float r, const float* scale, const float* base,
                                                   const MixHyper& h, int lane) {
  constexpr int N = 4;
  float P[N][N];
#pragma unroll
  for (int i = 0; i < N; ++i) {
#pragma unroll
    for (int j = 0; j < N; ++j) P[i][j] = MixLogit(r, d[2 * N + N * i + j], scale[2], base[2 * N + N * i + j]);
    const float mx = fmaxf(fmaxf(P[i][0], P[i][1]), fmaxf(P[i][2], P[i][3]));
#pragma unroll
    for (int j = 0; j < N; ++j) P[i][j] = SinkhornExp(__fsub_rn(P[i][j], mx));
    const float s = __fadd_rn(__fadd_rn(P[i][0], P[i][1]), __fadd_rn(P[i][2], P[i][3]));
    const float inv = SinkhornRcp(s);
#pragma unroll
    for (int j = 0; j < N; ++j) P[i][j] = __fadd_rn(__fmul_rn(P[i][j], inv), h.sinkhorn_eps);
  }
  auto column_step = [&] {
#pragma unroll
    for (int j = 0; j < N; ++j) {
      const float c = __fadd_rn(__fadd_rn(P[0][j], P[1][j]), __fadd_rn(P[2][j], P[3][j]));
      const float inv = SinkhornRcp(__fadd_rn(c, h.sinkhorn_eps));
#pragma unroll
      for (int i = 0; i < N; ++i) P[i][j] = __fmul_rn(P[i][j], inv);
    }
  };
  column_step();
  for (int it = 1; it < h.sinkhorn_iters; ++it) {
#pragma unroll
    for (int i = 0; i < N; ++i) {
      const float rs = __fadd_rn(__fadd_rn(P[i][0], P[i][1]), __fadd_rn(P[i][2], P[i][3]));
      const float inv = SinkhornRcp(__fadd_rn(rs, h.sinkhorn_eps));
#pragma unroll
      for (int j = 0; j < N; ++j) P[i][j] = __fmul_rn(P[i][j], inv);
    }
    column_step();
  }
  // Lane l's element without a dynamically indexed register array (which would go to local memory).
  const int li = (lane >> 2) & 3, lj = lane & 3;
  float out = P[0][0];
#pragma unroll
  for (int i = 0; i < N; ++i)
#pragma unroll
    for (int j = 0; j < N; ++j)
      if (i == li && j == lj) out = P[i][j];
  return out;
}

// post[j] and comb = Sinkhorn(rowwise softmax(L) + eps), spec/mhc.md "Mix". One thread, registers.
// Each normalisation multiplies by one reciprocal (SinkhornRcp) instead of dividing every element:
// the n^2 IEEE divisions per step (a multi-instruction sequence each) made the 2*iters steps cost
// ~25 us of serial latency.
template <int N>
__device__ __forceinline__ void ComputePostComb(const float* d, float S, float K, const float* scale,
                                                const float* base, const MixHyper& h, float* post, float* comb) {
  const float r = RsqrtMean(S, K, h.hc_norm_eps);
#pragma unroll
  for (int j = 0; j < N; ++j) post[j] = __fmul_rn(Sigmoid(MixLogit(r, d[N + j], scale[1], base[N + j])), h.post_scale);
  float P[N][N];
#pragma unroll
  for (int i = 0; i < N; ++i) {
    float mx = -INFINITY;
#pragma unroll
    for (int j = 0; j < N; ++j) {
      P[i][j] = MixLogit(r, d[2 * N + N * i + j], scale[2], base[2 * N + N * i + j]);
      mx = fmaxf(mx, P[i][j]);
    }
    float s = 0.0f;
#pragma unroll
    for (int j = 0; j < N; ++j) {
      P[i][j] = SinkhornExp(__fsub_rn(P[i][j], mx));
      s = __fadd_rn(s, P[i][j]);
    }
    const float inv = SinkhornRcp(s);
#pragma unroll
    for (int j = 0; j < N; ++j) P[i][j] = __fadd_rn(__fmul_rn(P[i][j], inv), h.sinkhorn_eps);
  }
  auto column_step = [&] {
#pragma unroll
    for (int j = 0; j < N; ++j) {
      float s = 0.0f;
#pragma unroll
      for (int i = 0; i < N; ++i) s = __fadd_rn(s, P[i][j]);
      const float inv = SinkhornRcp(__fadd_rn(s, h.sinkhorn_eps));
#pragma unroll
      for (int i = 0; i < N; ++i) P[i][j] = __fmul_rn(P[i][j], inv);
    }
  };
  column_step();
  for (int it = 1; it < h.sinkhorn_iters; ++it) {
#pragma unroll
    for (int i = 0; i < N; ++i) {
      float s = 0.0f;
#pragma unroll
      for (int j = 0; j < N; ++j) s = __fadd_rn(s, P[i][j]);
      const float inv = SinkhornRcp(__fadd_rn(s, h.sinkhorn_eps));
#pragma unroll
      for (int j = 0; j < N; ++j) P[i][j] = __fmul_rn(P[i][j], inv);
    }
    column_step();
  }
#pragma unroll
  for (int i = 0; i < N; ++i)
#pragma unroll
    for (int j = 0; j < N; ++j) comb[i * N + j] = P[i][j];
}

}  // namespace fusedlayer::gpu::mhc
