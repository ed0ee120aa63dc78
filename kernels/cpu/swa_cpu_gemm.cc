#include "swa_cpu_gemm.h"

#include <algorithm>
#include <array>
#include <vector>

#include "swa_cpu_simd.h"

namespace fusedlayer::cpu::swa {
namespace {

constexpr int64_t kBlk = 128;   // K block of the scales, and the N block of the weight scales
constexpr int64_t kTileM = 64;  // tokens per task: the decoded weight tile is reused this many times
constexpr int64_t kTileN = 128; // weight rows per task (one weight-scale row)

// fp8 code -> float, once per format (numeric.h is the definition).
struct Fp8Lut {
  std::array<float, 256> v;
  explicit Fp8Lut(Fp8Format f) {
    for (int c = 0; c < 256; ++c) v[c] = Fp8ToFloat(fp8_bits(c), f);
  }
};
const Fp8Lut& LutFor(Fp8Format f) {
  static const Fp8Lut fn(Fp8Format::kE4M3FN), fnuz(Fp8Format::kE4M3FNUZ);
  return f == Fp8Format::kE4M3FN ? fn : fnuz;
}

// A register tile of 16 floats (one zmm on AVX-512, two ymm on AVX2, four xmm on SSE2): GCC vector
// extensions keep the accumulators in registers on every clone.
typedef float V16 __attribute__((vector_size(64), aligned(4)));  // loads need no 64-byte alignment
constexpr int64_t kChunkN = 64;  // columns per register tile: 4 vectors

// acc[r][n] += s[r] * sum_k a[r][k] * bt[k][n] for R tokens and one 128-deep K block. Each output
// adds its 128 products in k order (products and sums rounded separately; no FMA, see CMakeLists),
// so the result is the same for any R, any clone and any tiling.
template <int R>
FL_FORCE_INLINE void TileKernel(const float* a, const float* bt, const float* s, float* acc) {
  for (int64_t nc = 0; nc < kTileN; nc += kChunkN) {
    V16 d[R][4];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < 4; ++j) d[r][j] = V16{};
    for (int64_t k = 0; k < kBlk; ++k) {
      const V16* br = reinterpret_cast<const V16*>(bt + k * kTileN + nc);
      const V16 b0 = br[0], b1 = br[1], b2 = br[2], b3 = br[3];
      for (int r = 0; r < R; ++r) {
        const float x = a[r * kBlk + k];
        d[r][0] += x * b0;
        d[r][1] += x * b1;
        d[r][2] += x * b2;
        d[r][3] += x * b3;
      }
    }
    for (int r = 0; r < R; ++r) {
      V16* c = reinterpret_cast<V16*>(acc + r * kTileN + nc);
      for (int j = 0; j < 4; ++j) c[j] += s[r] * d[r][j];
    }
  }
}

FL_SWA_MULTIVERSION
void BlockMicroKernel(const float* a, const float* bt, const float* s, int64_t mt, float* acc) {
  int64_t m = 0;
  for (; m + 4 <= mt; m += 4) TileKernel<4>(a + m * kBlk, bt, s + m, acc + m * kTileN);
  switch (mt - m) {
    case 3: TileKernel<3>(a + m * kBlk, bt, s + m, acc + m * kTileN); break;
    case 2: TileKernel<2>(a + m * kBlk, bt, s + m, acc + m * kTileN); break;
    case 1: TileKernel<1>(a + m * kBlk, bt, s + m, acc + m * kTileN); break;
    default: break;
  }
}

// Per-thread tile buffers (128 KiB; kept off the stack of whatever thread drives the pool).
void TileScratch(float** bt, float** af, float** acc) {
  thread_local std::vector<float> mem(kBlk * kTileN + kTileM * kBlk + kTileM * kTileN);
  *bt = mem.data();
  *af = *bt + kBlk * kTileN;
  *acc = *af + kTileM * kBlk;
}

}  // namespace

void BlockScaledFp8Gemm(const GemmA& a, const GemmB& b, int64_t M, int64_t N, int64_t K, Fp8Format fmt,
                        uint16_t* out, ThreadPool& pool) {
  if (M <= 0 || N <= 0) return;
  const float* lut = LutFor(fmt).v.data();
  const int64_t KB = K / kBlk;
  const int64_t m_tiles = (M + kTileM - 1) / kTileM;
  const int64_t n_tiles = N / kTileN;
  // Tasks are (token tile, weight-row tile) pairs; n varies fastest so that at decode (one token
  // tile) the threads split the weight rows. Tiling never changes any output's arithmetic.
  pool.ParallelFor(m_tiles * n_tiles, 1, [&](int64_t t0, int64_t t1) {
    float* bt = nullptr;   // decoded weight tile, transposed to [k][n]
    float* af = nullptr;   // decoded activation tile [m][k]
    float* acc = nullptr;  // [m][n]
    TileScratch(&bt, &af, &acc);
    float s[kTileM];
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t m0 = (t / n_tiles) * kTileM, nt = t % n_tiles, n0 = nt * kTileN;
      const int64_t mt = std::min(kTileM, M - m0);
      std::fill(acc, acc + mt * kTileN, 0.0f);
      for (int64_t kb = 0; kb < KB; ++kb) {
        for (int64_t n = 0; n < kTileN; ++n) {
          const uint8_t* row = b.codes + (n0 + n) * K + kb * kBlk;
          for (int64_t k = 0; k < kBlk; ++k) bt[k * kTileN + n] = lut[row[k]];
        }
        const float bs = b.scale[nt * KB + kb];
        for (int64_t m = 0; m < mt; ++m) {
          const uint8_t* row = a.codes + (m0 + m) * K + kb * kBlk;
          for (int64_t k = 0; k < kBlk; ++k) af[m * kBlk + k] = lut[row[k]];
          s[m] = a.scale[(m0 + m) * a.scale_row + kb * a.scale_col] * bs;
        }
        BlockMicroKernel(af, bt, s, mt, acc);
      }
      for (int64_t m = 0; m < mt; ++m) {
        uint16_t* o = out + (m0 + m) * N + n0;
        for (int64_t n = 0; n < kTileN; ++n) o[n] = FloatToBf16(acc[m * kTileN + n]);
      }
    }
  });
}

}  // namespace fusedlayer::cpu::swa
