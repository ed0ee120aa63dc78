#include "weights/export.h"

#include <filesystem>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "nlohmann/json.hpp"
#include "weights/packing.h"
#include "weights/safetensors.h"
#include "weights/safetensors_writer.h"

namespace fusedlayer::server {
namespace {

namespace v1 = ::fusedlayer::v1;
using ojson = nlohmann::ordered_json;

ojson MhcJson(const v1::MhcConfig& c) {
  ojson j;
  j["hc_mult"] = c.hc_mult();
  j["hidden"] = c.hidden();
  if (c.has_hc_norm_eps()) j["hc_norm_eps"] = c.hc_norm_eps();
  if (c.has_norm_eps()) j["norm_eps"] = c.norm_eps();
  if (c.has_hc_pre_eps()) j["hc_pre_eps"] = c.hc_pre_eps();
  if (c.has_sinkhorn_eps()) j["sinkhorn_eps"] = c.sinkhorn_eps();
  if (c.has_post_scale()) j["post_scale"] = c.post_scale();
  if (c.has_sinkhorn_iters()) j["sinkhorn_iters"] = c.sinkhorn_iters();
  return j;
}

ojson SwaJson(const v1::SwaConfig& c) {
  ojson j;
  j["q_rank"] = c.q_rank();
  j["head_dim"] = c.head_dim();
  if (c.has_eps()) j["eps"] = c.eps();
  j["fp8_format"] = c.fp8_format() == v1::FP8_FORMAT_E4M3FNUZ ? "e4m3fnuz" : "e4m3fn";
  j["scale_format"] = c.scale_format() == v1::SCALE_FORMAT_UE8M0 ? "ue8m0" : "fp32";
  j["scale_layout"] = c.scale_layout() == v1::SCALE_LAYOUT_COLUMN_MAJOR_TMA ? "column_major_tma" : "row_major";
  return j;
}

}  // namespace

absl::StatusOr<std::string> ExportWeightSets(const std::string& dir, const std::vector<PackedWeightSet>& sets) {
  ojson manifest;
  manifest["weight_sets"] = ojson::array();
  for (const PackedWeightSet& set : sets) {
    const v1::WeightSetHeader& h = set.first;
    const std::string file = absl::StrCat(absl::StrReplaceAll(h.name(), {{"/", "_"}}), ".safetensors");
    std::vector<SafetensorsEntry> entries;
    ojson tensors = ojson::object();
    for (const v1::TensorEntry& e : h.tensors()) {
      absl::StatusOr<std::string_view> bytes = PackedTensorBytes(set, e.name());
      if (!bytes.ok()) {
        return absl::InvalidArgumentError(absl::StrCat("weight set ", h.name(), ": ", bytes.status().message()));
      }
      const std::optional<DType> dtype = DTypeFromWire(e.dtype());  // known: PackedTensorBytes checked it
      entries.push_back({e.name(), DTypeToSafetensorsDType(*dtype), {e.shape().begin(), e.shape().end()},
                         std::string(*bytes)});
      tensors[e.name()] = {{"file", file}, {"tensor", e.name()}};
    }
    if (absl::Status s = WriteSafetensors((std::filesystem::path(dir) / file).string(), entries); !s.ok()) return s;
    ojson j;
    j["name"] = h.name();
    if (h.has_mhc()) j["mhc"] = MhcJson(h.mhc());
    if (h.has_swa()) j["swa"] = SwaJson(h.swa());
    j["tensors"] = std::move(tensors);
    manifest["weight_sets"].push_back(std::move(j));
  }
  const std::string path = (std::filesystem::path(dir) / "manifest.json").string();
  std::string text;
  try {
    text = manifest.dump(2);
  } catch (const nlohmann::json::exception& e) {  // a name that is not valid UTF-8
    return absl::InvalidArgumentError(absl::StrCat("cannot write manifest: ", e.what()));
  }
  std::ofstream f(path, std::ios::trunc);
  f << text << "\n";
  f.close();
  if (!f) return absl::InternalError(absl::StrCat("cannot write ", path));
  return path;
}

}  // namespace fusedlayer::server
