// Non-owning tensor views. A view says what the bytes are (dtype, shape, strides in elements) and
// where they are; the memory belongs to whoever made the view (the server's request buffers, a
// backend's weight set). The device is implied by the backend the view is handed to.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>

#include "absl/status/status.h"

namespace fusedlayer {

enum class DType : uint8_t { kBF16 = 0, kFP32 = 1, kFP8E4M3FN = 2, kFP8E4M3FNUZ = 3 };

constexpr size_t DTypeSize(DType d) { return d == DType::kFP32 ? 4 : d == DType::kBF16 ? 2 : 1; }
const char* DTypeName(DType d);  // "bf16", "fp32", "fp8_e4m3fn", "fp8_e4m3fnuz"

inline constexpr int kMaxRank = 4;

struct TensorView {
  void* data = nullptr;
  DType dtype = DType::kFP32;
  int rank = 0;
  std::array<int64_t, kMaxRank> shape{};
  std::array<int64_t, kMaxRank> stride{};  // in elements

  // A dense row-major view.
  static TensorView Contiguous(void* data, DType dtype, std::initializer_list<int64_t> dims);
  // A 2-D view whose rows are `row_stride` elements apart (row_stride >= cols).
  static TensorView Strided2D(void* data, DType dtype, int64_t rows, int64_t cols, int64_t row_stride);

  bool empty_view() const { return data == nullptr && rank == 0; }  // "absent" optional tensor
  int64_t numel() const;
  bool is_contiguous() const;
  std::string DebugString() const;  // e.g. "bf16[64, 4, 7168]"

  template <typename T>
  T* ptr() const { return static_cast<T*>(data); }
};

// Checks used by every backend before touching memory. They return InvalidArgument with a message
// naming `what` (e.g. "residual") so the user sees which tensor is wrong.
absl::Status ExpectTensor(const TensorView& t, const char* what, DType dtype,
                          std::initializer_list<int64_t> dims);
// Same, but the innermost dimension must be unit-stride and rows may be padded (2-D only).
absl::Status ExpectRowStridedTensor(const TensorView& t, const char* what, DType dtype, int64_t rows,
                                    int64_t cols);

}  // namespace fusedlayer
