// Client-certificate identities of fusedlayer_server (--auth_identities_file): under mutual TLS, the
// rights of a caller by the certificate it presented, like the token file's rights by token.
//
// Format, one entry per line:
//
//   # comment (a line whose first non-blank character is '#'); blank lines are ignored
//   <identity> <rights>
//
// <identity>, one of:
//   spiffe://<trust domain>/<path>   the certificate's SPIFFE ID: its one URI subjectAltName, as
//                                    gRPC reports it (AuthContext property peer_spiffe_id; a
//                                    certificate with several URI SANs has none and matches none)
//   subject:<distinguished name>     the certificate's whole subject, as gRPC reports it (property
//                                    x509_subject, RFC 2253 order: `openssl x509 -noout -subject
//                                    -nameopt RFC2253` prints it), e.g. subject:CN=loader,O=Acme Inc
//                                    (the only field that may contain spaces; the rights are the
//                                    line's last field)
// <rights>: `compute`, `admin` or `compute,admin`, as in the token file.
// An identity may appear only once; a file without any identity is an error.
//
// Identities are compared exactly (case-sensitive, no wildcards): a pattern that matched more than
// the operator meant would grant rights silently.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace fusedlayer::server::auth {

struct IdentityEntry {
  enum class Kind : uint8_t { kSpiffeId, kSubject };
  Kind kind = Kind::kSpiffeId;
  std::string value;  // the SPIFFE ID ("spiffe://...") or the subject without the "subject:" prefix
  uint8_t rights = 0;  // Right bits (auth/token_file.h)
};

inline constexpr size_t kMaxIdentityLength = 2048;

// Parses file contents; `source` names the file in error messages. InvalidArgument with
// "<source>:<line>: <why>" on the first bad line.
absl::StatusOr<std::vector<IdentityEntry>> ParseIdentityFile(absl::string_view contents, absl::string_view source);

// Reads and parses `path` (InvalidArgument when it cannot be read, too).
absl::StatusOr<std::vector<IdentityEntry>> LoadIdentityFile(const std::string& path);

}  // namespace fusedlayer::server::auth
