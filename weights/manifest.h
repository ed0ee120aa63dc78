// Weight-set manifests: a JSON file naming weight sets, their hyper-parameters, and where each of
// their tensors lies in safetensors files. Loading one yields PackedWeightSets (header + payload),
// the same form LoadWeights streams and the demo generator produce; BuildWeightSet then validates
// and prepares them.
//
// Format (docs/weights.md has the full description):
//
//   {"weight_sets": [
//     {"name": "v41-flash/L3/ffn",
//      "mhc": {"hc_mult": 4, "hidden": 5120, "norm_eps": 1e-20,
//              "hc_norm_eps": 1e-20, "hc_pre_eps": 1e-6, "sinkhorn_eps": 1e-6,
//              "post_scale": 2.0, "sinkhorn_iters": 20},
//      "swa": {"q_rank": 1280, "head_dim": 512, "eps": 1e-6, "fp8_format": "e4m3fn",
//              "scale_format": "fp32", "scale_layout": "row_major"},
//      "tensors": {"mhc.fn": {"file": "layer3.safetensors", "tensor": "layers.3.hc_ffn_fn"}, ...}}]}
//
// - "mhc" and "swa" are each optional (at least one is needed, checked by BuildWeightSet); in them
//   hc_mult, hidden, q_rank and head_dim are required, the rest default as in MhcHyperParams /
//   SwaHyperParams (fp8_format "e4m3fn" | "e4m3fnuz", scale_format "fp32" | "ue8m0",
//   scale_layout "row_major" | "column_major_tma").
// - "tensors" maps weight-set tensor names (weight_set.h) to a file and the tensor's name in it.
//   A relative "file" resolves against the manifest's directory.
// - Unknown keys anywhere, duplicate keys, duplicate set names, and values of the wrong JSON type
//   are INVALID_ARGUMENT (a typo must not silently select a default).
// - Tensor dtypes come from the files (BF16, F32, F8_E4M3 = e4m3fn, F8_E4M3FNUZ). A tensor whose
//   weight-set dtype is fixed (weight_set.h) is converted to it from F16 / BF16 / F8_E8M0 / F32 when
//   every value converts exactly (dtype_conversion.h), else INVALID_ARGUMENT naming the element;
//   other dtypes are INVALID_ARGUMENT naming the file and tensor. Shapes (and fp8 dtypes) must be
//   what weight_set.h lists, which BuildWeightSet checks.
// Files are read with SafetensorsFile (each file opened once per manifest), so their errors
// (NOT_FOUND, DATA_LOSS, INVALID_ARGUMENT) come through, prefixed with the manifest and set names.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "weights/weight_set.h"

namespace fusedlayer::server {

// Reads the manifest at `path` and the tensors it names. Each payload holds the set's tensors in
// the order of weight_set.h, each starting at a multiple of 64 bytes (zero padding between);
// header.payload_bytes and header.sha256 are filled. BuildWeightSet's `source` for these sets is,
// by convention, "manifest:" + path.
absl::StatusOr<std::vector<PackedWeightSet>> LoadManifest(const std::string& path);

// A manifest whose weight sets are read one at a time, so a caller that uploads or builds each set
// before the next (fusedctl load, a whole checkpoint's manifest) never holds every payload at once.
// Open checks the document's outline (an object with a "weight_sets" array of objects, each with a
// string "name", no name twice); Load(i) parses set i and reads only its tensors, with exactly the
// checks and messages of LoadManifest (which is Open + Load of every set). Safetensors files are
// opened (header only) the first time a set names them and stay open for the reader's lifetime.
class ManifestReader {
 public:
  static absl::StatusOr<ManifestReader> Open(const std::string& path);
  // From the manifest's text; relative file names resolve against `base_dir`, `source` names the
  // manifest in messages.
  static absl::StatusOr<ManifestReader> FromString(std::string_view json_text, const std::string& base_dir,
                                                   std::string_view source);
  ManifestReader(ManifestReader&&) noexcept;
  ManifestReader& operator=(ManifestReader&&) noexcept;
  ~ManifestReader();

  size_t size() const;
  const std::string& name(size_t i) const;  // i < size()
  // Reads weight set i (i < size()).
  absl::StatusOr<PackedWeightSet> Load(size_t i);

 private:
  struct Impl;
  explicit ManifestReader(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// Same, from the manifest's text; relative file names resolve against `base_dir`, and `source`
// names the manifest in messages.
absl::StatusOr<std::vector<PackedWeightSet>> LoadManifestFromString(std::string_view json_text,
                                                                    const std::string& base_dir,
                                                                    std::string_view source);

}  // namespace fusedlayer::server
