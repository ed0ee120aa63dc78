// Host side of the GPU mHC op: weight preparation (transposes, the fused path's bf16 hi/lo B
// fragments), the fused-path capability query and the launchers of both paths.
// gpu_runtime.h before anything that pulls in fusedlayer/numeric.h: under hipcc its device branch
// needs the HIP intrinsics (__float_as_uint) declared first.
#include "gpu_runtime.h"
#include "mhc_launch.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "fusedlayer/launch_prologue.h"
#include "device/mhc_finalize_kernel.cuh"
#include "device/mhc_fused_kernel.cuh"
#include "device/mhc_staged_pass_kernel.cuh"
#include "device/mhc_tuning.h"
#include "device/mhc_unfused_kernels.cuh"

namespace fusedlayer::gpu {
namespace {

using mhc::FinalizeParams;
using mhc::FusedParams;
using mhc::MixesParams;
using mhc::PostParams;
using mhc::YSource;

#if FL_HIP
constexpr auto kMaxDynamicSmemAttr = hipFuncAttributeMaxDynamicSharedMemorySize;
#else
constexpr auto kMaxDynamicSmemAttr = cudaFuncAttributeMaxDynamicSharedMemorySize;
#endif

// Token slices: the partials workspace is sized for one slice, so memory stays bounded for any T.
// Slicing never changes a token's arithmetic (every reduction order depends on C only).
constexpr size_t kMaxWorkspaceBytes = size_t(256) << 20;
constexpr int64_t kMaxSliceTokens = 65535;  // grid.y of the mixes kernel with one token per CTA

// fn as mma.sync m16n8k16 (bf16) B fragments (see mhc_fused_kernel.cuh): for 32-channel quad G, k16
// step s (stream j = s / 2, channel half u = s % 2), n-tile nt and lane (g, t): output o = nt*8 + g,
// b0 = channels G*32 + t*8 + 4u + {0, 1} (MMA k 2t, 2t+1) and b1 = + {2, 3} (MMA k 2t+8, 2t+9) of
// stream j, each packed as a bf16 pair (lower k in the low half), once for hi = bf16(f) and once for
// lo = bf16(f - hi) (f - hi is exact in fp32): 4 words per lane = (hi b0, hi b1, lo b0, lo b1).
// `row(o, k)` reads the source matrix; `streams` is 4 (seam) or 1 (first stage).
template <typename Row>
std::vector<uint32_t> BuildFragments(int64_t C, int streams, Row row) {
  const int64_t quads = C / 32;
  const int steps = streams * 2;
  std::vector<uint32_t> out(size_t(quads) * steps * 3 * 32 * 4);
  size_t i = 0;
  auto split = [](float f, uint32_t* hi, uint32_t* lo) {
    const uint16_t h = FloatToBf16(f);
    *hi = h;
    *lo = FloatToBf16(f - Bf16ToFloat(h));
  };
  for (int64_t G = 0; G < quads; ++G)
    for (int s = 0; s < steps; ++s)
      for (int nt = 0; nt < 3; ++nt)
        for (int lane = 0; lane < 32; ++lane) {
          const int g = lane / 4, t = lane % 4, j = s / 2, u = s % 2;
          const int o = nt * 8 + g;
          const int64_t k = int64_t(j) * C + G * 32 + t * 8 + 4 * u;
          uint32_t hi[4], lo[4];
          for (int e = 0; e < 4; ++e) split(row(o, k + e), &hi[e], &lo[e]);
          out[i++] = hi[0] | (hi[1] << 16);
          out[i++] = hi[2] | (hi[3] << 16);
          out[i++] = lo[0] | (lo[1] << 16);
          out[i++] = lo[2] | (lo[3] << 16);
        }
  return out;
}

absl::Status LaunchStatus(gpuError_t err, const char* what) {
  if (err == gpuSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(what, " launch failed: ", gpuGetErrorString(err)));
}
absl::Status LaunchStatus(const char* what) { return LaunchStatus(gpuGetLastError(), what); }

bool Aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

int GridStrideBlocks(int64_t items, const GpuContext& ctx) {
  const int64_t want = (items + 255) / 256;
  const int64_t cap = int64_t(std::max(ctx.sm_count, 1)) * 16;
  return int(std::max<int64_t>(1, std::min(want, cap)));
}

mhc::MixHyper Hyper(const MhcHyperParams& p) {
  return {p.hc_norm_eps, p.norm_eps, p.hc_pre_eps, p.sinkhorn_eps, p.post_scale, p.sinkhorn_iters};
}

// Everything one launch needs, with pointers already offset to the slice.
struct Slice {
  int64_t t0 = 0, tokens = 0;
};

template <typename T>
T* Offset(const TensorView& v, int64_t t0, int64_t per_token) {
  return v.data == nullptr ? nullptr : static_cast<T*>(v.data) + t0 * per_token;
}

// Mix warps per finalize mix block: 4 up to this many tokens (each mix warp then has an SM
// sub-partition to itself: warp w issues on sub-partition w % 4, and the register Sinkhorn is
// issue-bound, ~72 instructions per iteration, when two warps share one), the full 8 above, where
// the y blocks' bandwidth sets the time and fewer blocks schedule faster. A launch choice only: a
// token's arithmetic is the same in either (BatchInvariance crosses the boundary).
constexpr int64_t kFinalizeNarrowMixMaxTokens = 1024;
constexpr int kFinalizeNarrowMixWarps = 4;
// Above these token counts the finalize takes its instances compiled for more resident blocks
// (below): where its y blocks rescale z (the fused shifted seam), above the narrow-mix range (from
// T = 257 it measured -8% to +2% by size, +2% at T = 512 for every C); where they collapse R' (the
// unfused path, normal mode), from T = 257 (2-10% faster at every measured size; DESIGN.md).
constexpr int64_t kFinalizeRescaleOccupancyMinTokens = kFinalizeNarrowMixMaxTokens + 1;
constexpr int64_t kFinalizeCollapseOccupancyMinTokens = 257;

// The finalize lets the next kernel's CTAs in early (FinalizeParams::launch_dependents_early) only
// when it holds at most one SM in this many: those CTAs are then placed as on an idle GPU. On a
// busier GPU they are crowded onto the SMs left free (the staged pass at C = 7168 T = 64, 224 CTAs,
// after an 80-block finalize: 3 to an SM instead of 1-2) and the seam got 7% slower than with the
// trigger at completion; at T = 1 and 16 (2 and 20 blocks) the early trigger gains 0.3-0.4 us
// (DESIGN.md, "Launch order").
constexpr int64_t kFinalizeEarlyTriggerSmsPerBlock = 4;

template <int N, bool kVec>
absl::Status LaunchFinalize(FinalizeParams fp, const GpuContext& ctx) {
  fp.mix_warps = fp.tokens > kFinalizeNarrowMixMaxTokens ? mhc::kFinalizeWarps : kFinalizeNarrowMixWarps;
  const int64_t nvec = (fp.C + 7) / 8, nchunk = (fp.C + 127) / 128;
  const size_t smem = size_t(nvec + nchunk) * sizeof(float);
  // At large T the y blocks' bandwidth sets the time: an instance compiled for more resident
  // blocks (a launch choice like mix_warps; same bits). Measured at C = 7168, T = 4096
  // (DESIGN.md): rescaling z (the fused shifted seam) is fastest at 4
  // blocks per SM, collapsing R' (the unfused path, normal mode: 4x the loads per vector) at 3.
  // Only for n = 4 (DeepSeek's): each instance adds its code to every executable's fatbin.
  auto kernel = mhc::MhcFinalizeKernel<N, kVec, 2>;
  if constexpr (N == 4) {
    if (fp.y_source == mhc::YSource::kRescaleZ) {
      if (fp.tokens >= kFinalizeRescaleOccupancyMinTokens) {
        kernel = mhc::MhcFinalizeKernel<N, kVec, mhc::kFinalizeRescaleMinBlocks>;
      }
    } else if (fp.tokens >= kFinalizeCollapseOccupancyMinTokens) {
      kernel = mhc::MhcFinalizeKernel<N, kVec, mhc::kFinalizeCollapseMinBlocks>;
    }
  }
  if (smem > 48 * 1024) {
    if (smem > size_t(ctx.max_smem_per_block_optin)) {
      return absl::UnimplementedError(absl::StrCat("hidden size ", fp.C, " exceeds the finalize kernel's shared memory"));
    }
    if (gpuFuncSetAttribute(reinterpret_cast<const void*>(kernel), kMaxDynamicSmemAttr,
                            int(smem)) != gpuSuccess) {
      return LaunchStatus("MhcFinalizeKernel attribute");
    }
  }
  const int64_t blocks = fp.tokens + (fp.has_mixes ? (fp.tokens + fp.mix_warps - 1) / fp.mix_warps : 0);
  fp.launch_dependents_early = kernel == mhc::MhcFinalizeKernel<N, kVec, 2> &&  // the only instance that can
                               blocks * kFinalizeEarlyTriggerSmsPerBlock <= int64_t(ctx.sm_count);
  // Programmatic dependent launch: the finalize kernel is launched while its producer drains and
  // waits in GridDependencyWait (MhcFinalizeKernel) for the producer's memory, hiding the launch
  // gap between the two kernels (~1-2 us at decode sizes). The producer triggers early
  // (LaunchDependents), but the wait is still for its full completion.
  return LaunchStatus(
      LaunchKernel(/*pdl=*/true, kernel, dim3(unsigned(blocks)), dim3(mhc::kFinalizeThreads), smem, ctx.stream, fp),
      "MhcFinalizeKernel");
}

template <int N>
absl::Status LaunchFinalizeN(const FinalizeParams& fp, bool vec, const GpuContext& ctx) {
  return vec ? LaunchFinalize<N, true>(fp, ctx) : LaunchFinalize<N, false>(fp, ctx);
}

// ---------------------------------------------------------------------------------------------
// Unfused path
// ---------------------------------------------------------------------------------------------
#if !FL_HIP
// Token tiles of 16 (one m-tile per warp) up to this many tokens, 32 above (see kTiles and
// mhc_tuning.h).
constexpr int64_t kSingleTileMaxTokens = FL_MHC_SINGLE_TILE_MAX_TOKENS;

// 16-token tiles: the default instance (FL_MHC_TILE16_MIN_BLOCKS = 3 CTAs per SM, no spills) while
// the grid fits one wave of those; a larger grid runs the 4-CTA/SM instance (128 registers, a few
// spilled), which turns e.g. C = 7168, T = 128 (448 CTAs) from 1.13 waves into one (measured -11%
// there as a global switch, but +1-2% at T <= 64 from the spills;
// hence only where the grid exceeds the 3-CTA wave). Same arithmetic, same bits: the
// choice may depend on T (tested: BatchInvariance crosses it).
constexpr int kTile16WideMinBlocks = 4;

// The staged pass (mhc_staged_pass_kernel.cuh, same bits) for the fused path at these token counts:
// measured faster there (C = 7168: T = 64 14.5 -> 12.6 us, T = 1024 93.8 -> 90.9 us; T = 1 and the
// GEMM-only pass of the unfused path were slower or equal; DESIGN.md).
constexpr int64_t kStagedMinTokens = 2;
constexpr int64_t kStagedMaxTokens = 1024;
// 3 resident CTAs per SM (<= 85 registers, no spills; 72 KB of shared memory each): measured
// better than 2 at T = 128 for C = 5120 (15.8 vs 17.2 us) and within noise elsewhere.
constexpr int kStagedMinBlocks = 3;

template <bool kFirst, bool kShifted, bool kHasPre, bool kAux, bool kMix>
gpuError_t EnqueueStagedPass(const FusedParams& fp, int nchunk, gpuStream_t stream) {
  constexpr int kTiles = 1;
  auto kernel = mhc::MhcStagedPassKernel<kFirst, kShifted, kHasPre, kAux, kMix, false, kTiles, kStagedMinBlocks>;
  constexpr size_t smem = mhc::StagedSmem<kFirst, kTiles>::kBytes;
  // Above 48 KB of dynamic shared memory needs the opt-in attribute, once per instance; a failure
  // shows up as the launch error that the caller checks.
  static const gpuError_t attr =
      gpuFuncSetAttribute(reinterpret_cast<const void*>(kernel), kMaxDynamicSmemAttr, int(smem));
  (void)attr;
  const dim3 grid(unsigned((fp.tokens + 15) / 16), unsigned(nchunk));
  return LaunchKernel(/*pdl=*/true, kernel, grid, dim3(mhc::kStagedThreadsPerTile * kTiles), smem, stream, fp);
}

// The persistent staged pass (same tile arithmetic, same bits) wherever the one-tile staged pass
// would need more than one wave of CTAs (16-token tiles x chunks > kStagedMinBlocks x SMs), with 2
// resident CTAs per SM (<= 128 registers: the next tile's loads are held in registers). Measured
// (DESIGN.md): faster from T = 1024 at every C and at C = 7168 T = 128
// (448 staged CTAs, 1.13 waves: 16.55 -> 14.88 us); slower where the staged grid fits one wave (C =
// 5120 T = 128: 13.61 staged, 14.41 persistent).
constexpr int kPersistentMinBlocks = 2;
bool UsePersistentPass(int64_t tokens, int nchunk, int sm_count) {
  return (tokens + 15) / 16 * nchunk > int64_t(kStagedMinBlocks) * std::max(sm_count, 1);
}

template <bool kFirst, bool kShifted, bool kHasPre, bool kAux, bool kMix>
gpuError_t EnqueuePersistentPass(const FusedParams& fp, int nchunk, int sm_count, gpuStream_t stream) {
  auto kernel = mhc::MhcPersistentPassKernel<kFirst, kShifted, kHasPre, kAux, kMix, kPersistentMinBlocks>;
  constexpr size_t smem = mhc::StagedSmem<kFirst, 1>::kBytes;
  // One wave: the CTAs that fit the device at once (queried once per instance), each with an equal
  // contiguous range of the (chunk, tile) items.
  static const int per_sm = [&] {
    gpuFuncSetAttribute(reinterpret_cast<const void*>(kernel), kMaxDynamicSmemAttr, int(smem));
    int n = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, mhc::kStagedThreadsPerTile, smem) != cudaSuccess) n = 1;
    return std::max(n, 1);
  }();
  const int64_t items = (fp.tokens + 15) / 16 * nchunk;
  const int64_t grid = std::min<int64_t>(items, int64_t(per_sm) * std::max(sm_count, 1));
  return LaunchKernel(/*pdl=*/true, kernel, dim3(unsigned(grid)), dim3(mhc::kStagedThreadsPerTile), smem, stream, fp);
}

