#include "client/lib/checkpoint_import.h"

#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <regex>
#include <set>
#include <sstream>
#include <system_error>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "nlohmann/json.hpp"
#include "weights/dtype_conversion.h"
#include "weights/safetensors.h"
#include "weights/safetensors_writer.h"
#include "weights/strict_json.h"

namespace fusedlayer::client {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using nlohmann::ordered_json;
using server::SafetensorsFile;
using server::SafetensorsTensorInfo;

// ---- tensor-name dialects ---------------------------------------------------------------------
//
// DeepSeek's own inference code (the names of the checkpoints DeepSeek publishes): `layers.{i}.`
// then hc_attn_fn / hc_attn_base / hc_attn_scale, attn_norm.weight, hc_ffn_*, ffn_norm.weight,
// attn.q_norm.weight, attn.kv_norm.weight, attn.wq_b.weight with its block scales attn.wq_b.scale
// (DeepSeek's convert.py renames the HF `weight_scale_inv` to `scale`); top level norm.weight and
// hc_head_fn / hc_head_base / hc_head_scale. Seen in public code that reads DeepSeek-V4 checkpoints
// (name maps from Megatron and to transformers, per-layer loaders reading `{prefix}.scale`).
//
// Hugging Face transformers (models/deepseek_v4/modeling_deepseek_v4.py): `model.layers.{i}.` then
// attn_hc.fn / .base / .scale and ffn_hc.* (DeepseekV4HyperConnection), input_layernorm.weight,
// post_attention_layernorm.weight, self_attn.q_a_norm.weight, self_attn.kv_norm.weight,
// self_attn.q_b_proj.weight; top level model.norm.weight and model.hc_head.hc_fn / hc_base /
// hc_scale (DeepseekV4HyperHead). NOT SETTLED by public code: the block-scale tensor of q_b_proj.
// No public V4 conversion with FP8 weights was found; `weight_scale_inv` is the name transformers'
// fine-grained FP8 format and DeepSeek-V3's HF checkpoints use, so that is what is looked up.
struct Dialect {
  const char* name;
  const char* layer_prefix;  // followed by the layer index and '.'
  const char* hc_attn[3];    // fn, base, scale
  const char* attn_norm;
  const char* hc_ffn[3];
  const char* ffn_norm;
  const char* q_norm;
  const char* kv_norm;
  const char* wq_b;
  const char* wq_b_scale;
  const char* norm;          // top level from here on
  const char* hc_head[3];    // fn, base, scale
};

constexpr Dialect kDeepSeek = {
    "deepseek",
    "layers.",
    {"hc_attn_fn", "hc_attn_base", "hc_attn_scale"},
    "attn_norm.weight",
    {"hc_ffn_fn", "hc_ffn_base", "hc_ffn_scale"},
    "ffn_norm.weight",
    "attn.q_norm.weight",
    "attn.kv_norm.weight",
    "attn.wq_b.weight",
    "attn.wq_b.scale",
    "norm.weight",
    {"hc_head_fn", "hc_head_base", "hc_head_scale"},
};

constexpr Dialect kHuggingFace = {
    "huggingface",
    "model.layers.",
    {"attn_hc.fn", "attn_hc.base", "attn_hc.scale"},
    "input_layernorm.weight",
    {"ffn_hc.fn", "ffn_hc.base", "ffn_hc.scale"},
    "post_attention_layernorm.weight",
    "self_attn.q_a_norm.weight",
    "self_attn.kv_norm.weight",
    "self_attn.q_b_proj.weight",
    "self_attn.q_b_proj.weight_scale_inv",
    "model.norm.weight",
    {"model.hc_head.hc_fn", "model.hc_head.hc_base", "model.hc_head.hc_scale"},
};

// Name prefixes a tensor of either dialect starts with (DeepSeek's top level: embed, head, norm,
// hc_head_*, mtp.* for the multi-token-prediction layers; Hugging Face: model.*, lm_head). A
// tensor outside all of them means the folder holds some other layout.
constexpr const char* kKnownPrefixes[] = {"layers.", "embed.", "head.", "norm.", "hc_head_", "mtp.",
                                          "model.",  "lm_head."};

std::string LayerName(const Dialect& d, int layer, const char* suffix) {
  return absl::StrCat(d.layer_prefix, layer, ".", suffix);
}

std::string ShapeString(const std::vector<int64_t>& shape) { return absl::StrCat("[", absl::StrJoin(shape, ", "), "]"); }

absl::Status Prefixed(const absl::Status& s, const std::string& where) {
  return absl::Status(s.code(), absl::StrCat(where, ": ", s.message()));
}

absl::StatusOr<json> ReadJsonFile(const fs::path& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return absl::NotFoundError(absl::StrCat("cannot open ", path.string()));
  std::ostringstream text;
  text << f.rdbuf();
  if (f.bad()) return absl::InternalError(absl::StrCat("cannot read ", path.string()));
  return server::json_internal::ParseStrictJson(text.str(), path.string());
}

// ---- config.json ------------------------------------------------------------------------------

// The keys of a DeepSeek-V4 / V4.1 config.json the seams need (the same keys in DeepSeek's and in
// transformers' DeepseekV4Config). Every one is required: a default would silently stand in for a
// key spelled differently. The mapping follows vLLM's V4.1 integration (background/mhc-sources.md):
// hc_norm_eps = norm_eps = rms_norm_eps, hc_pre_eps = sinkhorn_eps = hc_eps, sinkhorn_iters =
// hc_sinkhorn_iters; post_scale is 2.0 in both models (hard-coded, not in the config), the
// contract's default; the SWA norms use rms_norm_eps.
struct ModelConfig {
  int64_t hidden = 0, hc_mult = 0, layers = 0, q_rank = 0, head_dim = 0, sinkhorn_iters = 0;
  double rms_norm_eps = 0, hc_eps = 0;
  bool ue8m0_activation_scales = false;   // quantization_config.scale_fmt == "ue8m0"
  std::vector<int64_t> weight_block_size;  // quantization_config.weight_block_size, if given
};

absl::StatusOr<ModelConfig> ParseConfig(const json& j, const std::string& where) {
  if (!j.is_object()) return absl::InvalidArgumentError(absl::StrCat(where, ": must be a JSON object"));
  ModelConfig c;
  auto get_int = [&](const char* key, int64_t* out) -> absl::Status {
    if (!j.contains(key)) return absl::InvalidArgumentError(absl::StrCat(where, ": missing \"", key, "\""));
    const std::optional<int64_t> v = server::json_internal::AsInt64(j[key]);
    if (!v || *v <= 0) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": \"", key, "\" must be a positive integer"));
    }
    *out = *v;
    return absl::OkStatus();
  };
  auto get_number = [&](const char* key, double* out) -> absl::Status {
    if (!j.contains(key)) return absl::InvalidArgumentError(absl::StrCat(where, ": missing \"", key, "\""));
    if (!j[key].is_number()) return absl::InvalidArgumentError(absl::StrCat(where, ": \"", key, "\" must be a number"));
    *out = j[key].get<double>();
    return absl::OkStatus();
  };
  for (auto [key, out] : {std::pair{"hidden_size", &c.hidden}, std::pair{"hc_mult", &c.hc_mult},
                          std::pair{"num_hidden_layers", &c.layers}, std::pair{"q_lora_rank", &c.q_rank},
                          std::pair{"head_dim", &c.head_dim}, std::pair{"hc_sinkhorn_iters", &c.sinkhorn_iters}}) {
    if (absl::Status s = get_int(key, out); !s.ok()) return s;
  }
  for (auto [key, out] : {std::pair{"rms_norm_eps", &c.rms_norm_eps}, std::pair{"hc_eps", &c.hc_eps}}) {
    if (absl::Status s = get_number(key, out); !s.ok()) return s;
  }
  if (j.contains("quantization_config")) {
    const json& q = j["quantization_config"];
    if (!q.is_object()) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": \"quantization_config\" must be an object"));
    }
    if (q.contains("scale_fmt")) {
      if (!q["scale_fmt"].is_string()) {
        return absl::InvalidArgumentError(absl::StrCat(where, ": quantization_config.scale_fmt must be a string"));
      }
      c.ue8m0_activation_scales = q["scale_fmt"].get<std::string>() == "ue8m0";
    }
    if (q.contains("weight_block_size")) {
      const json& b = q["weight_block_size"];
      if (!b.is_array()) {
        return absl::InvalidArgumentError(
            absl::StrCat(where, ": quantization_config.weight_block_size must be an array of integers"));
      }
      for (const json& e : b) {
        const std::optional<int64_t> v = server::json_internal::AsInt64(e);
        if (!v) {
          return absl::InvalidArgumentError(
              absl::StrCat(where, ": quantization_config.weight_block_size must be an array of integers"));
        }
        c.weight_block_size.push_back(*v);
      }
    }
  }
  return c;
}

