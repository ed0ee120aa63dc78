#include "weights/safetensors.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "weights/string_view_compat.h"
#include "weights/strict_json.h"

namespace fusedlayer::server {
namespace {

using json_internal::Quote;
using nlohmann::json;

// Bits per element of every safetensors dtype (sub-byte types are packed; a tensor's bit count must
// then be a whole number of bytes).
std::optional<uint64_t> DTypeBits(std::string_view d) {
  static constexpr std::pair<std::string_view, uint64_t> kBits[] = {
      {"BOOL", 8},    {"U8", 8},      {"I8", 8},           {"F8_E5M2", 8}, {"F8_E4M3", 8},
      {"F8_E8M0", 8}, {"F8_E4M3FNUZ", 8}, {"I16", 16},     {"U16", 16},    {"F16", 16},
      {"BF16", 16},   {"I32", 32},    {"U32", 32},         {"F32", 32},    {"F64", 64},
      {"I64", 64},    {"U64", 64},    {"C64", 64},         {"F4", 4},      {"F6_E2M3", 6},
      {"F6_E3M2", 6},
  };
  for (const auto& [name, bits] : kBits) {
    if (name == d) return bits;
  }
  return std::nullopt;
}

uint64_t ReadLe64(const char* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | static_cast<unsigned char>(p[i]);
  return v;
}

std::optional<uint64_t> AsUint64(const json& v) {
  if (v.is_number_unsigned()) return v.get<uint64_t>();
  if (v.is_number_integer() && v.get<int64_t>() >= 0) return static_cast<uint64_t>(v.get<int64_t>());
  return std::nullopt;
}

absl::Status ParseEntry(std::string_view source, const std::string& name, const json& entry,
                        SafetensorsTensorInfo* info) {
  const std::string where = absl::StrCat(AbslView(source), ": tensor ", Quote(name));
  if (!entry.is_object()) return absl::InvalidArgumentError(absl::StrCat(where, ": entry is not an object"));
  if (absl::Status s = json_internal::CheckAllowedKeys(entry, {"dtype", "shape", "data_offsets"}, where); !s.ok()) {
    return s;
  }
  for (const char* key : {"dtype", "shape", "data_offsets"}) {
    if (!entry.contains(key)) return absl::InvalidArgumentError(absl::StrCat(where, ": missing \"", key, "\""));
  }
  const json& dtype = entry["dtype"];
  if (!dtype.is_string()) return absl::InvalidArgumentError(absl::StrCat(where, ": dtype is not a string"));
  info->name = name;
  info->dtype = dtype.get<std::string>();
  const std::optional<uint64_t> bits = DTypeBits(info->dtype);
  if (!bits) return absl::InvalidArgumentError(absl::StrCat(where, ": unknown dtype ", Quote(info->dtype)));

  const json& shape = entry["shape"];
  if (!shape.is_array()) return absl::InvalidArgumentError(absl::StrCat(where, ": shape is not an array"));
  uint64_t numel = 1;
  bool overflow = false;
  for (const json& d : shape) {
    const std::optional<int64_t> dim = json_internal::AsInt64(d);
    if (!dim || *dim < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": shape entries must be non-negative integers"));
    }
    info->shape.push_back(*dim);
    overflow = overflow || __builtin_mul_overflow(numel, static_cast<uint64_t>(*dim), &numel);
  }
  // A zero dimension makes the count 0 whatever the others are, but an overflowing partial product
  // still marks a shape no tensor can have; reject it either way.
  uint64_t total_bits = 0;
  if (overflow || numel > static_cast<uint64_t>(INT64_MAX) ||
      __builtin_mul_overflow(numel, *bits, &total_bits)) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": element count overflows"));
  }
  if (total_bits % 8 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": ", numel, " elements of ", info->dtype, " are not a whole number of bytes"));
  }

  const json& offsets = entry["data_offsets"];
  if (!offsets.is_array() || offsets.size() != 2) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": data_offsets must be [begin, end]"));
  }
  const std::optional<uint64_t> begin = AsUint64(offsets[0]), end = AsUint64(offsets[1]);
  if (!begin || !end) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": data_offsets must be non-negative integers"));
  }
  if (*begin > *end) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": data_offsets [", *begin, ", ", *end, "] has begin > end"));
  }
  info->begin = *begin;
  info->end = *end;
  if (info->bytes() != total_bits / 8) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": data_offsets span ", info->bytes(), " bytes but ",
                                                   info->dtype, " shape [", absl::StrJoin(info->shape, ", "),
                                                   "] needs ", total_bits / 8));
  }
  return absl::OkStatus();
}

