// The identity a call acts as, for what belongs to an identity (shared-memory regions,
// server/transport/shared_memory.h):
//   - a bearer token (--auth_tokens_file): "token:" + the first 16 hex digits of the token's SHA-256
//     (set by TokenAuthProcessor as the AuthContext property "fusedlayer.identity"; the token itself
//     is never kept or shown);
//   - else a verified TLS client certificate (mutual TLS): "cert:" + its peer identity (the
//     subject alternative name, else the common name, as gRPC reports it);
//   - else "anonymous": with no authentication configured every caller is the one anonymous
//     identity (docs/security.md), so same-host clients that share a plaintext server share regions'
//     namespace and limits.
#pragma once

#include <string>

#include "grpcpp/server_context.h"

namespace fusedlayer::server::auth {

inline constexpr char kIdentityProperty[] = "fusedlayer.identity";

std::string CallerIdentity(const grpc::ServerContextBase& ctx);

}  // namespace fusedlayer::server::auth