// ---- the checkpoint's tensors -----------------------------------------------------------------

class Checkpoint {
 public:
  Checkpoint(fs::path dir, std::map<std::string, std::string> weight_map)
      : dir_(std::move(dir)), weight_map_(std::move(weight_map)) {}

  const std::map<std::string, std::string>& weight_map() const { return weight_map_; }
  bool Has(const std::string& name) const { return weight_map_.count(name) > 0; }

  // The shard holding `name` (opened, header only) and the tensor's entry in it. `role` says what
  // the seam needs it for, for the message.
  absl::StatusOr<std::pair<const SafetensorsFile*, const SafetensorsTensorInfo*>> Find(const std::string& name,
                                                                                       const std::string& role) {
    auto it = weight_map_.find(name);
    if (it == weight_map_.end()) {
      return absl::NotFoundError(
          absl::StrCat("tensor \"", name, "\" (", role, ") is not in model.safetensors.index.json"));
    }
    absl::StatusOr<const SafetensorsFile*> file = Shard(it->second);
    if (!file.ok()) return Prefixed(file.status(), absl::StrCat("tensor \"", name, "\" (", role, ")"));
    absl::StatusOr<const SafetensorsTensorInfo*> info = (*file)->index().Find(name);
    if (!info.ok()) {
      return Prefixed(info.status(), absl::StrCat("model.safetensors.index.json places \"", name, "\" in ", it->second));
    }
    return std::pair{*file, *info};
  }

