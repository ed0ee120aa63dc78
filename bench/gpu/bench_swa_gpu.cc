// SWA GPU benchmark: fused vs unfused launch sequences, timed as CUDA/HIP graph replays with a cold
// L2, against the byte-model floor.
//
// Method (BENCHMARKS.md, "Method"):
//   - each graph holds L launches, each on its own input/output set (L = clamp(1 GiB / bytes per
//     launch, 2, 200)), so no launch re-reads data another launch touched;
//   - before every replay a 512 MiB memset evicts the 60 MB L2 (outside the timed region: events are
//     recorded after it), so every launch reads its inputs from HBM; the small norm weights stay hot,
//     as they do in serving;
//   - time per launch = graph time / L; median of 15 replays after 2 warm-ups;
//   - "fused warm": the same graph shape with every launch on one set and no eviction (the decode
//     case, where the producing GEMM has just written the input into L2).
// Floor: fused bytes (2(Q+D) read + Q + 4Q/128 + 2D written per row) at 4.2 TB/s. The device-to-device
// copy bandwidth measured here is printed too (bytes read + written).
//
// wq_b section (--wqb: after the table; --wqb-only: alone): the production projection
// (LaunchWqbProjection: cuBLASLt block-scaled FP8 with the algorithm pinned at load, on CUDA e4m3fn)
// against our CUDA-core kernel (LaunchWqbGemm) in the same run, K = 1536, N in {8192, 24576},
// M in {1, 64, 1024, 4096, 16384}, same method (each launch on its own q, scales, output and weight
// copy; cold L2). Floors: bytes (q + weight + scales + bf16 out) at 4.2 TB/s and 2MNK at 1979 TFLOP/s
// (H200 dense FP8, datasheet).
//
// usage: bench_swa_gpu [--csv FILE] [--quick] [--tune] [--profile Q M] [--wqb | --wqb-only]
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "fusedlayer/numeric.h"
#include "fusedlayer/swa.h"
#include "gpu_context.h"
#include "gpu_runtime.h"
#include "swa_launch.h"
#include "swa_kernel_launch.h"
#include "wq_b_cublaslt.h"

namespace fl = fusedlayer;
namespace gpu = fusedlayer::gpu;