absl::Status ErrnoStatus(int err, std::string_view what) {
  const std::string msg = absl::StrCat(AbslView(what), ": ", std::strerror(err));
  switch (err) {
    case ENOENT:
    case ENOTDIR:
      return absl::NotFoundError(msg);
    case EACCES:
    case EPERM:
      return absl::PermissionDeniedError(msg);
    case ENOMEM:
      return absl::ResourceExhaustedError(msg);
    default:
      return absl::InternalError(msg);
  }
}

// Reads exactly `n` bytes at `offset`; DataLoss if the file ends first.
absl::Status PreadFully(int fd, char* dst, uint64_t n, uint64_t offset, std::string_view what) {
  while (n > 0) {
    const size_t chunk = static_cast<size_t>(std::min<uint64_t>(n, uint64_t{1} << 30));
    const ssize_t got = ::pread(fd, dst, chunk, static_cast<off_t>(offset));
    if (got < 0) {
      if (errno == EINTR) continue;
      return ErrnoStatus(errno, what);
    }
    if (got == 0) return absl::DataLossError(absl::StrCat(AbslView(what), ": unexpected end of file (truncated?)"));
    dst += got;
    n -= static_cast<uint64_t>(got);
    offset += static_cast<uint64_t>(got);
  }
  return absl::OkStatus();
}

}  // namespace

int64_t SafetensorsTensorInfo::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;  // cannot overflow: checked when parsed
  return n;
}

absl::StatusOr<const SafetensorsTensorInfo*> SafetensorsIndex::Find(std::string_view name) const {
  auto it = tensors.find(std::string(name));
  if (it != tensors.end()) return &it->second;
  std::vector<std::string> some;
  for (const auto& [n, t] : tensors) {
    if (some.size() == 8) break;
    some.push_back(n);
  }
  return absl::NotFoundError(absl::StrCat(AbslView(source), ": no tensor ", Quote(name), " (the file has ", tensors.size(),
                                          " tensors", some.empty() ? "" : ", e.g. ", absl::StrJoin(some, ", "),
                                          tensors.size() > some.size() ? ", ..." : "", ")"));
}

absl::StatusOr<SafetensorsIndex> ParseSafetensorsHeader(std::string_view header_json, uint64_t data_bytes,
                                                        std::string_view source) {
  absl::StatusOr<json> doc = json_internal::ParseStrictJson(header_json, absl::StrCat(AbslView(source), ": header"));
  if (!doc.ok()) return doc.status();
  if (!doc->is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(AbslView(source), ": header is not a JSON object"));
  }
  SafetensorsIndex index;
  index.source = std::string(source);
  index.data_bytes = data_bytes;
  for (const auto& [key, value] : doc->items()) {
    if (key == "__metadata__") {
      if (value.is_null()) continue;
      if (!value.is_object()) {
        return absl::InvalidArgumentError(absl::StrCat(AbslView(source), ": __metadata__ is not an object"));
      }
      for (const auto& [mk, mv] : value.items()) {
        if (!mv.is_string()) {
          return absl::InvalidArgumentError(
              absl::StrCat(AbslView(source), ": __metadata__ value of ", Quote(mk), " is not a string"));
        }
        index.metadata.emplace(mk, mv.get<std::string>());
      }
      continue;
    }
    SafetensorsTensorInfo info;
    if (absl::Status s = ParseEntry(source, key, value, &info); !s.ok()) return s;
    index.tensors.emplace(key, std::move(info));
  }

  // Bounds first: a tensor ending past the data section means the file lost its tail.
  std::vector<const SafetensorsTensorInfo*> by_offset;
  by_offset.reserve(index.tensors.size());
  for (const auto& [name, info] : index.tensors) {
    if (info.end > data_bytes) {
      return absl::DataLossError(absl::StrCat(AbslView(source), ": tensor ", Quote(name), " data_offsets [", info.begin, ", ",
                                              info.end, "] extend past the end of the data section (", data_bytes,
                                              " bytes): truncated file?"));
    }
    by_offset.push_back(&info);
  }
  // Then the layout: tensors tile the data section exactly (no overlap, no hole, nothing after).
  std::sort(by_offset.begin(), by_offset.end(), [](const auto* a, const auto* b) {
    return a->begin != b->begin ? a->begin < b->begin : a->end < b->end;
  });
  uint64_t cursor = 0;
  const SafetensorsTensorInfo* prev = nullptr;
  for (const SafetensorsTensorInfo* t : by_offset) {
    if (t->begin < cursor) {
      return absl::InvalidArgumentError(absl::StrCat(AbslView(source), ": tensors ", Quote(prev->name), " [", prev->begin, ", ",
                                                     prev->end, ") and ", Quote(t->name), " [", t->begin, ", ",
                                                     t->end, ") overlap"));
    }
    if (t->begin > cursor) {
      return absl::InvalidArgumentError(absl::StrCat(AbslView(source), ": bytes [", cursor, ", ", t->begin,
                                                     ") of the data section belong to no tensor (before ",
                                                     Quote(t->name), ")"));
    }
    // No overlap and no hole so far: the tensors tile [0, cursor) and t is the last tile.
    cursor = t->end;
    prev = t;
  }
  if (cursor != data_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(AbslView(source), ": ", data_bytes - cursor,
                                                   " trailing bytes after the last tensor"));
  }
  return index;
}

