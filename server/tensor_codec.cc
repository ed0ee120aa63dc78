#include "tensor_codec.h"

#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace fusedlayer::server {
namespace {

std::string ShapeString(const v1::Tensor& t) { return absl::StrCat("[", absl::StrJoin(t.shape(), ", "), "]"); }
std::string ShapeString(std::initializer_list<int64_t> dims) {
  return absl::StrCat("[", absl::StrJoin(dims, ", "), "]");
}

const char* ProtoDTypeName(v1::DataType d) {
  switch (d) {
    case v1::DATA_TYPE_BF16: return "bf16";
    case v1::DATA_TYPE_FP32: return "fp32";
    case v1::DATA_TYPE_FP8_E4M3FN: return "fp8_e4m3fn";
    case v1::DATA_TYPE_FP8_E4M3FNUZ: return "fp8_e4m3fnuz";
    case v1::DATA_TYPE_UNSPECIFIED: return "unspecified";
    default: return "unknown";
  }
}

// The tensor is absent or its dtype is wrong.
absl::Status CheckDType(const v1::Tensor& t, const char* name, DType dtype) {
  if (t.dtype() == ToProto(dtype)) return absl::OkStatus();
  if (t.dtype() == v1::DATA_TYPE_UNSPECIFIED && t.shape_size() == 0 && t.data().empty()) {
    return absl::InvalidArgumentError(absl::StrCat("tensor '", name, "' is missing (want ", DTypeName(dtype), ")"));
  }
  return absl::InvalidArgumentError(absl::StrCat("tensor '", name, "': dtype ", ProtoDTypeName(t.dtype()),
                                                 ", want ", DTypeName(dtype)));
}

absl::Status CheckBytes(const v1::Tensor& t, const char* name, DType dtype) {
  auto want = DenseBytes(dtype, t.shape().data(), t.shape_size(), name);
  if (!want.ok()) return want.status();
  if (t.data().size() != *want) {
    return absl::InvalidArgumentError(absl::StrCat("tensor '", name, "': ", DTypeName(dtype), ShapeString(t),
                                                   " needs ", *want, " bytes, got ", t.data().size()));
  }
  return absl::OkStatus();
}

}  // namespace

v1::DataType ToProto(DType dtype) {
  switch (dtype) {
    case DType::kBF16: return v1::DATA_TYPE_BF16;
    case DType::kFP32: return v1::DATA_TYPE_FP32;
    case DType::kFP8E4M3FN: return v1::DATA_TYPE_FP8_E4M3FN;
    case DType::kFP8E4M3FNUZ: return v1::DATA_TYPE_FP8_E4M3FNUZ;
  }
  return v1::DATA_TYPE_UNSPECIFIED;
}

absl::StatusOr<DType> FromProto(v1::DataType dtype) {
  switch (dtype) {
    case v1::DATA_TYPE_BF16: return DType::kBF16;
    case v1::DATA_TYPE_FP32: return DType::kFP32;
    case v1::DATA_TYPE_FP8_E4M3FN: return DType::kFP8E4M3FN;
    case v1::DATA_TYPE_FP8_E4M3FNUZ: return DType::kFP8E4M3FNUZ;
    default: return absl::InvalidArgumentError(absl::StrCat("unsupported dtype ", ProtoDTypeName(dtype)));
  }
}

absl::StatusOr<uint64_t> DenseBytes(DType dtype, const int64_t* dims, int rank, const char* name) {
  uint64_t bytes = DTypeSize(dtype);
  for (int i = 0; i < rank; ++i) {
    if (dims[i] < 0) {
      return absl::InvalidArgumentError(absl::StrCat("tensor '", name, "': negative dimension ", dims[i]));
    }
    if (__builtin_mul_overflow(bytes, static_cast<uint64_t>(dims[i]), &bytes) || bytes > (uint64_t{1} << 62)) {
      return absl::InvalidArgumentError(absl::StrCat("tensor '", name, "': size overflows"));
    }
  }
  return bytes;
}

absl::StatusOr<int64_t> LeadingDim(const v1::Tensor& t, const char* name, int rank) {
  if (t.shape_size() != rank) {
    if (t.dtype() == v1::DATA_TYPE_UNSPECIFIED && t.shape_size() == 0 && t.data().empty()) {
      return absl::InvalidArgumentError(absl::StrCat("tensor '", name, "' is missing"));
    }
    return absl::InvalidArgumentError(
        absl::StrCat("tensor '", name, "': rank ", t.shape_size(), " (shape ", ShapeString(t), "), want ", rank));
  }
  if (t.shape(0) < 0) {
    return absl::InvalidArgumentError(absl::StrCat("tensor '", name, "': negative dimension ", t.shape(0)));
  }
  return t.shape(0);
}

absl::StatusOr<TensorView> DecodeTensor(const v1::Tensor& t, const char* name, DType dtype,
                                        std::initializer_list<int64_t> dims) {
  if (absl::Status s = CheckDType(t, name, dtype); !s.ok()) return s;
  bool same = t.shape_size() == static_cast<int>(dims.size());
  if (same) {
    int i = 0;
    for (int64_t d : dims) same = same && t.shape(i++) == d;
  }
  if (!same) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor '", name, "': shape ", ShapeString(t), ", want ", ShapeString(dims)));
  }
  if (absl::Status s = CheckBytes(t, name, dtype); !s.ok()) return s;
  // The view is non-const because TensorView is; inputs are only ever read by the kernels.
  return TensorView::Contiguous(const_cast<char*>(t.data().data()), dtype, dims);
}

absl::StatusOr<TensorView> DecodeStrided2D(const v1::Tensor& t, const char* name, DType dtype, int64_t cols) {
  if (absl::Status s = CheckDType(t, name, dtype); !s.ok()) return s;
  if (t.shape_size() != 2 || t.shape(0) < 0 || t.shape(1) < cols) {
    return absl::InvalidArgumentError(absl::StrCat("tensor '", name, "': shape ", ShapeString(t), ", want [M, S] with S >= ",
                                                   cols));
  }
  if (absl::Status s = CheckBytes(t, name, dtype); !s.ok()) return s;
  return TensorView::Strided2D(const_cast<char*>(t.data().data()), dtype, t.shape(0), cols, t.shape(1));
}

TensorView AllocateOutput(v1::Tensor* out, DType dtype, std::initializer_list<int64_t> dims) {
  out->set_dtype(ToProto(dtype));
  out->clear_shape();
  uint64_t n = DTypeSize(dtype);
  for (int64_t d : dims) {
    out->add_shape(d);
    n *= static_cast<uint64_t>(d);
  }
  out->mutable_data()->resize(n);
  return TensorView::Contiguous(out->mutable_data()->data(), dtype, dims);
}

}  // namespace fusedlayer::server