// Every pass is launched with programmatic dependent launch: its CTAs become resident and start
// fetching fn while the previous kernel on the stream (e.g. the previous seam's finalize, which
// lets its dependents launch early) finishes; the pass waits (GridDependencyWait) before it reads
// an activation.
template <bool kFirst, bool kShifted, bool kHasPre, bool kAux, bool kMix, bool kGemmOnly = false>
gpuError_t EnqueueFusedPass(const FusedParams& fp, int nchunk, int sm_count, gpuStream_t stream) {
  if constexpr (!kGemmOnly) {
    if (UsePersistentPass(fp.tokens, nchunk, sm_count)) {
      return EnqueuePersistentPass<kFirst, kShifted, kHasPre, kAux, kMix>(fp, nchunk, sm_count, stream);
    }
    if (fp.tokens >= kStagedMinTokens && fp.tokens <= kStagedMaxTokens) {
      return EnqueueStagedPass<kFirst, kShifted, kHasPre, kAux, kMix>(fp, nchunk, stream);
    }
  }
  const dim3 block(mhc::kFusedThreads);
  if (fp.tokens <= kSingleTileMaxTokens) {
    const int64_t tiles = (fp.tokens + 15) / 16;
    const dim3 grid{unsigned(tiles), unsigned(nchunk)};
    if (tiles * nchunk > int64_t(FL_MHC_TILE16_MIN_BLOCKS) * std::max(sm_count, 1) &&
        kTile16WideMinBlocks > FL_MHC_TILE16_MIN_BLOCKS) {
      return LaunchKernel(/*pdl=*/true,
                          mhc::MhcFusedPassKernel<kFirst, kShifted, kHasPre, kAux, kMix, kGemmOnly, 1, kTile16WideMinBlocks>,
                          grid, block, 0, stream, fp);
    }
    return LaunchKernel(/*pdl=*/true, mhc::MhcFusedPassKernel<kFirst, kShifted, kHasPre, kAux, kMix, kGemmOnly, 1>, grid,
                        block, 0, stream, fp);
  }
  const dim3 grid(unsigned((fp.tokens + 31) / 32), unsigned(nchunk));
  return LaunchKernel(/*pdl=*/true, mhc::MhcFusedPassKernel<kFirst, kShifted, kHasPre, kAux, kMix, kGemmOnly, 2>, grid,
                      block, 0, stream, fp);
}
#endif