namespace {

#define CHECK_GPU(expr)                                                                          \
  do {                                                                                           \
    gpuError_t e_ = (expr);                                                                      \
    if (e_ != gpuSuccess) {                                                                      \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #expr, gpuGetErrorString(e_)); \
      std::exit(1);                                                                              \
    }                                                                                            \
  } while (0)

constexpr double kFloorBandwidth = 4.2e12;  // bytes/s, the H200's measured device-to-device copy rate
constexpr size_t kFlushBytes = size_t{512} << 20;

void* Alloc(size_t bytes) {
  void* p = nullptr;
  CHECK_GPU(gpuMalloc(&p, std::max<size_t>(bytes, 256)));
  return p;
}

// Timed replays of `exec`, each after an L2 flush; returns the median milliseconds per replay.
// flush == nullptr: warm (no eviction between replays).
double MedianReplayMs(gpuGraphExec_t exec, gpuStream_t stream, void* flush, gpuEvent_t e0, gpuEvent_t e1) {
  std::vector<double> ms;
  for (int rep = 0; rep < 17; ++rep) {
    if (flush != nullptr) CHECK_GPU(gpuMemsetAsync(flush, rep & 0xff, kFlushBytes, stream));
    CHECK_GPU(gpuEventRecord(e0, stream));
    CHECK_GPU(gpuGraphLaunch(exec, stream));
    CHECK_GPU(gpuEventRecord(e1, stream));
    CHECK_GPU(gpuEventSynchronize(e1));
    float t = 0;
    CHECK_GPU(gpuEventElapsedTime(&t, e0, e1));
    if (rep >= 2) ms.push_back(t);
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

template <typename Fn>
gpuGraphExec_t Capture(gpuStream_t stream, int launches, Fn&& launch) {
  gpuGraph_t g = nullptr;
  gpuGraphExec_t exec = nullptr;
  CHECK_GPU(gpuStreamBeginCapture(stream, gpuStreamCaptureModeThreadLocal));
  for (int i = 0; i < launches; ++i) CHECK_GPU(launch(i));
  CHECK_GPU(gpuStreamEndCapture(stream, &g));
  CHECK_GPU(gpuGraphInstantiate(&exec, g));
  CHECK_GPU(gpuGraphDestroy(g));
  return exec;
}

double CopyBandwidth(gpuStream_t stream, gpuEvent_t e0, gpuEvent_t e1) {
  const size_t bytes = size_t{2} << 30;
  void* a = Alloc(bytes);
  void* b = Alloc(bytes);
  CHECK_GPU(gpuMemsetAsync(a, 1, bytes, stream));
  std::vector<double> ms;
  for (int rep = 0; rep < 7; ++rep) {
    CHECK_GPU(gpuEventRecord(e0, stream));
    CHECK_GPU(gpuMemcpyAsync(b, a, bytes, gpuMemcpyDeviceToDevice, stream));
    CHECK_GPU(gpuEventRecord(e1, stream));
    CHECK_GPU(gpuEventSynchronize(e1));
    float t = 0;
    CHECK_GPU(gpuEventElapsedTime(&t, e0, e1));
    if (rep >= 2) ms.push_back(t);
  }
  CHECK_GPU(gpuFree(a));
  CHECK_GPU(gpuFree(b));
  std::sort(ms.begin(), ms.end());
  return 2.0 * double(bytes) / (ms[ms.size() / 2] * 1e-3);
}

constexpr double kPeakFp8 = 1979e12;  // H200 SXM dense FP8, datasheet

// The wq_b projection table (see the file header).
void WqbSection(gpu::GpuContext& ctx, void* flush, gpuEvent_t e0, gpuEvent_t e1) {
  const int K = 1536, G = K / 128;
  std::printf("\n## wq_b projection (K = %d, e4m3fn, cold L2)\n", K);
  std::mt19937_64 rng(4242);
  for (int N : {8192, 24576}) {
    fl::SwaHyperParams hp;
    hp.q_rank = K;
    hp.head_dim = 512;
    hp.fp8_format = fl::Fp8Format::kE4M3FN;
    hp.scale_layout = fl::ScaleLayout::kColumnMajorTma;
    hp.wq_b_rows = N;
    std::vector<uint16_t> qn(size_t(K), fl::FloatToBf16(1.0f)), kvn(512, fl::FloatToBf16(1.0f));
    std::vector<uint8_t> wb(size_t(N) * K);
    std::normal_distribution<float> nd(0.0f, 150.0f);
    for (auto& c : wb) c = fl::FloatToFp8(std::clamp(nd(rng), -448.0f, 448.0f), fl::Fp8Format::kE4M3FN);
    std::uniform_real_distribution<float> u(0.06f / 448, 0.14f / 448);
    std::vector<float> wbs(size_t(N / 128) * G);
    for (auto& v : wbs) v = u(rng);
    fl::SwaWeightsHost hw;
    hw.q_norm = fl::TensorView::Contiguous(qn.data(), fl::DType::kBF16, {K});
    hw.kv_norm = fl::TensorView::Contiguous(kvn.data(), fl::DType::kBF16, {512});
    hw.wq_b = fl::TensorView::Contiguous(wb.data(), fl::DType::kFP8E4M3FN, {N, K});
    hw.wq_b_scale = fl::TensorView::Contiguous(wbs.data(), fl::DType::kFP32, {N / 128, G});
    auto w0 = gpu::PrepareSwaGpu(hp, hw, ctx);
    if (!w0.ok()) {
      std::fprintf(stderr, "wq_b prepare failed: %s\n", std::string(w0.status().message()).c_str());
      std::exit(1);
    }
    std::printf("\nN = %d: production implementation: %s\n", N, (*w0)->wq_b_impl_detail.c_str());
    // The alternative pin (the heuristic's choice at M = 64) and the heuristic's own per-M choices.
    gpu::WqbLtPlan alt;
    bool have_alt = false;
#if !FL_HIP
    if ((*w0)->wq_b_impl == gpu::GpuSwaWeights::WqbImpl::kCublasLt) {
      auto a = gpu::PlanWqbCublasLt(ctx, N, K, 64);
      if (a.ok()) {
        alt = *a;
        have_alt = true;
        std::printf("  alternative pin (heuristic at M = 64): %s\n", alt.description.c_str());
      } else {
        std::printf("  alternative pin (heuristic at M = 64): %s\n", a.status().ToString().c_str());
      }
      for (int64_t m : {4, 64, 1024, 4096, 16384}) {
        auto d = gpu::DescribeWqbLtHeuristic(ctx, N, K, m);
        std::printf("  heuristic #0 at M = %lld: %s\n", (long long)m,
                    d.ok() ? d->c_str() : d.status().ToString().c_str());
      }
    }
#endif
    std::printf("\n| N | M | production us (TMA scales) | production us (row-major scales) | alt pin us | ours us | "
                "speed-up | production TFLOP/s | floor us (bytes / fp8) | production %% of floor |\n");
    std::printf("|---|---|---|---|---|---|---|---|---|---|\n");
    for (int64_t M : {int64_t{1}, int64_t{64}, int64_t{1024}, int64_t{4096}, int64_t{16384}}) {
      const int64_t Mp = fl::AlignTo4(M);
      const double bytes = double(M) * K + double(N) * K + 2.0 * M * N + 4.0 * M * G + 4.0 * (N / 128) * G;
      const double alloc = double(Mp) * K + double(N) * K + 2.0 * Mp * N + 8.0 * Mp * G;
      const int L = int(std::clamp(double(size_t{1} << 30) / alloc, 2.0, 200.0));
      // Per launch: q codes, TMA scales [G][Mp], row-major scales [M][G], output, weight copy.
      std::vector<void*> qv(L), st(L), sr(L), ov(L);
      std::vector<std::unique_ptr<gpu::GpuSwaWeights>> wv(L);
      std::vector<uint8_t> hq(size_t(M) * K);
      std::normal_distribution<float> qd(0.0f, 150.0f);
      for (auto& c : hq) c = fl::FloatToFp8(std::clamp(qd(rng), -448.0f, 448.0f), fl::Fp8Format::kE4M3FN);
      std::vector<float> hs(size_t(M) * G), ht(size_t(G) * Mp, 0.0f);
      std::uniform_real_distribution<float> us(2.0f / 448, 4.0f / 448);
      for (auto& v : hs) v = us(rng);
      for (int64_t m = 0; m < M; ++m)
        for (int g = 0; g < G; ++g) ht[size_t(g) * Mp + m] = hs[size_t(m) * G + g];
      for (int i = 0; i < L; ++i) {
        qv[i] = Alloc(hq.size());
        st[i] = Alloc(ht.size() * 4);
        sr[i] = Alloc(hs.size() * 4);
        ov[i] = Alloc(size_t(M) * N * 2);
        CHECK_GPU(gpuMemcpy(qv[i], hq.data(), hq.size(), gpuMemcpyHostToDevice));
        CHECK_GPU(gpuMemcpy(st[i], ht.data(), ht.size() * 4, gpuMemcpyHostToDevice));
        CHECK_GPU(gpuMemcpy(sr[i], hs.data(), hs.size() * 4, gpuMemcpyHostToDevice));
        auto wi = std::make_unique<gpu::GpuSwaWeights>();
        wi->params_ = (*w0)->params_;
        wi->wq_b_impl = (*w0)->wq_b_impl;
        wi->wq_b_lt = (*w0)->wq_b_lt;
        auto b = gpu::GpuAlloc(wb.size());
        auto bs = gpu::GpuAlloc(wbs.size() * 4);
        if (!b.ok() || !bs.ok()) {
          std::fprintf(stderr, "out of memory\n");
          std::exit(1);
        }
        CHECK_GPU(gpuMemcpy(b->get(), (*w0)->wq_b.get(), wb.size(), gpuMemcpyDeviceToDevice));
        CHECK_GPU(gpuMemcpy(bs->get(), (*w0)->wq_b_scale.get(), wbs.size() * 4, gpuMemcpyDeviceToDevice));
        wi->wq_b = std::move(*b);
        wi->wq_b_scale = std::move(*bs);
        wv[i] = std::move(wi);
      }
      const gpu::SwaScaleLayout tma{1, Mp, Mp}, row{G, 1, M};
      auto prod = [&](int i, bool use_tma, const gpu::WqbLtPlan* plan) -> gpuError_t {
        absl::Status s;
#if !FL_HIP
        if (plan != nullptr) {
          s = gpu::LaunchWqbCublasLt(*plan, ctx, static_cast<const uint8_t*>(qv[i]),
                                     static_cast<const float*>(use_tma ? st[i] : sr[i]), use_tma ? tma : row,
                                     static_cast<const uint8_t*>(wv[i]->wq_b.get()),
                                     static_cast<const float*>(wv[i]->wq_b_scale.get()), static_cast<uint16_t*>(ov[i]), M);
        } else
#endif
        {
          s = gpu::LaunchWqbProjection(*wv[i], static_cast<const uint8_t*>(qv[i]),
                                       static_cast<const float*>(use_tma ? st[i] : sr[i]), use_tma ? tma : row,
                                       static_cast<uint16_t*>(ov[i]), M, ctx);
        }
        if (!s.ok()) {
          std::fprintf(stderr, "wq_b launch failed: %s\n", s.ToString().c_str());
          std::exit(1);
        }
        return gpuSuccess;
      };
      auto ours = [&](int i) {
        return gpu::LaunchWqbGemm(static_cast<const uint8_t*>(qv[i]), static_cast<const float*>(st[i]), tma,
                                  static_cast<const uint8_t*>(wv[i]->wq_b.get()),
                                  static_cast<const float*>(wv[i]->wq_b_scale.get()), static_cast<uint16_t*>(ov[i]), M,
                                  N, K, fl::Fp8Format::kE4M3FN, ctx.stream);
      };
      // Eager once per variant: sizes the staging scratch, which capture cannot allocate.
      CHECK_GPU(prod(0, true, nullptr));
      CHECK_GPU(prod(0, false, nullptr));
      if (have_alt) CHECK_GPU(prod(0, true, &alt));
      CHECK_GPU(gpuStreamSynchronize(ctx.stream));
      auto timed = [&](auto&& fn) {
        gpuGraphExec_t g = Capture(ctx.stream, L, fn);
        const double us = MedianReplayMs(g, ctx.stream, flush, e0, e1) * 1e3 / L;
        CHECK_GPU(gpuGraphExecDestroy(g));
        return us;
      };
      const double t_tma = timed([&](int i) { return prod(i, true, nullptr); });
      const double t_row = timed([&](int i) { return prod(i, false, nullptr); });
      const double t_alt = have_alt ? timed([&](int i) { return prod(i, true, &alt); }) : 0.0;
      const double t_ours = timed(ours);
      const double flops = 2.0 * double(M) * N * K;
      const double fb = bytes / kFloorBandwidth * 1e6, ff = flops / kPeakFp8 * 1e6;
      char alt_s[32];
      std::snprintf(alt_s, sizeof alt_s, have_alt ? "%.2f" : "-", t_alt);
      std::printf("| %d | %lld | %.2f | %.2f | %s | %.2f | %.1fx | %.1f | %.2f / %.2f | %.0f%% |\n", N, (long long)M,
                  t_tma, t_row, alt_s, t_ours, t_ours / t_tma, flops / t_tma * 1e-6, fb, ff,
                  100.0 * std::max(fb, ff) / t_tma);
      std::fflush(stdout);
      for (int i = 0; i < L; ++i) {
        for (void* p : {qv[i], st[i], sr[i], ov[i]}) CHECK_GPU(gpuFree(p));
      }
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  std::string csv_path;
  bool quick = false;
  bool tune = false;
  int profile_q = 0;
  int64_t profile_m = 0;
  bool wqb = false, wqb_only = false;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--csv") && i + 1 < argc) csv_path = argv[++i];
    else if (!std::strcmp(argv[i], "--quick")) quick = true;
    // --tune: after the table, PDL on/off at small M and the one-row-per-block kernel on/off at mid M.
    else if (!std::strcmp(argv[i], "--tune")) tune = true;
    else if (!std::strcmp(argv[i], "--wqb")) wqb = true;
    else if (!std::strcmp(argv[i], "--wqb-only")) wqb = wqb_only = true;
    // --profile Q M: three eager fused launches at one shape, nothing else (for ncu).
    else if (!std::strcmp(argv[i], "--profile") && i + 2 < argc) {
      profile_q = std::atoi(argv[++i]);
      profile_m = std::atoll(argv[++i]);
    }
  }
  auto ctx_or = gpu::GpuContext::Create(0);
  if (!ctx_or.ok()) {
    std::fprintf(stderr, "no GPU: %s\n", std::string(ctx_or.status().message()).c_str());
    return 2;
  }
  gpu::GpuContext& ctx = **ctx_or;
  if (profile_q > 0) {
    const int Q = profile_q, D = 512;
    const int64_t M = profile_m;
    void* x = Alloc(size_t(M) * (Q + D) * 2);
    void* w = Alloc(size_t(Q + D) * 2);
    void* q = Alloc(size_t(M) * Q);
    void* s = Alloc(size_t(M) * (Q / 128) * 4);
    void* kv = Alloc(size_t(M) * D * 2);
    CHECK_GPU(gpuMemset(x, 0x3f, size_t(M) * (Q + D) * 2));  // bf16 0x3f3f ~ 0.75: not zeros
    CHECK_GPU(gpuMemset(w, 0x3f, size_t(Q + D) * 2));
    gpu::SwaRowParams p;
    p.qr_kv = static_cast<const uint16_t*>(x);
    p.row_stride = Q + D;
    p.tokens = M;
    p.q_rank = Q;
    p.head_dim = D;
    p.q_norm = static_cast<const uint16_t*>(w);
    p.kv_norm = static_cast<const uint16_t*>(w) + Q;
    p.kv = static_cast<uint16_t*>(kv);
    p.q_fp8 = static_cast<uint8_t*>(q);
    p.q_scale = static_cast<float*>(s);
    p.scale_layout = gpu::SwaScaleLayout{Q / 128, 1, M};
    for (int i = 0; i < 3; ++i) CHECK_GPU(gpu::LaunchSwaFusedRows(p, ctx.sm_count, ctx.stream));
    CHECK_GPU(gpuStreamSynchronize(ctx.stream));
    return 0;
  }
  gpuEvent_t e0, e1;
  CHECK_GPU(gpuEventCreate(&e0));
  CHECK_GPU(gpuEventCreate(&e1));
  void* flush = Alloc(kFlushBytes);
  const double copy_bw = CopyBandwidth(ctx.stream, e0, e1);
  std::printf("device %s (%s), %d SMs, L2 %.0f MB; measured D2D copy %.2f TB/s (read+write)\n", ctx.name.c_str(),
              ctx.arch.c_str(), ctx.sm_count, ctx.l2_bytes / 1e6, copy_bw / 1e12);

  if (wqb_only) {
    WqbSection(ctx, flush, e0, e1);
    CHECK_GPU(gpuFree(flush));
    return 0;
  }
  FILE* csv = csv_path.empty() ? nullptr : std::fopen(csv_path.c_str(), "w");
  if (csv) std::fprintf(csv, "Q,D,M,launches,fused_us,unfused_us,floor_us,fused_TBps,fused_pct_of_4.2,speedup,fused_warm_us\n");
  std::printf("\n| Q | M | fused us | unfused us | floor us | fused TB/s | fused %% of 4.2 TB/s | fused/unfused | fused warm us |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|\n");

  const int D = 512;
  std::vector<int> qs = {1024, 1280, 1536};
  std::vector<int64_t> ms = {1, 64, 1024, 4096, 8192, 16384};
  if (quick) {
    qs = {1536};
    ms = {64, 8192};
  }
  std::mt19937_64 rng(12345);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (int Q : qs) {
    const int G = Q / 128;
    std::vector<uint16_t> wq(static_cast<size_t>(Q)), wk(static_cast<size_t>(D));
    for (auto& v : wq) v = fl::FloatToBf16(1.0f + 0.1f * nd(rng));
    for (auto& v : wk) v = fl::FloatToBf16(1.0f + 0.1f * nd(rng));
    void* d_wq = Alloc(wq.size() * 2);
    void* d_wk = Alloc(wk.size() * 2);
    CHECK_GPU(gpuMemcpy(d_wq, wq.data(), wq.size() * 2, gpuMemcpyHostToDevice));
    CHECK_GPU(gpuMemcpy(d_wk, wk.data(), wk.size() * 2, gpuMemcpyHostToDevice));
    for (int64_t M : ms) {
      const double in_bytes = double(M) * (Q + D) * 2;
      const double fused_bytes = in_bytes + double(M) * (Q + 4.0 * G + 2.0 * D);
      const int L = int(std::clamp<double>(std::floor(double(size_t{1} << 30) / fused_bytes), 2, 200));
      const size_t xb = size_t(M) * (Q + D) * 2, qb = size_t(M) * Q, sb = size_t(M) * G * 4, kb = size_t(M) * D * 2;
      char* x = static_cast<char*>(Alloc(xb * L));
      char* q = static_cast<char*>(Alloc(qb * L));
      char* s = static_cast<char*>(Alloc(sb * L));
      char* kv = static_cast<char*>(Alloc(kb * L));
      void* ws = Alloc(size_t(M) * Q * 2);
      {
        // Random bf16 inputs (never zeros), one set generated and copied to all L sets.
        std::vector<uint16_t> hx(size_t(M) * (Q + D));
        for (auto& v : hx) {
          float f;
          do f = nd(rng); while (f == 0.0f);
          v = fl::FloatToBf16(f);
        }
        for (int i = 0; i < L; ++i) CHECK_GPU(gpuMemcpy(x + xb * i, hx.data(), xb, gpuMemcpyHostToDevice));
      }
      auto params = [&](int i) {
        gpu::SwaRowParams p;
        p.qr_kv = reinterpret_cast<const uint16_t*>(x + xb * i);
        p.row_stride = Q + D;
        p.tokens = M;
        p.q_rank = Q;
        p.head_dim = D;
        p.q_norm = static_cast<const uint16_t*>(d_wq);
        p.kv_norm = static_cast<const uint16_t*>(d_wk);
        p.kv = reinterpret_cast<uint16_t*>(kv + kb * i);
        p.q_fp8 = reinterpret_cast<uint8_t*>(q + qb * i);
        p.q_scale = reinterpret_cast<float*>(s + sb * i);
        p.scale_layout = gpu::SwaScaleLayout{G, 1, M};
        p.q_bf16 = static_cast<uint16_t*>(ws);
        return p;
      };
      gpuGraphExec_t fused = Capture(ctx.stream, L, [&](int i) {
        return gpu::LaunchSwaFusedRows(params(i), ctx.sm_count, ctx.stream);
      });
      gpuGraphExec_t unfused = Capture(ctx.stream, L, [&](int i) {
        gpu::SwaRowParams p = params(i);
        gpuError_t e = gpu::LaunchSwaNormRows(p, ctx.sm_count, ctx.stream);
        if (e != gpuSuccess) return e;
        return gpu::LaunchSwaGroupQuant(p.q_bf16, M, Q, p.q_fp8, p.q_scale, p.scale_layout, fl::Fp8Format::kE4M3FN,
                                        false, ctx.stream);
      });
      // Warm: every launch on set 0, no eviction (the decode case where the producer just wrote the input).
      gpuGraphExec_t warm = Capture(ctx.stream, L, [&](int) {
        return gpu::LaunchSwaFusedRows(params(0), ctx.sm_count, ctx.stream);
      });
      const double w_us = MedianReplayMs(warm, ctx.stream, nullptr, e0, e1) * 1e3 / L;
      CHECK_GPU(gpuGraphExecDestroy(warm));
      const double f_us = MedianReplayMs(fused, ctx.stream, flush, e0, e1) * 1e3 / L;
      const double u_us = MedianReplayMs(unfused, ctx.stream, flush, e0, e1) * 1e3 / L;
      const double floor_us = fused_bytes / kFloorBandwidth * 1e6;
      const double tbps = fused_bytes / (f_us * 1e-6) / 1e12;
      std::printf("| %d | %lld | %.2f | %.2f | %.3f | %.2f | %.0f%% | %.2fx | %.2f |\n", Q, (long long)M, f_us, u_us,
                  floor_us, tbps, 100.0 * tbps * 1e12 / kFloorBandwidth, u_us / f_us, w_us);
      if (csv) {
        std::fprintf(csv, "%d,%d,%lld,%d,%.3f,%.3f,%.3f,%.3f,%.1f,%.3f,%.3f\n", Q, D, (long long)M, L, f_us, u_us,
                     floor_us, tbps, 100.0 * tbps * 1e12 / kFloorBandwidth, u_us / f_us, w_us);
      }
      std::fflush(stdout);
      CHECK_GPU(gpuGraphExecDestroy(fused));
      CHECK_GPU(gpuGraphExecDestroy(unfused));
      for (void* p : {static_cast<void*>(x), static_cast<void*>(q), static_cast<void*>(s), static_cast<void*>(kv), ws}) {
        CHECK_GPU(gpuFree(p));
      }
    }
    CHECK_GPU(gpuFree(d_wq));
    CHECK_GPU(gpuFree(d_wk));
  }
  if (csv) std::fclose(csv);
  if (tune) {
    // Variants of the fused (and unfused) launch at one shape, cold L2, same method as the table.
    std::printf("\n| Q | M | variant | fused us | unfused us | fused warm us |\n|---|---|---|---|---|---|\n");
    struct Variant {
      const char* name;
      bool pdl;
      int64_t wide_max;  // -1 default
    };
    struct Shape {
      int Q;
      int64_t M;
      std::vector<Variant> v;
    };
    const std::vector<Shape> shapes = {
        {1536, 1, {{"pdl", true, -1}, {"no-pdl", false, -1}}},
        {1536, 64, {{"pdl", true, -1}, {"no-pdl", false, -1}}},
        {1024, 64, {{"pdl", true, -1}, {"no-pdl", false, -1}}},
        {1536, 1024, {{"row-per-block", true, 1 << 30}, {"multi-row", true, 0}}},
        {1536, 2048, {{"row-per-block", true, 1 << 30}, {"multi-row", true, 0}}},
    };
    std::mt19937_64 trng(777);
    std::normal_distribution<float> tnd(0.0f, 1.0f);
    for (const Shape& sh : shapes) {
      const int Q = sh.Q, G = Q / 128;
      const int64_t M = sh.M;
      const double fused_bytes = double(M) * (Q + D) * 2 + double(M) * (Q + 4.0 * G + 2.0 * D);
      const int L = int(std::clamp<double>(std::floor(double(size_t{1} << 30) / fused_bytes), 2, 200));
      const size_t xb = size_t(M) * (Q + D) * 2, qb = size_t(M) * Q, sb = size_t(M) * G * 4, kb = size_t(M) * D * 2;
      char* x = static_cast<char*>(Alloc(xb * L));
      char* q = static_cast<char*>(Alloc(qb * L));
      char* s = static_cast<char*>(Alloc(sb * L));
      char* kv = static_cast<char*>(Alloc(kb * L));
      void* ws = Alloc(size_t(M) * Q * 2);
      void* w = Alloc(size_t(Q + D) * 2);
      {
        std::vector<uint16_t> hw(size_t(Q + D));
        for (auto& v : hw) v = fl::FloatToBf16(1.0f + 0.1f * tnd(trng));
        CHECK_GPU(gpuMemcpy(w, hw.data(), hw.size() * 2, gpuMemcpyHostToDevice));
        std::vector<uint16_t> hx(size_t(M) * (Q + D));
        for (auto& v : hx) v = fl::FloatToBf16(tnd(trng) + 1e-3f);
        for (int i = 0; i < L; ++i) CHECK_GPU(gpuMemcpy(x + xb * i, hx.data(), xb, gpuMemcpyHostToDevice));
      }
      for (const Variant& var : sh.v) {
        auto params = [&](int i) {
          gpu::SwaRowParams p;
          p.qr_kv = reinterpret_cast<const uint16_t*>(x + xb * i);
          p.row_stride = Q + D;
          p.tokens = M;
          p.q_rank = Q;
          p.head_dim = D;
          p.q_norm = static_cast<const uint16_t*>(w);
          p.kv_norm = static_cast<const uint16_t*>(w) + Q;
          p.kv = reinterpret_cast<uint16_t*>(kv + kb * i);
          p.q_fp8 = reinterpret_cast<uint8_t*>(q + qb * i);
          p.q_scale = reinterpret_cast<float*>(s + sb * i);
          p.scale_layout = gpu::SwaScaleLayout{G, 1, M};
          p.q_bf16 = static_cast<uint16_t*>(ws);
          p.pdl = var.pdl;
          p.wide_rows_max = var.wide_max;
          return p;
        };
        gpuGraphExec_t fused = Capture(ctx.stream, L, [&](int i) {
          return gpu::LaunchSwaFusedRows(params(i), ctx.sm_count, ctx.stream);
        });
        gpuGraphExec_t unfused = Capture(ctx.stream, L, [&](int i) {
          gpu::SwaRowParams p = params(i);
          gpuError_t e = gpu::LaunchSwaNormRows(p, ctx.sm_count, ctx.stream);
          if (e != gpuSuccess) return e;
          return gpu::LaunchSwaGroupQuant(p.q_bf16, M, Q, p.q_fp8, p.q_scale, p.scale_layout,
                                          fl::Fp8Format::kE4M3FN, false, ctx.stream, var.pdl);
        });
        gpuGraphExec_t warm = Capture(ctx.stream, L, [&](int) {
          return gpu::LaunchSwaFusedRows(params(0), ctx.sm_count, ctx.stream);
        });
        const double w_us = MedianReplayMs(warm, ctx.stream, nullptr, e0, e1) * 1e3 / L;
        const double f_us = MedianReplayMs(fused, ctx.stream, flush, e0, e1) * 1e3 / L;
        const double u_us = MedianReplayMs(unfused, ctx.stream, flush, e0, e1) * 1e3 / L;
        std::printf("| %d | %lld | %s | %.2f | %.2f | %.2f |\n", Q, (long long)M, var.name, f_us, u_us, w_us);
        std::fflush(stdout);
        CHECK_GPU(gpuGraphExecDestroy(fused));
        CHECK_GPU(gpuGraphExecDestroy(unfused));
        CHECK_GPU(gpuGraphExecDestroy(warm));
      }
      for (void* p : {static_cast<void*>(x), static_cast<void*>(q), static_cast<void*>(s), static_cast<void*>(kv), ws, w}) {
        CHECK_GPU(gpuFree(p));
      }
    }
  }
  if (wqb) WqbSection(ctx, flush, e0, e1);
  CHECK_GPU(gpuFree(flush));
  return 0;
}
