// cuBLASLt block-scaled FP8 for the SWA wq_b projection (see wq_b_cublaslt.h). CUDA builds only.
//
// The handle and the 32 MiB cuBLASLt workspace live per GpuContext (ctx.wq_b_lt): a context is one
// device and one stream driven by one thread at a time (the backend's default context, or one
// lane's: backend.h), so every weight set of the context can share them; all their work is
// serialised on ctx.stream. Each lane creates its own on first use. The pinned algorithm
// lives per weight set (it depends on N and K). Descriptors are initialised on the stack for every
// call (cublasLt*Init: no allocation), so a plan is immutable and nothing else is cached.
#include "wq_b_cublaslt.h"

#include <cublasLt.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <set>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cublaslt_loader.h"

namespace fusedlayer::gpu {
namespace {

static_assert(sizeof(cublasLtMatmulAlgo_t) == sizeof(WqbLtPlan::algo), "algo descriptor size");

// Row counts the pinned algorithm must pass cublasLtMatmulAlgoCheck at: every batch the launcher
// issues is a multiple of 4 in [4, max_rows], and these cover the tile-boundary cases around the
// usual tile widths (M is the N-dimension of cuBLASLt's D^T).
constexpr int64_t kCheckRows[] = {4, 8, 12, 16, 20, 28, 32, 60, 64, 68, 100, 128, 132, 252, 256, 260, 1020, 1024, 1028, 4092, 4096};
// Largest batch per call, the largest of these that also passes the check (larger M is chunked).
constexpr int64_t kMaxRowsCandidates[] = {65536, 16384};
constexpr int64_t kMinMaxRows = 4096;
constexpr size_t kAlign = 256;  // scratch regions

// The loaded library. Only called once State() has succeeded, which loads it.
const CublasLtApi& Lt() { return *LoadCublasLt(); }

struct LtState final : GpuContext::Extension {
  cublasLtHandle_t handle = nullptr;
  void* workspace = nullptr;
  std::set<std::pair<int, int>> logged;  // (n, k) whose pinned algorithm was logged
  ~LtState() override {
    if (handle != nullptr) (void)Lt().Destroy(handle);
    if (workspace != nullptr) (void)cudaFree(workspace);
  }
};

absl::Status LtStatus(cublasStatus_t s, const char* what) {
  if (s == CUBLAS_STATUS_SUCCESS) return absl::OkStatus();
  return absl::InternalError(absl::StrCat("cuBLASLt ", what, ": ", Lt().GetStatusName(s), " (", int(s), ")"));
}

absl::StatusOr<LtState*> State(GpuContext& ctx) {
  if (ctx.wq_b_lt != nullptr) return static_cast<LtState*>(ctx.wq_b_lt.get());
  std::string why_not;
  if (LoadCublasLt(&why_not) == nullptr) return absl::FailedPreconditionError(why_not);
  auto st = std::make_unique<LtState>();
  if (absl::Status s = LtStatus(Lt().Create(&st->handle), "create"); !s.ok()) {
    st->handle = nullptr;
    return s;
  }
  if (cudaMalloc(&st->workspace, kWqbLtWorkspaceBytes) != cudaSuccess) {
    (void)cudaGetLastError();
    st->workspace = nullptr;
    return absl::ResourceExhaustedError(
        absl::StrCat("cuBLASLt workspace of ", kWqbLtWorkspaceBytes, " bytes could not be allocated"));
  }
  LtState* raw = st.get();
  ctx.wq_b_lt = std::move(st);
  return raw;
}

// Descriptors of one call D^T[n x rows] = W^T[n x k] * Q[k x rows], on the caller's stack.
struct Problem {
  cublasLtMatmulDescOpaque_t op_storage;
  cublasLtMatrixLayoutOpaque_t a_storage, b_storage, d_storage;
  cublasLtMatmulDesc_t op = &op_storage;
  cublasLtMatrixLayout_t la = &a_storage, lb = &b_storage, ld = &d_storage;

  Problem() = default;
  Problem(const Problem&) = delete;
  Problem& operator=(const Problem&) = delete;

