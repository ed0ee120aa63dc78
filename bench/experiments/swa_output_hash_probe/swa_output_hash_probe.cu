// SWA output-hash probe (not built by CMake): runs the fused launcher and the unfused chain
// (norm rows + group quant) on fixed pseudo-random inputs (outliers, all-zero groups, NaN, inf, -0,
// 1e+-30 rows; weights with -0 and 3e37) over 160 configurations (Q 128..2048, D 256/512/1024,
// M 16..4099, row stride +0/+8, e4m3fn/e4m3fnuz, fp32/UE8M0, row-/column-major scales, the
// one-row-per-block kernel forced off and on) and prints an FNV-1a hash of every output byte per
// configuration. Build it once against the reference kernel source and once against the changed one;
// a kernel change that claims bit-exactness must print identical lines.
//   W=/path/to/tree; F="-O2 -DNDEBUG -DFUSEDLAYER_HAS_GPU=1 -arch=sm_90a -std=c++20 -I$W/kernels/include -I$W/kernels/cpu"
//   nvcc $F -I<dir with the reference swa_kernel_launch.h> -I$W/kernels/gpu -o probe_ref swa_output_hash_probe.cu <the reference swa_row_launch.cu>
//   nvcc $F -I$W/kernels/gpu -o probe_new swa_output_hash_probe.cu $W/kernels/gpu/swa_row_launch.cu
//   ./probe_ref > ref.txt; ./probe_new > new.txt; cmp ref.txt new.txt
#include "gpu_runtime.h"
#include "swa_kernel_launch.h"
#include <cstdio>
#include <cstring>
#include <vector>
#include <random>
#include <cmath>
using namespace fusedlayer;
using namespace fusedlayer::gpu;
#define CK(x) do { auto e_ = (x); if (e_ != cudaSuccess) { printf("ERR %s line %d: %s\n", #x, __LINE__, cudaGetErrorString(e_)); return 1; } } while (0)
static uint64_t Fnv(const void* p, size_t n, uint64_t h = 1469598103934665603ull) {
  const uint8_t* b = (const uint8_t*)p; for (size_t i = 0; i < n; ++i) { h ^= b[i]; h *= 1099511628211ull; } return h;
}
int main() {
  std::mt19937_64 rng(42);
  std::normal_distribution<float> nd(0.f, 1.f);
  int sms = 132; cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  struct Cfg { int Q, D; int64_t M; int extra_stride; };
  std::vector<Cfg> cfgs = {{1536,512,2048,0},{1536,512,301,8},{1280,512,2051,0},{1024,512,1111,8},{1536,512,16,0},
                           {640,512,900,0},{384,256,513,8},{2048,1024,700,0},{1536,512,4099,0},{128,512,37,0}};
  for (const Cfg& c : cfgs) {
    const int Q = c.Q, D = c.D; const int64_t M = c.M; const int64_t stride = Q + D + c.extra_stride;
    std::vector<uint16_t> hx(size_t(M) * stride), hw(Q + D);
    for (auto& v : hw) v = FloatToBf16(1.0f + 0.25f * nd(rng));
    for (int64_t r = 0; r < M; ++r) {
      const int kind = int(r % 13);
      for (int64_t i = 0; i < stride; ++i) {
        float f = nd(rng) * (kind == 3 ? 1e-30f : kind == 4 ? 1e30f : 1.0f);
        if ((rng() & 255) == 0) f *= 300.f;              // outliers
        if (kind == 5 && i < Q) f = (i / 128) % 3 == 0 ? 0.0f : f;  // all-zero groups
        if (kind == 6 && i == 7) f = NAN;                 // a NaN in the row
        if (kind == 7 && i == 130) f = INFINITY;
        if (kind == 8 && (i % 17) == 0) f = -0.0f;
        if (kind == 9) f = 0.0f;
        hx[size_t(r) * stride + i] = FloatToBf16(f);
      }
    }
    if (Q >= 256) { hw[5] = FloatToBf16(-0.0f); hw[200] = FloatToBf16(3e37f); }
    uint16_t *dx, *dw, *dkv, *dqb; uint8_t* dq; float* ds;
    const int G = Q / 128; const int64_t padded = (M + 3) / 4 * 4;
    CK(cudaMalloc(&dx, hx.size() * 2)); CK(cudaMalloc(&dw, hw.size() * 2));
    CK(cudaMalloc(&dkv, size_t(M) * D * 2)); CK(cudaMalloc(&dqb, size_t(M) * Q * 2));
    CK(cudaMalloc(&dq, size_t(M) * Q)); CK(cudaMalloc(&ds, size_t(padded) * G * 4));
    CK(cudaMemcpy(dx, hx.data(), hx.size() * 2, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dw, hw.data(), hw.size() * 2, cudaMemcpyHostToDevice));
    for (int fmt = 0; fmt < 2; ++fmt)
    for (int ue = 0; ue < 2; ++ue)
    for (int cm = 0; cm < 2; ++cm)
    for (int wide = 0; wide < 2; ++wide) {
      SwaRowParams p;
      p.qr_kv = dx; p.row_stride = stride; p.tokens = M; p.q_rank = Q; p.head_dim = D;
      p.q_norm = dw; p.kv_norm = dw + Q; p.eps = 1e-6f; p.kv = dkv; p.q_fp8 = dq; p.q_scale = ds;
      p.scale_layout = cm ? SwaScaleLayout{1, padded, padded} : SwaScaleLayout{G, 1, M};
      p.fp8_format = fmt ? Fp8Format::kE4M3FNUZ : Fp8Format::kE4M3FN; p.ue8m0 = ue; p.q_bf16 = dqb;
      p.wide_rows_max = wide ? -1 : 0;  // 0: always the multi-row kernel
      std::vector<uint8_t> out;
      auto grab = [&](const void* d, size_t n) { size_t o = out.size(); out.resize(o + n); cudaMemcpy(out.data() + o, d, n, cudaMemcpyDeviceToHost); };
      CK(cudaMemset(dq, 0xA5, size_t(M) * Q)); CK(cudaMemset(ds, 0xA5, size_t(padded) * G * 4)); CK(cudaMemset(dkv, 0xA5, size_t(M) * D * 2));
      CK(LaunchSwaFusedRows(p, sms, 0)); CK(cudaDeviceSynchronize());
      grab(dq, size_t(M) * Q); grab(ds, size_t(padded) * G * 4); grab(dkv, size_t(M) * D * 2);
      const uint64_t hf = Fnv(out.data(), out.size()); out.clear();
      CK(cudaMemset(dq, 0x5A, size_t(M) * Q)); CK(cudaMemset(ds, 0x5A, size_t(padded) * G * 4)); CK(cudaMemset(dkv, 0x5A, size_t(M) * D * 2));
      CK(LaunchSwaNormRows(p, sms, 0));
      CK(LaunchSwaGroupQuant(dqb, M, Q, dq, ds, p.scale_layout, p.fp8_format, p.ue8m0, 0));
      CK(cudaDeviceSynchronize());
      grab(dqb, size_t(M) * Q * 2); grab(dq, size_t(M) * Q); grab(ds, size_t(padded) * G * 4); grab(dkv, size_t(M) * D * 2);
      const uint64_t hu = Fnv(out.data(), out.size());
      printf("Q=%d D=%d M=%lld stride+%d fmt=%d ue8m0=%d colmajor=%d wide=%d fused=%016llx unfused=%016llx\n", Q, D,
             (long long)M, c.extra_stride, fmt, ue, cm, wide, (unsigned long long)hf, (unsigned long long)hu);
    }
    cudaFree(dx); cudaFree(dw); cudaFree(dkv); cudaFree(dqb); cudaFree(dq); cudaFree(ds);
  }
  printf("done\n");
  return 0;
}
