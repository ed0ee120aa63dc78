// CPU SWA op: argument handling, the two paths' pass structure and threading. The per-row math is
// in swa_cpu_rows.cc, the wq_b GEMM in swa_cpu_gemm.cc.
//
// Fused path: one pass per token block (norm both halves, quantize q from fp32, write kv), then the
// GEMM on the pass's own (q_fp8, q_scale).
// Unfused path: the chain the fused kernel replaces. A norm pass writes bf16 q (and kv) to memory, a
// separate quant pass reads that bf16 q back; with wq_b the "linear layer" quantizes the bf16 q once
// more into its own buffers and runs the GEMM on those.
#include "swa_cpu.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "fusedlayer/launch_prologue.h"
#include "swa_cpu_gemm.h"
#include "swa_cpu_rows.h"

namespace fusedlayer::cpu {
namespace {

// Tokens per ParallelFor block of the row passes: enough work per block (~tens of microseconds at
// DeepSeek shapes) to amortise the pool's hand-off, small enough to balance 2..64 threads.
constexpr int64_t kRowBlock = 16;
// The fused kernel's vector tile along the kv half (head_dim).
constexpr int64_t kFusedKvTile = 64;
// The unfused chain materialises the bf16 q of at most this many bytes at a time (whole batch up to
// 64 MiB: at Q = 1536 that is 21845 tokens), bounding the scratch a huge request can pin.
constexpr int64_t kUnfusedScratchBytes = int64_t{64} << 20;

DType Fp8DType(Fp8Format f) { return f == Fp8Format::kE4M3FN ? DType::kFP8E4M3FN : DType::kFP8E4M3FNUZ; }

swa::RowParams MakeRowParams(const CpuSwaWeights& w) {
  swa::RowParams p;
  p.Q = w.params_.q_rank;
  p.D = w.params_.head_dim;
  p.eps = w.params_.eps;
  p.fp8 = w.params_.fp8_format;
  p.scale_format = w.params_.scale_format;
  p.q_norm = w.q_norm_.data();
  p.kv_norm = w.kv_norm_.data();
  return p;
}

// The output quant destination for tokens [m0, ...) of the call, in the weight set's scale layout.
swa::QuantOut OutputQuant(const SwaHyperParams& p, const SwaArgs& args) {
  swa::QuantOut q;
  q.codes = args.q_fp8.ptr<uint8_t>();
  q.scale = args.q_scale.ptr<float>();
  if (p.scale_layout == ScaleLayout::kRowMajor) {
    q.scale_row = p.groups();
    q.scale_col = 1;
  } else {
    q.scale_row = 1;
    q.scale_col = AlignTo4(args.tokens);
  }
  return q;
}

// Reusable scratch for the unfused chain, owned by the calling (executor) thread: the chain's
// intermediate tensors would be fresh allocations on a GPU; here they are kept to avoid page-fault
// costs that the GPU chain does not have.
struct UnfusedScratch {
  std::vector<uint16_t> q_bf16;
  std::vector<uint8_t> lin_codes;  // the linear layer's own quantized input (wq_b only)
  std::vector<float> lin_scale;
};
UnfusedScratch& ThreadScratch() {
  thread_local UnfusedScratch s;
  return s;
}

void RunFused(const CpuSwaWeights& w, const SwaArgs& args, ThreadPool& pool) {
  const SwaHyperParams& p = w.params_;
  const int64_t M = args.tokens;
  const swa::RowParams rp = MakeRowParams(w);
  const swa::QuantOut q = OutputQuant(p, args);
  const uint16_t* x = args.qr_kv.ptr<uint16_t>();
  const int64_t x_stride = args.qr_kv.stride[0];
  uint16_t* kv = args.kv.ptr<uint16_t>();
  pool.ParallelFor(M, kRowBlock, [&](int64_t m0, int64_t m1) {
    swa::FusedNormQuantRows(rp, x, x_stride, m0, m1, q, kv);
  });
  if (p.has_wq_b()) {
    swa::GemmA a{q.codes, q.scale, q.scale_row, q.scale_col};
    swa::GemmB b{w.wq_b_.data(), w.wq_b_scale_.data()};
    swa::BlockScaledFp8Gemm(a, b, M, p.wq_b_rows, p.q_rank, p.fp8_format, args.q_proj.ptr<uint16_t>(), pool);
  }
}

void RunUnfused(const CpuSwaWeights& w, const SwaArgs& args, ThreadPool& pool) {
  const SwaHyperParams& p = w.params_;
  const int64_t M = args.tokens, Q = p.q_rank, G = p.groups();
  const swa::RowParams rp = MakeRowParams(w);
  const swa::QuantOut out_q = OutputQuant(p, args);
  const uint16_t* x = args.qr_kv.ptr<uint16_t>();
  const int64_t x_stride = args.qr_kv.stride[0];
  uint16_t* kv = args.kv.ptr<uint16_t>();
  UnfusedScratch& scratch = ThreadScratch();
  const int64_t chunk = std::max<int64_t>(1, std::min<int64_t>(M, kUnfusedScratchBytes / (Q * 2)));
  if (int64_t(scratch.q_bf16.size()) < chunk * Q) scratch.q_bf16.resize(chunk * Q);
  if (p.has_wq_b() && int64_t(scratch.lin_codes.size()) < chunk * Q) {
    scratch.lin_codes.resize(chunk * Q);
    scratch.lin_scale.resize(chunk * G);
  }
  for (int64_t c0 = 0; c0 < M; c0 += chunk) {
    const int64_t cm = std::min(chunk, M - c0);
    // The scratch holds the chunk's rows at 0..cm; shift the global tensors so the row kernels index
    // them with chunk-local token numbers.
    uint16_t* q_bf16 = scratch.q_bf16.data();
    const uint16_t* xc = x + c0 * x_stride;
    uint16_t* kvc = kv + c0 * p.head_dim;
    swa::QuantOut oq = out_q;
    oq.codes += c0 * Q;
    oq.scale += c0 * out_q.scale_row;
    // 1. the norm kernel
    pool.ParallelFor(cm, kRowBlock, [&](int64_t m0, int64_t m1) {
      swa::NormRowsBf16(rp, xc, x_stride, m0, m1, q_bf16, kvc);
    });
    // 2. the quant kernel, reading the bf16 q back
    pool.ParallelFor(cm, kRowBlock, [&](int64_t m0, int64_t m1) {
      swa::QuantRowsBf16(rp, q_bf16, m0, m1, oq);
    });
    if (p.has_wq_b()) {
      // 3. the linear layer: its own input quant of the bf16 q (row-major scales), then the GEMM.
      swa::QuantOut lq;
      lq.codes = scratch.lin_codes.data();
      lq.scale = scratch.lin_scale.data();
      lq.scale_row = G;
      lq.scale_col = 1;
      pool.ParallelFor(cm, kRowBlock, [&](int64_t m0, int64_t m1) {
        swa::QuantRowsBf16(rp, q_bf16, m0, m1, lq);
      });
      swa::GemmA a{lq.codes, lq.scale, G, 1};
      swa::GemmB b{w.wq_b_.data(), w.wq_b_scale_.data()};
      swa::BlockScaledFp8Gemm(a, b, cm, p.wq_b_rows, Q, p.fp8_format,
                              args.q_proj.ptr<uint16_t>() + c0 * p.wq_b_rows, pool);
    }
  }
}

// Zeroes the padding rows m in [M, align(M, 4)) of a column-major TMA scale tensor.
void ZeroScalePadding(const SwaHyperParams& p, const SwaArgs& args) {
  if (p.scale_layout != ScaleLayout::kColumnMajorTma) return;
  const int64_t M = args.tokens, Ma = AlignTo4(M);
  float* s = args.q_scale.ptr<float>();
  for (int64_t g = 0; g < p.groups(); ++g) {
    for (int64_t m = M; m < Ma; ++m) s[g * Ma + m] = 0.0f;
  }
}

absl::Status CheckVector(const TensorView& t, const char* what, DType dtype, int64_t n) {
  return ExpectTensor(t, what, dtype, {n});
}

}  // namespace

size_t CpuSwaWeights::resident_bytes() const {
  return q_norm_.size() * sizeof(uint16_t) + kv_norm_.size() * sizeof(uint16_t) + wq_b_.size() +
         wq_b_scale_.size() * sizeof(float);
}

absl::StatusOr<std::unique_ptr<CpuSwaWeights>> PrepareSwaCpu(const SwaHyperParams& params,
                                                              const SwaWeightsHost& weights) {
  if (absl::Status s = params.Validate(); !s.ok()) return s;
  const int64_t Q = params.q_rank, D = params.head_dim, N = params.wq_b_rows;
  if (absl::Status s = CheckVector(weights.q_norm, "q_norm", DType::kBF16, Q); !s.ok()) return s;
  if (absl::Status s = CheckVector(weights.kv_norm, "kv_norm", DType::kBF16, D); !s.ok()) return s;
  if (params.has_wq_b()) {
    if (absl::Status s = ExpectTensor(weights.wq_b, "wq_b", Fp8DType(params.fp8_format), {N, Q}); !s.ok()) {
      return s;
    }
    if (absl::Status s = ExpectTensor(weights.wq_b_scale, "wq_b_scale", DType::kFP32,
                                      {N / kSwaGroup, Q / kSwaGroup});
        !s.ok()) {
      return s;
    }
    const float* sc = weights.wq_b_scale.ptr<float>();
    for (int64_t i = 0; i < weights.wq_b_scale.numel(); ++i) {
      if (!std::isfinite(sc[i]) || !(sc[i] > 0.0f)) {
        return absl::InvalidArgumentError(
            absl::StrCat("wq_b_scale: every scale must be finite and > 0; element ", i, " is ", sc[i]));
      }
    }
  } else if (!weights.wq_b.empty_view() || !weights.wq_b_scale.empty_view()) {
    return absl::InvalidArgumentError("wq_b / wq_b_scale given but wq_b_rows is 0 (no projection)");
  }

  auto w = std::make_unique<CpuSwaWeights>();
  w->params_ = params;
  const uint16_t* qn = weights.q_norm.ptr<uint16_t>();
  const uint16_t* kn = weights.kv_norm.ptr<uint16_t>();
  w->q_norm_.assign(qn, qn + Q);
  w->kv_norm_.assign(kn, kn + D);
  if (params.has_wq_b()) {
    const uint8_t* b = weights.wq_b.ptr<uint8_t>();
    const float* bs = weights.wq_b_scale.ptr<float>();
    w->wq_b_.assign(b, b + N * Q);
    w->wq_b_scale_.assign(bs, bs + weights.wq_b_scale.numel());
  }
  return w;
}

FusedSupport SwaFusedSupportCpu(const CpuSwaWeights& weights, const SwaShapeQuery& query,
                                int64_t fused_max_tokens) {
  if (query.tokens > fused_max_tokens) {
    return FusedSupport::No(FallbackReason::kTooManyTokens,
                            absl::StrCat("tokens = ", query.tokens, " exceeds fused_max_tokens = ", fused_max_tokens));
  }
  const int64_t D = weights.params_.head_dim;
  if (D % kFusedKvTile != 0) {
    return FusedSupport::No(FallbackReason::kHiddenSizeUnsupported,
                            absl::StrCat("head_dim = ", D, " is not a multiple of ", kFusedKvTile));
  }
  return FusedSupport::Yes();
}

absl::Status RunSwaCpu(const CpuSwaWeights& weights, const SwaArgs& args, Path path, int64_t fused_max_tokens,
                       ThreadPool& pool) {
  const SwaHyperParams& p = weights.params_;
  if (absl::Status s = SwaLaunchPrologue(weights, args, path,
                                         [&](const SwaShapeQuery& q) {
                                           return SwaFusedSupportCpu(weights, q, fused_max_tokens);
                                         });
      !s.ok()) {
    return s;
  }
  if (args.tokens == 0) return absl::OkStatus();
  if (path == Path::kFused) {
    RunFused(weights, args, pool);
  } else {
    RunUnfused(weights, args, pool);
  }
  ZeroScalePadding(p, args);
  return absl::OkStatus();
}

}  // namespace fusedlayer::cpu