absl::StatusOr<SafetensorsIndex> ParseSafetensors(std::string_view bytes, std::string_view source) {
  if (bytes.size() < 8) {
    return absl::DataLossError(absl::StrCat(AbslView(source), ": ", bytes.size(),
                                            " bytes; a safetensors file starts with an 8-byte header length"));
  }
  const uint64_t n = ReadLe64(bytes.data());
  if (n > kMaxSafetensorsHeaderBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(AbslView(source), ": header length ", n, " exceeds the limit of ", kMaxSafetensorsHeaderBytes));
  }
  if (n > bytes.size() - 8) {
    return absl::DataLossError(absl::StrCat(AbslView(source), ": header length ", n, " runs past the end of the file (",
                                            bytes.size(), " bytes): truncated file?"));
  }
  absl::StatusOr<SafetensorsIndex> index = ParseSafetensorsHeader(bytes.substr(8, n), bytes.size() - 8 - n, source);
  if (index.ok()) index->data_offset = 8 + n;
  return index;
}

std::optional<DType> SafetensorsDTypeToDType(std::string_view dtype) {
  if (dtype == "BF16") return DType::kBF16;
  if (dtype == "F32") return DType::kFP32;
  if (dtype == "F8_E4M3") return DType::kFP8E4M3FN;
  if (dtype == "F8_E4M3FNUZ") return DType::kFP8E4M3FNUZ;
  return std::nullopt;
}

const char* DTypeToSafetensorsDType(DType dtype) {
  switch (dtype) {
    case DType::kBF16: return "BF16";
    case DType::kFP32: return "F32";
    case DType::kFP8E4M3FN: return "F8_E4M3";
    case DType::kFP8E4M3FNUZ: return "F8_E4M3FNUZ";
  }
  return "UNKNOWN";
}

absl::StatusOr<std::unique_ptr<SafetensorsFile>> SafetensorsFile::Open(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return ErrnoStatus(errno, absl::StrCat("cannot open ", path));
  // From here the descriptor is owned by `file` (or closed on the error paths below).
  auto fail = [fd](absl::Status s) -> absl::Status {
    ::close(fd);
    return s;
  };
  struct stat st;
  if (::fstat(fd, &st) != 0) return fail(ErrnoStatus(errno, absl::StrCat("cannot stat ", path)));
  if (!S_ISREG(st.st_mode)) return fail(absl::InvalidArgumentError(absl::StrCat(path, ": not a regular file")));
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  if (size < 8) {
    return fail(absl::DataLossError(
        absl::StrCat(path, ": ", size, " bytes; a safetensors file starts with an 8-byte header length")));
  }
  char len_bytes[8];
  if (absl::Status s = PreadFully(fd, len_bytes, 8, 0, path); !s.ok()) return fail(s);
  const uint64_t n = ReadLe64(len_bytes);
  if (n > kMaxSafetensorsHeaderBytes) {
    return fail(absl::InvalidArgumentError(
        absl::StrCat(path, ": header length ", n, " exceeds the limit of ", kMaxSafetensorsHeaderBytes)));
  }
  if (n > size - 8) {
    return fail(absl::DataLossError(absl::StrCat(path, ": header length ", n, " runs past the end of the file (",
                                                 size, " bytes): truncated file?")));
  }
  std::string header(n, '\0');
  if (absl::Status s = PreadFully(fd, header.data(), n, 8, path); !s.ok()) return fail(s);
  absl::StatusOr<SafetensorsIndex> index = ParseSafetensorsHeader(header, size - 8 - n, path);
  if (!index.ok()) return fail(index.status());
  index->data_offset = 8 + n;
  return std::unique_ptr<SafetensorsFile>(new SafetensorsFile(path, fd, std::move(*index)));
}

SafetensorsFile::~SafetensorsFile() {
  if (fd_ >= 0) ::close(fd_);
}

absl::Status SafetensorsFile::AppendTensorBytes(const SafetensorsTensorInfo& tensor, std::string* out) const {
  const size_t old = out->size();
  out->resize(old + tensor.bytes());
  absl::Status s = PreadFully(fd_, out->data() + old, tensor.bytes(), index_.data_offset + tensor.begin,
                              absl::StrCat(path_, ": tensor ", Quote(tensor.name)));
  if (!s.ok()) out->resize(old);
  return s;
}

}  // namespace fusedlayer::server
