// Server transport security: builds the grpc::ServerCredentials for the listening port from
// --tls_cert / --tls_key / --tls_client_ca / --auth_tokens_file, and refuses the combinations that
// would expose secrets (tokens in clear text on a network interface).
//
//   TLS flags | tokens | credentials
//   ----------+--------+------------------------------------------------------------------------
//   none      | none   | InsecureServerCredentials (one WARNING line: anyone who reaches the port
//             |        | may call every RPC, LoadWeights and UnloadWeightSet included)
//   none      | yes    | LocalServerCredentials(LOCAL_TCP) (UDS for unix: addresses): loopback
//             |        | only; a non-loopback --address is a startup error
//   cert+key  | any    | SslServerCredentials (TLS); with --tls_client_ca the client must present a
//             |        | certificate signed by that CA (GRPC_SSL_REQUEST_AND_REQUIRE_..._AND_VERIFY)
//   cert+key  | none   | (and no --auth_identities_file) refused at startup (anyone who completes the handshake could call every
//             |        | RPC) unless --allow_unauthenticated_tls, then one WARNING line
// --auth_identities_file (client certificates' SPIFFE IDs / subjects and their rights) needs
// mutual TLS; with it, with tokens, or with both, the TokenAuthProcessor is attached (a call's
// rights are the union of its certificate's and its token's). It must never be attached to insecure
// credentials: gRPC 1.51 aborts the process there (GPR_ASSERT), which is why plaintext with tokens
// goes through local credentials.
#pragma once

#include <memory>
#include <string>
#include "absl/strings/string_view.h"

#include "absl/status/statusor.h"
#include "config.h"
#include "grpcpp/security/server_credentials.h"

namespace fusedlayer::server::auth {

struct ServerSecurity {
  std::shared_ptr<grpc::ServerCredentials> credentials;
  std::string description;  // one line for the startup log, e.g. "mutual TLS + bearer tokens (3)"
  bool plaintext_open = false;  // no TLS and no tokens: main logs a WARNING
  // TLS without tokens, accepted by --allow_unauthenticated_tls: a WARNING at startup.
  bool unauthenticated_tls = false;
};

// Reads and checks the PEM files and the token file. InvalidArgument naming the flag on any problem
// (missing half of a pair, unreadable file, PEM that does not parse, key not matching the
// certificate, bad token file, tokens without TLS on a non-loopback address).
absl::StatusOr<ServerSecurity> MakeServerSecurity(const ServerConfig& config);

// True for a host:port whose host is a loopback address (127.0.0.0/8, ::1, localhost) and for
// unix: / unix-abstract: addresses; false for wildcard (0.0.0.0, [::]) and every other host.
bool IsLocalOnlyAddress(absl::string_view address);

}  // namespace fusedlayer::server::auth
