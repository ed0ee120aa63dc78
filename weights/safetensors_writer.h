// Writes safetensors files: used by the tests, the e2e tests and the fuzz seed corpus to produce
// weight files, and by ExportWeightSets (export.h) to turn weight sets into a manifest directory.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace fusedlayer::server {

struct SafetensorsEntry {
  std::string name;
  std::string dtype;            // safetensors spelling: "BF16", "F32", "F8_E4M3", ...
  std::vector<int64_t> shape;
  std::string data;             // raw little-endian bytes; the writer checks the length
};

// The bytes of a safetensors file holding `tensors` in the given order, contiguous, with the header
// padded by spaces to a multiple of 8 bytes (as the reference writer does, so the data section is
// 8-byte aligned). InvalidArgument on a duplicate or reserved name ("__metadata__"), an unknown
// dtype, or data whose length does not match dtype and shape.
absl::StatusOr<std::string> SerializeSafetensors(const std::vector<SafetensorsEntry>& tensors,
                                                 const std::map<std::string, std::string>& metadata = {});

// SerializeSafetensors, written to `path` (replaced if it exists).
absl::Status WriteSafetensors(const std::string& path, const std::vector<SafetensorsEntry>& tensors,
                              const std::map<std::string, std::string>& metadata = {});

}  // namespace fusedlayer::server
