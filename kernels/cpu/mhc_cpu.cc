// CPU mHC seam (spec/mhc.md), both paths.
//
//   unfused: three passes over memory, like the GPU kernel chain: Post over all tokens (writes
//            new_residual), then Mix reading new_residual back (writes the mixes), then
//            Collapse + RMSNorm (+ aux) reading new_residual a third time (writes y, aux).
//   fused:   one pass per token block: post, mixes GEMM, Sinkhorn, collapse and norm run while the
//            block's R' is still in the core's L2.
//
// Both paths call the same per-token building blocks, so every output is bitwise identical between
// them. Batch invariance: every reduction below has a fixed order that depends only on (n, C):
// sums over channels use kLanes partial accumulators (lane l takes elements l, l+16, l+32, ... in
// ascending order, the K % 16 tail goes to lanes 0.. in order) followed by a fixed tree. Token
// blocking and the thread split never change a token's arithmetic.
//
// Floating point: this file is compiled with -ffp-contract=off (kernels/cpu/CMakeLists.txt); every
// FMA the contract or our reduction order needs is spelled fmaf(). On x86-64 (GCC) the hot loops
// are cloned for x86-64-v4 (AVX-512) and x86-64-v3 (AVX2 + FMA) and picked at load time (ifunc);
// with contraction off, explicit fmaf and no -ffast-math reassociation, every clone produces the
// same bits as the baseline code (vectorisation maps the 16 lanes onto registers, it never
// reorders a lane's additions). The mixes GEMM also has a hand-tiled AVX-512 form (intrinsics,
// MixLaneSumsAvx512) picked at run time on x86-64-v4 CPUs: register tiles of 4 tokens x 6 fn rows,
// the same per-lane FMA chains, so the same bits (asserted by MhcCpuGemmForms in the suite).
#include "mhc_cpu.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(FUSEDLAYER_NO_MULTIVERSION)
#include <immintrin.h>
#endif

#include "absl/strings/str_cat.h"
#include "fusedlayer/launch_prologue.h"
#include "fusedlayer/numeric.h"