  const fs::path& dir() const { return dir_; }

 private:
  absl::StatusOr<const SafetensorsFile*> Shard(const std::string& shard) {
    auto it = shards_.find(shard);
    if (it != shards_.end()) return it->second.get();
    absl::StatusOr<std::unique_ptr<SafetensorsFile>> f = SafetensorsFile::Open((dir_ / shard).string());
    if (!f.ok()) return f.status();
    return shards_.emplace(shard, *std::move(f)).first->second.get();
  }

  fs::path dir_;
  std::map<std::string, std::string> weight_map_;
  std::map<std::string, std::unique_ptr<SafetensorsFile>> shards_;
};

// The dialect whose layer-`layer` mHC tensor is in the index, or an error naming the first tensor
// no dialect places.
absl::StatusOr<const Dialect*> DetectDialect(const Checkpoint& ckpt, int layer) {
  const bool deepseek = ckpt.Has(LayerName(kDeepSeek, layer, kDeepSeek.hc_attn[0]));
  const bool hf = ckpt.Has(LayerName(kHuggingFace, layer, kHuggingFace.hc_attn[0]));
  if (deepseek && hf) {
    return absl::InvalidArgumentError(absl::StrCat(
        "model.safetensors.index.json mixes both dialects: it has \"", LayerName(kDeepSeek, layer, kDeepSeek.hc_attn[0]),
        "\" and \"", LayerName(kHuggingFace, layer, kHuggingFace.hc_attn[0]), "\""));
  }
  if (deepseek) return &kDeepSeek;
  if (hf) return &kHuggingFace;
  for (const auto& [name, shard] : ckpt.weight_map()) {
    bool known = false;
    for (const char* p : kKnownPrefixes) known = known || name.rfind(p, 0) == 0;
    if (!known) {
      return absl::InvalidArgumentError(absl::StrCat(
          "unknown checkpoint layout: cannot place tensor \"", name, "\" (in ", shard,
          "); the importer reads DeepSeek's names (layers.{i}.hc_attn_fn, ...) and Hugging Face's "
          "(model.layers.{i}.attn_hc.fn, ...)"));
    }
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown checkpoint layout: model.safetensors.index.json has neither \"",
      LayerName(kDeepSeek, layer, kDeepSeek.hc_attn[0]), "\" nor \"",
      LayerName(kHuggingFace, layer, kHuggingFace.hc_attn[0]),
      "\" (a DeepSeek-V4 / V4.1 checkpoint has one of them for every layer)"));
}

