// SWA q/kv RMSNorm + q FP8 1x128 group quant kernels (spec/swa.md), one source for CUDA and HIP.
//
// Work split (both the fused kernel and the unfused norm step): a team of kRowTeam = 32 threads owns
// one token row. The row is cut into 16-byte chunks of 8 bf16; chunk c of a half belongs to lane
// c % 32, so each load instruction of the team reads 512 contiguous bytes. For the q half, the 16
// chunks of quant group g sit on 16 consecutive lanes (chunk c = lane + 32 k: lanes 0..15 hold
// group 2k, lanes 16..31 group 2k + 1), so the group amax is a 4-step butterfly over 16 lanes, in
// registers, with no shared memory and no barrier. A team is a warp on NVIDIA and half a
// wavefront on CDNA; every shuffle names its width, nothing assumes 32-lane warps.
//
// For rows up to Q <= 2048 and D <= 1024 (all DeepSeek shapes) the row stays in registers between
// the sum of squares and the output pass, so HBM is read once; wider rows are re-read (streamed)
// in the second pass. At small M (<= 2 rows per SM) a "wide" variant gives each row a 128-thread
// block instead, shortening the per-row instruction chain that dominates there.
// All variants add the squares in one fixed tree (ChunkSq), which depends on the row width only:
// results are batch invariant and bitwise identical across the variants, and kv is bitwise equal
// between the fused and unfused paths. Measurements: bench/gpu/SWA_GPU_RESULTS.md.
// The runtime header first: under hipcc it provides the intrinsics numeric.h uses.
#include "gpu_runtime.h"
#include "swa_kernels.h"

#include <cstdint>

#include "fusedlayer/numeric.h"

#if !FL_HIP
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#endif

