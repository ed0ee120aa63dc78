// A validating reader for the safetensors format (https://github.com/huggingface/safetensors):
//
//   [8 bytes: N, little-endian uint64][N bytes: JSON header][data section]
//
// The header maps tensor names to {"dtype": "BF16", "shape": [..], "data_offsets": [begin, end]}
// (offsets relative to the start of the data section) plus an optional "__metadata__" object of
// string -> string. Trailing spaces after the JSON (writers pad the header to 8 bytes) are allowed.
//
// Every rule of the format is checked, and a bad file is an error naming the file and the tensor,
// never a crash or an out-of-bounds read (the parser is fuzzed: ParseSafetensors is the entry point):
//   DATA_LOSS         the file is shorter than it claims: under 8 bytes, header length past the end
//                     of the file, or tensors extending past the end of the data section (truncation)
//   INVALID_ARGUMENT  header length over kMaxSafetensorsHeaderBytes; malformed JSON or a duplicate
//                     key; a header that is not an object; an entry that is not {dtype, shape,
//                     data_offsets} (unknown keys included); an unknown dtype; a negative or non-integer
//                     dimension; an element count that overflows; data_offsets not two integers with
//                     begin <= end; end - begin != numel * dtype size; overlapping tensors; bytes of the
//                     data section that belong to no tensor (holes, trailing bytes: the format requires
//                     the data section to be fully indexed); __metadata__ values that are not strings.
//
// dtypes: every dtype of the format is parsed and size-checked (BOOL, U8, I8, F8_E5M2, F8_E4M3,
// F8_E8M0, I16, U16, F16, BF16, I32, U32, F32, F64, I64, U64, C64, and the sub-byte F4, F6_E2M3,
// F6_E3M2) so that weight files holding other tensors load; fusedlayer itself uses BF16, F32,
// F8_E4M3 (= OCP e4m3fn, the format's name for it) and F8_E4M3FNUZ (a fusedlayer extension for
// MI300 weights; the upstream format has no fnuz dtype).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "fusedlayer/tensor.h"

namespace fusedlayer::server {

// The reference implementation's limit; a real header is a few hundred KB at most.
inline constexpr uint64_t kMaxSafetensorsHeaderBytes = 100'000'000;

struct SafetensorsTensorInfo {
  std::string name;
  std::string dtype;            // as spelled in the file, e.g. "BF16"
  std::vector<int64_t> shape;   // may be empty (a scalar)
  uint64_t begin = 0;           // byte range in the data section
  uint64_t end = 0;

  uint64_t bytes() const { return end - begin; }
  int64_t numel() const;
};

// The parsed header of one safetensors file.
struct SafetensorsIndex {
  std::string source;                          // file name (or "<memory>") for messages
  uint64_t data_offset = 0;                    // absolute offset of the data section: 8 + N
  uint64_t data_bytes = 0;                     // size of the data section
  std::map<std::string, SafetensorsTensorInfo> tensors;
  std::map<std::string, std::string> metadata;  // __metadata__

  // NotFound naming the file and listing a few of its tensors when `name` is absent.
  absl::StatusOr<const SafetensorsTensorInfo*> Find(std::string_view name) const;
};

// Parses and validates a whole safetensors file held in memory. `source` names it in messages.
absl::StatusOr<SafetensorsIndex> ParseSafetensors(std::string_view bytes,
                                                  std::string_view source = "<memory>");

// Validates the JSON header of a file whose data section is `data_bytes` long.
absl::StatusOr<SafetensorsIndex> ParseSafetensorsHeader(std::string_view header_json, uint64_t data_bytes,
                                                        std::string_view source);

// The fusedlayer dtype of a safetensors dtype string, nullopt for dtypes fusedlayer does not use.
std::optional<DType> SafetensorsDTypeToDType(std::string_view dtype);
// The safetensors spelling of a fusedlayer dtype ("BF16", "F32", "F8_E4M3", "F8_E4M3FNUZ").
const char* DTypeToSafetensorsDType(DType dtype);

// A safetensors file opened for reading. The header is validated against the file size on Open;
// tensors are then read with pread, so only the tensors asked for are read (a checkpoint shard holds
// many more) and a file shrinking underneath yields DATA_LOSS rather than the SIGBUS an mmap gives.
class SafetensorsFile {
 public:
  // NotFound / PermissionDenied / Internal from the OS, or the parse errors above.
  static absl::StatusOr<std::unique_ptr<SafetensorsFile>> Open(const std::string& path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const SafetensorsIndex& index() const { return index_; }
  const std::string& path() const { return path_; }

  // Appends the bytes of `tensor` (an entry of index()) to `out`. DataLoss on a short read.
  absl::Status AppendTensorBytes(const SafetensorsTensorInfo& tensor, std::string* out) const;

 private:
  SafetensorsFile(std::string path, int fd, SafetensorsIndex index)
      : path_(std::move(path)), fd_(fd), index_(std::move(index)) {}
  std::string path_;
  int fd_ = -1;
  SafetensorsIndex index_;
};

}  // namespace fusedlayer::server