  absl::Status Init(int n, int k, int64_t rows, const void* w_scale, const void* q_scale) {
    absl::Status s;
    if (!(s = LtStatus(Lt().MatmulDescInit(op, sizeof(*op), CUBLAS_COMPUTE_32F, CUDA_R_32F), "matmul desc")).ok()) return s;
    const int32_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    const int32_t ma = CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F, mb = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
    const int8_t fast = 0;
    auto set = [&](cublasLtMatmulDescAttributes_t attr, const void* v, size_t bytes, const char* what) {
      return LtStatus(Lt().MatmulDescSetAttribute(op, attr, v, bytes), what);
    };
    if (!(s = set(CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta), "TRANSA")).ok()) return s;
    if (!(s = set(CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb), "TRANSB")).ok()) return s;
    if (!(s = set(CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &ma, sizeof(ma), "A_SCALE_MODE BLK128x128_32F")).ok()) return s;
    if (!(s = set(CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &mb, sizeof(mb), "B_SCALE_MODE VEC128_32F")).ok()) return s;
    if (!(s = set(CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast, sizeof(fast), "FAST_ACCUM")).ok()) return s;
    if (!(s = set(CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &w_scale, sizeof(w_scale), "A_SCALE_POINTER")).ok()) return s;
    if (!(s = set(CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &q_scale, sizeof(q_scale), "B_SCALE_POINTER")).ok()) return s;
    if (!(s = LtStatus(Lt().MatrixLayoutInit(la, sizeof(*la), CUDA_R_8F_E4M3, uint64_t(k), uint64_t(n), int64_t(k)), "layout A"))
             .ok()) {
      return s;
    }
    if (!(s = LtStatus(Lt().MatrixLayoutInit(lb, sizeof(*lb), CUDA_R_8F_E4M3, uint64_t(k), uint64_t(rows), int64_t(k)),
                       "layout B"))
             .ok()) {
      return s;
    }
    return LtStatus(Lt().MatrixLayoutInit(ld, sizeof(*ld), CUDA_R_16BF, uint64_t(n), uint64_t(rows), int64_t(n)), "layout D");
  }
};

template <typename T>
T ConfigAttr(const cublasLtMatmulAlgo_t& algo, cublasLtMatmulAlgoConfigAttributes_t attr) {
  T v{};
  size_t written = 0;
  if (Lt().MatmulAlgoConfigGetAttribute(&algo, attr, &v, sizeof(v), &written) != CUBLAS_STATUS_SUCCESS) return T{};
  return v;
}

uint32_t CapAlign(const cublasLtMatmulAlgo_t& algo, cublasLtMatmulAlgoCapAttributes_t attr) {
  uint32_t v = 0;
  size_t written = 0;
  if (Lt().MatmulAlgoCapGetAttribute(&algo, attr, &v, sizeof(v), &written) != CUBLAS_STATUS_SUCCESS || v == 0) {
    return 256;  // the heuristic's default assumption
  }
  return v;
}

std::string Describe(const cublasLtMatmulAlgo_t& algo, size_t ws) {
  return absl::StrCat("algo ", ConfigAttr<int32_t>(algo, CUBLASLT_ALGO_CONFIG_ID), " tile ",
                      ConfigAttr<uint32_t>(algo, CUBLASLT_ALGO_CONFIG_TILE_ID), " stages ",
                      ConfigAttr<uint32_t>(algo, CUBLASLT_ALGO_CONFIG_STAGES_ID), " splitK ",
                      ConfigAttr<int32_t>(algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM), " reduction ",
                      ConfigAttr<uint32_t>(algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME), " swizzle ",
                      ConfigAttr<uint32_t>(algo, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING), " custom ",
                      ConfigAttr<uint32_t>(algo, CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION), " inner ",
                      ConfigAttr<uint16_t>(algo, CUBLASLT_ALGO_CONFIG_INNER_SHAPE_ID), " cluster ",
                      ConfigAttr<uint16_t>(algo, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID), " workspace ", ws);
}

