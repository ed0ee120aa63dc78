// SWA op on the GPU: weight upload, capability query and the launch sequence of each path.
#include "swa_launch.h"

#include <cmath>
#include <cstdio>

#include "absl/strings/str_cat.h"
#include "fusedlayer/launch_prologue.h"
#include "swa_kernel_launch.h"

namespace fusedlayer::gpu {
namespace {

DType Fp8DType(Fp8Format f) { return f == Fp8Format::kE4M3FN ? DType::kFP8E4M3FN : DType::kFP8E4M3FNUZ; }

absl::Status LaunchStatus(gpuError_t err, const char* what) {
  if (err == gpuSuccess) return absl::OkStatus();
  (void)gpuGetLastError();
  return absl::InternalError(absl::StrCat(what, " launch failed: ", gpuGetErrorString(err)));
}

}  // namespace

absl::StatusOr<std::unique_ptr<GpuSwaWeights>> PrepareSwaGpu(const SwaHyperParams& params,
                                                              const SwaWeightsHost& weights, GpuContext& ctx) {
  if (absl::Status s = params.Validate(); !s.ok()) return s;
  const int64_t Q = params.q_rank, D = params.head_dim;
  absl::Status s;
  if (!(s = ExpectTensor(weights.q_norm, "q_norm", DType::kBF16, {Q})).ok()) return s;
  if (!(s = ExpectTensor(weights.kv_norm, "kv_norm", DType::kBF16, {D})).ok()) return s;
  if (params.has_wq_b()) {
    const int64_t N = params.wq_b_rows;
    if (!(s = ExpectTensor(weights.wq_b, "wq_b", Fp8DType(params.fp8_format), {N, Q})).ok()) return s;
    if (!(s = ExpectTensor(weights.wq_b_scale, "wq_b_scale", DType::kFP32, {N / kSwaGroup, Q / kSwaGroup})).ok()) {
      return s;
    }
    // Dequant scales must be finite and positive (a zero or NaN scale would silently poison q_proj).
    const float* bs = weights.wq_b_scale.ptr<const float>();
    for (int64_t i = 0; i < weights.wq_b_scale.numel(); ++i) {
      if (!(std::isfinite(bs[i]) && bs[i] > 0.0f)) {
        return absl::InvalidArgumentError(absl::StrCat("wq_b_scale[", i, "] = ", bs[i], " is not finite and > 0"));
      }
    }
  } else if (!weights.wq_b.empty_view() || !weights.wq_b_scale.empty_view()) {
    return absl::InvalidArgumentError("wq_b given but wq_b_rows is 0");
  }
  // Only the first 2^31 elements of a row are addressed with 32-bit lane arithmetic.
  if (Q + D > (int64_t{1} << 30)) return absl::InvalidArgumentError("q_rank + head_dim too large");

  auto w = std::make_unique<GpuSwaWeights>();
  w->params_ = params;
  auto up = [&](const TensorView& t, GpuMemory& dst) -> absl::Status {
    const size_t bytes = size_t(t.numel()) * DTypeSize(t.dtype);
    auto mem = GpuUpload(t.data, bytes, ctx);
    if (!mem.ok()) return mem.status();
    dst = std::move(*mem);
    w->resident_bytes_ += bytes;
    return absl::OkStatus();
  };
  if (!(s = up(weights.q_norm, w->q_norm)).ok()) return s;
  if (!(s = up(weights.kv_norm, w->kv_norm)).ok()) return s;
  if (params.has_wq_b()) {
    if (!(s = up(weights.wq_b, w->wq_b)).ok()) return s;
    if (!(s = up(weights.wq_b_scale, w->wq_b_scale)).ok()) return s;
    // One implementation (and one cuBLASLt algorithm) for the whole set: never mixed across M.
    w->wq_b_impl = GpuSwaWeights::WqbImpl::kOwnKernel;
#if FL_HIP
    w->wq_b_impl_detail = "our kernel (HIP build: no cuBLASLt)";
#else
    if (params.fp8_format != Fp8Format::kE4M3FN) {
      w->wq_b_impl_detail = "our kernel (e4m3fnuz has no cuBLASLt data type on NVIDIA)";
    } else {
      auto plan = PlanWqbCublasLt(ctx, int(params.wq_b_rows), int(Q));
      if (plan.ok()) {
        w->wq_b_impl = GpuSwaWeights::WqbImpl::kCublasLt;
        w->wq_b_lt = std::move(*plan);
        w->wq_b_impl_detail = absl::StrCat("cuBLASLt: ", w->wq_b_lt.description);
      } else {
        w->wq_b_impl_detail = absl::StrCat("our kernel (cuBLASLt unavailable: ", plan.status().ToString(), ")");
        std::fprintf(stderr, "fusedlayer gpu: wq_b N=%lld K=%lld on %s uses our CUDA-core kernel for every M: %s\n",
                     static_cast<long long>(params.wq_b_rows), static_cast<long long>(Q), ctx.arch.c_str(),
                     plan.status().ToString().c_str());
      }
    }
#endif
  }
  return w;
}

namespace {

// The cuBLASLt algorithm's operand alignment, checked before anything is enqueued (our own kernel
// would accept any pointer, but mixing implementations per call would break batch invariance).
absl::Status CheckWqbOperands(const GpuSwaWeights& weights, const uint8_t* q_fp8, const uint16_t* q_proj) {
#if !FL_HIP
  if (weights.wq_b_impl == GpuSwaWeights::WqbImpl::kCublasLt &&
      !WqbCublasLtAligned(weights.wq_b_lt, q_fp8, static_cast<const uint8_t*>(weights.wq_b.get()), q_proj)) {
    return absl::InvalidArgumentError(absl::StrCat("q_fp8 and q_proj must be aligned to ", weights.wq_b_lt.min_align_b,
                                                   " and ", weights.wq_b_lt.min_align_d,
                                                   " bytes for this weight set's cuBLASLt wq_b algorithm"));
  }
#endif
  return absl::OkStatus();
}

}  // namespace

absl::Status LaunchWqbProjection(const GpuSwaWeights& weights, const uint8_t* q_fp8, const float* q_scale,
                                 const SwaScaleLayout& layout, uint16_t* q_proj, int64_t tokens, GpuContext& ctx) {
  const SwaHyperParams& hp = weights.params();
  if (!hp.has_wq_b()) return absl::FailedPreconditionError("the weight set has no wq_b");
  const auto* b = static_cast<const uint8_t*>(weights.wq_b.get());
  const auto* bs = static_cast<const float*>(weights.wq_b_scale.get());
  if (absl::Status s = CheckWqbOperands(weights, q_fp8, q_proj); !s.ok()) return s;
#if !FL_HIP
  if (weights.wq_b_impl == GpuSwaWeights::WqbImpl::kCublasLt) {
    return LaunchWqbCublasLt(weights.wq_b_lt, ctx, q_fp8, q_scale, layout, b, bs, q_proj, tokens);
  }
#endif
  return LaunchStatus(LaunchWqbGemm(q_fp8, q_scale, layout, b, bs, q_proj, tokens, int(hp.wq_b_rows),
                                    int(hp.q_rank), hp.fp8_format, ctx.stream),
                      "wq_b GEMM");
}

FusedSupport SwaFusedSupportGpu(const GpuSwaWeights& /*weights*/, const SwaShapeQuery& query,
                                const GpuContext& /*ctx*/, int64_t fused_max_tokens) {
  if (query.tokens > fused_max_tokens) {
    return FusedSupport::No(FallbackReason::kTooManyTokens,
                            absl::StrCat("T = ", query.tokens, " exceeds fused_max_tokens = ", fused_max_tokens));
  }
  return FusedSupport::Yes();
}

absl::Status LaunchSwaGpu(const GpuSwaWeights& weights, const SwaArgs& args, Path path, GpuContext& ctx,
                          int64_t fused_max_tokens) {
  const SwaHyperParams& hp = weights.params();
  if (absl::Status s = SwaLaunchPrologue(weights, args, path,
                                         [&](const SwaShapeQuery& q) {
                                           return SwaFusedSupportGpu(weights, q, ctx, fused_max_tokens);
                                         });
      !s.ok()) {
    return s;
  }
  const int64_t M = args.tokens;
  if (M == 0) return absl::OkStatus();
  const int Q = int(hp.q_rank), D = int(hp.head_dim);
  if (hp.has_wq_b()) {  // the GEMM is the last step: check its operands before the first launch
    if (absl::Status s = CheckWqbOperands(weights, args.q_fp8.ptr<const uint8_t>(), args.q_proj.ptr<const uint16_t>());
        !s.ok()) {
      return s;
    }
  }

  SwaScaleLayout layout;
  if (hp.scale_layout == ScaleLayout::kRowMajor) {
    layout.m_stride = hp.groups();
    layout.g_stride = 1;
    layout.padded_rows = M;
  } else {
    layout.m_stride = 1;
    layout.g_stride = AlignTo4(M);
    layout.padded_rows = AlignTo4(M);
  }

  SwaRowParams p;
  p.qr_kv = args.qr_kv.ptr<const uint16_t>();
  p.row_stride = args.qr_kv.stride[0];
  p.tokens = M;
  p.q_rank = Q;
  p.head_dim = D;
  p.q_norm = static_cast<const uint16_t*>(weights.q_norm.get());
  p.kv_norm = static_cast<const uint16_t*>(weights.kv_norm.get());
  p.eps = hp.eps;
  p.kv = args.kv.ptr<uint16_t>();
  p.q_fp8 = args.q_fp8.ptr<uint8_t>();
  p.q_scale = args.q_scale.ptr<float>();
  p.scale_layout = layout;
  p.fp8_format = hp.fp8_format;
  p.ue8m0 = hp.scale_format == ScaleFormat::kUe8m0;

  if (path == Path::kFused) {
    if (absl::Status s = LaunchStatus(LaunchSwaFusedRows(p, ctx.sm_count, ctx.stream), "fused SWA"); !s.ok()) {
      return s;
    }
  } else {
    // The unfused chain materialises the bf16 q half, as vLLM's Triton norm does, then quantizes it.
    void* ws = ctx.Workspace(size_t(M) * size_t(Q) * sizeof(uint16_t));
    if (ws == nullptr) {
      return absl::ResourceExhaustedError(
          absl::StrCat("unfused SWA: workspace of ", M * Q * 2, " bytes for the bf16 q could not be allocated"));
    }
    p.q_bf16 = static_cast<uint16_t*>(ws);
    if (absl::Status s = LaunchStatus(LaunchSwaNormRows(p, ctx.sm_count, ctx.stream), "SWA RMSNorm"); !s.ok()) {
      return s;
    }
    if (absl::Status s = LaunchStatus(LaunchSwaGroupQuant(p.q_bf16, M, Q, p.q_fp8, p.q_scale, layout, hp.fp8_format,
                                                          p.ue8m0, ctx.stream),
                                      "SWA group quant");
        !s.ok()) {
      return s;
    }
  }
  if (hp.has_wq_b()) {
    // Both paths feed the fp8 q and its scales to the GEMM (unfused: the re-quantized bf16 q).
    if (absl::Status s = LaunchWqbProjection(weights, p.q_fp8, p.q_scale, layout, args.q_proj.ptr<uint16_t>(), M, ctx);
        !s.ok()) {
      return s;
    }
  }
  return absl::OkStatus();
}

}  // namespace fusedlayer::gpu
