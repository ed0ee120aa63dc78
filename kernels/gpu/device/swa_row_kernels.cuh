// SWA q/kv RMSNorm + q FP8 1x128 group quant kernels (spec/swa.md), one source for CUDA and HIP.
//
// Work split (both the fused kernel and the unfused norm step): a team of kRowTeam = 32 threads owns
// one token row. The row is cut into 16-byte chunks of 8 bf16; chunk c of a half belongs to lane
// c % 32, so each load instruction of the team reads 512 contiguous bytes. For the q half, the 16
// chunks of quant group g sit on 16 consecutive lanes (chunk c = lane + 32 k: lanes 0..15 hold
// group 2k, lanes 16..31 group 2k + 1), so the group amax is a butterfly over 16 lanes, in
// registers, with no shared memory and no barrier; the large-M kernel quantizes a lane's chunks k
// and k + 1 together (QuantizeGroupPair: one transposed butterfly and one scale/reciprocal
// sequence for two groups). A team is a warp on NVIDIA and half a wavefront on CDNA; every
// shuffle names its width, nothing assumes 32-lane warps.
//
// For rows up to Q <= 2048 and D <= 1024 (all DeepSeek shapes) the row stays in registers between
// the sum of squares and the output pass, so HBM is read once; wider rows are re-read (streamed)
// in the second pass. At small M (<= 8 rows per SM) a "wide" variant gives each row a block with
// one 8-element chunk per thread instead, shortening the per-row dependent chain that dominates
// there. Every launch uses programmatic dependent launch (PDL) on CUDA.
// All variants add the squares in one fixed tree (ChunkSq), which depends on the row width only:
// results are batch invariant and bitwise identical across the variants, and kv is bitwise equal
// between the fused and unfused paths. Design: kernels/gpu/DESIGN.md; numbers: BENCHMARKS.md.
//
// Device code only (kernels and their helpers); the launchers are in ../swa_row_launch.cu.
#pragma once

// The runtime header first: under hipcc it provides the intrinsics numeric.h uses.
#include "gpu_runtime.h"
#include "swa_kernel_launch.h"
#include "device/swa_quant_math.cuh"

#include <algorithm>
#include <cstdint>

#include "fusedlayer/numeric.h"

#if !FL_HIP
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#endif