// The tensor-core mixes pass (mhc_fused_kernel.cuh) serves the unfused path too wherever the fused
// path exists (n = 4, C % 128 == 0, sm_80+): both paths then share every reduction and their mixes
// and normal-mode y agree bit for bit. Elsewhere the unfused path runs the FMA GEMM.
bool UseMmaMixes(const GpuMhcWeights& w, const GpuContext& ctx) {
#if FL_HIP
  (void)w;
  (void)ctx;
  return false;
#else
  return w.params_.hc_mult == 4 && w.params_.hidden % mhc::kFusedChunkChannels == 0 && ctx.cc_major >= 8 &&
         w.fn_frag != nullptr;
#endif
}

template <int N>
absl::Status LaunchUnfusedN(const GpuMhcWeights& w, const MhcArgs& a, GpuContext& ctx) {
  constexpr int M = N * (N + 2);
  constexpr int TT = mhc::MixTokensPerCta(M);
  const MhcHyperParams& hp = w.params_;
  const int64_t C = hp.hidden, T = a.tokens;
  const bool first = a.stage == MhcStage::kFirst, head = a.stage == MhcStage::kHead;
  const bool has_mixes = !head;
  bool vec = C % 8 == 0;
  for (const TensorView* v : {&a.x, &a.residual, &a.new_residual, &a.y, &a.aux}) vec = vec && Aligned16(v->data);
  vec = vec && Aligned16(w.norm_weight.get());
  const bool mma = vec && UseMmaMixes(w, ctx);
  const int nsplit = mma ? int(C / mhc::kFusedChunkChannels)
                         : int((C + mhc::kMixSplitChannels - 1) / mhc::kMixSplitChannels);
  const int stride = mma ? mhc::kFusedPartialStride : M + 1;
  const size_t per_token = size_t(nsplit) * stride * sizeof(float);
  const int64_t slice = std::max<int64_t>(1, std::min<int64_t>({T, kMaxSliceTokens, int64_t(kMaxWorkspaceBytes / per_token)}));
  float* ws = nullptr;
  if (has_mixes) {
    ws = static_cast<float*>(ctx.Workspace(per_token * size_t(slice)));
    if (ws == nullptr) return absl::ResourceExhaustedError("mHC unfused workspace allocation failed");
  }
  const bool shifted_pre = a.mode == MhcMode::kShifted && !first && !a.pre_mix.empty_view();

  for (int64_t t0 = 0; t0 < T; t0 += slice) {
    const int64_t ts = std::min(slice, T - t0);
    uint16_t* nr = Offset<uint16_t>(a.new_residual, t0, N * C);
    if (first) {
      mhc::MhcBroadcastKernel<<<GridStrideBlocks(ts * N * C, ctx), 256, 0, ctx.stream>>>(
          Offset<const uint16_t>(a.x, t0, C), nr, ts, N, C);
      if (absl::Status s = LaunchStatus("MhcBroadcastKernel"); !s.ok()) return s;
    } else {
      PostParams pp{Offset<const uint16_t>(a.x, t0, C), Offset<const uint16_t>(a.residual, t0, N * C),
                    Offset<const float>(a.post_mix, t0, N), Offset<const float>(a.comb_mix, t0, N * N), nr,
                    a.capture_aux ? Offset<uint16_t>(a.aux, t0, C) : nullptr, ts, C};
      const int blocks = GridStrideBlocks(ts * ((C + 7) / 8), ctx);
      if (vec) {
        mhc::MhcPostKernel<N, true><<<blocks, 256, 0, ctx.stream>>>(pp);
      } else {
        mhc::MhcPostKernel<N, false><<<blocks, 256, 0, ctx.stream>>>(pp);
      }
      if (absl::Status s = LaunchStatus("MhcPostKernel"); !s.ok()) return s;
    }
    if (has_mixes && mma) {
#if !FL_HIP
      if constexpr (N == 4) {
        FusedParams fp{};
        fp.x = Offset<const uint16_t>(a.x, t0, C);
        fp.residual = nr;
        fp.frag = static_cast<const uint4*>(first ? w.fn_first_frag.get() : w.fn_frag.get());
        fp.partials = ws;
        fp.tokens = ts;
        fp.C = C;
        const gpuError_t err =
            first ? EnqueueFusedPass<true, false, false, false, true, true>(fp, nsplit, ctx.sm_count, ctx.stream)
                  : EnqueueFusedPass<false, false, false, false, true, true>(fp, nsplit, ctx.sm_count, ctx.stream);
        if (absl::Status s = LaunchStatus(err, "MhcFusedPassKernel (mixes GEMM)"); !s.ok()) return s;
      }
#endif
    } else if (has_mixes) {
      MixesParams mp;
      mp.residual = first ? Offset<const uint16_t>(a.x, t0, C) : nr;
      mp.token_stride = first ? C : N * C;
      mp.stream_stride = C;
      mp.fn_t = static_cast<const float*>(first ? w.fn_first_t.get() : w.fn_t.get());
      mp.partials = ws;
      mp.tokens = ts;
      mp.C = C;
      mp.nsplit = nsplit;
      const dim3 grid(unsigned(nsplit), unsigned((ts + TT - 1) / TT));
      if (first) {
        mhc::MhcMixesKernel<1, M, TT><<<grid, mhc::kMixThreads, 0, ctx.stream>>>(mp);
      } else {
        mhc::MhcMixesKernel<N, M, TT><<<grid, mhc::kMixThreads, 0, ctx.stream>>>(mp);
      }
      if (absl::Status s = LaunchStatus("MhcMixesKernel"); !s.ok()) return s;
    }
    FinalizeParams fp{};
    fp.partials = ws;
    fp.nsplit = nsplit;
    fp.stride = stride;
    fp.k_count = float(first ? C : N * C);
    fp.scale = static_cast<const float*>(w.scale.get());
    fp.base = static_cast<const float*>(w.base.get());
    fp.hyper = Hyper(hp);
    fp.has_mixes = has_mixes;
    fp.y_source = a.mode == MhcMode::kNormal ? YSource::kCollapseNew : YSource::kCollapseGiven;
    fp.pre_mix = shifted_pre ? Offset<const float>(a.pre_mix, t0, N) : nullptr;
    fp.new_residual = nr;
    fp.norm_weight = static_cast<const uint16_t*>(w.norm_weight.get());
    fp.y = Offset<uint16_t>(a.y, t0, C);
    fp.new_pre = Offset<float>(a.new_pre_mix, t0, N);
    fp.new_post = Offset<float>(a.new_post_mix, t0, N);
    fp.new_comb = Offset<float>(a.new_comb_mix, t0, N * N);
    fp.tokens = ts;
    fp.C = C;
    if (absl::Status s = LaunchFinalizeN<N>(fp, vec, ctx); !s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::Status LaunchUnfused(const GpuMhcWeights& w, const MhcArgs& a, GpuContext& ctx) {
  switch (w.params_.hc_mult) {
    case 1: return LaunchUnfusedN<1>(w, a, ctx);
    case 2: return LaunchUnfusedN<2>(w, a, ctx);
    case 3: return LaunchUnfusedN<3>(w, a, ctx);
    case 4: return LaunchUnfusedN<4>(w, a, ctx);
    case 5: return LaunchUnfusedN<5>(w, a, ctx);
    case 6: return LaunchUnfusedN<6>(w, a, ctx);
    case 7: return LaunchUnfusedN<7>(w, a, ctx);
    case 8: return LaunchUnfusedN<8>(w, a, ctx);
  }
  return absl::InvalidArgumentError("hc_mult must be in 1..8");
}

// ---------------------------------------------------------------------------------------------
// Fused path (n = 4)
// ---------------------------------------------------------------------------------------------
#if !FL_HIP
absl::Status LaunchFused(const GpuMhcWeights& w, const MhcArgs& a, GpuContext& ctx) {
  constexpr int N = 4;
  const MhcHyperParams& hp = w.params_;
  const int64_t C = hp.hidden, T = a.tokens;
  const bool first = a.stage == MhcStage::kFirst, head = a.stage == MhcStage::kHead;
  const bool shifted = a.mode == MhcMode::kShifted;
  const bool has_pre = shifted && !first && !a.pre_mix.empty_view();
  const bool aux = a.capture_aux;
  for (const TensorView* v : {&a.x, &a.residual, &a.new_residual, &a.y, &a.aux}) {
    if (!Aligned16(v->data)) return absl::FailedPreconditionError("the fused mHC path needs 16-byte aligned tensors");
  }
  const int nchunk = int(C / mhc::kFusedChunkChannels);
  const size_t per_token = size_t(nchunk) * mhc::kFusedPartialStride * sizeof(float);
  const int64_t slice = std::max<int64_t>(
      1, std::min<int64_t>({T, kMaxSliceTokens * mhc::kFusedTileTokens, int64_t(kMaxWorkspaceBytes / per_token)}));
  float* ws = static_cast<float*>(ctx.Workspace(per_token * size_t(slice)));
  if (ws == nullptr) return absl::ResourceExhaustedError("mHC fused workspace allocation failed");

  for (int64_t t0 = 0; t0 < T; t0 += slice) {
    const int64_t ts = std::min(slice, T - t0);
    FusedParams fp{};
    fp.x = Offset<const uint16_t>(a.x, t0, C);
    fp.residual = first ? nullptr : Offset<const uint16_t>(a.residual, t0, N * C);
    fp.post_mix = first ? nullptr : Offset<const float>(a.post_mix, t0, N);
    fp.comb_mix = first ? nullptr : Offset<const float>(a.comb_mix, t0, N * N);
    fp.pre_mix = has_pre ? Offset<const float>(a.pre_mix, t0, N) : nullptr;
    fp.frag = static_cast<const uint4*>(first ? w.fn_first_frag.get() : w.fn_frag.get());
    fp.new_residual = Offset<uint16_t>(a.new_residual, t0, N * C);
    fp.y = Offset<uint16_t>(a.y, t0, C);
    fp.aux = aux ? Offset<uint16_t>(a.aux, t0, C) : nullptr;
    fp.partials = ws;
    fp.tokens = ts;
    fp.C = C;
    // Template flags: (first, shifted, has_pre, aux, mix).
    gpuError_t err;
    if (first) {
      if (shifted) err = EnqueueFusedPass<true, true, false, false, true>(fp, nchunk, ctx.sm_count, ctx.stream);
      else err = EnqueueFusedPass<true, false, false, false, true>(fp, nchunk, ctx.sm_count, ctx.stream);
    } else if (head) {
      if (has_pre) err = EnqueueFusedPass<false, true, true, false, false>(fp, nchunk, ctx.sm_count, ctx.stream);
      else err = EnqueueFusedPass<false, true, false, false, false>(fp, nchunk, ctx.sm_count, ctx.stream);
    } else if (shifted) {
      if (has_pre) {
        if (aux) err = EnqueueFusedPass<false, true, true, true, true>(fp, nchunk, ctx.sm_count, ctx.stream);
        else err = EnqueueFusedPass<false, true, true, false, true>(fp, nchunk, ctx.sm_count, ctx.stream);
      } else {
        if (aux) err = EnqueueFusedPass<false, true, false, true, true>(fp, nchunk, ctx.sm_count, ctx.stream);
        else err = EnqueueFusedPass<false, true, false, false, true>(fp, nchunk, ctx.sm_count, ctx.stream);
      }
    } else {
      if (aux) err = EnqueueFusedPass<false, false, false, true, true>(fp, nchunk, ctx.sm_count, ctx.stream);
      else err = EnqueueFusedPass<false, false, false, false, true>(fp, nchunk, ctx.sm_count, ctx.stream);
    }
    if (absl::Status s = LaunchStatus(err, "MhcFusedPassKernel"); !s.ok()) return s;

    FinalizeParams f{};
    f.partials = ws;
    f.nsplit = nchunk;
    f.stride = mhc::kFusedPartialStride;
    f.k_count = float(first ? C : N * C);
    f.scale = static_cast<const float*>(w.scale.get());
    f.base = static_cast<const float*>(w.base.get());
    f.hyper = Hyper(hp);
    f.has_mixes = !head;
    f.y_source = shifted ? YSource::kRescaleZ : YSource::kCollapseNew;
    f.pre_mix = nullptr;
    f.new_residual = fp.new_residual;
    f.norm_weight = static_cast<const uint16_t*>(w.norm_weight.get());
    f.y = fp.y;
    f.new_pre = Offset<float>(a.new_pre_mix, t0, N);
    f.new_post = Offset<float>(a.new_post_mix, t0, N);
    f.new_comb = Offset<float>(a.new_comb_mix, t0, N * N);
    f.tokens = ts;
    f.C = C;
    if (absl::Status s = LaunchFinalizeN<N>(f, Aligned16(f.norm_weight) || f.norm_weight == nullptr, ctx); !s.ok()) {
      return s;
    }
  }
  return absl::OkStatus();
}
#endif  // !FL_HIP

}  // namespace

absl::StatusOr<std::unique_ptr<GpuMhcWeights>> PrepareMhcGpu(const MhcHyperParams& params,
                                                              const MhcWeightsHost& weights, GpuContext& ctx) {
  if (absl::Status s = params.Validate(); !s.ok()) return s;
  const int n = params.hc_mult, M = params.num_mixes();
  const int64_t C = params.hidden, K = params.flat_width();
  if (absl::Status s = ExpectTensor(weights.fn, "fn", DType::kFP32, {M, K}); !s.ok()) return s;
  if (absl::Status s = ExpectTensor(weights.scale, "scale", DType::kFP32, {3}); !s.ok()) return s;
  if (absl::Status s = ExpectTensor(weights.base, "base", DType::kFP32, {M}); !s.ok()) return s;
  const bool has_g = !weights.norm_weight.empty_view();
  if (has_g) {
    if (absl::Status s = ExpectTensor(weights.norm_weight, "norm_weight", DType::kBF16, {C}); !s.ok()) return s;
  }
  const float* fn = weights.fn.ptr<const float>();

  auto w = std::make_unique<GpuMhcWeights>();
  w->params_ = params;
  std::vector<float> fn_t(size_t(K) * M), fn_first(size_t(C) * M);
  for (int o = 0; o < M; ++o)
    for (int64_t k = 0; k < K; ++k) fn_t[size_t(k) * M + o] = fn[size_t(o) * K + k];
  // First stage: R_0 = e on every stream, so sum_k R_0[k] fn[o][k] = sum_c e[c] (sum_j fn[o][j*C + c]).
  for (int o = 0; o < M; ++o)
    for (int64_t c = 0; c < C; ++c) {
      float s = 0.0f;
      for (int j = 0; j < n; ++j) s += fn[size_t(o) * K + size_t(j) * C + c];
      fn_first[size_t(c) * M + o] = s;
    }
  size_t bytes = 0;
  auto upload = [&](GpuMemory& dst, const void* src, size_t nbytes) -> absl::Status {
    auto mem = GpuUpload(src, nbytes, ctx);
    if (!mem.ok()) return mem.status();
    dst = std::move(*mem);
    bytes += nbytes;
    return absl::OkStatus();
  };
  if (absl::Status s = upload(w->fn_t, fn_t.data(), fn_t.size() * 4); !s.ok()) return s;
  if (absl::Status s = upload(w->fn_first_t, fn_first.data(), fn_first.size() * 4); !s.ok()) return s;
  if (absl::Status s = upload(w->scale, weights.scale.data, 3 * 4); !s.ok()) return s;
  if (absl::Status s = upload(w->base, weights.base.data, size_t(M) * 4); !s.ok()) return s;
  if (has_g) {
    if (absl::Status s = upload(w->norm_weight, weights.norm_weight.data, size_t(C) * 2); !s.ok()) return s;
  }
  if (n == 4 && C % mhc::kFusedChunkChannels == 0) {
    const std::vector<uint32_t> frag =
        BuildFragments(C, 4, [&](int o, int64_t k) { return fn[size_t(o) * K + size_t(k)]; });
    const std::vector<uint32_t> frag_first =
        BuildFragments(C, 1, [&](int o, int64_t k) { return fn_first[size_t(k) * M + o]; });
    if (absl::Status s = upload(w->fn_frag, frag.data(), frag.size() * 4); !s.ok()) return s;
    if (absl::Status s = upload(w->fn_first_frag, frag_first.data(), frag_first.size() * 4); !s.ok()) return s;
  }
  w->resident_bytes_ = bytes;
  return w;
}

FusedSupport MhcFusedSupportGpu(const GpuMhcWeights& weights, const MhcShapeQuery& query, const GpuContext& ctx,
                                int64_t fused_max_tokens) {
  const MhcHyperParams& p = weights.params();
#if FL_HIP
  (void)ctx;
  return FusedSupport::No(FallbackReason::kDeviceArchUnsupported,
                          "the fused mHC kernel uses bf16 mma.sync tensor-core instructions (CUDA sm_80+)");
#else
  if (ctx.cc_major < 8) {
    return FusedSupport::No(FallbackReason::kDeviceArchUnsupported,
                            absl::StrCat("the fused mHC kernel needs sm_80+ (bf16 mma.sync), device is ", ctx.arch));
  }
#endif
  if (p.hc_mult != 4) {
    return FusedSupport::No(FallbackReason::kHcMultUnsupported,
                            absl::StrCat("the fused mHC kernel is specialised for hc_mult = 4, got ", p.hc_mult));
  }
  if (p.hidden % mhc::kFusedChunkChannels != 0) {
    return FusedSupport::No(FallbackReason::kHiddenSizeUnsupported,
                            absl::StrCat("C = ", p.hidden, " is not a multiple of ", mhc::kFusedChunkChannels));
  }
  if (query.tokens > fused_max_tokens) {
    return FusedSupport::No(FallbackReason::kTooManyTokens,
                            absl::StrCat("T = ", query.tokens, " exceeds fused_max_tokens = ", fused_max_tokens));
  }
  return FusedSupport::Yes();
}

absl::Status LaunchMhcGpu(const GpuMhcWeights& weights, const MhcArgs& args, Path path, GpuContext& ctx,
                          int64_t fused_max_tokens) {
  if (absl::Status s = MhcLaunchPrologue(weights, args, path,
                                         [&](const MhcShapeQuery& q) {
                                           return MhcFusedSupportGpu(weights, q, ctx, fused_max_tokens);
                                         });
      !s.ok()) {
    return s;
  }
  if (args.tokens == 0) return absl::OkStatus();
#if !FL_HIP
  if (path == Path::kFused) return LaunchFused(weights, args, ctx);
#endif
  return LaunchUnfused(weights, args, ctx);
}

}  // namespace fusedlayer::gpu
