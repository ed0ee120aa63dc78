// Bit-equivalence check of the finalize kernel's register Sinkhorn (kernels/gpu/DESIGN.md):
// the register Sinkhorn and per-lane gates of MixWarp4 (CombSinkhornRegs4, mhc_device_math.cuh)
// against the code they replaced, copied verbatim below (CombSinkhornLanes4: xor butterflies over
// the lanes; gates: ComputePre / ComputePost on lane 0). Random dots with outliers (including
// +-1e30, huge logits that saturate the softmax, and zero / denormal sums of squares), several
// sinkhorn_iters and eps values; every output must match bit for bit. A one-off device check, not
// a ctest test: it needs a GPU and compares against code no longer in the tree.
//   nvcc -std=c++20 -O3 -arch=sm_90a -Ikernels/gpu -Ikernels/include \
//     bench/experiments/sinkhorn_bits_check/sinkhorn_bits_check.cu -o sinkhorn_bits_check && ./sinkhorn_bits_check
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "device/mhc_device_math.cuh"

using namespace fusedlayer::gpu;
using namespace fusedlayer::gpu::mhc;

namespace {
constexpr int N = 4, M = N * (N + 2);

// Verbatim from mhc_device_math.cuh at mhc-gpu 95921bf.
__device__ __forceinline__ float CombSinkhornLanes4(const float* d, float S, float K, const float* scale,
                                                    const float* base, const MixHyper& h, int lane) {
  const float r = RsqrtMean(S, K, h.hc_norm_eps);
  const int o = 8 + (lane & 15);  // 2n + n*i + j with n = 4
  const float v = MixLogit(r, d[o], scale[2], base[o]);
  float mx = fmaxf(v, ShflXor(v, 1));
  mx = fmaxf(mx, ShflXor(mx, 2));
  const float e = expf(__fsub_rn(v, mx));
  float s = __fadd_rn(e, ShflXor(e, 1));
  s = __fadd_rn(s, ShflXor(s, 2));
  float P = __fadd_rn(__fdiv_rn(e, s), h.sinkhorn_eps);
  auto column_step = [&] {
    float c = __fadd_rn(P, ShflXor(P, 4));
    c = __fadd_rn(c, ShflXor(c, 8));
    P = __fmul_rn(P, SinkhornRcp(__fadd_rn(c, h.sinkhorn_eps)));
  };
  column_step();
  for (int it = 1; it < h.sinkhorn_iters; ++it) {
    float rs = __fadd_rn(P, ShflXor(P, 1));
    rs = __fadd_rn(rs, ShflXor(rs, 2));
    P = __fmul_rn(P, SinkhornRcp(__fadd_rn(rs, h.sinkhorn_eps)));
    column_step();
  }
  return P;
}

// One warp per token; out[t][0..15] comb, [16..19] pre, [20..23] post.
__global__ void OldKernel(const float* dots, float K, const float* scale, const float* base, MixHyper h, int T,
                          float* out) {
  const int lane = threadIdx.x % 32, t = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  if (t >= T) return;
  const float* d = dots + t * (M + 1);
  const float P = CombSinkhornLanes4(d, d[M], K, scale, base, h, lane);
  if (lane < 16) out[t * 24 + lane] = P;
  if (lane == 0) {
    float pre[N], post[N];
    ComputePre<N>(d, d[M], K, scale, base, h, pre);
    ComputePost<N>(d, d[M], K, scale, base, h, post);
    for (int j = 0; j < N; ++j) {
      out[t * 24 + 16 + j] = pre[j];
      out[t * 24 + 20 + j] = post[j];
    }
  }
}

// The new MixWarp4 tail, as in mhc_finalize_kernel.cuh.
__global__ void NewKernel(const float* dots, float K, const float* scale, const float* base, MixHyper h, int T,
                          float* out) {
  const int lane = threadIdx.x % 32, t = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  if (t >= T) return;
  const float* d = dots + t * (M + 1);
  const float r = RsqrtMean(d[M], K, h.hc_norm_eps);
  const int g = lane & (2 * N - 1);
  const float gate = Sigmoid(MixLogit(r, d[g], g < N ? scale[0] : scale[1], base[g]));
  const float gate_out = g < N ? __fadd_rn(gate, h.hc_pre_eps) : __fmul_rn(gate, h.post_scale);
  const float P = CombSinkhornRegs4(d, r, scale, base, h, lane);
  if (lane < 16) out[t * 24 + lane] = P;
  if (lane < 2 * N) out[t * 24 + 16 + lane] = gate_out;
}

#define CK(x)                                                                    \
  do {                                                                           \
    cudaError_t e_ = (x);                                                        \
    if (e_ != cudaSuccess) {                                                     \
      std::printf("CUDA error %s at %s:%d\n", cudaGetErrorString(e_), __FILE__, __LINE__); \
      return 2;                                                                  \
    }                                                                            \
  } while (0)
}  // namespace

