// CPU mHC seam benchmarks: DeepSeek-V4-Pro hidden size (C = 7168), n = 4, shifted mode with pre_mix
// and the norm weight (the V4.1 seam as vLLM calls it), fused vs unfused, T in {1, 8, 64, 1024, 4096}.
//
// Byte model (SetBytesProcessed), per token, the op's compulsory traffic:
//   read  x 2C + R 8C + post_mix 4n + comb_mix 4n^2 + pre_mix 4n
//   write R' 8C + y 2C + new pre/post mixes 8n + new comb 4n^2
//   = 20C + 16n + 8n^2 bytes = 143,488 B at C = 7168, n = 4.
// The weights (fn: 24 x 28672 fp32 = 2.75 MB) are not counted: they are read once per token block
// from cache, not per token from memory. The unfused path moves more than the model says (it reads
// R' back twice); that is the point of the comparison.
#include <cstdint>
#include <map>
#include <utility>
#include <memory>
#include <vector>

#include "benchmark/benchmark.h"
#include "fusedlayer/backend.h"
#include "deterministic_inputs.h"
#include "fusedlayer/numeric.h"

namespace fusedlayer {
namespace {

constexpr int kN = 4;
constexpr int64_t kC = 7168;

using bench::Gen;

struct SeamData {
  std::unique_ptr<Backend> backend;
  std::unique_ptr<PreparedMhcWeights> weights;
  std::vector<uint16_t> x, residual, new_residual, y;
  std::vector<float> post_mix, comb_mix, pre_mix, new_pre, new_post, new_comb;
  MhcArgs args;
};

// One data set per (T, threads), shared by the fused and unfused benchmarks.
SeamData& Data(int64_t T, int threads) {
  static std::map<std::pair<int64_t, int>, std::unique_ptr<SeamData>> cache;
  auto& slot = cache[{T, threads}];
  if (slot) return *slot;
  slot = std::make_unique<SeamData>();
  SeamData& d = *slot;
  BackendOptions opt;
  opt.num_threads = threads;
  d.backend = CreateCpuBackend(opt);
  Gen g{uint64_t(T) * 7919 + 1};
  MhcHyperParams hp;
  hp.hc_mult = kN;
  hp.hidden = kC;
  const int64_t M = hp.num_mixes(), K = hp.flat_width();
  std::vector<float> fn(M * K), scale = {g.Uniform(0.5f, 2), g.Uniform(0.5f, 2), g.Uniform(0.5f, 2)}, base(M);
  for (auto& f : fn) f = g.Uniform(-0.02f, 0.02f) + 1e-4f;
  for (auto& b : base) b = g.Uniform(-1, 1);
  std::vector<uint16_t> norm(kC);
  for (auto& v : norm) v = g.Bf16();
  MhcWeightsHost wh;
  wh.fn = TensorView::Contiguous(fn.data(), DType::kFP32, {M, K});
  wh.scale = TensorView::Contiguous(scale.data(), DType::kFP32, {3});
  wh.base = TensorView::Contiguous(base.data(), DType::kFP32, {M});
  wh.norm_weight = TensorView::Contiguous(norm.data(), DType::kBF16, {kC});
  d.weights = std::move(d.backend->PrepareMhc(hp, wh)).value();

  d.x.resize(T * kC);
  d.residual.resize(T * K);
  for (auto& v : d.x) v = g.Bf16();
  for (auto& v : d.residual) v = g.Bf16();
  d.post_mix.resize(T * kN);
  d.pre_mix.resize(T * kN);
  d.comb_mix.resize(T * kN * kN);
  for (auto& v : d.post_mix) v = g.Uniform(0.2f, 2.0f);
  for (auto& v : d.pre_mix) v = g.Uniform(0.1f, 1.5f);
  for (auto& v : d.comb_mix) v = g.Uniform(0.05f, 1.0f);
  d.new_residual.resize(T * K);
  d.y.resize(T * kC);
  d.new_pre.resize(T * kN);
  d.new_post.resize(T * kN);
  d.new_comb.resize(T * kN * kN);

  MhcArgs& a = d.args;
  a.stage = MhcStage::kSeam;
  a.mode = MhcMode::kShifted;
  a.tokens = T;
  a.x = TensorView::Contiguous(d.x.data(), DType::kBF16, {T, kC});
  a.residual = TensorView::Contiguous(d.residual.data(), DType::kBF16, {T, kN, kC});
  a.post_mix = TensorView::Contiguous(d.post_mix.data(), DType::kFP32, {T, kN});
  a.comb_mix = TensorView::Contiguous(d.comb_mix.data(), DType::kFP32, {T, kN, kN});
  a.pre_mix = TensorView::Contiguous(d.pre_mix.data(), DType::kFP32, {T, kN});
  a.new_residual = TensorView::Contiguous(d.new_residual.data(), DType::kBF16, {T, kN, kC});
  a.new_pre_mix = TensorView::Contiguous(d.new_pre.data(), DType::kFP32, {T, kN});
  a.new_post_mix = TensorView::Contiguous(d.new_post.data(), DType::kFP32, {T, kN});
  a.new_comb_mix = TensorView::Contiguous(d.new_comb.data(), DType::kFP32, {T, kN, kN});
  a.y = TensorView::Contiguous(d.y.data(), DType::kBF16, {T, kC});
  return d;
}

void BM_MhcSeamCpu(benchmark::State& state, Path path) {
  const int64_t T = state.range(0);
  SeamData& d = Data(T, int(state.range(1)));
  for (auto _ : state) {
    auto st = d.backend->RunMhc(*d.weights, d.args, path);
    if (!st.ok()) {
      state.SkipWithError(st.status().ToString().c_str());
      break;
    }
    benchmark::DoNotOptimize(d.y.data());
    benchmark::ClobberMemory();
  }
  const int64_t bytes_per_token = 20 * kC + 16 * kN + 8 * kN * kN;
  state.SetBytesProcessed(state.iterations() * T * bytes_per_token);
  state.counters["tokens"] = double(T);
  state.counters["tokens_per_s"] = benchmark::Counter(double(T), benchmark::Counter::kIsIterationInvariantRate);
  // Tokens per second, inverted: seconds per token.
  state.counters["s_per_token"] =
      benchmark::Counter(double(T), benchmark::Counter::kIsIterationInvariantRate | benchmark::Counter::kInvert);
  state.SetLabel(d.backend->device_name());
}

void BM_MhcSeamCpuFused(benchmark::State& state) { BM_MhcSeamCpu(state, Path::kFused); }
void BM_MhcSeamCpuUnfused(benchmark::State& state) { BM_MhcSeamCpu(state, Path::kUnfused); }

// threads = 0: the backend's default pool (hardware concurrency); threads = 1: one core, where the
// CPU-time column is the op's whole compute cost even on a loaded machine.
void Shapes(benchmark::internal::Benchmark* b) {
  b->ArgNames({"T", "threads"})->UseRealTime()->Unit(benchmark::kMicrosecond);
  for (int threads : {0, 1}) {
    for (int64_t T : {1, 8, 64, 1024, 4096}) b->Args({T, threads});
  }
}
BENCHMARK(BM_MhcSeamCpuFused)->Apply(Shapes);
BENCHMARK(BM_MhcSeamCpuUnfused)->Apply(Shapes);

}  // namespace
}  // namespace fusedlayer
