// CPU SWA op (spec/swa.md), fused versus unfused, at the DeepSeek-V4-Pro shape Q = 1536, D = 512,
// through the public Backend interface (so the numbers include validation and the pool hand-off).
//
// Byte model (SetBytesProcessed), per token, G = Q / 128:
//   fused:   read qr_kv 2(Q + D) + write q_fp8 Q + q_scale 4G + kv 2D
//   unfused: the same plus the chain's bf16 q written by the norm kernel and read back by the quant
//            kernel: + 4Q
// With wq_b (N rows) both add the weight read once per call (N*Q + 4*(N/128)*(Q/128)) and the q_proj
// write 2N per token; the GEMM is compute-bound, so that case's rate is reported for completeness.
#include <cstdint>
#include <random>
#include <vector>

#include "benchmark/benchmark.h"
#include "fusedlayer/backend.h"
#include "fusedlayer/numeric.h"

namespace fusedlayer {
namespace {

constexpr int64_t kQ = 1536, kD = 512;

std::vector<uint16_t> RandomBf16(std::mt19937_64& rng, size_t n) {
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  std::vector<uint16_t> v(n);
  for (auto& b : v) {
    float f = nd(rng);
    if (u(rng) < 0.01f) f *= 16.0f;
    b = FloatToBf16(f == 0.0f ? 1.0f : f);
  }
  return v;
}

struct SwaBenchCase {
  std::unique_ptr<Backend> backend;
  std::unique_ptr<PreparedSwaWeights> weights;
  std::vector<uint16_t> qr_kv, kv, q_proj;
  std::vector<uint8_t> q_fp8;
  std::vector<float> q_scale;
  SwaArgs args;
};

SwaBenchCase MakeCase(int64_t M, int64_t N, int threads) {
  SwaBenchCase c;
  BackendOptions opts;
  opts.num_threads = threads;
  c.backend = CreateCpuBackend(opts);
  std::mt19937_64 rng(1234);
  SwaHyperParams p;
  p.q_rank = kQ;
  p.head_dim = kD;
  p.wq_b_rows = N;
  std::vector<uint16_t> qn = RandomBf16(rng, kQ), kn = RandomBf16(rng, kD);
  std::vector<uint8_t> wq(N * kQ);
  std::vector<float> ws((N / 128) * (kQ / 128));
  for (auto& b : wq) b = FloatToE4M3FN(std::normal_distribution<float>(0.0f, 64.0f)(rng));
  for (auto& s : ws) s = std::uniform_real_distribution<float>(1e-4f, 1e-3f)(rng);
  SwaWeightsHost w;
  w.q_norm = TensorView::Contiguous(qn.data(), DType::kBF16, {kQ});
  w.kv_norm = TensorView::Contiguous(kn.data(), DType::kBF16, {kD});
  if (N > 0) {
    w.wq_b = TensorView::Contiguous(wq.data(), DType::kFP8E4M3FN, {N, kQ});
    w.wq_b_scale = TensorView::Contiguous(ws.data(), DType::kFP32, {N / 128, kQ / 128});
  }
  auto prepared = c.backend->PrepareSwa(p, w);
  if (!prepared.ok()) return c;
  c.weights = std::move(*prepared);
  c.qr_kv = RandomBf16(rng, size_t(M) * (kQ + kD));
  c.q_fp8.resize(M * kQ);
  c.q_scale.resize(M * (kQ / 128));
  c.kv.resize(M * kD);
  c.q_proj.resize(M * N);
  c.args.tokens = M;
  c.args.qr_kv = TensorView::Strided2D(c.qr_kv.data(), DType::kBF16, M, kQ + kD, kQ + kD);
  c.args.q_fp8 = TensorView::Contiguous(c.q_fp8.data(), DType::kFP8E4M3FN, {M, kQ});
  c.args.q_scale = TensorView::Contiguous(c.q_scale.data(), DType::kFP32, {M, kQ / 128});
  c.args.kv = TensorView::Contiguous(c.kv.data(), DType::kBF16, {M, kD});
  if (N > 0) c.args.q_proj = TensorView::Contiguous(c.q_proj.data(), DType::kBF16, {M, N});
  return c;
}

void BM_SwaCpu(benchmark::State& state) {
  const int64_t M = state.range(0);
  const Path path = state.range(1) == 0 ? Path::kFused : Path::kUnfused;
  const int64_t N = state.range(2);
  SwaBenchCase c = MakeCase(M, N, int(state.range(3)));
  if (!c.weights) {
    state.SkipWithError("PrepareSwa failed");
    return;
  }
  for (auto _ : state) {
    auto r = c.backend->RunSwa(*c.weights, c.args, path);
    if (!r.ok()) {
      state.SkipWithError(std::string(r.status().message()).c_str());
      return;
    }
    benchmark::DoNotOptimize(c.q_fp8.data());
    benchmark::ClobberMemory();
  }
  const int64_t G = kQ / 128;
  int64_t per_token = 2 * (kQ + kD) + kQ + 4 * G + 2 * kD;
  if (path == Path::kUnfused) per_token += 4 * kQ;
  int64_t per_call = 0;
  if (N > 0) {
    per_token += 2 * N;
    per_call += N * kQ + 4 * (N / 128) * G;
  }
  state.SetBytesProcessed(state.iterations() * (M * per_token + per_call));
  state.SetLabel(path == Path::kFused ? "fused" : "unfused");
  state.counters["tokens"] = double(M);
}

// Args: {M, path (0 fused, 1 unfused), wq_b rows N, threads (0 = all cores)}. The single-thread
// pair at M = 4096 isolates per-core cost from the pool hand-off and from other load on the host.
BENCHMARK(BM_SwaCpu)
    ->ArgNames({"M", "unfused", "N", "threads"})
    ->Args({1, 0, 0, 0})
    ->Args({1, 1, 0, 0})
    ->Args({64, 0, 0, 0})
    ->Args({64, 1, 0, 0})
    ->Args({4096, 0, 0, 0})
    ->Args({4096, 1, 0, 0})
    ->Args({4096, 0, 0, 1})
    ->Args({4096, 1, 0, 1})
    ->Args({64, 0, 4096, 0})
    ->Args({64, 1, 4096, 0})
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);

}  // namespace
}  // namespace fusedlayer
