// Exact dtype conversions applied when a manifest reads checkpoint tensors.
//
// Real checkpoints do not always store a tensor in the dtype a weight set keeps it in: DeepSeek's
// FP8 checkpoints carry block scales as UE8M0 (`F8_E8M0`) bytes, and norm weights or mHC
// parameters may be F16, BF16 or F32. A manifest load converts such a tensor to the weight set's
// dtype (weight_set.h) only when every value converts EXACTLY; otherwise it is INVALID_ARGUMENT
// naming the first value that would change. Nothing is ever rounded silently: the numbers a
// kernel sees are the numbers in the checkpoint.
//
//   to F32  (mhc.fn, mhc.scale, mhc.base, swa.wq_b_scale): from F32, BF16, F16, F8_E8M0 (always
//            exact; F8_E8M0 0xFF is NaN and rejected)
//   to BF16 (mhc.norm_weight, swa.q_norm, swa.kv_norm):      from BF16, and from F32 or F16 when
//            the value is a bf16 value (NaN is rejected)
//   fp8 tensors (swa.wq_b) are never converted.
#pragma once

#include <optional>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "fusedlayer/tensor.h"

namespace fusedlayer::server {

// The dtype a weight set keeps a tensor in when that dtype does not depend on hyper-parameters
// (weight_set.h's table); nullopt for swa.wq_b (fp8 in the set's format) and unknown names.
std::optional<DType> FixedWeightDType(std::string_view tensor_name);

// Converts `bytes` (little-endian elements of safetensors dtype `from`) to `to`. Returns the
// converted bytes, or InvalidArgument (prefixed with `where`) when the pair is not supported or a
// value is not exactly representable in `to`. Same dtype returns the bytes unchanged.
absl::StatusOr<std::string> ConvertTensorExactly(std::string_view from, DType to, std::string_view bytes,
                                                 std::string_view where);

}  // namespace fusedlayer::server
