#include "auth/caller_identity.h"

#include "grpcpp/security/auth_context.h"

namespace fusedlayer::server::auth {

std::string CallerIdentity(const grpc::ServerContextBase& ctx) {
  const std::shared_ptr<const grpc::AuthContext> auth = ctx.auth_context();
  if (auth != nullptr) {
    const std::vector<grpc::string_ref> token = auth->FindPropertyValues(kIdentityProperty);
    if (!token.empty()) return std::string(token.front().data(), token.front().size());
    if (auth->IsPeerAuthenticated()) {
      const std::vector<grpc::string_ref> peer = auth->GetPeerIdentity();
      if (!peer.empty()) return "cert:" + std::string(peer.front().data(), peer.front().size());
    }
  }
  return "anonymous";
}

}  // namespace fusedlayer::server::auth
