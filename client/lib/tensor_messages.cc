#include "client/lib/tensor_messages.h"

#include <bit>
#include <cstring>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "fusedlayer/numeric.h"

namespace fusedlayer::client {

// The wire format is little-endian; this client copies host memory straight into it.
static_assert(std::endian::native == std::endian::little, "fusedlayer client assumes a little-endian host");

size_t DataTypeSize(v1::DataType dtype) {
  switch (dtype) {
    case v1::DATA_TYPE_BF16: return 2;
    case v1::DATA_TYPE_FP32: return 4;
    case v1::DATA_TYPE_FP8_E4M3FN:
    case v1::DATA_TYPE_FP8_E4M3FNUZ: return 1;
    default: return 0;
  }
}

const char* DataTypeName(v1::DataType dtype) {
  switch (dtype) {
    case v1::DATA_TYPE_BF16: return "bf16";
    case v1::DATA_TYPE_FP32: return "fp32";
    case v1::DATA_TYPE_FP8_E4M3FN: return "fp8_e4m3fn";
    case v1::DATA_TYPE_FP8_E4M3FNUZ: return "fp8_e4m3fnuz";
    default: return "unspecified";
  }
}

absl::StatusOr<int64_t> NumElements(std::span<const int64_t> shape) {
  int64_t n = 1;
  for (int64_t d : shape) {
    if (d < 0) return absl::InvalidArgumentError(absl::StrCat("negative dimension in shape ", ShapeString(shape)));
    if (d != 0 && n > std::numeric_limits<int64_t>::max() / d) {
      return absl::InvalidArgumentError(absl::StrCat("shape ", ShapeString(shape), " overflows int64"));
    }
    n *= d;
  }
  return n;
}

absl::StatusOr<uint64_t> TensorByteSize(v1::DataType dtype, std::span<const int64_t> shape) {
  const size_t size = DataTypeSize(dtype);
  if (size == 0) return absl::InvalidArgumentError(absl::StrCat("unspecified or unknown dtype ", int(dtype)));
  absl::StatusOr<int64_t> n = NumElements(shape);
  if (!n.ok()) return n.status();
  if (uint64_t(*n) > std::numeric_limits<uint64_t>::max() / size) {
    return absl::InvalidArgumentError(absl::StrCat("shape ", ShapeString(shape), " overflows the byte count"));
  }
  return uint64_t(*n) * size;
}

std::string ShapeString(std::span<const int64_t> shape) { return absl::StrCat("[", absl::StrJoin(shape, ", "), "]"); }

std::vector<int64_t> ShapeOf(const v1::Tensor& t) { return {t.shape().begin(), t.shape().end()}; }

absl::Status ValidateTensor(const v1::Tensor& t, absl::string_view what) {
  const std::vector<int64_t> shape = ShapeOf(t);
  absl::StatusOr<uint64_t> bytes = TensorByteSize(t.dtype(), shape);
  if (!bytes.ok()) return absl::InvalidArgumentError(absl::StrCat(what, ": ", bytes.status().message()));
  if (*bytes != t.data().size()) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": ", DataTypeName(t.dtype()), ShapeString(shape), " needs ",
                                                   *bytes, " bytes of data, got ", t.data().size()));
  }
  return absl::OkStatus();
}

absl::StatusOr<v1::Tensor> MakeTensor(v1::DataType dtype, std::vector<int64_t> shape, std::string bytes) {
  v1::Tensor t;
  t.set_dtype(dtype);
  for (int64_t d : shape) t.add_shape(d);
  t.set_data(std::move(bytes));
  if (absl::Status s = ValidateTensor(t, "tensor"); !s.ok()) return s;
  return t;
}

namespace {
template <typename T>
absl::StatusOr<v1::Tensor> MakeFromSpan(v1::DataType dtype, std::vector<int64_t> shape, std::span<const T> values) {
  absl::StatusOr<int64_t> n = NumElements(shape);
  if (!n.ok()) return n.status();
  if (uint64_t(*n) != values.size()) {
    return absl::InvalidArgumentError(absl::StrCat(DataTypeName(dtype), ShapeString(shape), " needs ", *n,
                                                   " elements, got ", values.size()));
  }
  std::string bytes(values.size_bytes(), '\0');
  if (!bytes.empty()) std::memcpy(bytes.data(), values.data(), values.size_bytes());
  return MakeTensor(dtype, std::move(shape), std::move(bytes));
}
}  // namespace

absl::StatusOr<v1::Tensor> MakeBf16Tensor(std::vector<int64_t> shape, std::span<const uint16_t> bits) {
  return MakeFromSpan<uint16_t>(v1::DATA_TYPE_BF16, std::move(shape), bits);
}

absl::StatusOr<v1::Tensor> MakeFp32Tensor(std::vector<int64_t> shape, std::span<const float> values) {
  return MakeFromSpan<float>(v1::DATA_TYPE_FP32, std::move(shape), values);
}

absl::StatusOr<std::vector<float>> DecodeToFloat(const v1::Tensor& t) {
  if (absl::Status s = ValidateTensor(t, "tensor"); !s.ok()) return s;
  const std::string& d = t.data();
  const size_t n = d.size() / DataTypeSize(t.dtype());
  std::vector<float> out(n);
  const auto* p = reinterpret_cast<const unsigned char*>(d.data());
  switch (t.dtype()) {
    case v1::DATA_TYPE_BF16:
      for (size_t i = 0; i < n; ++i) {
        uint16_t b;
        std::memcpy(&b, p + 2 * i, 2);
        out[i] = Bf16ToFloat(b);
      }
      break;
    case v1::DATA_TYPE_FP32:
      if (n) std::memcpy(out.data(), p, 4 * n);
      break;
    case v1::DATA_TYPE_FP8_E4M3FN:
      for (size_t i = 0; i < n; ++i) out[i] = E4M3FNToFloat(p[i]);
      break;
    case v1::DATA_TYPE_FP8_E4M3FNUZ:
      for (size_t i = 0; i < n; ++i) out[i] = E4M3FNUZToFloat(p[i]);
      break;
    default:
      return absl::InvalidArgumentError("unspecified dtype");
  }
  return out;
}

}  // namespace fusedlayer::client
