#include "weights/manifest.h"

#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <memory>
#include <set>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "weights/dtype_conversion.h"
#include "weights/packing.h"
#include "weights/safetensors.h"
#include "weights/sha256.h"
#include "weights/strict_json.h"
#include "weights/string_view_compat.h"

namespace fusedlayer::server {
namespace {

namespace v1 = ::fusedlayer::v1;
using json_internal::AsInt64;
using json_internal::CheckAllowedKeys;
using json_internal::Quote;
using nlohmann::json;

// Tensors start at multiples of this in a payload, so every element type is aligned for the backend
// and whole cache lines hold one tensor.
constexpr uint64_t kPayloadAlignment = 64;

// Payload order: the order weight_set.h lists the tensors in.
constexpr const char* kTensorOrder[] = {"mhc.fn",     "mhc.scale",   "mhc.base", "mhc.norm_weight",
                                        "swa.q_norm", "swa.kv_norm", "swa.wq_b", "swa.wq_b_scale"};

absl::Status Bad(const std::string& where, std::string_view msg) {
  return absl::InvalidArgumentError(absl::StrCat(where, ": ", AbslView(msg)));
}

absl::StatusOr<int64_t> GetInt(const json& obj, const char* key, const std::string& where, int64_t lo, int64_t hi) {
  const std::optional<int64_t> v = AsInt64(obj[key]);
  if (!v || *v < lo || *v > hi) {
    return Bad(where, absl::StrCat("\"", key, "\" must be an integer in [", lo, ", ", hi, "]"));
  }
  return *v;
}

absl::StatusOr<float> GetFloat(const json& obj, const char* key, const std::string& where) {
  const json& v = obj[key];
  if (!v.is_number()) return Bad(where, absl::StrCat("\"", key, "\" must be a number"));
  const double d = v.get<double>();
  const float f = static_cast<float>(d);
  // A value that becomes inf or flushes to 0 as float is not the value the author wrote.
  if (!std::isfinite(f) || (d != 0.0 && f == 0.0f)) {
    return Bad(where, absl::StrCat("\"", key, "\" = ", d, " is not representable as a float"));
  }
  return f;
}

absl::StatusOr<std::string> GetString(const json& obj, const char* key, const std::string& where) {
  const json& v = obj[key];
  if (!v.is_string()) return Bad(where, absl::StrCat("\"", key, "\" must be a string"));
  return v.get<std::string>();
}

absl::Status ParseMhc(const json& j, const std::string& where, v1::MhcConfig* c) {
  if (!j.is_object()) return Bad(where, "must be an object");
  if (absl::Status s = CheckAllowedKeys(j, {"hc_mult", "hidden", "hc_norm_eps", "norm_eps", "hc_pre_eps",
                                            "sinkhorn_eps", "post_scale", "sinkhorn_iters"},
                                        where);
      !s.ok()) {
    return s;
  }
  for (const char* key : {"hc_mult", "hidden"}) {
    if (!j.contains(key)) return Bad(where, absl::StrCat("missing \"", key, "\""));
  }
  constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();
  absl::StatusOr<int64_t> i;
  if (!(i = GetInt(j, "hc_mult", where, 1, kInt32Max)).ok()) return i.status();
  c->set_hc_mult(static_cast<int32_t>(*i));
  if (!(i = GetInt(j, "hidden", where, 1, std::numeric_limits<int64_t>::max())).ok()) return i.status();
  c->set_hidden(*i);
  if (j.contains("sinkhorn_iters")) {
    if (!(i = GetInt(j, "sinkhorn_iters", where, 1, kMaxSinkhornIters)).ok()) return i.status();
    c->set_sinkhorn_iters(static_cast<int32_t>(*i));
  }
  struct FloatField {
    const char* key;
    void (v1::MhcConfig::*set)(float);
  };
  for (const FloatField& f : {FloatField{"hc_norm_eps", &v1::MhcConfig::set_hc_norm_eps},
                              FloatField{"norm_eps", &v1::MhcConfig::set_norm_eps},
                              FloatField{"hc_pre_eps", &v1::MhcConfig::set_hc_pre_eps},
                              FloatField{"sinkhorn_eps", &v1::MhcConfig::set_sinkhorn_eps},
                              FloatField{"post_scale", &v1::MhcConfig::set_post_scale}}) {
    if (!j.contains(f.key)) continue;
    absl::StatusOr<float> v = GetFloat(j, f.key, where);
    if (!v.ok()) return v.status();
    (c->*f.set)(*v);
  }
  return absl::OkStatus();
}

absl::Status ParseSwa(const json& j, const std::string& where, v1::SwaConfig* c) {
  if (!j.is_object()) return Bad(where, "must be an object");
  if (absl::Status s = CheckAllowedKeys(j, {"q_rank", "head_dim", "eps", "fp8_format", "scale_format", "scale_layout"},
                                        where);
      !s.ok()) {
    return s;
  }
  for (const char* key : {"q_rank", "head_dim"}) {
    if (!j.contains(key)) return Bad(where, absl::StrCat("missing \"", key, "\""));
  }
  absl::StatusOr<int64_t> i;
  if (!(i = GetInt(j, "q_rank", where, 1, std::numeric_limits<int64_t>::max())).ok()) return i.status();
  c->set_q_rank(*i);
  if (!(i = GetInt(j, "head_dim", where, 1, std::numeric_limits<int64_t>::max())).ok()) return i.status();
  c->set_head_dim(*i);
  if (j.contains("eps")) {
    absl::StatusOr<float> v = GetFloat(j, "eps", where);
    if (!v.ok()) return v.status();
    c->set_eps(*v);
  }
  absl::StatusOr<std::string> s;
  if (j.contains("fp8_format")) {
    if (!(s = GetString(j, "fp8_format", where)).ok()) return s.status();
    if (*s == "e4m3fn") c->set_fp8_format(v1::FP8_FORMAT_E4M3FN);
    else if (*s == "e4m3fnuz") c->set_fp8_format(v1::FP8_FORMAT_E4M3FNUZ);
    else return Bad(where, absl::StrCat("fp8_format ", Quote(*s), " is not \"e4m3fn\" or \"e4m3fnuz\""));
  }
  if (j.contains("scale_format")) {
    if (!(s = GetString(j, "scale_format", where)).ok()) return s.status();
    if (*s == "fp32") c->set_scale_format(v1::SCALE_FORMAT_FP32);
    else if (*s == "ue8m0") c->set_scale_format(v1::SCALE_FORMAT_UE8M0);
    else return Bad(where, absl::StrCat("scale_format ", Quote(*s), " is not \"fp32\" or \"ue8m0\""));
  }
  if (j.contains("scale_layout")) {
    if (!(s = GetString(j, "scale_layout", where)).ok()) return s.status();
    if (*s == "row_major") c->set_scale_layout(v1::SCALE_LAYOUT_ROW_MAJOR);
    else if (*s == "column_major_tma") c->set_scale_layout(v1::SCALE_LAYOUT_COLUMN_MAJOR_TMA);
    else return Bad(where, absl::StrCat("scale_layout ", Quote(*s), " is not \"row_major\" or \"column_major_tma\""));
  }
  return absl::OkStatus();
}

// Files opened while loading one manifest, by resolved path.
class FileCache {
 public:
  absl::StatusOr<const SafetensorsFile*> Get(const std::string& path) {
    auto it = files_.find(path);
    if (it != files_.end()) return it->second.get();
    absl::StatusOr<std::unique_ptr<SafetensorsFile>> f = SafetensorsFile::Open(path);
    if (!f.ok()) return f.status();
    return files_.emplace(path, std::move(*f)).first->second.get();
  }