absl::StatusOr<std::vector<cublasLtMatmulHeuristicResult_t>> Heuristic(LtState& st, int n, int k, int64_t rows,
                                                                       int count) {
  Problem p;
  // Non-null placeholder scale pointers for the query; real ones are set per call.
  if (absl::Status s = p.Init(n, k, rows, st.workspace, st.workspace); !s.ok()) return s;
  cublasLtMatmulPreferenceOpaque_t pref_storage;
  cublasLtMatmulPreference_t pref = &pref_storage;
  if (absl::Status s = LtStatus(Lt().MatmulPreferenceInit(pref, sizeof(*pref)), "preference"); !s.ok()) return s;
  const size_t wsz = kWqbLtWorkspaceBytes;
  if (absl::Status s = LtStatus(
          Lt().MatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsz, sizeof(wsz)),
          "preference workspace");
      !s.ok()) {
    return s;
  }
  std::vector<cublasLtMatmulHeuristicResult_t> res(static_cast<size_t>(count));
  int got = 0;
  if (absl::Status s = LtStatus(Lt().MatmulAlgoGetHeuristic(st.handle, p.op, p.la, p.lb, p.ld, p.ld, pref, count,
                                                               res.data(), &got),
                                "heuristic");
      !s.ok()) {
    return s;
  }
  res.resize(size_t(std::max(got, 0)));
  return res;
}

// cublasLtMatmulAlgoCheck at `rows`; the algorithm's workspace need on success.
absl::StatusOr<size_t> Check(LtState& st, const cublasLtMatmulAlgo_t& algo, int n, int k, int64_t rows) {
  Problem p;
  if (absl::Status s = p.Init(n, k, rows, st.workspace, st.workspace); !s.ok()) return s;
  cublasLtMatmulHeuristicResult_t r;
  std::memset(&r, 0, sizeof(r));
  if (absl::Status s = LtStatus(Lt().MatmulAlgoCheck(st.handle, p.op, p.la, p.lb, p.ld, p.ld, &algo, &r),
                                "algo check");
      !s.ok()) {
    return s;
  }
  return r.workspaceSize;
}

size_t AlignUp(size_t x) { return (x + kAlign - 1) / kAlign * kAlign; }

}  // namespace

absl::StatusOr<WqbLtPlan> PlanWqbCublasLt(GpuContext& ctx, int n, int k, int64_t plan_rows) {
  if (n <= 0 || k <= 0 || n % 128 != 0 || k % 128 != 0) {
    return absl::InvalidArgumentError(absl::StrCat("wq_b cuBLASLt: n = ", n, ", k = ", k, " not multiples of 128"));
  }
  auto st_or = State(ctx);
  if (!st_or.ok()) return st_or.status();
  LtState& st = **st_or;
  auto cand = Heuristic(st, n, k, plan_rows, 16);
  if (!cand.ok()) return cand.status();
  std::string rejected;
  for (const cublasLtMatmulHeuristicResult_t& h : *cand) {
    if (h.state != CUBLAS_STATUS_SUCCESS) continue;
    const std::string desc = Describe(h.algo, h.workspaceSize);
    // One dot-product sequence per output: split-K would make the summation order depend on the
    // split count, which the library may tie to the problem size.
    if (ConfigAttr<int32_t>(h.algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM) > 1 ||
        ConfigAttr<uint32_t>(h.algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME) != CUBLASLT_REDUCTION_SCHEME_NONE) {
      absl::StrAppend(&rejected, "; [", desc, "]: split-K");
      continue;
    }
    size_t ws = h.workspaceSize;
    absl::Status bad;
    for (int64_t rows : kCheckRows) {
      auto w = Check(st, h.algo, n, k, rows);
      if (!w.ok()) {
        bad = absl::FailedPreconditionError(absl::StrCat("rows ", rows, ": ", w.status().message()));
        break;
      }
      ws = std::max(ws, *w);
    }
    if (!bad.ok()) {
      absl::StrAppend(&rejected, "; [", desc, "]: ", bad.message());
      continue;
    }
    int64_t max_rows = kMinMaxRows;
    for (int64_t rows : kMaxRowsCandidates) {
      auto w = Check(st, h.algo, n, k, rows);
      if (w.ok() && *w <= kWqbLtWorkspaceBytes) {
        max_rows = rows;
        ws = std::max(ws, *w);
        break;
      }
    }
    if (ws > kWqbLtWorkspaceBytes) {
      absl::StrAppend(&rejected, "; [", desc, "]: workspace ", ws);
      continue;
    }
    WqbLtPlan plan;
    std::memcpy(plan.algo, &h.algo, sizeof(plan.algo));
    plan.n = n;
    plan.k = k;
    plan.max_rows = max_rows;
    plan.workspace_bytes = ws;
    plan.min_align_a = CapAlign(h.algo, CUBLASLT_ALGO_CAP_MIN_ALIGNMENT_A_BYTES);
    plan.min_align_b = CapAlign(h.algo, CUBLASLT_ALGO_CAP_MIN_ALIGNMENT_B_BYTES);
    plan.min_align_d = CapAlign(h.algo, CUBLASLT_ALGO_CAP_MIN_ALIGNMENT_D_BYTES);
    plan.description = absl::StrCat(Describe(h.algo, ws), ", pinned from the heuristic at M = ", plan_rows,
                                    ", max rows per call ", max_rows, ", cuBLASLt ", Lt().GetVersion());
    if (st.logged.insert({n, k}).second) {
      std::fprintf(stderr, "fusedlayer gpu: wq_b N=%d K=%d uses cuBLASLt block-scaled FP8 (%s)\n", n, k,
                   plan.description.c_str());
    }
    return plan;
  }
  return absl::FailedPreconditionError(
      absl::StrCat("no cuBLASLt algorithm valid for every row count (", cand->size(), " candidates at M = ",
                   plan_rows, rejected.empty() ? "" : rejected, ")"));
}