namespace fusedlayer::gpu {
namespace {

constexpr int kRowTeam = 32;         // threads per token row
constexpr int kChunk = 8;            // bf16 elements per 16-byte access
constexpr int kGroup = 128;          // quant group (spec: 1x128)
constexpr int kGroupLanes = kGroup / kChunk;  // 16 lanes share one group
constexpr int kMaxResidentQChunks = 8;        // Q <= 8 * 32 * 8 = 2048 kept in registers
constexpr int kMaxResidentDChunks = 4;        // D <= 4 * 32 * 8 = 1024
static_assert(kWarpSize % kRowTeam == 0, "a row team must not straddle warps");
static_assert(kRowTeam % kGroupLanes == 0, "a quant group must not straddle row teams");

enum class RowMode { kFused, kNormOnly };

// bf16 pairs packed little-endian in a 32-bit word: element 0 in the low half.
__device__ __forceinline__ float Bf16Lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float Bf16Hi(uint32_t w) { return __uint_as_float(w & 0xffff0000u); }

__device__ __forceinline__ void Unpack8(const uint4& u, float (&x)[kChunk]) {
  x[0] = Bf16Lo(u.x); x[1] = Bf16Hi(u.x);
  x[2] = Bf16Lo(u.y); x[3] = Bf16Hi(u.y);
  x[4] = Bf16Lo(u.z); x[5] = Bf16Hi(u.z);
  x[6] = Bf16Lo(u.w); x[7] = Bf16Hi(u.w);
}

// Elements [0, valid) of a chunk (valid may be <= 0 or >= 8); missing elements read as 0 so they
// add nothing to the sum of squares and the group amax. `vec`: 16-byte aligned source.
__device__ __forceinline__ uint4 LoadChunk(const uint16_t* p, int valid, bool vec) {
  if (vec && valid >= kChunk) return LoadReadOnly16(p);
  uint32_t w[4] = {0, 0, 0, 0};
#pragma unroll
  for (int j = 0; j < kChunk; ++j) {
    if (j < valid) w[j / 2] |= uint32_t(p[j]) << (16 * (j % 2));
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// fp32 -> bf16, round to nearest even (numeric.h's FloatToBf16). On NVIDIA cvt.rn.bf16.f32 rounds
// identically for every non-NaN input in one instruction instead of five; NaN keeps FloatToBf16's
// encoding (the hardware would return the canonical 0x7fff).
__device__ __forceinline__ uint16_t ToBf16(float f) {
#if !FL_HIP
  if (f == f) return __bfloat16_as_ushort(__float2bfloat16_rn(f));
#endif
  return FloatToBf16(f);
}

__device__ __forceinline__ void StoreBf16Chunk(uint16_t* p, const float (&y)[kChunk], int valid, bool vec) {
  uint16_t b[kChunk];
#pragma unroll
  for (int j = 0; j < kChunk; ++j) b[j] = ToBf16(y[j]);
  if (vec && valid >= kChunk) {
    *reinterpret_cast<uint4*>(p) = make_uint4(b[0] | uint32_t(b[1]) << 16, b[2] | uint32_t(b[3]) << 16,
                                              b[4] | uint32_t(b[5]) << 16, b[6] | uint32_t(b[7]) << 16);
    return;
  }
#pragma unroll
  for (int j = 0; j < kChunk; ++j) {
    if (j < valid) p[j] = b[j];
  }
}

// Sum of squares of one chunk, serial in element order from 0, fp32 (explicit FMA so the order and
// the rounding do not depend on the compiler's contraction choices). The row's sum of squares is,
// in every kernel variant, the same fixed tree: virtual lane l = c % 32 adds the partials of its
// chunks c = l, l + 32, ... in ascending order, then a 32-lane butterfly (TeamSum). It depends on
// the row width only, so every variant, batch size and row position gives the same bits.
__device__ __forceinline__ float ChunkSq(const uint4& u) {
  float x[kChunk];
  Unpack8(u, x);
  float p = 0.0f;
#pragma unroll
  for (int j = 0; j < kChunk; ++j) p = fmaf(x[j], x[j], p);
  return p;
}

__device__ __forceinline__ float TeamSum(float v) {
#pragma unroll
  for (int o = kRowTeam / 2; o > 0; o /= 2) v += ShflXor(v, o, kRowTeam);
  return v;  // a butterfly adds the same two values on both partners: every lane holds the same bits
}

// rrms = 1 / sqrt(ss / n + eps), each step correctly rounded (the CPU backend does the same).
__device__ __forceinline__ float Rrms(float ss, int n, float eps) {
  return DivRn(1.0f, SqrtRn(DivRn(ss, float(n)) + eps));
}

// y = (x * rrms) * w: two fp32 multiplies in this order (no FMA can form: there is no add).
__device__ __forceinline__ void Normalize(const uint4& xu, const uint4& wu, float rrms, float (&y)[kChunk]) {
  float x[kChunk], w[kChunk];
  Unpack8(xu, x);
  Unpack8(wu, w);
#pragma unroll
  for (int j = 0; j < kChunk; ++j) y[j] = (x[j] * rrms) * w[j];
}

// fp32 -> 4 fp8 codes packed little-endian.
template <Fp8Format kFmt>
__device__ __forceinline__ uint32_t EncodeFp8x4(float a, float b, float c, float d) {
#if !FL_HIP
  if constexpr (kFmt == Fp8Format::kE4M3FN) {
    // cvt.rn.satfinite.e4m3x2.f32 (sm_89+): round to nearest even, saturating at +-448, the
    // definition of FloatToE4M3FN for the finite, pre-clamped inputs given here. The GPU tests
    // compare every code with the CPU backend's software conversion.
    const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, __NV_E4M3);
    const uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(c, d), __NV_SATFINITE, __NV_E4M3);
    return lo | (hi << 16);
  }
#endif
  return uint32_t(FloatToFp8(a, kFmt)) | uint32_t(FloatToFp8(b, kFmt)) << 8 | uint32_t(FloatToFp8(c, kFmt)) << 16 |
         uint32_t(FloatToFp8(d, kFmt)) << 24;
}

// Quantizes this lane's 8 values of a 128-group spread over 16 consecutive lanes. All 16 lanes
// must call it (it shuffles). Returns the 8 codes and the group's multiplicative scale.
template <Fp8Format kFmt>
__device__ __forceinline__ uint2 QuantizeGroupChunk(const float (&v)[kChunk], bool ue8m0, float& scale_out) {
  float amax = 0.0f;
#pragma unroll
  for (int j = 0; j < kChunk; ++j) amax = fmaxf(amax, fabsf(v[j]));
#pragma unroll
  for (int o = kGroupLanes / 2; o > 0; o /= 2) amax = fmaxf(amax, ShflXor(amax, o, kGroupLanes));
  amax = fmaxf(amax, 1e-10f);
  constexpr float fmax = kFmt == Fp8Format::kE4M3FN ? 448.0f : 240.0f;
  constexpr float inv_fmax = 1.0f / fmax;  // RN(1/MAX), folded by the compiler
  // scale = amax / MAX and, for fp32 scales, q = v / scale, each correctly rounded (the contract's
  // IEEE divisions), without a division instruction sequence per value: Markstein's theorem says
  // that with y = RN(1/b) and q0 = RN(a * y) (within an ulp of a/b), the residual r = a - q0 * b is
  // exact in one FMA and RN(q0 + r * y) = RN(a / b). Operands stay far from overflow and
  // underflow (amax >= 1e-10, scale >= 1e-10/MAX, |v/scale| <= MAX; a quotient that underflows
  // encodes as fp8 zero either way). r == 0 means q0 is already exact: keep it, which also keeps
  // the sign of a zero v (q0 + 0 would turn -0 into +0; e4m3fn encodes -0 as 0x80). Checked
  // against IEEE division on 2e8 random pairs: all bitwise equal. (This removed 3 division
  // sequences per group, a third of the kernel's instructions.)
  const float s0 = amax * inv_fmax;
  const float sr = fmaf(-s0, fmax, amax);
  float scale = sr == 0.0f ? s0 : fmaf(sr, inv_fmax, s0);
  float q[kChunk];
  if (ue8m0) {
    scale = CeilToUe8m0(scale);
    // A power of two: multiplying by its (exact) reciprocal rounds exactly like dividing.
    const float inv = RcpRn(scale);
#pragma unroll
    for (int j = 0; j < kChunk; ++j) q[j] = fminf(fmaxf(v[j] * inv, -fmax), fmax);
  } else {
    const float inv = RcpRn(scale);
#pragma unroll
    for (int j = 0; j < kChunk; ++j) {
      const float q0 = v[j] * inv;
      const float r = fmaf(-q0, scale, v[j]);
      q[j] = fminf(fmaxf(r == 0.0f ? q0 : fmaf(r, inv, q0), -fmax), fmax);
    }
  }
  scale_out = scale;
  return make_uint2(EncodeFp8x4<kFmt>(q[0], q[1], q[2], q[3]), EncodeFp8x4<kFmt>(q[4], q[5], q[6], q[7]));
}

__device__ __forceinline__ void StoreCodes(uint8_t* p, const uint2& c, bool vec) {
  if (vec) {
    *reinterpret_cast<uint2*>(p) = c;
    return;
  }
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    p[j] = uint8_t(c.x >> (8 * j));
    p[4 + j] = uint8_t(c.y >> (8 * j));
  }
}

struct RowFlags {
  bool vec_in;     // qr_kv base 16-byte aligned and row stride a multiple of 8 elements
  bool vec_kv;     // kv base 16-byte aligned and D a multiple of 8
  bool vec_codes;  // q_fp8 base 8-byte aligned (Q is a multiple of 128)
};

// Memory access of one chunk. kFast (register-resident instances, chosen only when every access is
// aligned and D % 8 == 0): a chunk is either whole or entirely past the row end, so each access is
// one predicated 16-byte (codes: 8-byte) instruction. Otherwise the runtime-checked general forms.
// Keeping the scalar fallbacks out of the fast instances matters: they tripled the code size, and
// at small M the kernel then waited on instruction fetch.
template <bool kFast>
__device__ __forceinline__ uint4 Load(const uint16_t* p, int valid, bool vec) {
  if constexpr (kFast) {
    return valid > 0 ? LoadReadOnly16(p) : make_uint4(0u, 0u, 0u, 0u);
  } else {
    return LoadChunk(p, valid, vec);
  }
}
template <bool kFast>
__device__ __forceinline__ void StoreBf16(uint16_t* p, const float (&y)[kChunk], int valid, bool vec) {
  StoreBf16Chunk(p, y, kFast ? kChunk : valid, kFast || vec);
}
template <bool kFast>
__device__ __forceinline__ void StoreQ(uint8_t* p, const uint2& c, bool vec) {
  StoreCodes(p, c, kFast || vec);
}

// KQ / KD: chunks per lane kept in registers for the q / kv half; 0 = streamed (re-read).
template <int KQ, int KD, RowMode kMode, Fp8Format kFmt>
__global__ void __launch_bounds__(256) SwaRowKernel(SwaRowParams p, RowFlags f) {
  constexpr bool kResident = KQ > 0;
  static_assert((KQ > 0) == (KD > 0), "both halves resident or both streamed");
  const int lane = int(threadIdx.x) % kRowTeam;
  const int64_t row_raw = int64_t(blockIdx.x) * (blockDim.x / kRowTeam) + threadIdx.x / kRowTeam;
  // Teams past the last row compute on the last row (shuffles need every lane) and store nothing.
  const bool active = row_raw < p.tokens;
  const int64_t row = active ? row_raw : p.tokens - 1;
  const int Q = p.q_rank, D = p.head_dim;
  const uint16_t* q_in = p.qr_kv + row * p.row_stride;
  const uint16_t* kv_in = q_in + Q;
  const int nq = kResident ? KQ : (Q / kChunk + kRowTeam - 1) / kRowTeam;
  const int nd = kResident ? KD : ((D + kChunk - 1) / kChunk + kRowTeam - 1) / kRowTeam;

  uint4 xq[kResident ? KQ : 1], xk[kResident ? KD : 1];
  // Resident instances stage both norm weights in shared memory once per block (all rows of the
  // block share them): registers stay free for the row itself (more resident warps, more bytes in
  // flight), and shared-memory reads, unlike global ones, can be scheduled across the byte stores
  // to q_fp8 (which the compiler must otherwise assume may alias the weights).
  __shared__ uint4 s_w[kResident ? (KQ + KD) * kRowTeam : 1];
  float ssq = 0.0f, ssk = 0.0f;
  if constexpr (kResident) {
    // Issue every load of the row before the first use: KQ + KD independent 16-byte loads per lane.
#pragma unroll
    for (int k = 0; k < KQ; ++k) {
      const int c = lane + k * kRowTeam;
      xq[k] = Load<true>(q_in + c * kChunk, Q - c * kChunk, true);
    }
#pragma unroll
    for (int k = 0; k < KD; ++k) {
      const int c = lane + k * kRowTeam;
      xk[k] = Load<true>(kv_in + c * kChunk, D - c * kChunk, true);
    }
    // s_w[0, Q/8) = q_norm chunks, s_w[KQ*32, KQ*32 + D/8) = kv_norm chunks (D % 8 == 0 here).
    const int qw = Q / kChunk, kw = D / kChunk;
    for (int i = int(threadIdx.x); i < qw + kw; i += int(blockDim.x)) {
      s_w[i < qw ? i : KQ * kRowTeam + (i - qw)] =
          i < qw ? LoadReadOnly16(p.q_norm + i * kChunk) : LoadReadOnly16(p.kv_norm + (i - qw) * kChunk);
    }
    __syncthreads();
#pragma unroll
    for (int k = 0; k < KQ; ++k) ssq += ChunkSq(xq[k]);
#pragma unroll
    for (int k = 0; k < KD; ++k) ssk += ChunkSq(xk[k]);
  } else {
    for (int k = 0; k < nq; ++k) {
      const int c = lane + k * kRowTeam;
      ssq += ChunkSq(LoadChunk(q_in + c * kChunk, Q - c * kChunk, f.vec_in));
    }
    for (int k = 0; k < nd; ++k) {
      const int c = lane + k * kRowTeam;
      ssk += ChunkSq(LoadChunk(kv_in + c * kChunk, D - c * kChunk, f.vec_in));
    }
  }
  const float rq = Rrms(TeamSum(ssq), Q, p.eps);
  const float rk = Rrms(TeamSum(ssk), D, p.eps);

  // ---- q half ----
  const int q_chunks = Q / kChunk;
#pragma unroll
  for (int k = 0; k < (kResident ? KQ : 1); ++k) {
    for (int ks = kResident ? k : 0; ks < (kResident ? k + 1 : nq); ++ks) {
      const int c = lane + ks * kRowTeam;
      const bool in_range = c < q_chunks;  // uniform over each 16-lane group (Q % 128 == 0)
      const uint4 x = kResident ? xq[k] : LoadChunk(q_in + c * kChunk, Q - c * kChunk, f.vec_in);
      uint4 w;
      if constexpr (kResident) {
        w = in_range ? s_w[c] : make_uint4(0u, 0u, 0u, 0u);
      } else {
        w = LoadChunk(p.q_norm + c * kChunk, Q - c * kChunk, true);
      }
      float y[kChunk];
      Normalize(x, w, rq, y);
      if constexpr (kMode == RowMode::kNormOnly) {
        if (active && in_range) StoreBf16<true>(p.q_bf16 + row * Q + c * kChunk, y, kChunk, true);
      } else {
        float scale;
        const uint2 codes = QuantizeGroupChunk<kFmt>(y, p.ue8m0, scale);
        if (active && in_range) {
          StoreQ<kResident>(p.q_fp8 + row * Q + c * kChunk, codes, f.vec_codes);
          if (lane % kGroupLanes == 0) {
            const int64_t g = c / kGroupLanes;
            p.q_scale[row * p.scale_layout.m_stride + g * p.scale_layout.g_stride] = scale;
          }
        }
      }
    }
  }
  if constexpr (kMode == RowMode::kFused) {
    // The last row's team zero-fills the column-major layout's padding rows (at most 3); kept out
    // of the unrolled group loop, where it would be replicated for every group.
    if (active && row == p.tokens - 1) {
#pragma unroll 1
      for (int g = lane; g < Q / kGroup; g += kRowTeam) {
#pragma unroll 1
        for (int64_t r = p.tokens; r < p.scale_layout.padded_rows; ++r) {
          p.q_scale[r * p.scale_layout.m_stride + g * p.scale_layout.g_stride] = 0.0f;
        }
      }
    }
  }

  // ---- kv half ----
#pragma unroll
  for (int k = 0; k < (kResident ? KD : 1); ++k) {
    for (int ks = kResident ? k : 0; ks < (kResident ? k + 1 : nd); ++ks) {
      const int c = lane + ks * kRowTeam;
      const int valid = D - c * kChunk;
      if (!active || valid <= 0) continue;  // no shuffles below this point
      const uint4 x = kResident ? xk[k] : LoadChunk(kv_in + c * kChunk, valid, f.vec_in);
      uint4 w;
      if constexpr (kResident) {
        w = s_w[KQ * kRowTeam + c];
      } else {
        w = LoadChunk(p.kv_norm + c * kChunk, valid, true);
      }
      float y[kChunk];
      Normalize(x, w, rk, y);
      StoreBf16<kResident>(p.kv + row * D + c * kChunk, y, valid, f.vec_kv);
    }
  }
}

// Small-M variant: one row per block of kWideTeam = 128 threads (4 chunks in flight per thread
// instead of up to 12), so the row's instruction stream, not the memory latency, stops being the
// critical path when there are too few rows to fill the GPU. The sum of squares follows the same
// fixed tree as SwaRowKernel (chunk partials through shared memory, each 32-thread group then
// replays the 32 virtual lanes' serial sums and the butterfly), so results are bitwise identical
// to the 32-thread variant: batch invariance holds across the switch between the two.
constexpr int kWideTeam = 128;
static_assert(kWideTeam % kGroupLanes == 0 && kWideTeam % kRowTeam == 0, "wide team layout");

template <int KQW, int KDW, RowMode kMode, Fp8Format kFmt>
__global__ void __launch_bounds__(kWideTeam) SwaRowWideKernel(SwaRowParams p) {
  __shared__ float s_part[(KQW + KDW) * kWideTeam];  // chunk partials: q chunks, then kv chunks
  const int t = int(threadIdx.x);
  const int64_t row = blockIdx.x;  // grid = tokens: every block has a row
  const int Q = p.q_rank, D = p.head_dim;
  const int qc = Q / kChunk, dc = D / kChunk;  // D % 8 == 0 for this variant
  const uint16_t* q_in = p.qr_kv + row * p.row_stride;
  const uint16_t* kv_in = q_in + Q;
  uint4 xq[KQW], xk[KDW], wq[KQW], wk[KDW];
#pragma unroll
  for (int j = 0; j < KQW; ++j) {
    const int c = t + j * kWideTeam;
    xq[j] = Load<true>(q_in + c * kChunk, Q - c * kChunk, true);
    wq[j] = Load<true>(p.q_norm + c * kChunk, Q - c * kChunk, true);
  }
#pragma unroll
  for (int j = 0; j < KDW; ++j) {
    const int c = t + j * kWideTeam;
    xk[j] = Load<true>(kv_in + c * kChunk, D - c * kChunk, true);
    wk[j] = Load<true>(p.kv_norm + c * kChunk, D - c * kChunk, true);
  }
#pragma unroll
  for (int j = 0; j < KQW; ++j) {
    const int c = t + j * kWideTeam;
    if (c < qc) s_part[c] = ChunkSq(xq[j]);
  }
#pragma unroll
  for (int j = 0; j < KDW; ++j) {
    const int c = t + j * kWideTeam;
    if (c < dc) s_part[qc + c] = ChunkSq(xk[j]);
  }
  __syncthreads();
  const int l = t % kRowTeam;
  float ssq = 0.0f, ssk = 0.0f;
  for (int c = l; c < qc; c += kRowTeam) ssq += s_part[c];
  for (int c = l; c < dc; c += kRowTeam) ssk += s_part[qc + c];
  const float rq = Rrms(TeamSum(ssq), Q, p.eps);
  const float rk = Rrms(TeamSum(ssk), D, p.eps);

#pragma unroll
  for (int j = 0; j < KQW; ++j) {
    const int c = t + j * kWideTeam;
    const bool in_range = c < qc;  // uniform over each 16-thread group
    float y[kChunk];
    Normalize(xq[j], wq[j], rq, y);
    if constexpr (kMode == RowMode::kNormOnly) {
      if (in_range) StoreBf16<true>(p.q_bf16 + row * Q + c * kChunk, y, kChunk, true);
    } else {
      float scale;
      const uint2 codes = QuantizeGroupChunk<kFmt>(y, p.ue8m0, scale);
      if (in_range) {
        StoreQ<true>(p.q_fp8 + row * Q + c * kChunk, codes, true);
        if (t % kGroupLanes == 0) {
          p.q_scale[row * p.scale_layout.m_stride + int64_t(c / kGroupLanes) * p.scale_layout.g_stride] = scale;
        }
      }
    }
  }
  if constexpr (kMode == RowMode::kFused) {
    if (row == p.tokens - 1) {
#pragma unroll 1
      for (int g = t; g < Q / kGroup; g += kWideTeam) {
#pragma unroll 1
        for (int64_t r = p.tokens; r < p.scale_layout.padded_rows; ++r) {
          p.q_scale[r * p.scale_layout.m_stride + g * p.scale_layout.g_stride] = 0.0f;
        }
      }
    }
  }
#pragma unroll
  for (int j = 0; j < KDW; ++j) {
    const int c = t + j * kWideTeam;
    if (c >= dc) continue;
    float y[kChunk];
    Normalize(xk[j], wk[j], rk, y);
    StoreBf16<true>(p.kv + row * D + c * kChunk, y, kChunk, true);
  }
}

// Unfused step 2: group quant of the bf16 q written by the norm step. 16 lanes per group.
template <Fp8Format kFmt>
__global__ void __launch_bounds__(256) SwaGroupQuantKernel(const uint16_t* q_bf16, int64_t tokens, int groups,
                                                          uint8_t* q_fp8, float* q_scale, SwaScaleLayout layout,
                                                          bool ue8m0) {
  const int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t gi_raw = t / kGroupLanes;
  const int lane = int(t % kGroupLanes);
  const bool active = gi_raw < tokens * groups;
  const int64_t gi = active ? gi_raw : tokens * groups - 1;
  const int64_t m = gi / groups;
  const int64_t g = gi % groups;
  const int64_t Q = int64_t(groups) * kGroup;
  const int64_t off = m * Q + g * kGroup + lane * kChunk;  // dense workspace: always 16-byte aligned
  float v[kChunk];
  Unpack8(LoadReadOnly16(q_bf16 + off), v);
  float scale;
  const uint2 codes = QuantizeGroupChunk<kFmt>(v, ue8m0, scale);
  if (!active) return;
  StoreCodes(q_fp8 + off, codes, (reinterpret_cast<uintptr_t>(q_fp8) & 7) == 0);
  if (lane == 0) {
    q_scale[m * layout.m_stride + g * layout.g_stride] = scale;
    if (m == tokens - 1) {
      for (int64_t r = tokens; r < layout.padded_rows; ++r) q_scale[r * layout.m_stride + g * layout.g_stride] = 0.0f;
    }
  }
}

using RowKernelFn = void (*)(SwaRowParams, RowFlags);

template <RowMode kMode, Fp8Format kFmt, int KD>
RowKernelFn PickKq(int kq) {
  // Chunk counts are rounded up to an instantiated one (masked chunks cost registers, not
  // bandwidth); DeepSeek's Q = 1024 / 1280 / 1536 are exactly 4 / 5 / 6.
  if (kq <= 2) return SwaRowKernel<2, KD, kMode, kFmt>;
  if (kq <= 4) return SwaRowKernel<4, KD, kMode, kFmt>;
  if (kq == 5) return SwaRowKernel<5, KD, kMode, kFmt>;
  if (kq == 6) return SwaRowKernel<6, KD, kMode, kFmt>;
  return SwaRowKernel<8, KD, kMode, kFmt>;
}

template <RowMode kMode, Fp8Format kFmt>
RowKernelFn PickRowKernel(int q_rank, int head_dim, const RowFlags& f) {
  const int kq = (q_rank / kChunk + kRowTeam - 1) / kRowTeam;
  const int kd = ((head_dim + kChunk - 1) / kChunk + kRowTeam - 1) / kRowTeam;
  const bool aligned = f.vec_in && f.vec_kv && f.vec_codes && head_dim % kChunk == 0;
  if (aligned && kq <= kMaxResidentQChunks && kd <= kMaxResidentDChunks) {
    return kd <= 2 ? PickKq<kMode, kFmt, 2>(kq) : PickKq<kMode, kFmt, 4>(kq);
  }
  return SwaRowKernel<0, 0, kMode, kFmt>;
}

using WideKernelFn = void (*)(SwaRowParams);

template <RowMode kMode, Fp8Format kFmt>
WideKernelFn PickWideKernel(int q_rank, int head_dim) {
  const int kq = (q_rank / kChunk + kWideTeam - 1) / kWideTeam;
  const int kd = (head_dim / kChunk + kWideTeam - 1) / kWideTeam;
  if (kd > 1) return nullptr;
  if (kq == 1) return SwaRowWideKernel<1, 1, kMode, kFmt>;
  if (kq == 2) return SwaRowWideKernel<2, 1, kMode, kFmt>;
  return nullptr;
}

template <RowMode kMode>
gpuError_t LaunchRows(const SwaRowParams& p, int sm_count, gpuStream_t stream) {
  if (p.tokens == 0) return gpuSuccess;
  const bool use_wide_fmt_fn = kMode == RowMode::kNormOnly || p.fp8_format == Fp8Format::kE4M3FN;
  {
    // Up to about two rows per multiprocessor, one 128-thread block per row (Q <= 2048, D <= 1024,
    // aligned): latency-bound regime.
    const bool aligned = (reinterpret_cast<uintptr_t>(p.qr_kv) % 16 == 0) && (p.row_stride % kChunk == 0) &&
                         (reinterpret_cast<uintptr_t>(p.kv) % 16 == 0) && (p.head_dim % kChunk == 0) &&
                         (kMode == RowMode::kNormOnly || reinterpret_cast<uintptr_t>(p.q_fp8) % 8 == 0);
    if (aligned && p.tokens <= int64_t(2) * (sm_count > 0 ? sm_count : 1)) {
      WideKernelFn fn = use_wide_fmt_fn ? PickWideKernel<kMode, Fp8Format::kE4M3FN>(p.q_rank, p.head_dim)
                                        : PickWideKernel<kMode, Fp8Format::kE4M3FNUZ>(p.q_rank, p.head_dim);
      if (fn != nullptr) {
        fn<<<dim3(unsigned(p.tokens)), dim3(kWideTeam), 0, stream>>>(p);
        return gpuGetLastError();
      }
    }
  }
  // Few rows: 2 rows per block spreads them over more multiprocessors (latency-bound regime);
  // many rows: 8 rows (256 threads) per block.
  const int rows_per_block = p.tokens <= int64_t(4) * (sm_count > 0 ? sm_count : 1) ? 2 : 8;
  const int64_t blocks = (p.tokens + rows_per_block - 1) / rows_per_block;
  RowFlags f;
  f.vec_in = (reinterpret_cast<uintptr_t>(p.qr_kv) % 16 == 0) && (p.row_stride % kChunk == 0);
  f.vec_kv = (reinterpret_cast<uintptr_t>(p.kv) % 16 == 0) && (p.head_dim % kChunk == 0);
  // The norm step writes no codes (q_fp8 unused); its bf16 q goes to the aligned workspace.
  f.vec_codes = kMode == RowMode::kNormOnly || reinterpret_cast<uintptr_t>(p.q_fp8) % 8 == 0;
  // The norm step writes no codes: one format's instances serve it.
  RowKernelFn fn = kMode == RowMode::kNormOnly || p.fp8_format == Fp8Format::kE4M3FN
                       ? PickRowKernel<kMode, Fp8Format::kE4M3FN>(p.q_rank, p.head_dim, f)
                       : PickRowKernel<kMode, Fp8Format::kE4M3FNUZ>(p.q_rank, p.head_dim, f);
  fn<<<dim3(unsigned(blocks)), dim3(rows_per_block * kRowTeam), 0, stream>>>(p, f);
  return gpuGetLastError();
}

}  // namespace

