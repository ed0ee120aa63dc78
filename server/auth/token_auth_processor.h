// Authentication by bearer token and/or client-certificate identity, and per-method authorization,
// as a grpc::AuthMetadataProcessor.
//
// A call's rights are the union of
//   - its token's rights (--auth_tokens_file), from exactly one `authorization: Bearer <token>`
//     header (the scheme case-insensitive, one space, then the token), and
//   - under mutual TLS with --auth_identities_file, the rights of the verified client
//     certificate's SPIFFE ID and of its subject (auth/identity_file.h).
// Every call to fusedlayer.v1.FusedLayer must be authenticated by at least one of them:
//   no known identity and no header                    -> UNAUTHENTICATED
//   more than one authorization header                 -> UNAUTHENTICATED
//   a header that is not `Bearer <token>` (Basic ...,
//   empty, no token), an unknown token, or a token
//   where the server checks none (identities only)     -> UNAUTHENTICATED (credentials presented are
//                                                         checked, never ignored, even when the
//                                                         certificate alone would have sufficed)
//   authenticated without the method's right           -> PERMISSION_DENIED
//   unknown FusedLayer method                          -> PERMISSION_DENIED (deny by default)
// Calls to grpc.health.v1.Health and to server reflection pass without a token: load balancers and
// Kubernetes probes cannot present one, and neither reveals anything beyond serving status and the
// public API schema. Any other service is refused (UNAUTHENTICATED without a token).
//
// The authorization header is left in the call's metadata: auth/caller_identity.h digests it to
// the identity that owns shared-memory regions (the AuthContext is per connection, so it cannot
// carry a per-call identity; for the same reason no per-call rights are written into it).
// Tokens are compared as SHA-256 digests with CRYPTO_memcmp over every entry (no early exit), so
// the time taken does not depend on how much of a token matched or which entry matched.
#pragma once

#include "absl/strings/string_view.h"
#include <vector>

#include "auth/identity_file.h"
#include "auth/token_file.h"
#include "grpcpp/security/auth_metadata_processor.h"

namespace fusedlayer::server::auth {

// The right a full method path ("/fusedlayer.v1.FusedLayer/MhcSeam") needs; kRightNone for the
// open services (health, reflection). Returns false for paths no token may call.
bool RightForMethod(absl::string_view path, uint8_t* right);

class TokenAuthProcessor final : public grpc::AuthMetadataProcessor {
 public:
  // Either list may be empty (not both): no tokens means no token is accepted; no identities means
  // certificates grant nothing.
  TokenAuthProcessor(std::vector<TokenEntry> tokens, std::vector<IdentityEntry> identities = {});

  // The check is a few digests in memory: running it inline on the gRPC thread is cheaper than the
  // thread hop of a blocking processor.
  bool IsBlocking() const override { return false; }

  grpc::Status Process(const InputMetadata& auth_metadata, grpc::AuthContext* context, OutputMetadata* consumed_auth_metadata,
                       OutputMetadata* response_metadata) override;

  // The rights of `token` (kRightNone when unknown), in constant time with respect to the entries.
  uint8_t RightsOf(absl::string_view token) const;
  // The rights of the peer's verified certificate (its SPIFFE ID and its subject, as gRPC put them
  // in `context`); kRightNone when it has none listed, or there is no certificate.
  uint8_t CertificateRights(const grpc::AuthContext& context) const;

 private:
  const std::vector<TokenEntry> tokens_;
  const std::vector<IdentityEntry> identities_;
};

}  // namespace fusedlayer::server::auth
