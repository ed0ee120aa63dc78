// Reading request inputs from, and writing response outputs to, safetensors files
// (https://github.com/huggingface/safetensors: u64 little-endian header length, a JSON header
// {name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {str: str}}, then the data).
//
// dtype mapping: BF16 <-> bf16, F32 <-> fp32, F8_E4M3 <-> fp8_e4m3fn (safetensors' F8_E4M3 is the
// OCP "fn" variant, as in PyTorch's float8_e4m3fn), F8_E4M3FNUZ <-> fp8_e4m3fnuz. The last is not in
// the upstream safetensors dtype list; it is the spelling the server's weight manifests use
// (weights/manifest.h), so files written here load there.
#pragma once

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "fusedlayer/v1/fusedlayer.pb.h"

namespace fusedlayer::client {

namespace v1 = ::fusedlayer::v1;

struct SafetensorsFile {
  std::map<std::string, v1::Tensor> tensors;
  std::map<std::string, std::string> metadata;
};

// Parses a whole file image. InvalidArgument on any malformation (header length, JSON, unknown
// dtype, offsets out of range or not matching shape x dtype).
absl::StatusOr<SafetensorsFile> ParseSafetensors(const std::string& image);
absl::StatusOr<SafetensorsFile> ReadSafetensors(const std::string& path);

// Serialises tensors in the given order (offsets ascending, 8-byte aligned header as the format
// recommends). Names must be unique and non-empty.
absl::StatusOr<std::string> SerializeSafetensors(const std::vector<std::pair<std::string, v1::Tensor>>& tensors,
                                                 const std::map<std::string, std::string>& metadata = {});
absl::Status WriteSafetensors(const std::string& path,
                              const std::vector<std::pair<std::string, v1::Tensor>>& tensors,
                              const std::map<std::string, std::string>& metadata = {});

}  // namespace fusedlayer::client
