// mHC seam GPU benchmark (n = 4, shifted mode unless --mode normal, norm weight present): fused vs
// unfused, timed as CUDA graph replays with a cold L2, against the byte-model floor.
//
// Method (BENCHMARKS.md, "Method"):
//   - each graph holds L launches of LaunchMhcGpu, each on its own input/output set
//     (L = clamp(1 GiB / bytes per launch, 2, 64)), so no launch re-reads what another touched;
//   - before every replay a 512 MiB memset evicts the 60 MB L2 (outside the timed region), so every
//     launch reads its inputs from HBM; the weights stay as warm as they are in serving;
//   - time per launch = graph time / L; median of 15 replays after 2 warm-ups.
// Byte model (floor at 4.2 TB/s): R and x read once, R' and y written once (20*C bytes per token),
// plus the small mixes in/out (about 200 B per token) and fn read once (96*C*4 bytes per call).
// Inputs are pseudo-random bf16 (never zero, with outliers), generated on the device.
//
// Paths: fused (pass + finalize) and unfused, timed back to back in the same process.
//
// usage: bench_mhc_gpu [--quick] [--csv FILE] [--C c] [--T t] [--once] [--mode shifted|normal]
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "fusedlayer/numeric.h"
#include "gpu_context.h"
#include "gpu_runtime.h"
#include "mhc_launch.h"

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
#define CHECK_OK(expr)                                                                     \
  do {                                                                                     \
    absl::Status s_ = (expr);                                                              \
    if (!s_.ok()) {                                                                        \
      std::fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, std::string(s_.message()).c_str()); \
      std::exit(1);                                                                        \
    }                                                                                      \
  } while (0)

constexpr double kFloorBandwidth = 4.2e12;
constexpr size_t kFlushBytes = size_t{512} << 20;

__device__ uint32_t Hash(uint64_t i, uint32_t seed) {
  uint64_t z = i * 0x9e3779b97f4a7c15ull + seed;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return uint32_t(z ^ (z >> 31));
}
// Roughly uniform in [-1, 1) with 1% outliers x16, never zero.
__global__ void FillBf16(uint16_t* p, int64_t n, uint32_t seed) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const uint32_t h = Hash(i, seed);
    float v = (float(h >> 8) * (1.0f / 16777216.0f)) * 2.0f - 1.0f;
    if ((h & 0xff) < 3) v *= 16.0f;
    if (v == 0.0f) v = 0.5f;
    p[i] = fl::FloatToBf16(v);
  }
}
__global__ void FillF32(float* p, int64_t n, uint32_t seed, float lo, float hi) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    p[i] = lo + (hi - lo) * (float(Hash(i, seed) >> 8) * (1.0f / 16777216.0f) + 1e-4f);
}

void* Alloc(size_t bytes) {
  void* p = nullptr;
  CHECK_GPU(gpuMalloc(&p, std::max<size_t>(bytes, 256)));
  return p;
}

struct Set {
  void *x, *r, *post, *comb, *pre, *nr, *npre, *npost, *ncomb, *y;
};