absl::StatusOr<std::string> DescribeWqbLtHeuristic(GpuContext& ctx, int n, int k, int64_t rows) {
  auto st = State(ctx);
  if (!st.ok()) return st.status();
  auto cand = Heuristic(**st, n, k, rows, 1);
  if (!cand.ok()) return cand.status();
  if (cand->empty()) return absl::NotFoundError("no algorithm");
  return Describe((*cand)[0].algo, (*cand)[0].workspaceSize);
}

bool WqbCublasLtAligned(const WqbLtPlan& plan, const uint8_t* a, const uint8_t* b, const uint16_t* out) {
  // cuBLASLt's A is the weight, B the q codes.
  return reinterpret_cast<uintptr_t>(b) % plan.min_align_a == 0 && reinterpret_cast<uintptr_t>(a) % plan.min_align_b == 0 &&
         reinterpret_cast<uintptr_t>(out) % plan.min_align_d == 0;
}

absl::Status LaunchWqbCublasLt(const WqbLtPlan& plan, GpuContext& ctx, const uint8_t* a, const float* a_scale,
                               const SwaScaleLayout& a_layout, const uint8_t* b, const float* b_scale,
                               uint16_t* out, int64_t tokens) {
  if (tokens <= 0) return absl::OkStatus();
  auto st_or = State(ctx);
  if (!st_or.ok()) return st_or.status();
  LtState& st = **st_or;
  const int n = plan.n, k = plan.k, G = k / 128;
  const int64_t M = tokens, main_rows = M & ~int64_t{3}, tail = M & 3;
  // The column-major TMA layout is exactly cuBLASLt's [G][M] when M % 4 == 0 and one call takes
  // every row; otherwise the scales are packed per call.
  const bool direct = a_layout.m_stride == 1 && a_layout.g_stride == M && tail == 0 && M <= plan.max_rows &&
                      reinterpret_cast<uintptr_t>(a_scale) % 16 == 0;
  const size_t main_bytes = direct || main_rows == 0 ? 0 : AlignUp(size_t(G) * size_t(main_rows) * 4);
  const size_t tail_scale_bytes = tail ? AlignUp(size_t(G) * 4 * 4) : 0;
  const size_t tail_a_bytes = tail ? AlignUp(size_t(4) * size_t(k)) : 0;
  const size_t tail_out_bytes = tail && M < 4 ? AlignUp(size_t(4) * size_t(n) * 2) : 0;
  const size_t scratch_bytes = main_bytes + tail_scale_bytes + tail_a_bytes + tail_out_bytes;
  char* scratch = nullptr;
  if (scratch_bytes > 0) {
    scratch = static_cast<char*>(ctx.Workspace(scratch_bytes, GpuContext::Scratch::kWqb));
    if (scratch == nullptr) {
      return absl::ResourceExhaustedError(
          absl::StrCat("wq_b cuBLASLt: scratch of ", scratch_bytes, " bytes could not be allocated"));
    }
  }
  float* main_scale = main_bytes ? reinterpret_cast<float*>(scratch) : nullptr;
  float* tail_scale = tail ? reinterpret_cast<float*>(scratch + main_bytes) : nullptr;
  uint8_t* tail_a = tail ? reinterpret_cast<uint8_t*>(scratch + main_bytes + tail_scale_bytes) : nullptr;
  uint16_t* tail_out = tail && M < 4 ? reinterpret_cast<uint16_t*>(scratch + main_bytes + tail_scale_bytes + tail_a_bytes)
                                     : out + (M - 4) * int64_t(n);
  const int64_t tail_row0 = M < 4 ? 0 : M - 4;
  if (scratch_bytes > 0) {
    WqbPackParams pp;
    pp.a = a;
    pp.a_scale = a_scale;
    pp.layout = a_layout;
    pp.tokens = M;
    pp.k = k;
    pp.main_scale = main_scale;
    pp.main_rows = main_rows;
    pp.chunk_rows = plan.max_rows;
    pp.tail_scale = tail_scale;
    pp.tail_row0 = tail_row0;
    pp.tail_a = tail_a;
    if (gpuError_t e = LaunchWqbPack(pp, ctx.stream); e != gpuSuccess) {
      (void)gpuGetLastError();
      return absl::InternalError(absl::StrCat("wq_b operand staging launch failed: ", gpuGetErrorString(e)));
    }
  }
  cublasLtMatmulAlgo_t algo;
  std::memcpy(&algo, plan.algo, sizeof(algo));
  const float alpha = 1.0f, beta = 0.0f;
  auto matmul = [&](const uint8_t* q, const float* qs, uint16_t* d, int64_t rows) -> absl::Status {
    Problem p;
    if (absl::Status s = p.Init(n, k, rows, b_scale, qs); !s.ok()) return s;
    return LtStatus(Lt().Matmul(st.handle, p.op, &alpha, b, p.la, q, p.lb, &beta, d, p.ld, d, p.ld, &algo,
                                   st.workspace, kWqbLtWorkspaceBytes, ctx.stream),
                    "matmul");
  };
  for (int64_t r0 = 0; r0 < main_rows; r0 += plan.max_rows) {
    const int64_t rows = std::min(plan.max_rows, main_rows - r0);
    const float* qs = direct ? a_scale : main_scale + int64_t(G) * r0;
    if (absl::Status s = matmul(a + r0 * k, qs, out + r0 * n, rows); !s.ok()) return s;
  }
  if (tail) {
    // Rows [M-4, M) (or the padded rows [0, 4)) as one batch of 4: the rows the main batch also
    // wrote get the same bits again (the pinned algorithm is batch-invariant; tests check it).
    // The main batch is already queued on the stream, so the rewrite is ordered after it.
    // The codes come from scratch too: rows M-4.. start at a multiple of k bytes only.
    if (absl::Status s = matmul(tail_a, tail_scale, tail_out, 4); !s.ok()) return s;
    if (M < 4) {
      if (cudaError_t e = cudaMemcpyAsync(out, tail_out, size_t(M) * size_t(n) * 2, cudaMemcpyDeviceToDevice, ctx.stream);
          e != cudaSuccess) {
        (void)cudaGetLastError();
        return absl::InternalError(absl::StrCat("wq_b tail copy: ", cudaGetErrorString(e)));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace fusedlayer::gpu