namespace fusedlayer::gpu::swa_rows {

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

// True when any of the 8 values is NaN. On NVIDIA four setp.nan (two operands each) chained by
// their predicate operand; elsewhere plain compares.
__device__ __forceinline__ bool AnyNan8(const float (&y)[kChunk]) {
#if !FL_HIP
  uint32_t r;
  asm("{\n\t.reg .pred p;\n\t"
      "setp.nan.f32 p, %1, %2;\n\t"
      "setp.nan.or.f32 p, %3, %4, p;\n\t"
      "setp.nan.or.f32 p, %5, %6, p;\n\t"
      "setp.nan.or.f32 p, %7, %8, p;\n\t"
      "selp.u32 %0, 1, 0, p;\n\t}"
      : "=r"(r)
      : "f"(y[0]), "f"(y[1]), "f"(y[2]), "f"(y[3]), "f"(y[4]), "f"(y[5]), "f"(y[6]), "f"(y[7]));
  return r != 0;
#else
  bool any = false;
#pragma unroll
  for (int j = 0; j < kChunk; ++j) any |= y[j] != y[j];
  return any;
#endif
}

// 8 values -> 8 bf16 (RNE) packed little-endian. On NVIDIA one cvt.rn.bf16x2.f32 per pair, which
// rounds like FloatToBf16 for every non-NaN input; a chunk holding a NaN takes FloatToBf16 for
// every element (the hardware would return the canonical 0x7fff).
__device__ __forceinline__ uint4 PackBf16x8(const float (&y)[kChunk]) {
#if !FL_HIP
  if (!AnyNan8(y)) {
    uint32_t w[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const __nv_bfloat162 h = __floats2bfloat162_rn(y[2 * j], y[2 * j + 1]);  // .x = low half
      w[j] = *reinterpret_cast<const uint32_t*>(&h);
    }
    return make_uint4(w[0], w[1], w[2], w[3]);
  }
#endif
  uint16_t b[kChunk];
#pragma unroll
  for (int j = 0; j < kChunk; ++j) b[j] = FloatToBf16(y[j]);
  return make_uint4(b[0] | uint32_t(b[1]) << 16, b[2] | uint32_t(b[3]) << 16, b[4] | uint32_t(b[5]) << 16,
                    b[6] | uint32_t(b[7]) << 16);
}

__device__ __forceinline__ void StoreBf16Chunk(uint16_t* p, const float (&y)[kChunk], int valid, bool vec) {
  if (vec && valid >= kChunk) {
    *reinterpret_cast<uint4*>(p) = PackBf16x8(y);
    return;
  }
#pragma unroll
  for (int j = 0; j < kChunk; ++j) {
    if (j < valid) p[j] = ToBf16(y[j]);
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

// Both halves' rrms from the lanes' partial sums of squares with one reduction and one Rrms
// sequence, bitwise equal to Rrms(TeamSum(ssq), Q) and Rrms(TeamSum(ssk), D): the first butterfly
// step (xor 16) is transposed (lanes 0-15 keep q's pairwise sums, lanes 16-31 kv's; each is the
// same sum of the same two values as in TeamSum), the other four steps reduce each half within its
// 16 lanes exactly as TeamSum's last four steps do. Lane 0 then holds q's rrms, lane 16 kv's.
__device__ __forceinline__ void RowRrms(float ssq, float ssk, int Q, int D, float eps, int lane, float& rq,
                                        float& rk) {
  static_assert(kRowTeam == 32, "the transposed first step splits a 32-lane team in halves");
  const bool hi = (lane & 16) != 0;
  float s = (hi ? ssk : ssq) + ShflXor(hi ? ssq : ssk, 16, kRowTeam);
#pragma unroll
  for (int o = 8; o > 0; o /= 2) s += ShflXor(s, o, kRowTeam);
  const float r = Rrms(s, hi ? D : Q, eps);
  rq = Shfl(r, 0, kRowTeam);
  rk = Shfl(r, 16, kRowTeam);
}

// y = (x * rrms) * w: two fp32 multiplies in this order (no FMA can form: there is no add).
// Weights already in fp32 (staged unpacked in shared memory by the resident row kernel).
__device__ __forceinline__ void NormalizeW(const uint4& xu, const float4& wlo, const float4& whi, float rrms,
                                           float (&y)[kChunk]) {
  float x[kChunk];
  Unpack8(xu, x);
  const float w[kChunk] = {wlo.x, wlo.y, wlo.z, wlo.w, whi.x, whi.y, whi.z, whi.w};
#pragma unroll
  for (int j = 0; j < kChunk; ++j) y[j] = (x[j] * rrms) * w[j];
}

__device__ __forceinline__ void Normalize(const uint4& xu, const uint4& wu, float rrms, float (&y)[kChunk]) {
  float x[kChunk], w[kChunk];
  Unpack8(xu, x);
  Unpack8(wu, w);
#pragma unroll
  for (int j = 0; j < kChunk; ++j) y[j] = (x[j] * rrms) * w[j];
}

// EncodeFp8x4, GroupScale and EncodeChunk (the quantization arithmetic) are in swa_quant_math.cuh,
// shared with the GPU test's equivalence check (tests/gpu/swa_quant_check.cu).
using swa_quant::EncodeChunk;
using swa_quant::EncodeFp8x4;
using swa_quant::GroupScale;
static_assert(swa_quant::kQuantChunk == kChunk, "EncodeChunk quantizes one 8-value chunk");

// max |v| over this lane's 8 values: 7 max in a depth-3 tree instead of a chain of 8.
// fmaxf ignores NaN operands, as the former chain from 0 did (the final 1e-10 floor makes an
// all-NaN group identical either way).
__device__ __forceinline__ float LocalAmax(const float (&v)[kChunk]) {
  const float a = fmaxf(fabsf(v[0]), fabsf(v[1])), b = fmaxf(fabsf(v[2]), fabsf(v[3]));
  const float c = fmaxf(fabsf(v[4]), fabsf(v[5])), d = fmaxf(fabsf(v[6]), fabsf(v[7]));
  return fmaxf(fmaxf(a, b), fmaxf(c, d));
}

// Quantizes this lane's 8 values of a 128-group spread over 16 consecutive lanes. All 16 lanes
// must call it (it shuffles). Returns the 8 codes and the group's multiplicative scale.
template <Fp8Format kFmt>
__device__ __forceinline__ uint2 QuantizeGroupChunk(const float (&v)[kChunk], bool ue8m0, float& scale_out) {
  float amax = LocalAmax(v);
#pragma unroll
  for (int o = kGroupLanes / 2; o > 0; o /= 2) amax = fmaxf(amax, ShflXor(amax, o, kGroupLanes));
  float scale, inv;
  GroupScale<kFmt>(amax, ue8m0, scale, inv);
  scale_out = scale;
  return EncodeChunk<kFmt>(v, scale, inv, ue8m0);
}

// Two chunks of two different groups per lane (chunks k and k + 1 of SwaRowKernel: lanes 0-15 of
// a team hold groups 2k and 2k + 2, lanes 16-31 groups 2k + 1 and 2k + 3), quantized with one
// group-scale computation instead of two. The amax reduction is transposed: in its first step
// (xor 8) a lane with bit 3 clear keeps its chunk-0 maximum and sends the chunk-1 one, a lane with
// bit 3 set the opposite, so afterwards each lane carries one group's partial maximum and the
// remaining three steps (xor 4, 2, 1) finish it: 10 instructions for both groups instead of 16.
// Each lane then computes the scale and reciprocal of "its" group (bit 3 clear: chunk 0's, set:
// chunk 1's) and receives the other one from lane ^ 8 (2 shuffles instead of a second scale and
// rcp sequence). max is exact and order-free (|v| >= +0, NaN dropped either way), so amax, scale,
// inv and the codes are bitwise those of QuantizeGroupChunk on each chunk. All 16 lanes of a group
// pair must call it. scale_mine: the scale of the group this lane computed (chunk bit3 ? 1 : 0).
template <Fp8Format kFmt>
__device__ __forceinline__ void QuantizeGroupPair(const float (&v0)[kChunk], const float (&v1)[kChunk], bool ue8m0,
                                                  bool bit3, uint2& c0, uint2& c1, float& scale_mine) {
  const float a0 = LocalAmax(v0), a1 = LocalAmax(v1);
  float amax = fmaxf(bit3 ? a1 : a0, ShflXor(bit3 ? a0 : a1, 8, kGroupLanes));
#pragma unroll
  for (int o = kGroupLanes / 4; o > 0; o /= 2) amax = fmaxf(amax, ShflXor(amax, o, kGroupLanes));
  float scale, inv;
  GroupScale<kFmt>(amax, ue8m0, scale, inv);
  scale_mine = scale;
  const float scale_o = ShflXor(scale, 8, kGroupLanes), inv_o = ShflXor(inv, 8, kGroupLanes);
  c0 = EncodeChunk<kFmt>(v0, bit3 ? scale_o : scale, bit3 ? inv_o : inv, ue8m0);
  c1 = EncodeChunk<kFmt>(v1, bit3 ? scale : scale_o, bit3 ? inv : inv_o, ue8m0);
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

// Programmatic dependent launch: every kernel calls GridDependencyWait() before its first global
// access, then LaunchDependents() (gpu_runtime.h).
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
  // to q_fp8 (which the compiler must otherwise assume may alias the weights). They are staged as
  // fp32 (unpacked once per block, not once per row): slot i holds elements 0-3 of its chunk at
  // s_wf[i] and 4-7 at s_wf[kSlots + i], so each read is a conflict-free 16-byte access.
  constexpr int kSlots = kResident ? (KQ + KD) * kRowTeam : 1;
  __shared__ float4 s_wf[2 * kSlots];
  float ssq = 0.0f, ssk = 0.0f;
  GridDependencyWait();  // PDL: nothing global is touched before the previous kernel completes
  LaunchDependents();
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
    // Slots [0, KQ*32): q_norm chunks, [KQ*32, (KQ+KD)*32): kv_norm chunks (D % 8 == 0 here);
    // slots past a half's end hold zeros (a masked q chunk then normalises to zeros, as before).
    const int qw = Q / kChunk, kw = D / kChunk;
    for (int i = int(threadIdx.x); i < kSlots; i += int(blockDim.x)) {
      const int kc = i - KQ * kRowTeam;
      uint4 u = make_uint4(0u, 0u, 0u, 0u);
      if (i < qw) u = LoadReadOnly16(p.q_norm + i * kChunk);
      else if (kc >= 0 && kc < kw) u = LoadReadOnly16(p.kv_norm + kc * kChunk);
      float w[kChunk];
      Unpack8(u, w);
      s_wf[i] = make_float4(w[0], w[1], w[2], w[3]);
      s_wf[kSlots + i] = make_float4(w[4], w[5], w[6], w[7]);
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
  float rq, rk;
  RowRrms(ssq, ssk, Q, D, p.eps, lane, rq, rk);

  // ---- q half ----
  const int q_chunks = Q / kChunk;
  if constexpr (kResident && kMode == RowMode::kFused) {
    // Chunks k, k + 1 in pairs (QuantizeGroupPair); an odd last chunk alone. Output addresses
    // from per-row bases: codes at constant offsets, scales one g_stride multiple per pair.
    // (Measured with ncu: 1,314 -> 1,079 warp instructions per row at
    // Q = 1536. Branching once per row on p.ue8m0 instead of per group measured 7% more
    // instructions; three groups per scale sequence needs 72 registers.)
    uint8_t* const q_out = p.q_fp8 + row * Q + lane * kChunk;
    const bool bit3 = (lane & 8) != 0;
    const int half = lane / kGroupLanes;  // 0: groups 2k (and 2k + 2), 1: groups 2k + 1 (2k + 3)
    const int64_t gs = p.scale_layout.g_stride;
    // The group whose scale this lane stores (lanes 0, 8, 16, 24 of the team): 2 (k + bit3) + half.
    float* const s_out = p.q_scale + row * p.scale_layout.m_stride + (2 * int(bit3) + half) * gs;
    const bool store_scale = active && (lane & 7) == 0;
#pragma unroll
    for (int k = 0; k < KQ; k += 2) {
      const int c = lane + k * kRowTeam;
      float y0[kChunk];
      NormalizeW(xq[k], s_wf[c], s_wf[kSlots + c], rq, y0);
      if (k + 1 < KQ) {
        float y1[kChunk];
        NormalizeW(xq[k + 1], s_wf[c + kRowTeam], s_wf[kSlots + c + kRowTeam], rq, y1);
        uint2 c0, c1;
        float scale;
        QuantizeGroupPair<kFmt>(y0, y1, p.ue8m0, bit3, c0, c1, scale);
        if (active && c < q_chunks) StoreQ<true>(q_out + k * kRowTeam * kChunk, c0, true);
        if (active && c + kRowTeam < q_chunks) StoreQ<true>(q_out + (k + 1) * kRowTeam * kChunk, c1, true);
        // This lane's scale belongs to chunk k + bit3, whose group starts at chunk
        // 16 half + 32 (k + bit3).
        if (store_scale && half * kGroupLanes + (k + int(bit3)) * kRowTeam < q_chunks) {
          s_out[int64_t(2 * k) * gs] = scale;
        }
      } else {
        float scale;
        const uint2 codes = QuantizeGroupChunk<kFmt>(y0, p.ue8m0, scale);
        if (active && c < q_chunks) {
          StoreQ<true>(q_out + k * kRowTeam * kChunk, codes, true);
          if (lane % kGroupLanes == 0) s_out[int64_t(2 * k) * gs] = scale;  // bit3 clear: group 2k + half
        }
      }
    }
  } else {
#pragma unroll
  for (int k = 0; k < (kResident ? KQ : 1); ++k) {
    for (int ks = kResident ? k : 0; ks < (kResident ? k + 1 : nq); ++ks) {
      const int c = lane + ks * kRowTeam;
      const bool in_range = c < q_chunks;  // uniform over each 16-lane group (Q % 128 == 0)
      const uint4 x = kResident ? xq[k] : LoadChunk(q_in + c * kChunk, Q - c * kChunk, f.vec_in);
      float y[kChunk];
      if constexpr (kResident) {
        NormalizeW(x, s_wf[c], s_wf[kSlots + c], rq, y);
      } else {
        Normalize(x, LoadChunk(p.q_norm + c * kChunk, Q - c * kChunk, true), rq, y);
      }
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
      float y[kChunk];
      if constexpr (kResident) {
        NormalizeW(x, s_wf[KQ * kRowTeam + c], s_wf[kSlots + KQ * kRowTeam + c], rk, y);
      } else {
        Normalize(x, LoadChunk(p.kv_norm + c * kChunk, valid, true), rk, y);
      }
      StoreBf16<kResident>(p.kv + row * D + c * kChunk, y, valid, f.vec_kv);
    }
  }
}

// Small-M variant: one row per block, one 8-element chunk per thread. Teams [0, nqt) of the block
// hold the q chunks (chunk c on thread c), teams [nqt, nqt + nkt) the kv chunks; a team is 32
// threads and lies in one half only (kRowTeam divides the warp). The per-row dependent chain, which
// is the whole cost at decode sizes, is then one load, one chunk of arithmetic, one reduction and
// one quantization (no thread holds two chunks whose chains would run back to back). The sum of
// squares follows the same fixed tree as SwaRowKernel (chunk partials through shared memory; each
// team replays its half's 32 virtual lanes in order, all loads unrolled, then the butterfly), so
// results are bitwise identical to the 32-thread variant: batch invariance holds across the switch.
constexpr int kWideMaxTeams = 12;  // q: Q <= 2048 (8 teams), kv: D <= 1024 (4 teams)

template <RowMode kMode, Fp8Format kFmt>
__global__ void __launch_bounds__(kWideMaxTeams * kRowTeam) SwaRowWideKernel(SwaRowParams p, int nqt) {
  __shared__ float s_part[kWideMaxTeams * kRowTeam];  // chunk partials: q teams, then kv teams
  const int t = int(threadIdx.x);
  const int64_t row = blockIdx.x;  // grid = tokens: every block has a row
  const int Q = p.q_rank, D = p.head_dim;  // D % 8 == 0 for this variant
  const bool is_q = t < nqt * kRowTeam;   // uniform over each team
  const int c = is_q ? t : t - nqt * kRowTeam;  // chunk index within its half
  const int n = is_q ? Q / kChunk : D / kChunk;  // chunks in this half
  const bool in_range = c < n;  // uniform over each 16-thread group in the q half (Q % 128 == 0)
  const uint16_t* src = p.qr_kv + row * p.row_stride + (is_q ? 0 : Q) + c * kChunk;
  const uint16_t* wsrc = (is_q ? p.q_norm : p.kv_norm) + c * kChunk;
  GridDependencyWait();
  LaunchDependents();
  const uint4 x = in_range ? LoadReadOnly16(src) : make_uint4(0u, 0u, 0u, 0u);
  const uint4 w = in_range ? LoadReadOnly16(wsrc) : make_uint4(0u, 0u, 0u, 0u);
  s_part[t] = ChunkSq(x);  // +0 for a masked chunk: adding it leaves any sum unchanged
  __syncthreads();
  const int l = t % kRowTeam;
  const float* part = s_part + (is_q ? 0 : nqt * kRowTeam);
  const int teams = is_q ? nqt : int(blockDim.x) / kRowTeam - nqt;
  float ss = 0.0f;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    if (j < teams) ss += part[l + j * kRowTeam];
  }
  const float rr = Rrms(TeamSum(ss), is_q ? Q : D, p.eps);
  float y[kChunk];
  Normalize(x, w, rr, y);
  if (is_q) {
    if constexpr (kMode == RowMode::kNormOnly) {
      if (in_range) StoreBf16<true>(p.q_bf16 + row * Q + c * kChunk, y, kChunk, true);
    } else {
      float scale;
      const uint2 codes = QuantizeGroupChunk<kFmt>(y, p.ue8m0, scale);
      if (in_range) {
        StoreQ<true>(p.q_fp8 + row * Q + c * kChunk, codes, true);
        if (c % kGroupLanes == 0) {
          p.q_scale[row * p.scale_layout.m_stride + int64_t(c / kGroupLanes) * p.scale_layout.g_stride] = scale;
        }
      }
      if (row == p.tokens - 1) {
        // The last row's block zero-fills the column-major layout's padding rows (at most 3).
#pragma unroll 1
        for (int g = t; g < Q / kGroup; g += nqt * kRowTeam) {
#pragma unroll 1
          for (int64_t r = p.tokens; r < p.scale_layout.padded_rows; ++r) {
            p.q_scale[r * p.scale_layout.m_stride + g * p.scale_layout.g_stride] = 0.0f;
          }
        }
      }
    }
  } else if (in_range) {
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
  GridDependencyWait();  // the bf16 q comes from the norm kernel just before
  LaunchDependents();
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

}  // namespace fusedlayer::gpu::swa_rows