// Every tensor name the importer knows in dialect `d` for a model of `layers` layers: what it reads,
// whether or not this import reads it (--layers).
std::set<std::string> RecognisedNames(const Dialect& d, int64_t layers) {
  std::set<std::string> out = {d.norm, d.hc_head[0], d.hc_head[1], d.hc_head[2]};
  for (int layer = 0; layer < layers; ++layer) {
    for (const char* t : {d.hc_attn[0], d.hc_attn[1], d.hc_attn[2], d.attn_norm, d.hc_ffn[0], d.hc_ffn[1], d.hc_ffn[2],
                          d.ffn_norm, d.q_norm, d.kv_norm, d.wq_b, d.wq_b_scale}) {
      out.insert(LayerName(d, layer, t));
    }
  }
  return out;
}

// A name that looks like an mHC parameter (hc_head / hc_attn / hc_ffn in DeepSeek's spelling,
// attn_hc / ffn_hc in transformers') or an SWA norm (a q / kv norm directly in a layer's attention).
bool LooksLikeSeamParameter(const std::string& name) {
  for (const char* marker : {"hc_head", "hc_attn", "hc_ffn", "attn_hc", "ffn_hc"}) {
    if (name.find(marker) != std::string::npos) return true;
  }
  static const std::regex swa_norm(R"(^(model\.)?layers\.[0-9]+\.(self_)?attn\.[A-Za-z_]*(q|kv)[A-Za-z_]*norm[A-Za-z_]*\.[A-Za-z_]+$)");
  return std::regex_match(name, swa_norm);
}

// INVALID_ARGUMENT naming the tensors that look like mHC / SWA parameters but that the dialect does
// not place (another spelling of hc_head, a renamed norm, ...): importing without them would
// silently serve zeros or fail later. The multi-token-prediction layers (mtp.*) are not imported.
absl::Status RejectUnrecognisedSeamTensors(const Checkpoint& ckpt, const Dialect& d, int64_t layers) {
  const std::set<std::string> known = RecognisedNames(d, layers);
  std::vector<std::string> unknown;
  for (const auto& [name, shard] : ckpt.weight_map()) {
    if (name.rfind("mtp.", 0) == 0 || known.count(name) || !LooksLikeSeamParameter(name)) continue;
    unknown.push_back(absl::StrCat("\"", name, "\""));
  }
  if (unknown.empty()) return absl::OkStatus();
  const size_t total = unknown.size();
  if (unknown.size() > 8) unknown.resize(8);
  return absl::InvalidArgumentError(absl::StrCat(
      "model.safetensors.index.json has ", total, " tensor(s) that look like mHC / SWA parameters but are not in the ",
      d.name, " names the importer reads: ", absl::StrJoin(unknown, ", "), total > 8 ? ", ..." : "",
      " (a spelling of another layout? docs/weights.md lists the names read)"));
}

absl::StatusOr<std::string> SetName(const std::string& prefix, const std::string& name) {
  if (prefix.empty()) return name;
  const bool chars_ok = prefix.find_first_not_of(
      "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._/-") == std::string::npos;
  if (!chars_ok || prefix.front() == '/' || prefix.back() == '/') {
    return absl::InvalidArgumentError(absl::StrCat("--prefix=", prefix, ": set names take [A-Za-z0-9._/-] only, "
                                                   "and the prefix must not start or end with '/'"));
  }
  return absl::StrCat(prefix, "/", name);
}