namespace fusedlayer::cpu {
namespace {

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(FUSEDLAYER_NO_MULTIVERSION)
#define FL_MHC_MULTIVERSION __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
// The mixes GEMM has a hand-tiled AVX-512 form (MixLaneSumsAvx512), picked at run time.
#define FL_MHC_AVX512_GEMM 1
#define FL_AVX512_FN __attribute__((target("arch=x86-64-v4")))
#else
#define FL_MHC_MULTIVERSION
#define FL_MHC_AVX512_GEMM 0
#endif

using bf16 = bf16_bits;

constexpr int kLanes = 16;            // partial accumulators per reduction (one AVX-512 / two AVX2 vectors)
constexpr int64_t kTokenBlock = 8;    // tokens per ParallelFor block and per mixes-GEMM token tile
constexpr int64_t kKChunk = 2048;     // GEMM k chunk: 24 fn rows x 2048 x 4 B = 192 KB, L2-resident
constexpr int64_t kFusedTile = 64;    // the fused kernel's channel tile: C % 64 == 0, so no K tails
constexpr int kFusedHcMult = 4;       // the fused kernel is instantiated for n = 4 only

// Fixed reduction tree over the kLanes partial sums: (l, l+8), then (l, l+4), (l, l+2), (0, 1).
FL_FORCE_INLINE float ReduceLanes(const float* a) {
  float t[8];
  for (int l = 0; l < 8; ++l) t[l] = a[l] + a[l + 8];
  for (int l = 0; l < 4; ++l) t[l] = t[l] + t[l + 4];
  for (int l = 0; l < 2; ++l) t[l] = t[l] + t[l + 2];
  return t[0] + t[1];
}

// Everything one call needs, resolved once.
struct Problem {
  const CpuMhcWeights* w;
  const MhcArgs* a;
  int n;
  int64_t C, K;
};

// ---------------------------------------------------------------------------------------------
// Post: R'[j][c] = bf16(fma chain over i of R[i][c] * comb[i][j], started from x[c] * post[j]).
// ---------------------------------------------------------------------------------------------
template <int kN>
FL_FORCE_INLINE void PostToken(const bf16* x, const bf16* R, const float* post, const float* comb, int64_t C,
                               bf16* out) {
  for (int j = 0; j < kN; ++j) {
    const float pj = post[j];
    float cj[kN];
    for (int i = 0; i < kN; ++i) cj[i] = comb[i * kN + j];
    bf16* o = out + j * C;
    for (int64_t c = 0; c < C; ++c) {
      float v = Bf16ToFloat(x[c]) * pj;
      for (int i = 0; i < kN; ++i) v = fmaf(Bf16ToFloat(R[i * C + c]), cj[i], v);
      o[c] = FloatToBf16(v);
    }
  }
}

// First stage: R_0 = the embedding on every stream.
template <int kN>
FL_FORCE_INLINE void BroadcastToken(const bf16* e, int64_t C, bf16* out) {
  for (int j = 0; j < kN; ++j) std::memcpy(out + j * C, e, size_t(C) * sizeof(bf16));
}

// Writes new_residual for tokens [t0, t1).
template <int kN>
FL_MHC_MULTIVERSION void PostBlock(const Problem& p, int64_t t0, int64_t t1) {
  const MhcArgs& a = *p.a;
  const int64_t C = p.C;
  const bf16* x = a.x.ptr<const bf16>();
  bf16* nr = a.new_residual.ptr<bf16>();
  for (int64_t t = t0; t < t1; ++t) {
    if (a.stage == MhcStage::kFirst) {
      BroadcastToken<kN>(x + t * C, C, nr + t * p.K);
    } else {
      PostToken<kN>(x + t * C, a.residual.ptr<const bf16>() + t * p.K, a.post_mix.ptr<const float>() + t * kN,
                    a.comb_mix.ptr<const float>() + t * kN * kN, C, nr + t * p.K);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Mix: S and d[o] for a token tile, then the affine map, sigmoids and Sinkhorn per token.
// ---------------------------------------------------------------------------------------------

// The GEMM's inner kernels. Lane l of a (token, output) pair accumulates k = l, l + 16, ... in
// ascending order. Four output rows share each load of R' (written out row by row: GCC vectorises
// this form into 8 register-resident AVX2 accumulators, a generic [rows][16] array it does not).
FL_FORCE_INLINE void Dot4(const float* rf, const float* f0, const float* f1, const float* f2, const float* f3,
                          int64_t len, float (*acc)[kLanes]) {
  float s0[kLanes], s1[kLanes], s2[kLanes], s3[kLanes];
  for (int l = 0; l < kLanes; ++l) {
    s0[l] = acc[0][l];
    s1[l] = acc[1][l];
    s2[l] = acc[2][l];
    s3[l] = acc[3][l];
  }
  for (int64_t k = 0; k < len; k += kLanes) {
    for (int l = 0; l < kLanes; ++l) {
      const float r = rf[k + l];
      s0[l] = fmaf(r, f0[k + l], s0[l]);
      s1[l] = fmaf(r, f1[k + l], s1[l]);
      s2[l] = fmaf(r, f2[k + l], s2[l]);
      s3[l] = fmaf(r, f3[k + l], s3[l]);
    }
  }
  for (int l = 0; l < kLanes; ++l) {
    acc[0][l] = s0[l];
    acc[1][l] = s1[l];
    acc[2][l] = s2[l];
    acc[3][l] = s3[l];
  }
}

FL_FORCE_INLINE void Dot1(const float* rf, const float* f0, int64_t len, float* acc) {
  float s0[kLanes];
  for (int l = 0; l < kLanes; ++l) s0[l] = acc[l];
  for (int64_t k = 0; k < len; k += kLanes) {
    for (int l = 0; l < kLanes; ++l) s0[l] = fmaf(rf[k + l], f0[k + l], s0[l]);
  }
  for (int l = 0; l < kLanes; ++l) acc[l] = s0[l];
}

// Lane sums of the mixes GEMM over k < k_full (a multiple of kLanes) for nt <= kTokenBlock tokens:
// sacc[t][l] = sum of squares and acc[t][o][l] = dot products of R'_flat (rows of new_residual),
// lane l taking k = l, l + 16, ... in ascending order. acc and sacc come in zeroed. Both versions
// below (and the ISA clones of the generic one) run exactly these per-lane FMA chains; k chunking,
// token/row blocking and register tiling change only the memory access order.
template <int kN>
using MixAcc = float[kN * (kN + 2)][kLanes];

// Generic form (the target_clones vectorise it): per token, four fn rows share each load of R'.
// The k chunking keeps the fn chunk in L2 for every token of the tile.
template <int kN>
FL_MHC_MULTIVERSION void MixLaneSumsGeneric(const Problem& p, int64_t t0, int64_t nt, int64_t k_full,
                                            MixAcc<kN>* acc, float (*sacc)[kLanes]) {
  constexpr int M = kN * (kN + 2);
  const int64_t K = p.K;
  const float* fn = p.w->fn_.data();
  const bf16* rows = p.a->new_residual.ptr<const bf16>() + t0 * K;
  alignas(64) float rf[kKChunk];
  for (int64_t k0 = 0; k0 < k_full; k0 += kKChunk) {
    const int64_t len = std::min(k_full, k0 + kKChunk) - k0;
    for (int64_t t = 0; t < nt; ++t) {
      const bf16* r = rows + t * K + k0;
      for (int64_t k = 0; k < len; ++k) rf[k] = Bf16ToFloat(r[k]);
      float s[kLanes];
      for (int l = 0; l < kLanes; ++l) s[l] = sacc[t][l];
      for (int64_t k = 0; k < len; k += kLanes) {
        for (int l = 0; l < kLanes; ++l) s[l] = fmaf(rf[k + l], rf[k + l], s[l]);
      }
      for (int l = 0; l < kLanes; ++l) sacc[t][l] = s[l];
      int o = 0;
      for (; o + 4 <= M; o += 4) {
        const float* f = fn + int64_t(o) * K + k0;
        Dot4(rf, f, f + K, f + 2 * K, f + 3 * K, len, acc[t] + o);
      }
      for (; o < M; ++o) Dot1(rf, fn + int64_t(o) * K + k0, len, acc[t][o]);
    }
  }
}

#if FL_MHC_AVX512_GEMM
// AVX-512 form: one zmm holds the 16 lanes of one (token, fn row) pair, and a register tile of
// kTok tokens x kRows fn rows shares every load (kTok + kRows loads per kTok * kRows FMAs, against
// 5 per 4 in the generic form), so the fn chunk is read once per 4 tokens instead of once per token.
// _mm512_fmadd_ps(a, b, c) rounds a * b + c once, exactly as fmaf: same bits as the generic form.
constexpr int64_t kKChunkAvx512 = 512;  // 8 tokens x 2 KB of R' + 24 fn rows x 2 KB: L1/L2-resident
constexpr int kRowTileAvx512 = 6;       // 4 x 6 accumulators + 4 R' vectors + 1 fn vector = 29 zmm

template <int kTok, int kRows>
FL_AVX512_FN FL_FORCE_INLINE void DotTileAvx512(const float* rf, const float* f, int64_t K, int64_t len, float* acc,
                                                int64_t acc_tok_stride) {
  __m512 s[kTok][kRows];
#pragma GCC unroll 8
  for (int t = 0; t < kTok; ++t) {
#pragma GCC unroll 8
    for (int r = 0; r < kRows; ++r) s[t][r] = _mm512_load_ps(acc + t * acc_tok_stride + r * kLanes);
  }
  for (int64_t k = 0; k < len; k += kLanes) {
    __m512 x[kTok];
#pragma GCC unroll 8
    for (int t = 0; t < kTok; ++t) x[t] = _mm512_load_ps(rf + t * kKChunkAvx512 + k);
#pragma GCC unroll 8
    for (int r = 0; r < kRows; ++r) {
      const __m512 fv = _mm512_loadu_ps(f + r * K + k);
#pragma GCC unroll 8
      for (int t = 0; t < kTok; ++t) s[t][r] = _mm512_fmadd_ps(x[t], fv, s[t][r]);
    }
  }
#pragma GCC unroll 8
  for (int t = 0; t < kTok; ++t) {
#pragma GCC unroll 8
    for (int r = 0; r < kRows; ++r) _mm512_store_ps(acc + t * acc_tok_stride + r * kLanes, s[t][r]);
  }
}

// kRows fn rows against all nt tokens, four tokens per register tile.
template <int kRows>
FL_AVX512_FN FL_FORCE_INLINE void DotRowsAvx512(const float* rf, const float* f, int64_t K, int64_t len, int64_t nt,
                                                float* acc, int64_t acc_tok_stride) {
  int64_t t = 0;
  for (; t + 4 <= nt; t += 4) {
    DotTileAvx512<4, kRows>(rf + t * kKChunkAvx512, f, K, len, acc + t * acc_tok_stride, acc_tok_stride);
  }
  const float* rt = rf + t * kKChunkAvx512;
  float* at = acc + t * acc_tok_stride;
  switch (nt - t) {
    case 3: DotTileAvx512<3, kRows>(rt, f, K, len, at, acc_tok_stride); break;
    case 2: DotTileAvx512<2, kRows>(rt, f, K, len, at, acc_tok_stride); break;
    case 1: DotTileAvx512<1, kRows>(rt, f, K, len, at, acc_tok_stride); break;
    default: break;
  }
}

template <int kN>
FL_AVX512_FN void MixLaneSumsAvx512(const Problem& p, int64_t t0, int64_t nt, int64_t k_full, MixAcc<kN>* acc,
                                    float (*sacc)[kLanes]) {
  constexpr int M = kN * (kN + 2);
  constexpr int64_t kAccTokStride = int64_t(M) * kLanes;
  const int64_t K = p.K;
  const float* fn = p.w->fn_.data();
  const bf16* rows = p.a->new_residual.ptr<const bf16>() + t0 * K;
  alignas(64) float rf[kTokenBlock][kKChunkAvx512];
  for (int64_t k0 = 0; k0 < k_full; k0 += kKChunkAvx512) {
    const int64_t len = std::min(k_full, k0 + kKChunkAvx512) - k0;
    for (int64_t t = 0; t < nt; ++t) {
      // bf16 -> fp32 is a 16-bit shift (exact), then the sum of squares in the same lane order.
      const bf16* r = rows + t * K + k0;
      __m512 ss = _mm512_load_ps(sacc[t]);
      for (int64_t k = 0; k < len; k += kLanes) {
        const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r + k));
        const __m512 v = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
        _mm512_store_ps(rf[t] + k, v);
        ss = _mm512_fmadd_ps(v, v, ss);
      }
      _mm512_store_ps(sacc[t], ss);
    }
    const float* f = fn + k0;
    int o = 0;
    for (; o + kRowTileAvx512 <= M; o += kRowTileAvx512) {
      DotRowsAvx512<kRowTileAvx512>(rf[0], f + int64_t(o) * K, K, len, nt, acc[0][o], kAccTokStride);
    }
    for (; o < M; ++o) DotRowsAvx512<1>(rf[0], f + int64_t(o) * K, K, len, nt, acc[0][o], kAccTokStride);
  }
}

// Tests compare the two forms bitwise (SetMhcCpuAvx512ForTesting).
std::atomic<bool> g_allow_avx512_gemm{true};

// The same ISA level the target attribute compiles for (AVX-512 F/BW/DQ/VL and everything below),
// i.e. the level whose target_clones the loader would pick.
bool CpuHasAvx512Gemm() {
  static const bool supported = __builtin_cpu_supports("x86-64-v4");
  return supported;
}

bool UseAvx512Gemm() { return CpuHasAvx512Gemm() && g_allow_avx512_gemm.load(std::memory_order_relaxed); }
#endif  // FL_MHC_AVX512_GEMM

// Sum of squares and the M dot products of R'_flat for tokens [t0, t1), t1 - t0 <= kTokenBlock.
template <int kN, bool kFullTiles>
FL_MHC_MULTIVERSION void MixDotsBlock(const Problem& p, int64_t t0, int64_t t1, float* d /*[nt][M]*/,
                                      float* S /*[nt]*/) {
  constexpr int M = kN * (kN + 2);
  const int64_t K = p.K, nt = t1 - t0;
  const float* fn = p.w->fn_.data();
  const bf16* rows = p.a->new_residual.ptr<const bf16>() + t0 * K;
  alignas(64) float acc[kTokenBlock][M][kLanes];
  alignas(64) float sacc[kTokenBlock][kLanes];
  std::memset(acc, 0, sizeof(acc));
  std::memset(sacc, 0, sizeof(sacc));
  const int64_t k_full = kFullTiles ? K : K / kLanes * kLanes;
#if FL_MHC_AVX512_GEMM
  if (UseAvx512Gemm()) {
    MixLaneSumsAvx512<kN>(p, t0, nt, k_full, acc, sacc);
  } else {
    MixLaneSumsGeneric<kN>(p, t0, nt, k_full, acc, sacc);
  }
#else
  MixLaneSumsGeneric<kN>(p, t0, nt, k_full, acc, sacc);
#endif
  if constexpr (!kFullTiles) {
    // K % 16 tail: element k_full + l goes to lane l, after the lane's full-width terms.
    for (int64_t t = 0; t < nt; ++t) {
      const bf16* r = rows + t * K;
      for (int64_t k = k_full; k < K; ++k) {
        const float v = Bf16ToFloat(r[k]);
        sacc[t][k - k_full] = fmaf(v, v, sacc[t][k - k_full]);
        for (int o = 0; o < M; ++o) acc[t][o][k - k_full] = fmaf(v, fn[int64_t(o) * K + k], acc[t][o][k - k_full]);
      }
    }
  }
  for (int64_t t = 0; t < nt; ++t) {
    S[t] = ReduceLanes(sacc[t]);
    for (int o = 0; o < M; ++o) d[t * M + o] = ReduceLanes(acc[t][o]);
  }
}

FL_FORCE_INLINE float Sigmoid(float v) { return 1.0f / (1.0f + expf(-v)); }

// a[o] = (r * d[o]) * alpha[g(o)] + b[o]; pre/post sigmoids; Sinkhorn on the comb logits.
template <int kN>
void MixFinishToken(const Problem& p, const float* d, float S, float* pre, float* post, float* comb) {
  const MhcHyperParams& hp = p.w->params_;
  const float* alpha = p.w->scale_.data();
  const float* b = p.w->base_.data();
  const float r = 1.0f / sqrtf(S / float(p.K) + hp.hc_norm_eps);
  for (int j = 0; j < kN; ++j) {
    pre[j] = Sigmoid((r * d[j]) * alpha[0] + b[j]) + hp.hc_pre_eps;
    post[j] = Sigmoid((r * d[kN + j]) * alpha[1] + b[kN + j]) * hp.post_scale;
  }
  float P[kN][kN];
  for (int i = 0; i < kN; ++i) {
    float mx = -INFINITY;
    for (int j = 0; j < kN; ++j) {
      P[i][j] = (r * d[2 * kN + kN * i + j]) * alpha[2] + b[2 * kN + kN * i + j];
      mx = std::max(mx, P[i][j]);
    }
    float sum = 0.0f;
    for (int j = 0; j < kN; ++j) {
      P[i][j] = expf(P[i][j] - mx);
      sum += P[i][j];
    }
    for (int j = 0; j < kN; ++j) P[i][j] = P[i][j] / sum + hp.sinkhorn_eps;
  }
  auto column_step = [&] {
    for (int j = 0; j < kN; ++j) {
      float sum = 0.0f;
      for (int i = 0; i < kN; ++i) sum += P[i][j];
      const float den = sum + hp.sinkhorn_eps;
      for (int i = 0; i < kN; ++i) P[i][j] /= den;
    }
  };
  column_step();
  for (int it = 1; it < hp.sinkhorn_iters; ++it) {
    for (int i = 0; i < kN; ++i) {
      float sum = 0.0f;
      for (int j = 0; j < kN; ++j) sum += P[i][j];
      const float den = sum + hp.sinkhorn_eps;
      for (int j = 0; j < kN; ++j) P[i][j] /= den;
    }
    column_step();
  }
  for (int i = 0; i < kN; ++i)
    for (int j = 0; j < kN; ++j) comb[i * kN + j] = P[i][j];
}

// Mixes for tokens [t0, t1) (t1 - t0 <= kTokenBlock), read from new_residual.
template <int kN, bool kFullTiles>
void MixBlock(const Problem& p, int64_t t0, int64_t t1) {
  constexpr int M = kN * (kN + 2);
  float d[kTokenBlock * M];
  float S[kTokenBlock];
  MixDotsBlock<kN, kFullTiles>(p, t0, t1, d, S);
  const MhcArgs& a = *p.a;
  for (int64_t t = t0; t < t1; ++t) {
    MixFinishToken<kN>(p, d + (t - t0) * M, S[t - t0], a.new_pre_mix.ptr<float>() + t * kN,
                       a.new_post_mix.ptr<float>() + t * kN, a.new_comb_mix.ptr<float>() + t * kN * kN);
  }
}

// ---------------------------------------------------------------------------------------------
// Collapse + RMSNorm (+ aux), per token. z goes to y first (bf16, as the contract rounds it), its
// sum of squares is taken from the rounded values, then y is normalised in place.
// ---------------------------------------------------------------------------------------------
template <int kN>
FL_FORCE_INLINE void CollapseNormToken(const bf16* Rp, const float* coef /*nullptr: stream 0*/, const bf16* g,
                                       float norm_eps, int64_t C, bf16* y) {
  if (coef == nullptr) {
    std::memcpy(y, Rp, size_t(C) * sizeof(bf16));
  } else {
    float cf[kN];
    for (int j = 0; j < kN; ++j) cf[j] = coef[j];
    for (int64_t c = 0; c < C; ++c) {
      float acc = 0.0f;
      for (int j = 0; j < kN; ++j) acc = fmaf(cf[j], Bf16ToFloat(Rp[j * C + c]), acc);
      y[c] = FloatToBf16(acc);
    }
  }
  if (g == nullptr) return;  // no norm weight: y is the un-normalised bf16 collapse
  float s[kLanes] = {};
  const int64_t c_full = C / kLanes * kLanes;
  for (int64_t c0 = 0; c0 < c_full; c0 += kLanes) {
    for (int l = 0; l < kLanes; ++l) {
      const float z = Bf16ToFloat(y[c0 + l]);
      s[l] = fmaf(z, z, s[l]);
    }
  }
  for (int64_t c = c_full; c < C; ++c) {
    const float z = Bf16ToFloat(y[c]);
    s[c - c_full] = fmaf(z, z, s[c - c_full]);
  }
  const float rho = 1.0f / sqrtf(ReduceLanes(s) / float(C) + norm_eps);
  for (int64_t c = 0; c < C; ++c) y[c] = FloatToBf16((Bf16ToFloat(y[c]) * rho) * Bf16ToFloat(g[c]));
}

// aux[c] = bf16((sum_j R'[j][c]) / n), summed in stream order.
template <int kN>
FL_FORCE_INLINE void AuxToken(const bf16* Rp, int64_t C, bf16* aux) {
  const float den = float(kN);
  for (int64_t c = 0; c < C; ++c) {
    float s = Bf16ToFloat(Rp[c]);
    for (int j = 1; j < kN; ++j) s += Bf16ToFloat(Rp[j * C + c]);
    aux[c] = FloatToBf16(s / den);
  }
}

// y (and aux) for tokens [t0, t1), from new_residual and, in normal mode, new_pre_mix.
template <int kN>
FL_MHC_MULTIVERSION void CollapseBlock(const Problem& p, int64_t t0, int64_t t1) {
  const MhcArgs& a = *p.a;
  const int64_t C = p.C;
  const bf16* g = p.w->norm_weight_.empty() ? nullptr : p.w->norm_weight_.data();
  const float eps = p.w->params_.norm_eps;
  for (int64_t t = t0; t < t1; ++t) {
    const bf16* Rp = a.new_residual.ptr<const bf16>() + t * p.K;
    bf16* y = a.y.ptr<bf16>() + t * C;
    const float* coef = nullptr;
    if (a.mode == MhcMode::kNormal) {
      coef = a.new_pre_mix.ptr<const float>() + t * kN;
    } else if (a.stage != MhcStage::kFirst && !a.pre_mix.empty_view()) {
      coef = a.pre_mix.ptr<const float>() + t * kN;
    }
    // first + shifted: y = RMSNorm(e) and every stream of R_0 is e, so stream 0 is exactly e.
    CollapseNormToken<kN>(Rp, coef, g, eps, C, y);
    if (a.capture_aux) AuxToken<kN>(Rp, C, a.aux.ptr<bf16>() + t * C);
  }
}

// ---------------------------------------------------------------------------------------------
// The two paths.
// ---------------------------------------------------------------------------------------------
template <int kN>
void RunUnfused(const Problem& p, ThreadPool& pool) {
  const int64_t T = p.a->tokens;
  const bool has_mixes = p.a->stage != MhcStage::kHead;
  pool.ParallelFor(T, kTokenBlock, [&](int64_t t0, int64_t t1) { PostBlock<kN>(p, t0, t1); });
  if (has_mixes) {
    pool.ParallelFor(T, kTokenBlock, [&](int64_t t0, int64_t t1) { MixBlock<kN, false>(p, t0, t1); });
  }
  pool.ParallelFor(T, kTokenBlock, [&](int64_t t0, int64_t t1) { CollapseBlock<kN>(p, t0, t1); });
}

void RunFused(const Problem& p, ThreadPool& pool) {
  constexpr int kN = kFusedHcMult;
  const bool has_mixes = p.a->stage != MhcStage::kHead;
  pool.ParallelFor(p.a->tokens, kTokenBlock, [&](int64_t t0, int64_t t1) {
    PostBlock<kN>(p, t0, t1);
    if (has_mixes) MixBlock<kN, true>(p, t0, t1);
    CollapseBlock<kN>(p, t0, t1);
  });
}

void RunUnfusedAnyN(const Problem& p, ThreadPool& pool) {
  switch (p.n) {
    case 1: return RunUnfused<1>(p, pool);
    case 2: return RunUnfused<2>(p, pool);
    case 3: return RunUnfused<3>(p, pool);
    case 4: return RunUnfused<4>(p, pool);
    case 5: return RunUnfused<5>(p, pool);
    case 6: return RunUnfused<6>(p, pool);
    case 7: return RunUnfused<7>(p, pool);
    case 8: return RunUnfused<8>(p, pool);
  }
}

}  // namespace

bool SetMhcCpuAvx512ForTesting(bool allow) {
#if FL_MHC_AVX512_GEMM
  g_allow_avx512_gemm.store(allow, std::memory_order_relaxed);
  return CpuHasAvx512Gemm();
#else
  (void)allow;
  return false;
#endif
}

size_t CpuMhcWeights::resident_bytes() const {
  return fn_.size() * sizeof(float) + scale_.size() * sizeof(float) + base_.size() * sizeof(float) +
         norm_weight_.size() * sizeof(uint16_t);
}

absl::StatusOr<std::unique_ptr<CpuMhcWeights>> PrepareMhcCpu(const MhcHyperParams& params,
                                                              const MhcWeightsHost& weights) {
  if (absl::Status s = params.Validate(); !s.ok()) return s;
  const int64_t M = params.num_mixes(), K = params.flat_width(), C = params.hidden;
  absl::Status s;
  if (!(s = ExpectTensor(weights.fn, "fn", DType::kFP32, {M, K})).ok()) return s;
  if (!(s = ExpectTensor(weights.scale, "scale", DType::kFP32, {3})).ok()) return s;
  if (!(s = ExpectTensor(weights.base, "base", DType::kFP32, {M})).ok()) return s;
  const bool has_norm = !weights.norm_weight.empty_view();
  if (has_norm && !(s = ExpectTensor(weights.norm_weight, "norm_weight", DType::kBF16, {C})).ok()) return s;

  auto w = std::make_unique<CpuMhcWeights>();
  w->params_ = params;
  const float* fn = weights.fn.ptr<const float>();
  w->fn_.assign(fn, fn + M * K);
  w->scale_.assign(weights.scale.ptr<const float>(), weights.scale.ptr<const float>() + 3);
  w->base_.assign(weights.base.ptr<const float>(), weights.base.ptr<const float>() + M);
  if (has_norm) {
    w->norm_weight_.assign(weights.norm_weight.ptr<const uint16_t>(), weights.norm_weight.ptr<const uint16_t>() + C);
  }
  return w;
}

FusedSupport MhcFusedSupportCpu(const CpuMhcWeights& weights, const MhcShapeQuery& query, int64_t fused_max_tokens) {
  const MhcHyperParams& p = weights.params();
  if (p.hc_mult != kFusedHcMult) {
    return FusedSupport::No(FallbackReason::kHcMultUnsupported,
                            absl::StrCat("the CPU fused mHC kernel is specialised for hc_mult = ", kFusedHcMult,
                                         ", got ", p.hc_mult));
  }
  if (p.hidden % kFusedTile != 0) {
    return FusedSupport::No(FallbackReason::kHiddenSizeUnsupported,
                            absl::StrCat("C = ", p.hidden, " is not a multiple of the CPU fused kernel's tile ",
                                         kFusedTile));
  }
  if (query.tokens > fused_max_tokens) {
    return FusedSupport::No(FallbackReason::kTooManyTokens,
                            absl::StrCat("T = ", query.tokens, " exceeds fused_max_tokens = ", fused_max_tokens));
  }
  return FusedSupport::Yes();
}

absl::Status RunMhcCpu(const CpuMhcWeights& weights, const MhcArgs& args, Path path, int64_t fused_max_tokens,
                       ThreadPool& pool) {
  const MhcHyperParams& hp = weights.params();
  if (absl::Status s = MhcLaunchPrologue(weights, args, path,
                                         [&](const MhcShapeQuery& q) {
                                           return MhcFusedSupportCpu(weights, q, fused_max_tokens);
                                         });
      !s.ok()) {
    return s;
  }
  if (args.tokens == 0) return absl::OkStatus();
  Problem p{&weights, &args, hp.hc_mult, hp.hidden, hp.flat_width()};
  if (path == Path::kFused) {
    RunFused(p, pool);
  } else {
    RunUnfusedAnyN(p, pool);
  }
  return absl::OkStatus();
}

}  // namespace fusedlayer::cpu
