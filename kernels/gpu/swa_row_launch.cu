// Launchers of the SWA row kernels (device/swa_row_kernels.cuh): picks the kernel instance for a
// shape and alignment, the grid and the block, and launches it with programmatic dependent launch
// (LaunchKernel in gpu_runtime.h). Host code; compiled by nvcc / hipcc because it launches kernels.
// The runtime header first: under hipcc it provides the intrinsics numeric.h uses.
#include "gpu_runtime.h"
#include "swa_kernel_launch.h"
#include "device/swa_row_kernels.cuh"

#include <algorithm>
#include <cstdint>

namespace fusedlayer::gpu {
namespace {

using namespace swa_rows;  // kernels, tile constants and RowFlags of device/swa_row_kernels.cuh

using RowKernelFn = void (*)(SwaRowParams, RowFlags);

template <RowMode kMode, Fp8Format kFmt, int KD>
RowKernelFn PickKq(int kq) {
  // Chunk counts are rounded up to an instantiated one (masked chunks cost registers, not
  // bandwidth); DeepSeek's Q = 1024 / 1280 / 1536 are exactly 4 / 5 / 6.
  if (kq <= 2) return SwaRowKernel<2, KD, kMode, kFmt>;
  if (kq <= 4) return SwaRowKernel<4, KD, kMode, kFmt>;
  if (kq == 5) return SwaRowKernel<5, KD, kMode, kFmt>;
  if (kq == 6) return SwaRowKernel<6, KD, kMode, kFmt>;
  return SwaRowKernel<8, KD, kMode, kFmt>;
}

template <RowMode kMode, Fp8Format kFmt>
RowKernelFn PickRowKernel(int q_rank, int head_dim, const RowFlags& f) {
  const int kq = (q_rank / kChunk + kRowTeam - 1) / kRowTeam;
  const int kd = ((head_dim + kChunk - 1) / kChunk + kRowTeam - 1) / kRowTeam;
  const bool aligned = f.vec_in && f.vec_kv && f.vec_codes && head_dim % kChunk == 0;
  if (aligned && kq <= kMaxResidentQChunks && kd <= kMaxResidentDChunks) {
    return kd <= 2 ? PickKq<kMode, kFmt, 2>(kq) : PickKq<kMode, kFmt, 4>(kq);
  }
  return SwaRowKernel<0, 0, kMode, kFmt>;
}

template <RowMode kMode>
gpuError_t LaunchRows(const SwaRowParams& p, int sm_count, gpuStream_t stream) {
  if (p.tokens == 0) return gpuSuccess;
  const bool fmt_fn = kMode == RowMode::kNormOnly || p.fp8_format == Fp8Format::kE4M3FN;
  {
    // Up to 8 rows per multiprocessor, one block per row with one chunk per thread (Q <= 2048,
    // D <= 1024, aligned): the latency-bound regime (31 registers: 8 blocks of 256 per SM).
    const bool aligned = (reinterpret_cast<uintptr_t>(p.qr_kv) % 16 == 0) && (p.row_stride % kChunk == 0) &&
                         (reinterpret_cast<uintptr_t>(p.kv) % 16 == 0) && (p.head_dim % kChunk == 0) &&
                         (kMode == RowMode::kNormOnly || reinterpret_cast<uintptr_t>(p.q_fp8) % 8 == 0);
    const int nqt = (p.q_rank / kChunk + kRowTeam - 1) / kRowTeam;
    const int nkt = (p.head_dim / kChunk + kRowTeam - 1) / kRowTeam;
    // Measured on the H200: one row per block wins up to M = 8 x SMs (Q = 1536,
    // M = 1024: 3.96 against 5.18 us cold, 3.35 against 4.06 warm) and loses from about 16 x SMs.
    const int64_t wide_max = p.wide_rows_max >= 0 ? p.wide_rows_max : int64_t(8) * (sm_count > 0 ? sm_count : 1);
    if (aligned && nqt <= 8 && nkt <= kWideMaxTeams - 8 && p.tokens <= wide_max) {
      return fmt_fn ? LaunchKernel(p.pdl, SwaRowWideKernel<kMode, Fp8Format::kE4M3FN>, dim3(unsigned(p.tokens)), dim3((nqt + nkt) * kRowTeam), 0,
                                   stream, p, nqt)
                    : LaunchKernel(p.pdl, SwaRowWideKernel<kMode, Fp8Format::kE4M3FNUZ>, dim3(unsigned(p.tokens)),
                                   dim3((nqt + nkt) * kRowTeam), 0, stream, p, nqt);
    }
  }
  // Few rows: 2 rows per block spreads them over more multiprocessors (latency-bound regime);
  // many rows: 8 rows (256 threads) per block.
  const int rows_per_block = p.tokens <= int64_t(4) * (sm_count > 0 ? sm_count : 1) ? 2 : 8;
  const int64_t blocks = (p.tokens + rows_per_block - 1) / rows_per_block;
  RowFlags f;
  f.vec_in = (reinterpret_cast<uintptr_t>(p.qr_kv) % 16 == 0) && (p.row_stride % kChunk == 0);
  f.vec_kv = (reinterpret_cast<uintptr_t>(p.kv) % 16 == 0) && (p.head_dim % kChunk == 0);
  // The norm step writes no codes (q_fp8 unused); its bf16 q goes to the aligned workspace.
  f.vec_codes = kMode == RowMode::kNormOnly || reinterpret_cast<uintptr_t>(p.q_fp8) % 8 == 0;
  // The norm step writes no codes: one format's instances serve it.
  RowKernelFn fn = fmt_fn ? PickRowKernel<kMode, Fp8Format::kE4M3FN>(p.q_rank, p.head_dim, f)
                          : PickRowKernel<kMode, Fp8Format::kE4M3FNUZ>(p.q_rank, p.head_dim, f);
  return LaunchKernel(p.pdl, fn, dim3(unsigned(blocks)), dim3(rows_per_block * kRowTeam), 0, stream, p, f);
}

}  // namespace


gpuError_t ProbeSwaKernelImage() {
  gpuFuncAttributes attr;
  return gpuFuncGetAttributes(&attr, reinterpret_cast<const void*>(SwaGroupQuantKernel<Fp8Format::kE4M3FN>));
}

gpuError_t LaunchSwaFusedRows(const SwaRowParams& p, int sm_count, gpuStream_t stream) {
  return LaunchRows<RowMode::kFused>(p, sm_count, stream);
}

gpuError_t LaunchSwaNormRows(const SwaRowParams& p, int sm_count, gpuStream_t stream) {
  return LaunchRows<RowMode::kNormOnly>(p, sm_count, stream);
}

gpuError_t LaunchSwaGroupQuant(const uint16_t* q_bf16, int64_t tokens, int q_rank, uint8_t* q_fp8, float* q_scale,
                               const SwaScaleLayout& layout, Fp8Format fmt, bool ue8m0, gpuStream_t stream, bool pdl) {
  if (tokens == 0) return gpuSuccess;
  const int groups = q_rank / kGroup;
  const int64_t threads = tokens * groups * kGroupLanes;
  const int block = 256;
  const int64_t blocks = (threads + block - 1) / block;
  auto* kernel = fmt == Fp8Format::kE4M3FN ? SwaGroupQuantKernel<Fp8Format::kE4M3FN>
                                           : SwaGroupQuantKernel<Fp8Format::kE4M3FNUZ>;
  return LaunchKernel(pdl, kernel, dim3(unsigned(blocks)), dim3(block), 0, stream, q_bf16, tokens, groups, q_fp8,
                      q_scale, layout, ue8m0);
}

}  // namespace fusedlayer::gpu
