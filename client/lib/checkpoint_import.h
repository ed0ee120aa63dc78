// `fusedctl import-checkpoint`: turns a DeepSeek-V4 / V4.1 checkpoint folder into a weight-set
// manifest (docs/weights.md) with one weight set per mHC seam, so a whole model loads with
// `fusedctl load` or `--weights_manifest` instead of ~120 hand-written entries.
//
// Reads DIR/config.json (hyper-parameters) and DIR/model.safetensors.index.json (which shard holds
// which tensor), opens only the headers of the shards it needs (to check every tensor is there
// with the shape the config implies), and writes:
//   L{i}/attn  mHC part: the attention sublayer's hc_attn_{fn,base,scale} + its input norm weight;
//              SWA part: q norm, kv norm and (when the checkpoint's block-scaled FP8 layout is the
//              one the service implements) wq_b with its block scales
//   L{i}/ffn   mHC part: hc_ffn_{fn,base,scale} + the FFN norm weight
//   head       the final norm weight, with hc_head's parameters where the model has them (below)
// Both tensor-name dialects are accepted (checkpoint_import.cc lists them with their sources):
// DeepSeek's own inference code (`layers.{i}.hc_attn_fn`, `layers.{i}.attn.q_norm.weight`, ...)
// and the Hugging Face transformers conversion (`model.layers.{i}.attn_hc.fn`,
// `model.layers.{i}.self_attn.q_a_norm.weight`, ...).
//
// The manifest names checkpoint tensors in place (relative to the manifest's folder), so loading it
// reads each set's tensors from the shards lazily (server::ManifestReader), converting UE8M0 scales
// and F16 / F32 norm weights exactly as every manifest does (weights/dtype_conversion.h).
// The one exception is `head`: the weight-set table needs mhc.fn [n(n+2), nC], mhc.scale [3] and
// mhc.base [n(n+2)], which no checkpoint stores for the head, so the importer writes those three
// into a small safetensors file beside the manifest (OUTPUT with ".head.safetensors" for ".json"):
//   - V4 (hc_head_fn [n, nC], hc_head_scale [1], hc_head_base [n] present): their values in the
//     pre rows (0..n-1) and α_pre, zeros elsewhere. A normal-mode seam with this set then computes
//     exactly V4's head, h = RMSNorm_g(Collapse(R', σ(α·r·(R'·hc_head_fn) + b) + hc_eps)).
//   - V4.1 (no hc_head: the head collapses with the carried pre_mix, spec/mhc.md "head"): zeros,
//     which the head stage never reads (it computes no mixes).
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace fusedlayer::client {

struct LayerRange {
  int first = 0;
  int last = 0;  // inclusive
};

// --layers: "A-B" (inclusive) or "A"; non-negative, A <= B. InvalidArgument otherwise.
absl::StatusOr<LayerRange> ParseLayerRange(std::string_view s);

struct CheckpointImportOptions {
  std::string checkpoint_dir;
  std::string output_path = "manifest.json";
  std::optional<LayerRange> layers;  // absent: every layer; the head set only when the last layer is in
  // Set names become PREFIX/L0/attn, ..., PREFIX/head (empty: L0/attn, ...), so two models can share a
  // server. Characters of a set name only ([A-Za-z0-9._/-]), no leading or trailing '/'.
  std::string prefix;
};

struct CheckpointImportResult {
  std::string manifest_path;
  std::string head_tensors_path;        // empty when no head set was written
  std::string dialect;                  // "deepseek" | "huggingface"
  std::vector<std::string> set_names;   // in manifest order
  std::vector<std::string> notes;       // one line each: what was left out and why
};

// Writes the manifest (and the head file). Errors name the file, the tensor or the config key:
//   NOT_FOUND         DIR, config.json, the index, a shard, a tensor the seams need, or OUTPUT's folder
//   INVALID_ARGUMENT  malformed JSON, a config key missing or of the wrong type, --layers past the
//                     model, an unknown layout (the first tensor no dialect places), a tensor whose
//                     dtype or shape is not the one the config implies
//   others            writing OUTPUT (PERMISSION_DENIED, ...)
absl::StatusOr<CheckpointImportResult> ImportCheckpoint(const CheckpointImportOptions& options);

}  // namespace fusedlayer::client
