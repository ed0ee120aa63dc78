#include "fusedlayer/tensor.h"
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace fusedlayer {

const char* DTypeName(DType d) {
  switch (d) {
    case DType::kBF16: return "bf16";
    case DType::kFP32: return "fp32";
    case DType::kFP8E4M3FN: return "fp8_e4m3fn";
    case DType::kFP8E4M3FNUZ: return "fp8_e4m3fnuz";
  }
  return "unknown";
}

TensorView TensorView::Contiguous(void* data, DType dtype, std::initializer_list<int64_t> dims) {
  TensorView t;
  t.data = data;
  t.dtype = dtype;
  t.rank = static_cast<int>(dims.size());
  int i = 0;
  for (int64_t d : dims) t.shape[i++] = d;
  int64_t s = 1;
  for (int k = t.rank - 1; k >= 0; --k) {
    t.stride[k] = s;
    s *= t.shape[k];
  }
  return t;
}

TensorView TensorView::Strided2D(void* data, DType dtype, int64_t rows, int64_t cols, int64_t row_stride) {
  TensorView t;
  t.data = data;
  t.dtype = dtype;
  t.rank = 2;
  t.shape[0] = rows;
  t.shape[1] = cols;
  t.stride[0] = row_stride;
  t.stride[1] = 1;
  return t;
}

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int k = 0; k < rank; ++k) n *= shape[k];
  return n;
}

bool TensorView::is_contiguous() const {
  int64_t s = 1;
  for (int k = rank - 1; k >= 0; --k) {
    if (shape[k] != 1 && stride[k] != s) return false;
    s *= shape[k];
  }
  return true;
}

std::string TensorView::DebugString() const {
  std::vector<int64_t> dims(shape.begin(), shape.begin() + rank);
  return absl::StrCat(DTypeName(dtype), "[", absl::StrJoin(dims, ", "), "]");
}

namespace {
std::string DimsString(std::initializer_list<int64_t> dims) {
  return absl::StrCat("[", absl::StrJoin(dims, ", "), "]");
}
}  // namespace

absl::Status ExpectTensor(const TensorView& t, const char* what, DType dtype,
                          std::initializer_list<int64_t> dims) {
  const std::string want = absl::StrCat(DTypeName(dtype), DimsString(dims));
  if (t.dtype != dtype || t.rank != static_cast<int>(dims.size())) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": expected ", want, ", got ", t.DebugString()));
  }
  int i = 0;
  for (int64_t d : dims) {
    if (t.shape[i++] != d) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": expected ", want, ", got ", t.DebugString()));
    }
  }
  if (!t.is_contiguous()) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": must be contiguous (row-major)"));
  }
  if (t.data == nullptr && t.numel() > 0) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": missing"));
  }
  return absl::OkStatus();
}

absl::Status ExpectRowStridedTensor(const TensorView& t, const char* what, DType dtype, int64_t rows,
                                    int64_t cols) {
  if (t.dtype != dtype || t.rank != 2 || t.shape[0] != rows || t.shape[1] != cols) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": expected ", DTypeName(dtype), "[", rows, ", ",
                                                   cols, "], got ", t.DebugString()));
  }
  if (t.stride[1] != 1 || (rows > 1 && t.stride[0] < cols)) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": rows must be unit-stride with row stride >= ", cols, " (got stride ",
                     t.stride[0], ")"));
  }
  if (t.data == nullptr && rows > 0 && cols > 0) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": missing"));
  }
  return absl::OkStatus();
}

}  // namespace fusedlayer