int main() {
  constexpr int T = 1 << 16;
  std::mt19937 rng(20261202);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::uniform_real_distribution<float> ud(0.0f, 1.0f);
  long long mismatches = 0, compared = 0;
  const int iters_list[] = {1, 2, 20, 37};
  const float eps_list[] = {1e-6f, 0.0f, 1e-3f};
  for (int iters : iters_list)
    for (float seps : eps_list) {
      std::vector<float> dots(size_t(T) * (M + 1)), scale(3), base(M);
      for (int t = 0; t < T; ++t) {
        float* d = dots.data() + size_t(t) * (M + 1);
        const float mag = std::exp(nd(rng) * 3.0f);
        for (int o = 0; o < M; ++o) {
          float v = nd(rng) * mag;
          const float u = ud(rng);
          if (u < 0.01f) v = (u < 0.005f ? 1e30f : -1e30f);
          else if (u < 0.03f) v *= 1e4f;
          else if (u < 0.04f) v = 0.0f;
          d[o] = v;
        }
        const float us = ud(rng);
        d[M] = us < 0.01f ? 0.0f : (us < 0.02f ? 1e-42f : std::fabs(nd(rng)) * mag * mag * 4 * 7168);
      }
      for (int i = 0; i < 3; ++i) scale[i] = 0.5f + ud(rng);
      for (int o = 0; o < M; ++o) base[o] = nd(rng);
      const MixHyper h{1e-6f, 1e-6f, 1e-2f, seps, 2.0f, iters};
      float *dd, *ds, *db, *o1, *o2;
      CK(cudaMalloc(&dd, dots.size() * 4));
      CK(cudaMalloc(&ds, 12));
      CK(cudaMalloc(&db, M * 4));
      CK(cudaMalloc(&o1, size_t(T) * 24 * 4));
      CK(cudaMalloc(&o2, size_t(T) * 24 * 4));
      CK(cudaMemcpy(dd, dots.data(), dots.size() * 4, cudaMemcpyHostToDevice));
      CK(cudaMemcpy(ds, scale.data(), 12, cudaMemcpyHostToDevice));
      CK(cudaMemcpy(db, base.data(), M * 4, cudaMemcpyHostToDevice));
      CK(cudaMemset(o1, 0xff, size_t(T) * 24 * 4));  // poison (NaN pattern) before each run
      CK(cudaMemset(o2, 0x7f, size_t(T) * 24 * 4));
      const float K = 4.0f * 7168;
      OldKernel<<<T / 8, 256>>>(dd, K, ds, db, h, T, o1);
      NewKernel<<<T / 8, 256>>>(dd, K, ds, db, h, T, o2);
      CK(cudaGetLastError());
      CK(cudaDeviceSynchronize());
      std::vector<uint32_t> a(size_t(T) * 24), b(size_t(T) * 24);
      CK(cudaMemcpy(a.data(), o1, a.size() * 4, cudaMemcpyDeviceToHost));
      CK(cudaMemcpy(b.data(), o2, b.size() * 4, cudaMemcpyDeviceToHost));
      long long mm = 0, nan = 0;
      for (size_t i = 0; i < a.size(); ++i) {
        mm += a[i] != b[i];
        float f;
        std::memcpy(&f, &a[i], 4);
        nan += f != f;
      }
      std::printf("iters=%d sinkhorn_eps=%g: %zu values, %lld differ, %lld NaN in the old output\n", iters, seps,
                  a.size(), mm, nan);
      mismatches += mm;
      compared += (long long)a.size();
      cudaFree(dd); cudaFree(ds); cudaFree(db); cudaFree(o1); cudaFree(o2);
    }
  std::printf("sinkhorn_bits_check: %lld values compared, %lld differ -> %s\n", compared, mismatches,
              mismatches == 0 ? "PASS" : "FAIL");
  return mismatches == 0 ? 0 : 1;
}
