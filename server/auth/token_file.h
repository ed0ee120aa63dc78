// Bearer-token file of fusedlayer_server (--auth_tokens_file): parsing and strict validation.
//
// Format, one entry per line:
//
//   # comment (a line whose first non-blank character is '#'); blank lines are ignored
//   <token> <rights>
//
// <token>: 16 to 512 characters of the RFC 6750 token68 alphabet (A-Z a-z 0-9 - . _ ~ + /, then
// optional trailing '='), so it travels unchanged in an `authorization: Bearer <token>` header.
// <rights>: `compute`, `admin` or `compute,admin` (either order, no repeats, no spaces).
// A token may appear only once; a file without any token is an error (an empty file would lock
// every client out, which is never what an operator meant).
//
// Tokens are secrets: parsing keeps only their SHA-256 digests, and no error message ever contains
// a token (errors name the file and the line number).
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include "absl/strings/string_view.h"
#include <vector>

#include "absl/status/statusor.h"

namespace fusedlayer::server::auth {

// Bit set of rights; a method needs exactly one of them (see RightForMethod).
enum Right : uint8_t {
  kRightNone = 0,
  kRightCompute = 1,  // MhcSeam, SwaNormQuant, GetServerInfo, ListWeightSets
  kRightAdmin = 2,    // LoadWeights, CommitWeightSets, UnloadWeightSet
};

using TokenDigest = std::array<uint8_t, 32>;  // SHA-256 of the token bytes

struct TokenEntry {
  TokenDigest digest;
  uint8_t rights = kRightNone;
};

inline constexpr size_t kMinTokenLength = 16;
inline constexpr size_t kMaxTokenLength = 512;

// SHA-256 of `token`.
TokenDigest DigestToken(absl::string_view token);

// Parses file contents; `source` names the file in error messages. InvalidArgument with
// "<source>:<line>: <why>" on the first bad line.
absl::StatusOr<std::vector<TokenEntry>> ParseTokenFile(absl::string_view contents, absl::string_view source);

// Reads and parses `path` (InvalidArgument when it cannot be read, too).
absl::StatusOr<std::vector<TokenEntry>> LoadTokenFile(const std::string& path);

// `compute`, `admin` or `compute,admin` (either order, no repeats, no spaces) as Right bits;
// InvalidArgument naming the bad right otherwise. Shared with the identity file.
absl::StatusOr<uint8_t> ParseRights(absl::string_view field);

// "compute", "admin", "compute,admin", "none".
std::string RightsName(uint8_t rights);

}  // namespace fusedlayer::server::auth
