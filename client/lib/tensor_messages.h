// Building and decoding fusedlayer.v1.Tensor messages on the host.
//
// The wire format (fusedlayer.proto): little-endian, row-major, contiguous; len(data) ==
// product(shape) * size(dtype). These helpers enforce that on the client so a malformed request
// fails locally with a message naming the tensor instead of a server round trip.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include "absl/strings/string_view.h"
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "fusedlayer/v1/fusedlayer.pb.h"

namespace fusedlayer::client {

namespace v1 = ::fusedlayer::v1;

// Bytes per element; 0 for DATA_TYPE_UNSPECIFIED or an unknown value.
size_t DataTypeSize(v1::DataType dtype);
// "bf16", "fp32", "fp8_e4m3fn", "fp8_e4m3fnuz" (the server's DTypeName spelling), "unspecified".
const char* DataTypeName(v1::DataType dtype);

// Product of the dimensions. InvalidArgument on a negative dimension or an int64 overflow.
absl::StatusOr<int64_t> NumElements(std::span<const int64_t> shape);
// Bytes the data of a tensor of this dtype and shape must hold (same errors, plus unspecified dtype).
absl::StatusOr<uint64_t> TensorByteSize(v1::DataType dtype, std::span<const int64_t> shape);

// "[64, 4, 7168]".
std::string ShapeString(std::span<const int64_t> shape);
std::vector<int64_t> ShapeOf(const v1::Tensor& t);

// Checks dtype and byte length; `what` names the tensor in the message ("residual").
absl::Status ValidateTensor(const v1::Tensor& t, absl::string_view what);

// Tensors from host vectors. InvalidArgument when the element count does not match the shape.
absl::StatusOr<v1::Tensor> MakeBf16Tensor(std::vector<int64_t> shape, std::span<const uint16_t> bits);
absl::StatusOr<v1::Tensor> MakeFp32Tensor(std::vector<int64_t> shape, std::span<const float> values);
// Raw bytes of any dtype (e.g. fp8 codes or data read from a file).
absl::StatusOr<v1::Tensor> MakeTensor(v1::DataType dtype, std::vector<int64_t> shape, std::string bytes);

// Decodes every element to float (bf16 and fp8 exactly, fp32 as is). Validates first.
absl::StatusOr<std::vector<float>> DecodeToFloat(const v1::Tensor& t);

}  // namespace fusedlayer::client
