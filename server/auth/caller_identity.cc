#include "auth/caller_identity.h"

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/string_view.h"
#include "auth/token_file.h"
#include "grpcpp/security/auth_context.h"

namespace fusedlayer::server::auth {

Caller CallerOf(const grpc::ServerContextBase& ctx, bool tokens_configured, const UnixPeerTable* unix_peers) {
  if (tokens_configured) {
    const auto& md = ctx.client_metadata();
    if (auto it = md.find("authorization"); it != md.end()) {
      const absl::string_view value(it->second.data(), it->second.size());
      // The processor accepted exactly this shape ("Bearer " + token, scheme case-insensitive).
      if (value.size() > 7 && absl::EqualsIgnoreCase(value.substr(0, 7), "bearer ")) {
        static constexpr char kHex[] = "0123456789abcdef";
        const TokenDigest digest = DigestToken(value.substr(7));
        std::string identity = "token:";
        for (int i = 0; i < 8; ++i) {
          identity.push_back(kHex[digest[i] >> 4]);
          identity.push_back(kHex[digest[i] & 15]);
        }
        return {identity, std::nullopt};
      }
    }
  }
  const std::shared_ptr<const grpc::AuthContext> auth = ctx.auth_context();
  if (auth != nullptr && auth->IsPeerAuthenticated()) {
    const std::vector<grpc::string_ref> peer = auth->GetPeerIdentity();
    if (!peer.empty()) return {"cert:" + std::string(peer.front().data(), peer.front().size()), std::nullopt};
  }
  if (unix_peers != nullptr) {
    const std::string grpc_peer = ctx.peer();
    if (UnixPeerTable::IsFdPeer(grpc_peer)) {
      std::optional<UnixPeer> peer = unix_peers->Find(grpc_peer);
      return {peer ? UnixPeerIdentity(*peer) : std::string(kUnknownUnixPeer), peer};
    }
  }
  return {"anonymous", std::nullopt};
}

}  // namespace fusedlayer::server::auth
