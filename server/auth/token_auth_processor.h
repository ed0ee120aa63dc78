// Bearer-token authentication and per-method authorization, as a grpc::AuthMetadataProcessor.
//
// Every call to fusedlayer.v1.FusedLayer must carry `authorization: Bearer <token>`:
//   missing header, wrong scheme or unknown token -> UNAUTHENTICATED
//   known token without the method's right       -> PERMISSION_DENIED
//   unknown FusedLayer method                     -> PERMISSION_DENIED (deny by default)
// Calls to grpc.health.v1.Health and to server reflection pass without a token: load balancers and
// Kubernetes probes cannot present one, and neither reveals anything beyond serving status and the
// public API schema. Any other service is refused (UNAUTHENTICATED without a token).
//
// The authorization header is left in the call's metadata: auth/caller_identity.h digests it to
// the identity that owns shared-memory regions (the AuthContext is per connection, so it cannot
// carry a per-call identity). The rights are added to the AuthContext as property
// "fusedlayer.rights" -- per connection too: with several tokens on one connection it lists each.
// Tokens are compared as SHA-256 digests with CRYPTO_memcmp over every entry (no early exit), so
// the time taken does not depend on how much of a token matched or which entry matched.
#pragma once

#include "absl/strings/string_view.h"
#include <vector>

#include "auth/token_file.h"
#include "grpcpp/security/auth_metadata_processor.h"

namespace fusedlayer::server::auth {

// The right a full method path ("/fusedlayer.v1.FusedLayer/MhcSeam") needs; kRightNone for the
// open services (health, reflection). Returns false for paths no token may call.
bool RightForMethod(absl::string_view path, uint8_t* right);

class TokenAuthProcessor final : public grpc::AuthMetadataProcessor {
 public:
  explicit TokenAuthProcessor(std::vector<TokenEntry> tokens);

  // The check is a few digests in memory: running it inline on the gRPC thread is cheaper than the
  // thread hop of a blocking processor.
  bool IsBlocking() const override { return false; }

  grpc::Status Process(const InputMetadata& auth_metadata, grpc::AuthContext* context, OutputMetadata* consumed_auth_metadata,
                       OutputMetadata* response_metadata) override;

  // The rights of `token` (kRightNone when unknown), in constant time with respect to the entries.
  uint8_t RightsOf(absl::string_view token) const;

 private:
  const std::vector<TokenEntry> tokens_;
};

}  // namespace fusedlayer::server::auth