double MedianReplayMs(gpuGraphExec_t exec, gpuStream_t stream, void* flush, gpuEvent_t e0, gpuEvent_t e1) {
  std::vector<double> ms;
  for (int rep = 0; rep < 17; ++rep) {
    CHECK_GPU(gpuMemsetAsync(flush, rep & 0xff, kFlushBytes, stream));
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

}  // namespace

int main(int argc, char** argv) {
  bool quick = false, once = false;
  const char* csv_path = nullptr;
  int64_t only_c = 0, only_t = 0;
  fl::MhcMode mode = fl::MhcMode::kShifted;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--quick")) quick = true;
    if (!std::strcmp(argv[i], "--once")) once = true;  // one eager launch per path (for ncu)
    if (!std::strcmp(argv[i], "--csv") && i + 1 < argc) csv_path = argv[++i];
    if (!std::strcmp(argv[i], "--C") && i + 1 < argc) only_c = std::atoll(argv[++i]);
    if (!std::strcmp(argv[i], "--T") && i + 1 < argc) only_t = std::atoll(argv[++i]);
    // --mode normal: V4's normal mode (y from the new pre mix; no pre_mix input) instead of shifted.
    if (!std::strcmp(argv[i], "--mode") && i + 1 < argc) {
      mode = !std::strcmp(argv[++i], "normal") ? fl::MhcMode::kNormal : fl::MhcMode::kShifted;
    }
  }
  auto ctx_or = gpu::GpuContext::Create(0);
  if (!ctx_or.ok()) {
    std::fprintf(stderr, "no GPU: %s\n", std::string(ctx_or.status().message()).c_str());
    return 1;
  }
  gpu::GpuContext& ctx = **ctx_or;
  std::printf("device: %s (%s, %d SMs, L2 %zu MB)\n", ctx.name.c_str(), ctx.arch.c_str(), ctx.sm_count,
              ctx.l2_bytes >> 20);
  FILE* csv = csv_path ? std::fopen(csv_path, "w") : nullptr;
  if (csv) std::fprintf(csv, "C,T,path,us_per_call,floor_us,pct_of_floor_bw,launches_per_graph\n");
  void* flush = Alloc(kFlushBytes);
  gpuEvent_t e0, e1;
  CHECK_GPU(gpuEventCreate(&e0));
  CHECK_GPU(gpuEventCreate(&e1));

  std::vector<int64_t> Cs = quick ? std::vector<int64_t>{7168} : std::vector<int64_t>{4096, 5120, 7168};
  std::vector<int64_t> Ts = quick ? std::vector<int64_t>{1, 64, 4096}
                                  : std::vector<int64_t>{1, 16, 64, 128, 1024, 4096, 16384};
  if (only_c) Cs = {only_c};
  if (only_t) Ts = {only_t};
  std::printf("%6s %6s %10s %10s %10s %10s %8s\n", "C", "T", "fused_us", "unfused_us", "floor_us", "fused_%bw", "L");
  for (int64_t C : Cs) {
    constexpr int n = 4, M = 24;
    const int64_t K = n * C;
    // Weights: fn ~ U(-1,1)/sqrt(K), alpha ~ [0.5, 2], base ~ [-1, 1], g bf16.
    std::vector<float> fn(size_t(M) * K), scale = {1.0f, 0.7f, 1.3f}, base(M);
    std::vector<uint16_t> g(C);
    uint64_t s = 12345;
    auto rnd = [&] { s = s * 6364136223846793005ull + 1442695040888963407ull; return float((s >> 40) & 0xffffff) / 16777216.0f; };
    for (auto& f : fn) f = (rnd() * 2 - 1) / std::sqrt(float(K));
    for (auto& b : base) b = rnd() * 2 - 1;
    for (auto& w : g) w = fl::FloatToBf16(0.5f + rnd());
    fl::MhcHyperParams hp;
    hp.hc_mult = n;
    hp.hidden = C;
    fl::MhcWeightsHost wh;
    wh.fn = fl::TensorView::Contiguous(fn.data(), fl::DType::kFP32, {M, K});
    wh.scale = fl::TensorView::Contiguous(scale.data(), fl::DType::kFP32, {3});
    wh.base = fl::TensorView::Contiguous(base.data(), fl::DType::kFP32, {M});
    wh.norm_weight = fl::TensorView::Contiguous(g.data(), fl::DType::kBF16, {C});
    auto w_or = gpu::PrepareMhcGpu(hp, wh, ctx);
    CHECK_OK(w_or.status());
    const gpu::GpuMhcWeights& w = **w_or;

    for (int64_t T : Ts) {
      const double bytes = 20.0 * double(C) * double(T) + 200.0 * double(T) + 96.0 * double(C) * 4.0;
      const int L = once ? 1 : int(std::clamp<double>(double(size_t{1} << 30) / bytes, 2, 64));
      std::vector<Set> sets(L);
      for (int l = 0; l < L; ++l) {
        Set& st = sets[l];
        st.x = Alloc(size_t(T) * C * 2);
        st.r = Alloc(size_t(T) * n * C * 2);
        st.post = Alloc(size_t(T) * n * 4);
        st.comb = Alloc(size_t(T) * n * n * 4);
        st.pre = Alloc(size_t(T) * n * 4);
        st.nr = Alloc(size_t(T) * n * C * 2);
        st.npre = Alloc(size_t(T) * n * 4);
        st.npost = Alloc(size_t(T) * n * 4);
        st.ncomb = Alloc(size_t(T) * n * n * 4);
        st.y = Alloc(size_t(T) * C * 2);
        FillBf16<<<1024, 256, 0, ctx.stream>>>(static_cast<uint16_t*>(st.x), T * C, 1 + l);
        FillBf16<<<1024, 256, 0, ctx.stream>>>(static_cast<uint16_t*>(st.r), T * n * C, 100 + l);
        FillF32<<<64, 256, 0, ctx.stream>>>(static_cast<float*>(st.post), T * n, 200 + l, 0.1f, 2.0f);
        FillF32<<<64, 256, 0, ctx.stream>>>(static_cast<float*>(st.comb), T * n * n, 300 + l, 0.01f, 1.0f);
        FillF32<<<64, 256, 0, ctx.stream>>>(static_cast<float*>(st.pre), T * n, 400 + l, 0.01f, 1.0f);
        CHECK_GPU(gpuGetLastError());
      }
      auto args_for = [&](const Set& st) {
        fl::MhcArgs a;
        a.stage = fl::MhcStage::kSeam;
        a.mode = mode;
        a.tokens = T;
        a.x = fl::TensorView::Contiguous(st.x, fl::DType::kBF16, {T, C});
        a.residual = fl::TensorView::Contiguous(st.r, fl::DType::kBF16, {T, n, C});
        a.post_mix = fl::TensorView::Contiguous(st.post, fl::DType::kFP32, {T, n});
        a.comb_mix = fl::TensorView::Contiguous(st.comb, fl::DType::kFP32, {T, n, n});
        if (mode == fl::MhcMode::kShifted) a.pre_mix = fl::TensorView::Contiguous(st.pre, fl::DType::kFP32, {T, n});
        a.new_residual = fl::TensorView::Contiguous(st.nr, fl::DType::kBF16, {T, n, C});
        a.new_pre_mix = fl::TensorView::Contiguous(st.npre, fl::DType::kFP32, {T, n});
        a.new_post_mix = fl::TensorView::Contiguous(st.npost, fl::DType::kFP32, {T, n});
        a.new_comb_mix = fl::TensorView::Contiguous(st.ncomb, fl::DType::kFP32, {T, n, n});
        a.y = fl::TensorView::Contiguous(st.y, fl::DType::kBF16, {T, C});
        return a;
      };
      double us[2] = {0, 0};
      constexpr int npaths = 2;
      for (int pi = 0; pi < npaths; ++pi) {
        const fl::Path path = pi == 1 ? fl::Path::kUnfused : fl::Path::kFused;
        // Eager warm-up: sizes the workspace (no allocation may happen during capture).
        CHECK_OK(gpu::LaunchMhcGpu(w, args_for(sets[0]), path, ctx, int64_t{1} << 20));
        CHECK_GPU(gpuStreamSynchronize(ctx.stream));
        if (once) continue;
        gpuGraph_t graph;
        gpuGraphExec_t exec;
        CHECK_GPU(gpuStreamBeginCapture(ctx.stream, gpuStreamCaptureModeThreadLocal));
        for (int l = 0; l < L; ++l) CHECK_OK(gpu::LaunchMhcGpu(w, args_for(sets[l]), path, ctx, int64_t{1} << 20));
        CHECK_GPU(gpuStreamEndCapture(ctx.stream, &graph));
        CHECK_GPU(gpuGraphInstantiate(&exec, graph));
        us[pi] = MedianReplayMs(exec, ctx.stream, flush, e0, e1) * 1e3 / L;
        CHECK_GPU(gpuGraphExecDestroy(exec));
        CHECK_GPU(gpuGraphDestroy(graph));
      }
      const double floor_us = bytes / kFloorBandwidth * 1e6;
      std::printf("%6lld %6lld %10.2f %10.2f %10.2f %9.1f%% %8d\n", (long long)C, (long long)T, us[0], us[1],
                  floor_us, 100.0 * floor_us / us[0], L);
      std::fflush(stdout);
      if (csv) {
        for (int pi = 0; pi < npaths; ++pi)
          std::fprintf(csv, "%lld,%lld,%s,%.3f,%.3f,%.1f,%d\n", (long long)C, (long long)T,
                       pi == 0 ? "fused" : "unfused", us[pi], floor_us,
                       100.0 * floor_us / us[pi], L);
      }
      for (Set& st : sets)
        for (void* p : {st.x, st.r, st.post, st.comb, st.pre, st.nr, st.npre, st.npost, st.ncomb, st.y})
          CHECK_GPU(gpuFree(p));
    }
  }
  if (csv) std::fclose(csv);
  CHECK_GPU(gpuFree(flush));
  return 0;
}
