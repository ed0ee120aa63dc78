// One-line statistics of a response tensor for humans: shape, dtype, min/max/mean/absmax over the
// finite values, and NaN/inf counts (a NaN in an output is a bug; it must be visible at a glance).
#pragma once

#include <cstdint>
#include <string>
#include "absl/strings/string_view.h"
#include <vector>

#include "absl/status/statusor.h"
#include "fusedlayer/v1/fusedlayer.pb.h"

namespace fusedlayer::client {

namespace v1 = ::fusedlayer::v1;

struct TensorSummary {
  std::vector<int64_t> shape;
  std::string dtype;       // DataTypeName, with " (dequantized)" when fp8 codes were scaled
  int64_t count = 0;       // elements
  int64_t finite = 0;      // elements that entered min/max/mean
  int64_t nan_count = 0;
  int64_t inf_count = 0;
  double min = 0, max = 0, mean = 0, absmax = 0;  // over finite values; 0 when there are none
};

// Statistics of the decoded values.
TensorSummary SummarizeValues(std::vector<int64_t> shape, std::string dtype, const std::vector<float>& values);
absl::StatusOr<TensorSummary> SummarizeTensor(const v1::Tensor& t);

// Dequantizes fp8 q [M, Q] with its per-1x128-group scales (x ~ q * s) and summarises the result.
// The layout is the weight set's: row-major scale [M, G] or column-major TMA [G, align(M, 4)].
absl::StatusOr<std::vector<float>> DequantizeFp8Groups(const v1::Tensor& q, const v1::Tensor& scale,
                                                       v1::ScaleLayout layout);
absl::StatusOr<TensorSummary> SummarizeDequantized(const v1::Tensor& q, const v1::Tensor& scale,
                                                   v1::ScaleLayout layout);

// "new_residual  bf16[64, 4, 5120]  min=-1.2e+01 max=... mean=... absmax=... nan=0"
std::string FormatSummary(absl::string_view name, const TensorSummary& s);

}  // namespace fusedlayer::client
