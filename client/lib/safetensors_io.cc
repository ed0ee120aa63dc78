#include "client/lib/safetensors_io.h"

#include <cerrno>
#include <cstring>
#include <fstream>
#include <set>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"
#include "client/lib/tensor_messages.h"

namespace fusedlayer::client {

namespace {

using nlohmann::json;

constexpr uint64_t kMaxHeaderBytes = 100u << 20;  // the reference implementation's limit

absl::StatusOr<v1::DataType> ParseDtype(const std::string& s) {
  if (s == "BF16") return v1::DATA_TYPE_BF16;
  if (s == "F32") return v1::DATA_TYPE_FP32;
  if (s == "F8_E4M3") return v1::DATA_TYPE_FP8_E4M3FN;
  if (s == "F8_E4M3FNUZ") return v1::DATA_TYPE_FP8_E4M3FNUZ;
  return absl::InvalidArgumentError(
      absl::StrCat("unsupported safetensors dtype \"", s, "\" (expected BF16, F32, F8_E4M3, F8_E4M3FNUZ)"));
}

const char* DtypeString(v1::DataType d) {
  switch (d) {
    case v1::DATA_TYPE_BF16: return "BF16";
    case v1::DATA_TYPE_FP32: return "F32";
    case v1::DATA_TYPE_FP8_E4M3FN: return "F8_E4M3";
    case v1::DATA_TYPE_FP8_E4M3FNUZ: return "F8_E4M3FNUZ";
    default: return nullptr;
  }
}

}  // namespace

absl::StatusOr<SafetensorsFile> ParseSafetensors(const std::string& image) {
  if (image.size() < 8) return absl::InvalidArgumentError("safetensors: file shorter than its 8-byte header length");
  uint64_t header_len;
  std::memcpy(&header_len, image.data(), 8);
  if (header_len > kMaxHeaderBytes || header_len > image.size() - 8) {
    return absl::InvalidArgumentError(absl::StrCat("safetensors: header length ", header_len, " is invalid for a ",
                                                   image.size(), "-byte file"));
  }
  json header = json::parse(image.begin() + 8, image.begin() + 8 + int64_t(header_len), nullptr,
                            /*allow_exceptions=*/false);
  if (header.is_discarded() || !header.is_object()) {
    return absl::InvalidArgumentError("safetensors: header is not a JSON object");
  }
  const size_t data_begin = 8 + size_t(header_len);
  const size_t data_size = image.size() - data_begin;

  SafetensorsFile file;
  if (auto it = header.find("__metadata__"); it != header.end()) {
    if (!it->is_object()) return absl::InvalidArgumentError("safetensors: __metadata__ is not an object");
    for (auto& [k, v] : it->items()) {
      if (!v.is_string()) return absl::InvalidArgumentError("safetensors: __metadata__ values must be strings");
      file.metadata[k] = v.get<std::string>();
    }
  }
  for (auto& [name, entry] : header.items()) {
    if (name == "__metadata__") continue;
    auto bad = [&](absl::string_view why) {
      return absl::InvalidArgumentError(absl::StrCat("safetensors: tensor \"", name, "\": ", why));
    };
    if (!entry.is_object() || !entry.contains("dtype") || !entry.contains("shape") || !entry.contains("data_offsets")) {
      return bad("needs dtype, shape and data_offsets");
    }
    if (!entry["dtype"].is_string()) return bad("dtype is not a string");
    absl::StatusOr<v1::DataType> dtype = ParseDtype(entry["dtype"].get<std::string>());
    if (!dtype.ok()) return bad(dtype.status().message());
    std::vector<int64_t> shape;
    if (!entry["shape"].is_array()) return bad("shape is not an array");
    for (const json& d : entry["shape"]) {
      if (!d.is_number_unsigned()) return bad("shape has a non-integer or negative dimension");
      const uint64_t v = d.get<uint64_t>();
      if (v > uint64_t(INT64_MAX)) return bad("dimension too large");
      shape.push_back(int64_t(v));
    }
    const json& off = entry["data_offsets"];
    if (!off.is_array() || off.size() != 2 || !off[0].is_number_unsigned() || !off[1].is_number_unsigned()) {
      return bad("data_offsets must be two non-negative integers");
    }
    const uint64_t begin = off[0].get<uint64_t>(), end = off[1].get<uint64_t>();
    if (begin > end || end > data_size) return bad(absl::StrCat("data_offsets [", begin, ", ", end, "] out of range"));
    absl::StatusOr<v1::Tensor> t =
        MakeTensor(*dtype, shape, image.substr(data_begin + size_t(begin), size_t(end - begin)));
    if (!t.ok()) return bad(t.status().message());
    file.tensors.emplace(name, *std::move(t));
  }
  return file;
}

absl::StatusOr<SafetensorsFile> ReadSafetensors(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open ", path, ": ", std::strerror(errno)));
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) return absl::DataLossError(absl::StrCat("error reading ", path));
  absl::StatusOr<SafetensorsFile> f = ParseSafetensors(ss.str());
  if (!f.ok()) return absl::Status(f.status().code(), absl::StrCat(path, ": ", f.status().message()));
  return f;
}

