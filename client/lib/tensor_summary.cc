#include "client/lib/tensor_summary.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "client/lib/tensor_messages.h"

namespace fusedlayer::client {

TensorSummary SummarizeValues(std::vector<int64_t> shape, std::string dtype, const std::vector<float>& values) {
  TensorSummary s;
  s.shape = std::move(shape);
  s.dtype = std::move(dtype);
  s.count = int64_t(values.size());
  double sum = 0;
  double lo = INFINITY, hi = -INFINITY;
  for (float v : values) {
    if (std::isnan(v)) { ++s.nan_count; continue; }
    if (std::isinf(v)) { ++s.inf_count; continue; }
    ++s.finite;
    lo = std::min(lo, double(v));
    hi = std::max(hi, double(v));
    sum += v;
  }
  if (s.finite > 0) {
    s.min = lo;
    s.max = hi;
    s.mean = sum / double(s.finite);
    s.absmax = std::max(std::fabs(lo), std::fabs(hi));
  }
  return s;
}

absl::StatusOr<TensorSummary> SummarizeTensor(const v1::Tensor& t) {
  absl::StatusOr<std::vector<float>> values = DecodeToFloat(t);
  if (!values.ok()) return values.status();
  return SummarizeValues(ShapeOf(t), DataTypeName(t.dtype()), *values);
}

absl::StatusOr<std::vector<float>> DequantizeFp8Groups(const v1::Tensor& q, const v1::Tensor& scale,
                                                       v1::ScaleLayout layout) {
  constexpr int64_t kGroup = 128;
  if (q.dtype() != v1::DATA_TYPE_FP8_E4M3FN && q.dtype() != v1::DATA_TYPE_FP8_E4M3FNUZ) {
    return absl::InvalidArgumentError(absl::StrCat("q_fp8 has dtype ", DataTypeName(q.dtype()), ", not fp8"));
  }
  if (scale.dtype() != v1::DATA_TYPE_FP32) {
    return absl::InvalidArgumentError(absl::StrCat("q_scale has dtype ", DataTypeName(scale.dtype()), ", not fp32"));
  }
  if (q.shape_size() != 2 || scale.shape_size() != 2 || q.shape(1) % kGroup != 0) {
    return absl::InvalidArgumentError(absl::StrCat("q_fp8 ", ShapeString(ShapeOf(q)), " / q_scale ",
                                                   ShapeString(ShapeOf(scale)), " are not [M, Q] / 2-D scales"));
  }
  const int64_t m = q.shape(0), g = q.shape(1) / kGroup, m4 = (m + 3) / 4 * 4;
  const bool row_major = layout == v1::SCALE_LAYOUT_ROW_MAJOR;
  const int64_t want0 = row_major ? m : g, want1 = row_major ? g : m4;
  if (scale.shape(0) != want0 || scale.shape(1) != want1) {
    return absl::InvalidArgumentError(absl::StrCat("q_scale is ", ShapeString(ShapeOf(scale)), ", expected [", want0,
                                                   ", ", want1, "] for the ", row_major ? "row-major" : "column-major TMA",
                                                   " layout"));
  }
  absl::StatusOr<std::vector<float>> codes = DecodeToFloat(q);
  if (!codes.ok()) return codes.status();
  absl::StatusOr<std::vector<float>> s = DecodeToFloat(scale);
  if (!s.ok()) return s.status();
  std::vector<float>& out = *codes;
  const int64_t cols = q.shape(1);
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t k = 0; k < cols; ++k) {
      const int64_t grp = k / kGroup;
      const float sc = row_major ? (*s)[r * g + grp] : (*s)[grp * m4 + r];
      out[r * cols + k] *= sc;
    }
  }
  return std::move(out);
}

absl::StatusOr<TensorSummary> SummarizeDequantized(const v1::Tensor& q, const v1::Tensor& scale,
                                                   v1::ScaleLayout layout) {
  absl::StatusOr<std::vector<float>> values = DequantizeFp8Groups(q, scale, layout);
  if (!values.ok()) return values.status();
  return SummarizeValues(ShapeOf(q), absl::StrCat(DataTypeName(q.dtype()), " (dequantized)"), *values);
}

std::string FormatSummary(absl::string_view name, const TensorSummary& s) {
  std::string line = absl::StrFormat("  %-13s %s%s", name, s.dtype, ShapeString(s.shape));
  if (s.count == 0) return absl::StrCat(line, "  (empty)");
  absl::StrAppend(&line, absl::StrFormat("  min=%.6g max=%.6g mean=%.6g absmax=%.6g nan=%d", s.min, s.max, s.mean,
                                         s.absmax, s.nan_count));
  if (s.inf_count) absl::StrAppend(&line, " inf=", s.inf_count);
  return line;
}

}  // namespace fusedlayer::client
