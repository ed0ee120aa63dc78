// The SWA wq_b projection through cuBLASLt's block-scaled FP8 matmul (CUDA only; the HIP build and
// e4m3fnuz weight sets keep swa_wq_b_launch.cu). The header has no cuBLAS types, so swa_launch.h can
// hold a plan in every build; wq_b_cublaslt.cc is compiled into CUDA builds only.
//
// Mapping (checked against an fp64 reference on the H200): row-major q_proj[M, N] is the
// column-major D^T [N x M] = op(A) op(B) with A = wq_b [N, K] (TRANSA = T, BLK128x128_32F scales =
// wq_b_scale [N/128][K/128] as stored) and B = q codes [M, K] (TRANSB = N, VEC128_32F scales laid
// out [K/128][M], M contiguous); D bf16, CUBLAS_COMPUTE_32F, fast accumulation off, alpha 1, beta 0.
//
// Batch invariance (spec/mhc.md, required by spec/swa.md): a token's q_proj must not depend on M or
// on the token's position. The heuristic picks per shape, so one algorithm is pinned per weight set
// at load (the heuristic's best at kWqbLtPlanRows without split-K, kept only if it passes
// cublasLtMatmulAlgoCheck at every row count the launcher can issue) and used for every M.
// cuBLASLt has no algorithm for M % 4 != 0: rows [0, M & ~3) run as one batch straight into
// q_proj, the last M % 4 rows as the 4-row batch of rows [M-4, M) (also straight into q_proj: its
// first rows rewrite values the main batch wrote, bitwise identical under the pinned algorithm),
// and M < 4 as a zero-padded 4-row copy in scratch whose first M rows are copied out.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gpu_context.h"
#include "swa_kernel_launch.h"

namespace fusedlayer::gpu {

// cuBLASLt workspace, allocated once per GpuContext.
inline constexpr size_t kWqbLtWorkspaceBytes = size_t{32} << 20;
// Row count whose heuristic choice is pinned (prefill-sized, where the GEMM time is).
inline constexpr int64_t kWqbLtPlanRows = 4096;

// The pinned algorithm of one weight set (N, K, e4m3fn). Plain data: cuBLASLt's algo descriptor is
// a trivially copyable 64-byte struct, kept here as bytes.
struct WqbLtPlan {
  uint64_t algo[8] = {};
  int n = 0, k = 0;
  int64_t max_rows = 0;        // largest batch per call (multiple of 4); larger M runs in chunks
  size_t workspace_bytes = 0;  // the algorithm's need (<= kWqbLtWorkspaceBytes)
  // Buffer alignment the algorithm needs (bytes) for the weight, the q codes and q_proj.
  uint32_t min_align_a = 256, min_align_b = 256, min_align_d = 256;
  std::string description;     // "algo 66 tile 13 stages 21 splitK 1 ...", for logs and reports
};

// Pins the algorithm for (n, k) on ctx's device; creates the context's cuBLASLt handle and
// workspace on first use (ctx.wq_b_lt). Errors (no sm_90 block scaling, no algorithm valid for
// every row count, cuBLASLt failures) mean "use swa_wq_b_launch.cu for this weight set".
// plan_rows: the row count whose heuristic choice is pinned (benchmarks compare choices).
absl::StatusOr<WqbLtPlan> PlanWqbCublasLt(GpuContext& ctx, int n, int k, int64_t plan_rows = kWqbLtPlanRows);

// The heuristic's first choice at `rows` rows, described (diagnostics; nothing is pinned).
absl::StatusOr<std::string> DescribeWqbLtHeuristic(GpuContext& ctx, int n, int k, int64_t rows);

// Whether the launcher can take these operands: q codes `a`, weight `b` and q_proj `out` aligned as
// the pinned algorithm needs (row offsets the launcher issues keep it: N is a multiple of 128 and
// only rows [0, M & ~3) and chunk starts are read in place; tail rows are staged).
bool WqbCublasLtAligned(const WqbLtPlan& plan, const uint8_t* a, const uint8_t* b, const uint16_t* out);

// Enqueues q_proj[tokens, n] on ctx.stream with the plan's algorithm, any tokens >= 1 and either
// scale layout. Staging uses ctx.Workspace(kWqb). No synchronisation (graph-capturable after an
// eager call of the same shape has sized the scratch). cuBLASLt failures are Internal with the
// status name; missing scratch is ResourceExhausted.
absl::Status LaunchWqbCublasLt(const WqbLtPlan& plan, GpuContext& ctx, const uint8_t* a, const float* a_scale,
                               const SwaScaleLayout& a_layout, const uint8_t* b, const float* b_scale,
                               uint16_t* out, int64_t tokens);

}  // namespace fusedlayer::gpu
