// Output-hash probe for the CPU mHC kernels (it showed the AVX-512 mixes-GEMM
// form bitwise equal to the generic one): deterministic inputs over 3,024
// configurations (n 1-8, C with and without K % 16 tails, T 1-40, every stage,
// mode and path, 1, 2 and 5 threads), one FNV-1a hash per configuration over every
// output byte, and a total. Build it against two versions of the library and
// diff the outputs: identical lines = identical bits. `generic` as an argument
// forbids the AVX-512 GEMM form (add -DPROBE_LIBRARY_BEFORE_GEMM_FORMS for a
// library older than it). Not part of the build; from the repository
// root, with a CPU build in build/:
//
//   g++ -std=c++20 -O2 -Ikernels/include -Ikernels/cpu -Ibench/experiments \
//     bench/experiments/mhc_cpu_output_hash_probe/mhc_cpu_output_hash_probe.cc \
//     build/kernels/libfusedlayer_kernels.a \
//     $(pkg-config --libs absl_status absl_statusor absl_strings absl_str_format) \
//     -lpthread -o /tmp/mhc_probe && /tmp/mhc_probe > hashes.txt
#include "../deterministic_inputs.h"
#include "fusedlayer/backend.h"
#include "fusedlayer/numeric.h"
#include "mhc_cpu.h"
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>
using namespace fusedlayer;
using bench::Gen;
static uint64_t H(uint64_t h, const void *p, size_t n) {
  auto *b = (const unsigned char *)p;
  for (size_t i = 0; i < n; ++i) {
    h ^= b[i];
    h *= 1099511628211ull;
  }
  return h;
}
int main(int argc, char **argv) {
#ifndef PROBE_LIBRARY_BEFORE_GEMM_FORMS  // define it for libraries older than the AVX-512 form
  if (argc > 1)
    printf("avx512 form available: %d (forbidden now)\n",
           fusedlayer::cpu::SetMhcCpuAvx512ForTesting(false));
#else
  (void)argc;
  (void)argv;
#endif
  uint64_t total = 1469598103934665603ull;
  int configs = 0;
  for (int threads : {1, 2, 5}) {  // 2 and 5: row-split mixes at T <= 8 / 32
    BackendOptions opt;
    opt.num_threads = threads;
    auto be = CreateCpuBackend(opt);
    for (int n : {1, 2, 3, 4, 5, 8})
      for (int64_t C : {64, 200, 512, 4096, 7168})
        for (int64_t T : {1, 3, 8, 9, 17, 40}) {
          if (n != 4 && C > 512)
            continue;
          for (int stage = 0; stage < 3; ++stage)
            for (int mode = 0; mode < 2; ++mode)
              for (int variant = 0; variant < 2; ++variant)
                for (int path = 0; path < 2; ++path) {
                  if (stage == 2 && mode == 1)
                    continue;
                  Gen g{uint64_t(n * 1000003 + C * 101 + T * 7 + stage * 13 +
                                 mode * 17 + variant * 19)};
                  MhcHyperParams hp;
                  hp.hc_mult = n;
                  hp.hidden = C;
                  hp.sinkhorn_iters = variant ? 7 : 20;
                  const int64_t M = hp.num_mixes(), K = hp.flat_width();
                  std::vector<float> fn(M * K),
                      scale = {g.Uniform(0.5f, 2), g.Uniform(0.5f, 2), g.Uniform(0.5f, 2)},
                      base(M);
                  for (auto &f : fn) {
                    f = g.Uniform(-0.05f, 0.05f) + 1e-4f;
                    if ((g.Next() & 255) == 0)
                      f *= 30;
                  }
                  for (auto &b : base)
                    b = g.Uniform(-1, 1);
                  std::vector<uint16_t> norm(C);
                  for (auto &v : norm)
                    v = g.Bf16();
                  MhcWeightsHost wh;
                  wh.fn =
                      TensorView::Contiguous(fn.data(), DType::kFP32, {M, K});
                  wh.scale =
                      TensorView::Contiguous(scale.data(), DType::kFP32, {3});
                  wh.base =
                      TensorView::Contiguous(base.data(), DType::kFP32, {M});
                  if (variant == 0)
                    wh.norm_weight =
                        TensorView::Contiguous(norm.data(), DType::kBF16, {C});
                  auto w = be->PrepareMhc(hp, wh);
                  if (!w.ok()) {
                    printf("prep fail %s\n", w.status().ToString().c_str());
                    return 1;
                  }
                  std::vector<uint16_t> x(T * C), R(T * K), nr(T * K, 0x7fc1),
                      y(T * C, 0x7fc1), aux(T * C, 0x7fc1);
                  for (auto &v : x)
                    v = g.Bf16();
                  for (auto &v : R)
                    v = g.Bf16();
                  std::vector<float> post(T * n), comb(T * n * n), pre(T * n),
                      npre(T * n, NAN), npost(T * n, NAN),
                      ncomb(T * n * n, NAN);
                  for (auto &v : post)
                    v = g.Uniform(0.2f, 2);
                  for (auto &v : pre)
                    v = g.Uniform(0.1f, 1.5f);
                  for (auto &v : comb)
                    v = g.Uniform(0.05f, 1);
                  MhcArgs a;
                  a.stage = MhcStage(stage);
                  a.mode = MhcMode(mode);
                  a.tokens = T;
                  a.capture_aux = (variant == 1);
                  a.x = TensorView::Contiguous(x.data(), DType::kBF16, {T, C});
                  a.new_residual = TensorView::Contiguous(
                      nr.data(), DType::kBF16, {T, n, C});
                  a.y = TensorView::Contiguous(y.data(), DType::kBF16, {T, C});
                  if (a.capture_aux)
                    a.aux = TensorView::Contiguous(aux.data(), DType::kBF16,
                                                   {T, C});
                  if (stage != 1) {
                    a.residual = TensorView::Contiguous(R.data(), DType::kBF16,
                                                        {T, n, C});
                    a.post_mix = TensorView::Contiguous(post.data(),
                                                        DType::kFP32, {T, n});
                    a.comb_mix = TensorView::Contiguous(
                        comb.data(), DType::kFP32, {T, n, n});
                  }
                  if (mode == 0 && stage != 1 && variant == 0)
                    a.pre_mix = TensorView::Contiguous(pre.data(), DType::kFP32,
                                                       {T, n});
                  if (stage != 2) {
                    a.new_pre_mix = TensorView::Contiguous(
                        npre.data(), DType::kFP32, {T, n});
                    a.new_post_mix = TensorView::Contiguous(
                        npost.data(), DType::kFP32, {T, n});
                    a.new_comb_mix = TensorView::Contiguous(
                        ncomb.data(), DType::kFP32, {T, n, n});
                  }
                  auto r =
                      be->RunMhc(**w, a, path ? Path::kUnfused : Path::kFused);
                  uint64_t h = 1469598103934665603ull;
                  if (!r.ok()) {
                    printf("n%d C%ld T%ld s%d m%d v%d p%d th%d: %s\n", n,
                           (long)C, (long)T, stage, mode, variant, path,
                           threads,
                           r.status().ToString().substr(0, 60).c_str());
                    continue;
                  }
                  h = H(h, nr.data(), nr.size() * 2);
                  h = H(h, y.data(), y.size() * 2);
                  h = H(h, aux.data(), aux.size() * 2);
                  h = H(h, npre.data(), npre.size() * 4);
                  h = H(h, npost.data(), npost.size() * 4);
                  h = H(h, ncomb.data(), ncomb.size() * 4);
                  printf("n%d C%ld T%ld s%d m%d v%d p%d th%d %016lx\n", n,
                         (long)C, (long)T, stage, mode, variant, path, threads,
                         (unsigned long)h);
                  total = H(total, &h, 8);
                  ++configs;
                }
        }
  }
  printf("TOTAL %d configs %016lx\n", configs, (unsigned long)total);
}