// A manifest tensor reference, its path relative to the manifest's folder.
struct TensorRef {
  std::string file;
  std::string tensor;
};

class ManifestBuilder {
 public:
  ManifestBuilder(Checkpoint& ckpt, const fs::path& manifest_dir) : ckpt_(ckpt), manifest_dir_(manifest_dir) {}

  // `name` from the checkpoint, with `shape` (empty = not checked here), as weight-set tensor
  // `set_tensor` of `set`.
  absl::Status Add(ordered_json& tensors, const char* set_tensor, const std::string& name,
                   const std::vector<int64_t>& shape, const std::string& role) {
    auto found = ckpt_.Find(name, role);
    if (!found.ok()) return found.status();
    const SafetensorsTensorInfo& info = *found->second;
    if (!shape.empty() && info.shape != shape) {
      return absl::InvalidArgumentError(absl::StrCat("tensor \"", name, "\" (", role, ") has shape ",
                                                     ShapeString(info.shape), "; config.json implies ",
                                                     ShapeString(shape)));
    }
    tensors[set_tensor] = {{"file", RelativeFile(found->first->path())}, {"tensor", name}};
    return absl::OkStatus();
  }

  std::string RelativeFile(const std::string& path) const {
    std::error_code ec;
    const fs::path abs = fs::absolute(path, ec);
    const fs::path rel = ec ? fs::path() : abs.lexically_relative(manifest_dir_);
    return rel.empty() ? abs.string() : rel.string();
  }

 private:
  Checkpoint& ckpt_;
  fs::path manifest_dir_;
};

ordered_json MhcConfig(const ModelConfig& c) {
  return {{"hc_mult", c.hc_mult},          {"hidden", c.hidden},          {"hc_norm_eps", c.rms_norm_eps},
          {"norm_eps", c.rms_norm_eps},    {"hc_pre_eps", c.hc_eps},      {"sinkhorn_eps", c.hc_eps},
          {"sinkhorn_iters", c.sinkhorn_iters}};
}

// The fp32 values of a small checkpoint tensor (hc_head_*), converted exactly.
absl::StatusOr<std::string> ReadF32(Checkpoint& ckpt, const std::string& name, const std::vector<int64_t>& shape,
                                    const std::string& role) {
  auto found = ckpt.Find(name, role);
  if (!found.ok()) return found.status();
  const SafetensorsTensorInfo& info = *found->second;
  if (info.shape != shape) {
    return absl::InvalidArgumentError(absl::StrCat("tensor \"", name, "\" (", role, ") has shape ",
                                                   ShapeString(info.shape), "; config.json implies ",
                                                   ShapeString(shape)));
  }
  std::string raw;
  if (absl::Status s = found->first->AppendTensorBytes(info, &raw); !s.ok()) {
    return Prefixed(s, absl::StrCat("tensor \"", name, "\""));
  }
  return server::ConvertTensorExactly(info.dtype, DType::kFP32, raw,
                                      absl::StrCat(found->first->path(), ": tensor \"", name, "\""));
}

absl::Status WriteTextFile(const fs::path& path, const std::string& text) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  if (!f) {
    return absl::PermissionDeniedError(absl::StrCat("cannot write ", path.string(), ": ", std::strerror(errno)));
  }
  f << text;
  f.close();
  if (!f) return absl::InternalError(absl::StrCat("writing ", path.string(), " failed"));
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<LayerRange> ParseLayerRange(std::string_view s) {
  const std::string text(s);
  const absl::Status bad =
      absl::InvalidArgumentError(absl::StrCat("--layers=", text, ": expected A-B (0 <= A <= B) or A, decimal"));
  // Digits only: SimpleAtoi would also take "+3" and " 3".
  auto parse = [](const std::string& t, int* out) {
    return !t.empty() && t.size() <= 9 && t.find_first_not_of("0123456789") == std::string::npos &&
           absl::SimpleAtoi(t, out);
  };
  LayerRange r;
  const size_t dash = text.find('-');
  if (dash == std::string::npos) {
    if (!parse(text, &r.first)) return bad;
    r.last = r.first;
  } else if (!parse(text.substr(0, dash), &r.first) || !parse(text.substr(dash + 1), &r.last) || r.last < r.first) {
    return bad;
  }
  return r;
}

