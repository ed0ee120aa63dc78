// Strict JSON parsing shared by the safetensors header and the manifest parsers (internal to
// fusedlayer_weights: this header exposes nlohmann::json, which is a private dependency).
//
// nlohmann::json silently keeps the last of duplicate object keys; in a weight file that would make
// a tensor name mean two things, so duplicates are an error here. Parsing never throws.
#pragma once

#include <initializer_list>
#include <optional>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"

namespace fusedlayer::server::json_internal {

// Nesting deeper than this is rejected: no valid safetensors header or manifest comes close, and a
// bound keeps hostile input from building huge nested documents.
inline constexpr int kMaxJsonDepth = 32;

// Parses `text` as one JSON document. InvalidArgument naming `what` on a syntax error (with the
// byte position), a duplicate key, or nesting deeper than kMaxJsonDepth.
absl::StatusOr<nlohmann::json> ParseStrictJson(std::string_view text, std::string_view what);

// InvalidArgument naming `where` and the key when `obj` has a key not in `allowed`.
absl::Status CheckAllowedKeys(const nlohmann::json& obj, std::initializer_list<std::string_view> allowed,
                              std::string_view where);

// A JSON value as an exact integer: an integer literal (not 1.0, not true). nullopt otherwise or
// when out of int64 range.
std::optional<int64_t> AsInt64(const nlohmann::json& v);

// Printable form of a user-supplied string for error messages (C-escaped, truncated).
std::string Quote(std::string_view s);

}  // namespace fusedlayer::server::json_internal