gpuError_t ProbeSwaKernelImage() {
  gpuFuncAttributes attr;
  return gpuFuncGetAttributes(&attr, reinterpret_cast<const void*>(SwaGroupQuantKernel<Fp8Format::kE4M3FN>));
}

gpuError_t LaunchSwaFusedRows(const SwaRowParams& p, int sm_count, gpuStream_t stream) {
  return LaunchRows<RowMode::kFused>(p, sm_count, stream);
}

gpuError_t LaunchSwaNormRows(const SwaRowParams& p, int sm_count, gpuStream_t stream) {
  return LaunchRows<RowMode::kNormOnly>(p, sm_count, stream);
}

gpuError_t LaunchSwaGroupQuant(const uint16_t* q_bf16, int64_t tokens, int q_rank, uint8_t* q_fp8, float* q_scale,
                               const SwaScaleLayout& layout, Fp8Format fmt, bool ue8m0, gpuStream_t stream) {
  if (tokens == 0) return gpuSuccess;
  const int groups = q_rank / kGroup;
  const int64_t threads = tokens * groups * kGroupLanes;
  const int block = 256;
  const int64_t blocks = (threads + block - 1) / block;
  auto* kernel = fmt == Fp8Format::kE4M3FN ? SwaGroupQuantKernel<Fp8Format::kE4M3FN>
                                           : SwaGroupQuantKernel<Fp8Format::kE4M3FNUZ>;
  kernel<<<dim3(unsigned(blocks)), dim3(block), 0, stream>>>(q_bf16, tokens, groups, q_fp8, q_scale, layout, ue8m0);
  return gpuGetLastError();
}

}  // namespace fusedlayer::gpu
