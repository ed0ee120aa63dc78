// A weight set: the immutable, backend-prepared weights of one named model part, with the op
// hyper-parameters. Every source (manifest of safetensors files, a LoadWeights stream, the demo
// generator) produces the same representation, a WeightSetHeader plus a payload byte string, and
// BuildWeightSet turns it into a WeightSet after validating all of it.
//
// Tensor names and shapes (n = hc_mult, C = hidden, M = n(n+2), K = nC; Q = q_rank, D = head_dim):
//   mhc.fn           fp32 [M, K]     required with an mhc part
//   mhc.scale        fp32 [3]        required with an mhc part
//   mhc.base         fp32 [M]        required with an mhc part
//   mhc.norm_weight  bf16 [C]        optional
//   swa.q_norm       bf16 [Q]        required with an swa part
//   swa.kv_norm      bf16 [D]        required with an swa part
//   swa.wq_b         fp8  [N, Q]     optional; fp8 in the set's fp8_format; N a positive multiple of 128
//   swa.wq_b_scale   fp32 [N/128, Q/128]  required with swa.wq_b, forbidden without it
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>
#include <string_view>
#include <utility>

#include "absl/functional/any_invocable.h"
#include "absl/status/statusor.h"
#include "fusedlayer/backend.h"
#include "fusedlayer/v1/fusedlayer.pb.h"

namespace fusedlayer::server {

// Serving bounds on the hyper-parameters (docs/weights.md), on every path that builds a set (RPC
// header, manifest, builder): a loop count or scale the contracts allow but no model needs would
// let one upload stall the executor (warm-up and every call run sinkhorn_iters iterations).
inline constexpr int kMaxSinkhornIters = 1000;  // DeepSeek V4 uses 20
inline constexpr float kMaxEps = 1.0f;          // every eps in [0, 1]; the models use 1e-20 .. 1e-6
inline constexpr float kMaxPostScale = 1000.0f;  // post_scale in (0, 1000]; the models use 2

// The common form of a weight set before it is prepared: header (name, configs, tensor entries with
// payload offsets, payload_bytes, sha256) and the payload the entries point into.
using PackedWeightSet = std::pair<fusedlayer::v1::WeightSetHeader, std::string>;

// Every valid name matches [A-Za-z0-9._/-]{1,128}.
inline constexpr size_t kMaxWeightSetNameLength = 128;
bool IsValidWeightSetName(std::string_view name);

struct WeightSet {
  std::string name;
  std::string source;   // "demo", "manifest:<path>", "rpc"
  std::string sha256;   // of the payload, lower-case hex (always computed)
  // The header as loaded, with `mhc` / `swa` normalised to the effective hyper-parameters (absent
  // optional fields filled with their defaults), sha256 set, and replace cleared.
  fusedlayer::v1::WeightSetHeader header;
  // The set's parts as one device's backend prepared them; a part is null when the set has none.
  struct DeviceParts {
    std::shared_ptr<const PreparedMhcWeights> mhc;
    std::shared_ptr<const PreparedSwaWeights> swa;
  };
  // One entry per device the set is prepared on, in the order of the backends it was built for
  // (a server's serving devices, runtime/serving_devices.h: entry i on the device of ordinal i).
  std::vector<DeviceParts> devices;
  const DeviceParts& on(size_t device) const { return devices[device]; }
  bool has_mhc() const { return !devices.empty() && devices.front().mhc != nullptr; }
  bool has_swa() const { return !devices.empty() && devices.front().swa != nullptr; }
  uint64_t resident_bytes = 0;  // backend memory held by the parts, on all devices together
  // SWA with wq_b: per row n of wq_b, max_k |dequant(wq_b)[n, k]| (from the host payload; the shadow
  // comparator's q_proj bound, server/shadow/compare.h). Empty without wq_b.
  std::vector<float> swa_wq_b_row_abs_max;
  // mhc.norm_weight as bf16 bits [C] (a host copy; empty without one): the shadow comparator's
  // normal-mode y bound scales with |g[c]| (server/shadow/compare.h).
  std::vector<uint16_t> mhc_norm_weight;
};

// Validates `header` + `payload` and prepares the weights on `backend`. Status codes:
//   INVALID_ARGUMENT  bad name; neither mhc nor swa; a hyper-parameter out of range; a tensor
//                     missing, unknown, duplicated, of the wrong dtype or shape, outside the payload
//                     or overlapping another; sha256 not 64 hex digits
//   DATA_LOSS         payload size != header.payload_bytes (a truncated or over-long stream), or
//                     sha256 given and different from the payload's
//   others            from Backend::PrepareMhc / PrepareSwa (e.g. RESOURCE_EXHAUSTED)
// Messages start with the set's name. The payload is only read; tensors at offsets not aligned to
// their element size are copied to aligned memory before they are handed to the backend.
// Backend::Prepare* is called from the calling thread: run this where the backend may be driven
// (the server's device executor). `payload_sha256`, when given, is the payload's SHA-256 (lower-
// case hex) already computed by the caller over exactly `payload` (LoadWeights hashes the chunks
// as they arrive, off the executor); otherwise it is computed here.
absl::StatusOr<std::shared_ptr<const WeightSet>> BuildWeightSet(Backend& backend,
                                                                const fusedlayer::v1::WeightSetHeader& header,
                                                                std::string_view payload, std::string source,
                                                                std::optional<std::string> payload_sha256 = std::nullopt);

// One device a set is prepared on (BuildWeightSetOn).
struct PrepareTarget {
  Backend* backend = nullptr;
  // Runs the device's Prepare* calls where its backend may be driven (a server: the device's
  // executor) and returns their status; null: on the calling thread.
  std::function<absl::Status(absl::AnyInvocable<absl::Status() &&>)> run;
  // Takes each prepared part (type-erased) and returns what owns it from then on, so that its
  // memory is freed where the backend may be driven; null: the part as it is.
  std::function<std::shared_ptr<const void>(std::shared_ptr<const void>)> hold;
};
// BuildWeightSet on several devices: validated once, prepared on each target in order (the first
// failure is the result, naming the device's backend, and nothing of the set is kept).
absl::StatusOr<std::shared_ptr<const WeightSet>> BuildWeightSetOn(const std::vector<PrepareTarget>& targets,
                                                                  const fusedlayer::v1::WeightSetHeader& header,
                                                                  std::string_view payload, std::string source,
                                                                  std::optional<std::string> payload_sha256 = std::nullopt);

// Hyper-parameters of a config message, with defaults for absent optional fields (not validated).
MhcHyperParams MhcParamsFromProto(const fusedlayer::v1::MhcConfig& config);
SwaHyperParams SwaParamsFromProto(const fusedlayer::v1::SwaConfig& config, int64_t wq_b_rows);

// The wire description of a loaded set, including whether each op's fused path is available for
// it on `backend` (asked for a one-token shifted seam / a one-token SWA call, i.e. the shape
// independent part of the answer), with the parts prepared on it (`device`: the set's entry).
fusedlayer::v1::WeightSetInfo ToInfo(const WeightSet& set, const Backend& backend, size_t device = 0);

// The proto enum value of a library fallback reason (names match one to one; shared with the
// dispatcher's ExecutionReport).
fusedlayer::v1::FallbackReason ProtoFallbackReason(FallbackReason reason);

}  // namespace fusedlayer::server
