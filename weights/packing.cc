#include "weights/packing.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "weights/sha256.h"
#include "weights/string_view_compat.h"

namespace fusedlayer::server {

namespace v1 = ::fusedlayer::v1;

WeightSetPacker::WeightSetPacker(std::string name) { packed_.first.set_name(std::move(name)); }

void WeightSetPacker::Add(const std::string& name, DType dtype, const std::vector<int64_t>& shape,
                          std::string_view bytes) {
  std::string& payload = packed_.second;
  payload.append((kPackAlignment - payload.size() % kPackAlignment) % kPackAlignment, '\0');
  v1::TensorEntry* e = packed_.first.add_tensors();
  e->set_name(name);
  e->set_dtype(DTypeToWire(dtype));
  for (int64_t d : shape) e->add_shape(d);
  e->set_offset(payload.size());
  payload.append(bytes.data(), bytes.size());
}

absl::StatusOr<PackedWeightSet> WeightSetPacker::Finish() {
  packed_.first.set_payload_bytes(packed_.second.size());
  absl::StatusOr<std::string> sha = Sha256Hex(packed_.second);
  if (!sha.ok()) return sha.status();
  packed_.first.set_sha256(*sha);
  return std::exchange(packed_, PackedWeightSet{});
}

absl::StatusOr<std::string_view> PackedTensorBytes(const PackedWeightSet& set, std::string_view name) {
  for (const v1::TensorEntry& e : set.first.tensors()) {
    if (e.name() != name) continue;
    const std::optional<DType> dtype = DTypeFromWire(e.dtype());
    if (!dtype) return absl::InvalidArgumentError(absl::StrCat("tensor ", e.name(), ": unknown dtype"));
    uint64_t bytes = DTypeSize(*dtype);
    for (int64_t d : e.shape()) {
      if (d < 0 || __builtin_mul_overflow(bytes, static_cast<uint64_t>(d), &bytes)) {
        return absl::OutOfRangeError(absl::StrCat("tensor ", e.name(), ": bad shape"));
      }
    }
    const std::string& payload = set.second;
    if (e.offset() > payload.size() || bytes > payload.size() - e.offset()) {
      return absl::OutOfRangeError(absl::StrCat("tensor ", e.name(), " lies outside the payload"));
    }
    return std::string_view(payload).substr(e.offset(), bytes);
  }
  return absl::NotFoundError(absl::StrCat("no tensor ", AbslView(name), " in weight set ", set.first.name()));
}

v1::DataType DTypeToWire(DType d) {
  switch (d) {
    case DType::kBF16: return v1::DATA_TYPE_BF16;
    case DType::kFP32: return v1::DATA_TYPE_FP32;
    case DType::kFP8E4M3FN: return v1::DATA_TYPE_FP8_E4M3FN;
    case DType::kFP8E4M3FNUZ: return v1::DATA_TYPE_FP8_E4M3FNUZ;
  }
  return v1::DATA_TYPE_UNSPECIFIED;
}

std::optional<DType> DTypeFromWire(v1::DataType d) {
  switch (d) {
    case v1::DATA_TYPE_BF16: return DType::kBF16;
    case v1::DATA_TYPE_FP32: return DType::kFP32;
    case v1::DATA_TYPE_FP8_E4M3FN: return DType::kFP8E4M3FN;
    case v1::DATA_TYPE_FP8_E4M3FNUZ: return DType::kFP8E4M3FNUZ;
    default: return std::nullopt;
  }
}

}  // namespace fusedlayer::server
