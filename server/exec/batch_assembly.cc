#include "exec/batch_assembly.h"

#include <cstring>
#include <memory>
#include <utility>

namespace fusedlayer::server {
namespace {

// Elements in one token's slice of a token-major view ([T, d1, ...] or a strided [T, cols]).
int64_t RowElements(const TensorView& v) {
  int64_t n = 1;
  for (int k = 1; k < v.rank; ++k) n *= v.shape[k];
  return n;
}

// Copies `rows` token rows of `row_bytes` each between two views with their own row strides.
void CopyRows(char* dst, int64_t dst_stride_bytes, const char* src, int64_t src_stride_bytes, int64_t rows,
              size_t row_bytes) {
  if (dst_stride_bytes == static_cast<int64_t>(row_bytes) && src_stride_bytes == static_cast<int64_t>(row_bytes)) {
    std::memcpy(dst, src, row_bytes * static_cast<size_t>(rows));
    return;
  }
  for (int64_t r = 0; r < rows; ++r) std::memcpy(dst + r * dst_stride_bytes, src + r * src_stride_bytes, row_bytes);
}

// A dense view like `like` with `tokens` rows.
TensorView DenseLike(void* data, const TensorView& like, int64_t tokens) {
  TensorView v;
  v.data = data;
  v.dtype = like.dtype;
  v.rank = like.rank;
  v.shape = like.shape;
  v.shape[0] = tokens;
  int64_t stride = 1;
  for (int k = v.rank - 1; k >= 0; --k) {
    v.stride[k] = stride;
    stride *= v.shape[k];
  }
  return v;
}

template <typename Args, typename Field>
std::vector<const TensorView*> FieldOf(const std::vector<const Args*>& calls, Field field) {
  std::vector<const TensorView*> parts;
  parts.reserve(calls.size());
  for (const Args* a : calls) parts.push_back(&(a->*field));
  return parts;
}

}  // namespace

// The batch's host buffers come from one per-thread cache, reused batch after batch (the executor's
// worker is the only caller): a fresh allocation per batch was zero-filled and page-faulted in every
// time, which at C = 7168, T = 64 cost more than the batch saved (H200, 2026-12-02 dataplane run).
// The cache holds at most the largest batch seen: --max_batch_tokens bounds it. Every byte handed
// out is written before it is read (inputs by the gather, outputs by the kernels), so it is not
// cleared.
void* BatchAssembly::NewBuffer(size_t bytes) {
  thread_local std::vector<std::pair<size_t, std::unique_ptr<char[]>>> cache;
  const size_t slot = next_buffer_++;
  if (slot == cache.size()) cache.emplace_back(0, nullptr);
  auto& [capacity, buffer] = cache[slot];
  if (capacity < bytes || buffer == nullptr) {
    capacity = bytes == 0 ? 1 : bytes;
    buffer.reset(new char[capacity]);  // uninitialised on purpose (see above)
  }
  return buffer.get();
}

TensorView BatchAssembly::Input(const std::vector<const TensorView*>& parts, int64_t total_tokens) {
  const TensorView& first = *parts.front();
  if (first.empty_view()) return first;
  const size_t elem = DTypeSize(first.dtype);
  const size_t row_bytes = static_cast<size_t>(RowElements(first)) * elem;
  TensorView batched = DenseLike(NewBuffer(row_bytes * static_cast<size_t>(total_tokens)), first, total_tokens);
  char* dst = batched.ptr<char>();
  for (const TensorView* p : parts) {
    CopyRows(dst, static_cast<int64_t>(row_bytes), p->ptr<const char>(), p->stride[0] * static_cast<int64_t>(elem),
             p->shape[0], row_bytes);
    dst += row_bytes * static_cast<size_t>(p->shape[0]);
  }
  return batched;
}

TensorView BatchAssembly::Output(const std::vector<const TensorView*>& parts, int64_t total_tokens) {
  const TensorView& first = *parts.front();
  if (first.empty_view()) return first;
  const size_t row_bytes = static_cast<size_t>(RowElements(first)) * DTypeSize(first.dtype);
  OutputSlices out;
  out.batched = DenseLike(NewBuffer(row_bytes * static_cast<size_t>(total_tokens)), first, total_tokens);
  for (const TensorView* p : parts) out.parts.push_back(*p);
  outputs_.push_back(out);
  return out.batched;
}

// q_scale in the DeepGEMM TMA layout: [G, align4(M)], a token's scales are a column.
TensorView BatchAssembly::ColumnMajorScaleOutput(const std::vector<const TensorView*>& parts,
                                                 std::vector<int64_t> tokens, int64_t total_tokens) {
  const TensorView& first = *parts.front();
  const int64_t groups = first.shape[0], padded = AlignTo4(total_tokens);
  OutputSlices out;
  out.batched = TensorView::Contiguous(NewBuffer(sizeof(float) * static_cast<size_t>(groups * padded)), DType::kFP32,
                                       {groups, padded});
  out.column_tokens = std::move(tokens);
  for (const TensorView* p : parts) out.parts.push_back(*p);
  outputs_.push_back(out);
  return out.batched;
}

const MhcArgs& BatchAssembly::Gather(const std::vector<const MhcArgs*>& calls) {
  int64_t total = 0;
  for (const MhcArgs* a : calls) total += a->tokens;
  mhc_ = *calls.front();
  mhc_.tokens = total;
  mhc_.contract_checked = false;  // new arguments: the backend checks them before the launch
  mhc_.x = Input(FieldOf(calls, &MhcArgs::x), total);
  mhc_.residual = Input(FieldOf(calls, &MhcArgs::residual), total);
  mhc_.post_mix = Input(FieldOf(calls, &MhcArgs::post_mix), total);
  mhc_.comb_mix = Input(FieldOf(calls, &MhcArgs::comb_mix), total);
  mhc_.pre_mix = Input(FieldOf(calls, &MhcArgs::pre_mix), total);
  mhc_.new_residual = Output(FieldOf(calls, &MhcArgs::new_residual), total);
  mhc_.new_pre_mix = Output(FieldOf(calls, &MhcArgs::new_pre_mix), total);
  mhc_.new_post_mix = Output(FieldOf(calls, &MhcArgs::new_post_mix), total);
  mhc_.new_comb_mix = Output(FieldOf(calls, &MhcArgs::new_comb_mix), total);
  mhc_.y = Output(FieldOf(calls, &MhcArgs::y), total);
  mhc_.aux = Output(FieldOf(calls, &MhcArgs::aux), total);
  return mhc_;
}

const SwaArgs& BatchAssembly::Gather(const std::vector<const SwaArgs*>& calls, ScaleLayout scale_layout) {
  int64_t total = 0;
  for (const SwaArgs* a : calls) total += a->tokens;
  swa_ = *calls.front();
  swa_.tokens = total;
  swa_.contract_checked = false;  // new arguments: the backend checks them before the launch
  swa_.qr_kv = Input(FieldOf(calls, &SwaArgs::qr_kv), total);
  swa_.q_fp8 = Output(FieldOf(calls, &SwaArgs::q_fp8), total);
  if (scale_layout == ScaleLayout::kRowMajor) {
    swa_.q_scale = Output(FieldOf(calls, &SwaArgs::q_scale), total);  // [M, G]: token-major
  } else {
    std::vector<int64_t> tokens;
    for (const SwaArgs* a : calls) tokens.push_back(a->tokens);
    swa_.q_scale = ColumnMajorScaleOutput(FieldOf(calls, &SwaArgs::q_scale), std::move(tokens), total);
  }
  swa_.kv = Output(FieldOf(calls, &SwaArgs::kv), total);
  swa_.q_proj = Output(FieldOf(calls, &SwaArgs::q_proj), total);
  return swa_;
}

void BatchAssembly::Scatter() {
  for (const OutputSlices& out : outputs_) {
    if (!out.column_tokens.empty()) {
      // [G, align4(M)]: each group row holds every token's scale; a call's slice of a row is its
      // tokens' columns. Its own padding columns stay zero (the response was zero-filled, and the
      // kernels zero them for a call alone).
      const int64_t groups = out.batched.shape[0], batched_cols = out.batched.shape[1];
      const float* src = out.batched.ptr<const float>();
      int64_t offset = 0;
      for (size_t i = 0; i < out.parts.size(); ++i) {
        const TensorView& p = out.parts[i];
        const int64_t tokens = out.column_tokens[i], cols = p.shape[1];
        float* dst = p.ptr<float>();
        for (int64_t g = 0; g < groups; ++g) {
          std::memcpy(dst + g * cols, src + g * batched_cols + offset, sizeof(float) * static_cast<size_t>(tokens));
          std::memset(dst + g * cols + tokens, 0, sizeof(float) * static_cast<size_t>(cols - tokens));
        }
        offset += tokens;
      }
      continue;
    }
    const size_t row_bytes = static_cast<size_t>(RowElements(out.batched)) * DTypeSize(out.batched.dtype);
    const char* src = out.batched.ptr<const char>();
    for (const TensorView& p : out.parts) {
      CopyRows(p.ptr<char>(), p.stride[0] * static_cast<int64_t>(DTypeSize(p.dtype)), src,
               static_cast<int64_t>(row_bytes), p.shape[0], row_bytes);
      src += row_bytes * static_cast<size_t>(p.shape[0]);
    }
  }
}

}  // namespace fusedlayer::server
