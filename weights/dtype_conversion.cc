#include "weights/dtype_conversion.h"

#include <cmath>
#include <cstdint>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "fusedlayer/numeric.h"
#include "weights/string_view_compat.h"

namespace fusedlayer::server {
namespace {

float F16ToFloat(uint16_t h) {
  const uint32_t sign = uint32_t(h >> 15) << 31;
  const uint32_t exp = (h >> 10) & 0x1f;
  const uint32_t man = h & 0x3ff;
  if (exp == 0x1f) return BitsToFloat(sign | 0x7f800000u | (man << 13));  // inf / NaN (payload kept)
  if (exp != 0) return BitsToFloat(sign | ((exp + 112) << 23) | (man << 13));
  // Zero or subnormal: man * 2^-24, exact in fp32.
  const float mag = std::ldexp(static_cast<float>(man), -24);
  return sign ? -mag : mag;
}

// UE8M0: 2^(e - 127); e = 0xFF is NaN. 2^-127 is an fp32 subnormal, still exact.
std::optional<float> E8M0ToFloat(uint8_t e) {
  if (e == 0xff) return std::nullopt;
  return std::ldexp(1.0f, int(e) - 127);
}

template <typename T>
T Load(std::string_view bytes, size_t i) {
  T v;
  std::memcpy(&v, bytes.data() + i * sizeof(T), sizeof(T));
  return v;
}

absl::Status Inexact(std::string_view where, size_t i, float v, std::string_view from, DType to) {
  return absl::InvalidArgumentError(absl::StrFormat(
      "%s: element %d of the %s tensor is %.9g, which %s cannot hold exactly; convert the checkpoint "
      "tensor to %s yourself if rounding is intended",
      AbslView(where), i, AbslView(from), v, DTypeName(to), DTypeName(to)));
}

}  // namespace

std::optional<DType> FixedWeightDType(std::string_view name) {
  if (name == "mhc.fn" || name == "mhc.scale" || name == "mhc.base" || name == "swa.wq_b_scale") return DType::kFP32;
  if (name == "mhc.norm_weight" || name == "swa.q_norm" || name == "swa.kv_norm") return DType::kBF16;
  return std::nullopt;
}

absl::StatusOr<std::string> ConvertTensorExactly(std::string_view from, DType to, std::string_view bytes,
                                                 std::string_view where) {
  // Decodes element i of the source as a float (every supported source widens exactly), or
  // nullopt for a value no weight may hold (E8M0 NaN).
  size_t width = 0;
  std::optional<float> (*decode)(std::string_view, size_t) = nullptr;
  if (from == "F32") {
    width = 4;
    decode = [](std::string_view b, size_t i) -> std::optional<float> { return Load<float>(b, i); };
  } else if (from == "BF16") {
    width = 2;
    decode = [](std::string_view b, size_t i) -> std::optional<float> { return Bf16ToFloat(Load<uint16_t>(b, i)); };
  } else if (from == "F16") {
    width = 2;
    decode = [](std::string_view b, size_t i) -> std::optional<float> { return F16ToFloat(Load<uint16_t>(b, i)); };
  } else if (from == "F8_E8M0") {
    width = 1;
    decode = [](std::string_view b, size_t i) { return E8M0ToFloat(static_cast<uint8_t>(b[i])); };
  }
  const bool same = (from == "F32" && to == DType::kFP32) || (from == "BF16" && to == DType::kBF16);
  if (same) return std::string(bytes);
  const bool supported = decode != nullptr && (to == DType::kFP32 || (to == DType::kBF16 && from != "F8_E8M0"));
  if (!supported) {
    return absl::InvalidArgumentError(absl::StrCat(AbslView(where), ": dtype ", AbslView(from), " cannot be converted to ",
                                                   DTypeName(to), " (",
                                                   to == DType::kFP32 ? "F32, BF16, F16 and F8_E8M0 can"
                                                                      : "BF16, and F32 or F16 holding bf16 values, can",
                                                   ")"));
  }
  if (bytes.size() % width != 0) {
    return absl::InvalidArgumentError(absl::StrCat(AbslView(where), ": ", bytes.size(), " bytes are not whole ",
                                                   AbslView(from), " elements"));
  }
  const size_t n = bytes.size() / width;
  std::string out(n * DTypeSize(to), '\0');
  for (size_t i = 0; i < n; ++i) {
    const std::optional<float> v = decode(bytes, i);
    if (!v) {
      return absl::InvalidArgumentError(
          absl::StrCat(AbslView(where), ": element ", i, " of the ", AbslView(from), " tensor is NaN (0xFF)"));
    }
    if (to == DType::kFP32) {
      std::memcpy(out.data() + 4 * i, &*v, 4);
    } else {
      const bf16_bits b = FloatToBf16(*v);
      if (std::isnan(*v) || Bf16ToFloat(b) != *v) return Inexact(where, i, *v, from, to);
      std::memcpy(out.data() + 2 * i, &b, 2);
    }
  }
  return out;
}

}  // namespace fusedlayer::server
