#include "weights/safetensors_writer.h"

#include <fstream>
#include <set>

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"
#include "weights/safetensors.h"

namespace fusedlayer::server {

absl::StatusOr<std::string> SerializeSafetensors(const std::vector<SafetensorsEntry>& tensors,
                                                 const std::map<std::string, std::string>& metadata) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) {
    header["__metadata__"] = nlohmann::ordered_json::object();
    for (const auto& [k, v] : metadata) header["__metadata__"][k] = v;
  }
  std::set<std::string> names;
  uint64_t offset = 0;
  for (const SafetensorsEntry& t : tensors) {
    if (t.name == "__metadata__" || !names.insert(t.name).second) {
      return absl::InvalidArgumentError(absl::StrCat("safetensors writer: duplicate or reserved name ", t.name));
    }
    nlohmann::ordered_json entry;
    entry["dtype"] = t.dtype;
    entry["shape"] = t.shape;
    entry["data_offsets"] = {offset, offset + t.data.size()};
    header[t.name] = std::move(entry);
    offset += t.data.size();
  }
  std::string json_text;
  try {
    json_text = header.dump();
  } catch (const nlohmann::json::exception& e) {  // names that are not valid UTF-8
    return absl::InvalidArgumentError(absl::StrCat("safetensors writer: ", e.what()));
  }
  json_text.append((8 - json_text.size() % 8) % 8, ' ');
  std::string out;
  out.reserve(8 + json_text.size() + offset);
  uint64_t n = json_text.size();
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((n >> (8 * i)) & 0xff));
  out += json_text;
  for (const SafetensorsEntry& t : tensors) out += t.data;
  // Validate with the reader: dtype names, shapes and byte lengths follow one definition.
  absl::StatusOr<SafetensorsIndex> check = ParseSafetensors(out, "safetensors writer");
  if (!check.ok()) return check.status();
  return out;
}

absl::Status WriteSafetensors(const std::string& path, const std::vector<SafetensorsEntry>& tensors,
                              const std::map<std::string, std::string>& metadata) {
  absl::StatusOr<std::string> bytes = SerializeSafetensors(tensors, metadata);
  if (!bytes.ok()) return bytes.status();
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(bytes->data(), static_cast<std::streamsize>(bytes->size()));
  f.close();
  if (!f) return absl::InternalError(absl::StrCat("cannot write ", path));
  return absl::OkStatus();
}

}  // namespace fusedlayer::server
