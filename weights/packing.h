// Building and reading PackedWeightSets (header + payload): used by the demo generator, the
// manifest exporter, the tests and the e2e tests (which stream packed sets over LoadWeights).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "fusedlayer/tensor.h"
#include "weights/weight_set.h"

namespace fusedlayer::server {

// Appends tensors to a payload, each at a multiple of kPackAlignment bytes (zero padding), and
// records them in the header.
class WeightSetPacker {
 public:
  static constexpr uint64_t kPackAlignment = 64;

  explicit WeightSetPacker(std::string name);

  // Set mhc / swa configs here (mutable_mhc(), mutable_swa()).
  fusedlayer::v1::WeightSetHeader& header() { return packed_.first; }

  // `bytes` must hold product(shape) * DTypeSize(dtype) bytes (not checked here: BuildWeightSet
  // checks the result, and tests pack deliberately wrong tensors).
  void Add(const std::string& name, DType dtype, const std::vector<int64_t>& shape, std::string_view bytes);

  // Fills payload_bytes and sha256 and returns the set. The packer is empty afterwards.
  absl::StatusOr<PackedWeightSet> Finish();

 private:
  PackedWeightSet packed_;
};

// The bytes of tensor `name` of a packed set. NotFound when there is no such entry, OutOfRange when
// the entry does not lie within the payload.
absl::StatusOr<std::string_view> PackedTensorBytes(const PackedWeightSet& set, std::string_view name);

// Conversions between the wire dtype and the library's. DTypeFromWire: nullopt for UNSPECIFIED
// and unknown values.
fusedlayer::v1::DataType DTypeToWire(DType dtype);
std::optional<DType> DTypeFromWire(fusedlayer::v1::DataType dtype);

}  // namespace fusedlayer::server