absl::StatusOr<CheckpointImportResult> ImportCheckpoint(const CheckpointImportOptions& options) {
  const fs::path dir(options.checkpoint_dir);
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) {
    return absl::NotFoundError(absl::StrCat("checkpoint folder ", dir.string(), " does not exist or is not a folder"));
  }
  const fs::path config_path = dir / "config.json";
  absl::StatusOr<json> config_json = ReadJsonFile(config_path);
  if (!config_json.ok()) return config_json.status();
  absl::StatusOr<ModelConfig> config = ParseConfig(*config_json, config_path.string());
  if (!config.ok()) return config.status();
  const ModelConfig& c = *config;

  const fs::path index_path = dir / "model.safetensors.index.json";
  absl::StatusOr<json> index = ReadJsonFile(index_path);
  if (!index.ok()) return index.status();
  if (!index->is_object() || !index->contains("weight_map") || !(*index)["weight_map"].is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(index_path.string(), ": needs a \"weight_map\" object"));
  }
  std::map<std::string, std::string> weight_map;
  for (const auto& [name, shard] : (*index)["weight_map"].items()) {
    if (!shard.is_string()) {
      return absl::InvalidArgumentError(
          absl::StrCat(index_path.string(), ": weight_map[\"", name, "\"] must be a shard file name"));
    }
    weight_map[name] = shard.get<std::string>();
  }
  Checkpoint ckpt(dir, std::move(weight_map));

  LayerRange range{0, static_cast<int>(c.layers - 1)};
  if (options.layers) {
    if (options.layers->last >= c.layers) {
      return absl::InvalidArgumentError(absl::StrCat("--layers=", options.layers->first, "-", options.layers->last,
                                                     ": the model has ", c.layers, " layers (0-", c.layers - 1, ")"));
    }
    range = *options.layers;
  }
  absl::StatusOr<const Dialect*> dialect = DetectDialect(ckpt, range.first);
  if (!dialect.ok()) return dialect.status();
  const Dialect& d = **dialect;
  if (absl::Status s = RejectUnrecognisedSeamTensors(ckpt, d, c.layers); !s.ok()) return s;
  if (absl::StatusOr<std::string> p = SetName(options.prefix, "head"); !p.ok()) return p.status();
  auto set_name = [&](const std::string& name) { return *SetName(options.prefix, name); };

  const int64_t n = c.hc_mult, C = c.hidden, M = n * (n + 2), K = n * C, Q = c.q_rank, D = c.head_dim;
  CheckpointImportResult result;
  result.dialect = d.name;
  const fs::path manifest_path = fs::absolute(options.output_path, ec);
  if (ec) return absl::InvalidArgumentError(absl::StrCat("--output=", options.output_path, ": ", ec.message()));
  result.manifest_path = manifest_path.string();
  if (!fs::is_directory(manifest_path.parent_path(), ec)) {
    return absl::NotFoundError(absl::StrCat("--output=", options.output_path, ": folder ",
                                            manifest_path.parent_path().string(), " does not exist"));
  }
  ManifestBuilder builder(ckpt, manifest_path.parent_path());

  // The service's wq_b is block-scaled FP8 with 128x128 blocks (spec/swa.md); other layouts (V4.1's
  // MXFP8 per the vLLM ROCm docstring, a bf16 checkpoint) import without it, said in a note.
  const bool blocks_128 =
      c.weight_block_size.empty() || c.weight_block_size == std::vector<int64_t>{128, 128};
  bool wq_b_note_given = false;

  ordered_json sets = ordered_json::array();
  for (int layer = range.first; layer <= range.last; ++layer) {
    const std::string attn_name = set_name(absl::StrCat("L", layer, "/attn"));
    ordered_json attn = {{"name", attn_name}, {"mhc", MhcConfig(c)}};
    ordered_json swa = {{"q_rank", Q}, {"head_dim", D}, {"eps", c.rms_norm_eps}};
    if (c.ue8m0_activation_scales) swa["scale_format"] = "ue8m0";
    ordered_json tensors = ordered_json::object();
    const std::string role = absl::StrCat("layer ", layer, " attention seam");
    if (absl::Status s = builder.Add(tensors, "mhc.fn", LayerName(d, layer, d.hc_attn[0]), {M, K}, role); !s.ok()) return s;
    if (absl::Status s = builder.Add(tensors, "mhc.scale", LayerName(d, layer, d.hc_attn[2]), {3}, role); !s.ok()) return s;
    if (absl::Status s = builder.Add(tensors, "mhc.base", LayerName(d, layer, d.hc_attn[1]), {M}, role); !s.ok()) return s;
    if (absl::Status s = builder.Add(tensors, "mhc.norm_weight", LayerName(d, layer, d.attn_norm), {C}, role); !s.ok()) return s;
    if (absl::Status s = builder.Add(tensors, "swa.q_norm", LayerName(d, layer, d.q_norm), {Q}, role); !s.ok()) return s;
    if (absl::Status s = builder.Add(tensors, "swa.kv_norm", LayerName(d, layer, d.kv_norm), {D}, role); !s.ok()) return s;
    const std::string wq_b = LayerName(d, layer, d.wq_b);
    if (ckpt.Has(wq_b)) {
      auto w = ckpt.Find(wq_b, role);
      if (!w.ok()) return w.status();
      const SafetensorsTensorInfo& wi = *w->second;
      std::string skip;
      if (wi.dtype != "F8_E4M3" && wi.dtype != "F8_E4M3FNUZ") {
        skip = absl::StrCat("dtype ", wi.dtype, ", the service's wq_b is FP8");
      } else if (!blocks_128) {
        skip = absl::StrCat("weight_block_size [", absl::StrJoin(c.weight_block_size, ", "),
                            "], the service's wq_b has 128x128 blocks");
      } else if (wi.shape.size() != 2 || wi.shape[1] != Q || wi.shape[0] <= 0 || wi.shape[0] % 128 != 0) {
        return absl::InvalidArgumentError(absl::StrCat("tensor \"", wq_b, "\" (", role, ") has shape ",
                                                       ShapeString(wi.shape), "; expected [N, ", Q,
                                                       "] with N a positive multiple of 128"));
      }
      if (skip.empty()) {
        if (wi.dtype == "F8_E4M3FNUZ") swa["fp8_format"] = "e4m3fnuz";
        if (absl::Status s = builder.Add(tensors, "swa.wq_b", wq_b, {}, role); !s.ok()) return s;
        if (absl::Status s = builder.Add(tensors, "swa.wq_b_scale", LayerName(d, layer, d.wq_b_scale),
                                         {wi.shape[0] / 128, Q / 128}, role);
            !s.ok()) {
          return s;
        }
      } else if (!wq_b_note_given) {
        result.notes.push_back(absl::StrCat("wq_b left out of the L{i}/attn sets (", skip, "): \"", wq_b, "\""));
        wq_b_note_given = true;
      }
    } else if (!wq_b_note_given) {
      result.notes.push_back(absl::StrCat("no \"", wq_b, "\" in the index: the L{i}/attn sets have no wq_b"));
      wq_b_note_given = true;
    }
    attn["swa"] = std::move(swa);
    attn["tensors"] = std::move(tensors);
    sets.push_back(std::move(attn));
    result.set_names.push_back(attn_name);

    const std::string ffn_name = set_name(absl::StrCat("L", layer, "/ffn"));
    ordered_json ffn_tensors = ordered_json::object();
    const std::string ffn_role = absl::StrCat("layer ", layer, " FFN seam");
    if (absl::Status s = builder.Add(ffn_tensors, "mhc.fn", LayerName(d, layer, d.hc_ffn[0]), {M, K}, ffn_role); !s.ok()) return s;
    if (absl::Status s = builder.Add(ffn_tensors, "mhc.scale", LayerName(d, layer, d.hc_ffn[2]), {3}, ffn_role); !s.ok()) return s;
    if (absl::Status s = builder.Add(ffn_tensors, "mhc.base", LayerName(d, layer, d.hc_ffn[1]), {M}, ffn_role); !s.ok()) return s;
    if (absl::Status s = builder.Add(ffn_tensors, "mhc.norm_weight", LayerName(d, layer, d.ffn_norm), {C}, ffn_role); !s.ok()) return s;
    sets.push_back({{"name", ffn_name}, {"mhc", MhcConfig(c)}, {"tensors", std::move(ffn_tensors)}});
    result.set_names.push_back(ffn_name);
  }

  if (range.last == c.layers - 1) {
    // head (checkpoint_import.h): θ in a file of our own, the final norm from the checkpoint.
    const std::string role = "head";
    int present = 0;
    for (const char* t : d.hc_head) present += ckpt.Has(t) ? 1 : 0;
    if (present != 0 && present != 3) {
      for (const char* t : d.hc_head) {
        if (!ckpt.Has(t)) {
          return absl::NotFoundError(absl::StrCat("tensor \"", t, "\" (head) is not in model.safetensors.index.json, "
                                                  "though the other hc_head tensors are"));
        }
      }
    }
    std::vector<float> fn(size_t(M * K), 0.0f), scale(3, 0.0f), base(size_t(M), 0.0f);
    if (present == 3) {
      absl::StatusOr<std::string> head_fn = ReadF32(ckpt, d.hc_head[0], {n, K}, role);
      if (!head_fn.ok()) return head_fn.status();
      absl::StatusOr<std::string> head_base = ReadF32(ckpt, d.hc_head[1], {n}, role);
      if (!head_base.ok()) return head_base.status();
      absl::StatusOr<std::string> head_scale = ReadF32(ckpt, d.hc_head[2], {1}, role);
      if (!head_scale.ok()) return head_scale.status();
      std::memcpy(fn.data(), head_fn->data(), head_fn->size());        // pre rows 0..n-1
      std::memcpy(base.data(), head_base->data(), head_base->size());  // pre bases
      std::memcpy(scale.data(), head_scale->data(), 4);                // α_pre
    } else {
      result.notes.push_back(
          "no hc_head tensors (V4.1): the head set's mixes parameters are zeros, unused by the head stage");
    }
    auto bytes = [](const std::vector<float>& v) {
      return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(float));
    };
    fs::path head_path = manifest_path;
    head_path.replace_extension(".head.safetensors");
    if (absl::Status s = server::WriteSafetensors(
            head_path.string(),
            {{"head.fn", "F32", {M, K}, bytes(fn)}, {"head.scale", "F32", {3}, bytes(scale)}, {"head.base", "F32", {M}, bytes(base)}},
            {{"producer", "fusedctl import-checkpoint"},
             {"source", present == 3 ? "hc_head_fn/hc_head_scale/hc_head_base in the pre rows, zeros elsewhere"
                                     : "zeros (the model has no hc_head)"}});
        !s.ok()) {
      return s;
    }
    result.head_tensors_path = head_path.string();
    const std::string head_file = builder.RelativeFile(head_path.string());
    ordered_json tensors = {{"mhc.fn", {{"file", head_file}, {"tensor", "head.fn"}}},
                            {"mhc.scale", {{"file", head_file}, {"tensor", "head.scale"}}},
                            {"mhc.base", {{"file", head_file}, {"tensor", "head.base"}}}};
    if (absl::Status s = builder.Add(tensors, "mhc.norm_weight", d.norm, {C}, role); !s.ok()) return s;
    sets.push_back({{"name", set_name("head")}, {"mhc", MhcConfig(c)}, {"tensors", std::move(tensors)}});
    result.set_names.push_back(set_name("head"));
  } else {
    result.notes.push_back(absl::StrCat("no head set: --layers stops before the last layer (", c.layers - 1, ")"));
  }

  ordered_json manifest = {{"weight_sets", std::move(sets)}};
  if (absl::Status s = WriteTextFile(manifest_path, manifest.dump(2) + "\n"); !s.ok()) return s;
  return result;
}

}  // namespace fusedlayer::client