 private:
  std::map<std::string, std::unique_ptr<SafetensorsFile>> files_;
};

absl::Status Prefixed(const absl::Status& s, const std::string& where) {
  return absl::Status(s.code(), absl::StrCat(where, ": ", s.message()));
}

absl::StatusOr<PackedWeightSet> LoadSet(const json& j, const std::string& manifest_where, const std::string& base_dir,
                                        FileCache& files) {
  if (!j.is_object()) return Bad(manifest_where, "each entry of \"weight_sets\" must be an object");
  if (!j.contains("name") || !j["name"].is_string()) {
    return Bad(manifest_where, "a weight set lacks a string \"name\"");
  }
  const std::string name = j["name"].get<std::string>();
  const std::string where = absl::StrCat(manifest_where, ": weight set ", Quote(name));
  if (absl::Status s = CheckAllowedKeys(j, {"name", "mhc", "swa", "tensors"}, where); !s.ok()) return s;

  PackedWeightSet out;
  v1::WeightSetHeader& header = out.first;
  std::string& payload = out.second;
  header.set_name(name);
  if (j.contains("mhc")) {
    if (absl::Status s = ParseMhc(j["mhc"], absl::StrCat(where, ": mhc"), header.mutable_mhc()); !s.ok()) return s;
  }
  if (j.contains("swa")) {
    if (absl::Status s = ParseSwa(j["swa"], absl::StrCat(where, ": swa"), header.mutable_swa()); !s.ok()) return s;
  }
  if (!j.contains("tensors") || !j["tensors"].is_object()) return Bad(where, "\"tensors\" must be an object");
  const json& tensors = j["tensors"];

  // Known names first in their canonical order, then any others (BuildWeightSet rejects those
  // with the list of known names; packing them keeps that message in one place).
  std::vector<std::string> order;
  for (const char* n : kTensorOrder) {
    if (tensors.contains(n)) order.push_back(n);
  }
  for (const auto& [n, v] : tensors.items()) {
    if (std::find(order.begin(), order.end(), n) == order.end()) order.push_back(n);
  }
  for (const std::string& tname : order) {
    const json& ref = tensors[tname];
    const std::string twhere = absl::StrCat(where, ": tensor ", Quote(tname));
    if (!ref.is_object()) return Bad(twhere, "must be {\"file\": ..., \"tensor\": ...}");
    if (absl::Status s = CheckAllowedKeys(ref, {"file", "tensor"}, twhere); !s.ok()) return s;
    if (!ref.contains("file") || !ref.contains("tensor")) return Bad(twhere, "needs \"file\" and \"tensor\"");
    absl::StatusOr<std::string> file = GetString(ref, "file", twhere);
    if (!file.ok()) return file.status();
    absl::StatusOr<std::string> src_name = GetString(ref, "tensor", twhere);
    if (!src_name.ok()) return src_name.status();
    if (file->empty()) return Bad(twhere, "\"file\" is empty");
    std::filesystem::path path(*file);
    if (path.is_relative()) path = std::filesystem::path(base_dir) / path;

    absl::StatusOr<const SafetensorsFile*> f = files.Get(path.lexically_normal().string());
    if (!f.ok()) return Prefixed(f.status(), twhere);
    absl::StatusOr<const SafetensorsTensorInfo*> info = (*f)->index().Find(*src_name);
    if (!info.ok()) return Prefixed(info.status(), twhere);
    // A tensor whose weight-set dtype is fixed is converted to it when every value converts
    // exactly (dtype_conversion.h); others keep the file's dtype and BuildWeightSet checks it.
    const std::optional<DType> fixed = FixedWeightDType(tname);
    std::optional<DType> dtype = SafetensorsDTypeToDType((*info)->dtype);
    const bool convert = fixed && dtype != fixed;
    if (convert) dtype = fixed;
    if (!dtype) {
      return Bad(twhere, absl::StrCat((*f)->path(), ": tensor ", Quote(*src_name), " has dtype ", (*info)->dtype,
                                      "; weight sets use BF16, F32, F8_E4M3 or F8_E4M3FNUZ (F16 and F8_E8M0 "
                                      "convert exactly where the set keeps F32 or BF16)"));
    }
    payload.append((kPayloadAlignment - payload.size() % kPayloadAlignment) % kPayloadAlignment, '\0');
    v1::TensorEntry* e = header.add_tensors();
    e->set_name(tname);
    e->set_dtype(DTypeToWire(*dtype));
    for (int64_t d : (*info)->shape) e->add_shape(d);
    e->set_offset(payload.size());
    if (!convert) {
      if (absl::Status s = (*f)->AppendTensorBytes(**info, &payload); !s.ok()) return Prefixed(s, twhere);
    } else {
      std::string raw;
      if (absl::Status s = (*f)->AppendTensorBytes(**info, &raw); !s.ok()) return Prefixed(s, twhere);
      absl::StatusOr<std::string> converted = ConvertTensorExactly(
          (*info)->dtype, *dtype, raw, absl::StrCat(twhere, ": ", (*f)->path(), ": tensor ", Quote(*src_name)));
      if (!converted.ok()) return converted.status();
      payload.append(*converted);
    }
  }
  header.set_payload_bytes(payload.size());
  absl::StatusOr<std::string> sha = Sha256Hex(payload);
  if (!sha.ok()) return sha.status();
  header.set_sha256(*sha);
  return out;
}

}  // namespace

struct ManifestReader::Impl {
  json doc;                          // the parsed manifest
  std::string where;                 // "manifest <source>"
  std::string base_dir;
  std::vector<std::string> names;    // of the weight sets, in manifest order
  FileCache files;
};

ManifestReader::ManifestReader(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
ManifestReader::ManifestReader(ManifestReader&&) noexcept = default;
ManifestReader& ManifestReader::operator=(ManifestReader&&) noexcept = default;
ManifestReader::~ManifestReader() = default;

absl::StatusOr<ManifestReader> ManifestReader::FromString(std::string_view json_text, const std::string& base_dir,
                                                          std::string_view source) {
  auto impl = std::make_unique<Impl>();
  impl->where = absl::StrCat("manifest ", AbslView(source));
  impl->base_dir = base_dir;
  const std::string& where = impl->where;
  absl::StatusOr<json> doc = json_internal::ParseStrictJson(json_text, where);
  if (!doc.ok()) return doc.status();
  if (!doc->is_object()) return Bad(where, "must be a JSON object");
  if (absl::Status s = CheckAllowedKeys(*doc, {"weight_sets"}, where); !s.ok()) return s;
  if (!doc->contains("weight_sets") || !(*doc)["weight_sets"].is_array()) {
    return Bad(where, "needs a \"weight_sets\" array");
  }
  std::set<std::string> seen;
  for (const json& j : (*doc)["weight_sets"]) {
    if (!j.is_object()) return Bad(where, "each entry of \"weight_sets\" must be an object");
    if (!j.contains("name") || !j["name"].is_string()) return Bad(where, "a weight set lacks a string \"name\"");
    const std::string name = j["name"].get<std::string>();
    if (!seen.insert(name).second) return Bad(where, absl::StrCat("weight set ", Quote(name), " is defined twice"));
    impl->names.push_back(name);
  }
  impl->doc = *std::move(doc);
  return ManifestReader(std::move(impl));
}

absl::StatusOr<ManifestReader> ManifestReader::Open(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return absl::NotFoundError(absl::StrCat("cannot open manifest ", path));
  std::ostringstream text;
  text << f.rdbuf();
  if (f.bad()) return absl::InternalError(absl::StrCat("cannot read manifest ", path));
  const std::filesystem::path p(path);
  return FromString(text.str(), p.parent_path().string(), path);
}

size_t ManifestReader::size() const { return impl_->names.size(); }

const std::string& ManifestReader::name(size_t i) const { return impl_->names.at(i); }

absl::StatusOr<PackedWeightSet> ManifestReader::Load(size_t i) {
  return LoadSet(impl_->doc["weight_sets"].at(i), impl_->where, impl_->base_dir, impl_->files);
}

namespace {

absl::StatusOr<std::vector<PackedWeightSet>> LoadEverySet(absl::StatusOr<ManifestReader> reader) {
  if (!reader.ok()) return reader.status();
  std::vector<PackedWeightSet> out;
  out.reserve(reader->size());
  for (size_t i = 0; i < reader->size(); ++i) {
    absl::StatusOr<PackedWeightSet> set = reader->Load(i);
    if (!set.ok()) return set.status();
    out.push_back(*std::move(set));
  }
  return out;
}

}  // namespace

absl::StatusOr<std::vector<PackedWeightSet>> LoadManifestFromString(std::string_view json_text,
                                                                    const std::string& base_dir,
                                                                    std::string_view source) {
  return LoadEverySet(ManifestReader::FromString(json_text, base_dir, source));
}

absl::StatusOr<std::vector<PackedWeightSet>> LoadManifest(const std::string& path) {
  return LoadEverySet(ManifestReader::Open(path));
}

}  // namespace fusedlayer::server