absl::StatusOr<std::string> SerializeSafetensors(const std::vector<std::pair<std::string, v1::Tensor>>& tensors,
                                                 const std::map<std::string, std::string>& metadata) {
  // nlohmann::ordered_json keeps tensors in the order given (offsets ascending).
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  nlohmann::ordered_json meta = nlohmann::ordered_json::object();
  for (const auto& [k, v] : metadata) meta[k] = v;
  std::set<std::string> seen;
  uint64_t offset = 0;
  for (const auto& [name, t] : tensors) {
    if (name.empty() || name == "__metadata__") return absl::InvalidArgumentError("invalid tensor name");
    if (!seen.insert(name).second) return absl::InvalidArgumentError(absl::StrCat("duplicate tensor name ", name));
    if (absl::Status s = ValidateTensor(t, name); !s.ok()) return s;
    const char* dtype = DtypeString(t.dtype());
    if (dtype == nullptr) return absl::InvalidArgumentError(absl::StrCat(name, ": unspecified dtype"));
    header[name] = {{"dtype", dtype},
                    {"shape", std::vector<int64_t>(t.shape().begin(), t.shape().end())},
                    {"data_offsets", {offset, offset + t.data().size()}}};
    offset += t.data().size();
  }
  if (!meta.empty()) {
    // __metadata__ first, as the reference writer does.
    nlohmann::ordered_json with_meta = nlohmann::ordered_json::object();
    with_meta["__metadata__"] = meta;
    for (auto& [k, v] : header.items()) with_meta[k] = v;
    header = std::move(with_meta);
  }
  std::string text = header.dump();
  // Pad the header with spaces so the data starts 8-byte aligned (allowed by the format).
  text.append((8 - text.size() % 8) % 8, ' ');
  std::string out(8, '\0');
  const uint64_t len = text.size();
  std::memcpy(out.data(), &len, 8);
  out += text;
  out.reserve(out.size() + offset);
  for (const auto& [name, t] : tensors) out += t.data();
  return out;
}

absl::Status WriteSafetensors(const std::string& path, const std::vector<std::pair<std::string, v1::Tensor>>& tensors,
                              const std::map<std::string, std::string>& metadata) {
  absl::StatusOr<std::string> image = SerializeSafetensors(tensors, metadata);
  if (!image.ok()) return image.status();
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) return absl::PermissionDeniedError(absl::StrCat("cannot write ", path, ": ", std::strerror(errno)));
  out.write(image->data(), std::streamsize(image->size()));
  out.close();
  if (!out) return absl::DataLossError(absl::StrCat("error writing ", path));
  return absl::OkStatus();
}

}  // namespace fusedlayer::client
