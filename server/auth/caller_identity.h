// The identity a call acts as, for what belongs to an identity (shared-memory regions,
// server/transport/shared_memory.h):
//   - with bearer tokens configured (--auth_tokens_file): "token:" + the first 16 hex digits of the
//     SHA-256 of the call's token (the TokenAuthProcessor admitted the call, so the token is valid;
//     the token itself is never kept or shown). Read from the call's own metadata: gRPC's
//     AuthContext is per connection, and two tokens can share one connection;
//   - else a verified TLS client certificate (mutual TLS, per connection): "cert:" + its peer
//     identity (subject alternative name, else common name, as gRPC reports it);
//   - else, on a plaintext unix socket the server accepts itself (rpc/plaintext_listener.h), the
//     connecting process's user from the kernel: "uid:" + its user id (auth/unix_peers.h); a call
//     whose connection is no longer known (it closed meanwhile) is "unix-peer:unknown", which owns
//     nothing;
//   - else "anonymous": with no authentication configured every TCP caller is the one anonymous
//     identity (docs/security.md), so same-host clients of a plaintext TCP server share one region
//     namespace and one set of limits.
#pragma once

#include <optional>
#include <string>

#include "auth/unix_peers.h"
#include "grpcpp/server_context.h"

namespace fusedlayer::server::auth {

inline constexpr std::string_view kUnknownUnixPeer = "unix-peer:unknown";

// Who a call is: its identity and, on the server's own unix socket, its peer's credentials (absent
// when the connection is no longer known).
struct Caller {
  std::string identity;
  std::optional<UnixPeer> unix_peer;
};

// `unix_peers`: the server's table of accepted unix-socket connections, null when it has none.
Caller CallerOf(const grpc::ServerContextBase& ctx, bool tokens_configured, const UnixPeerTable* unix_peers);

}  // namespace fusedlayer::server::auth
