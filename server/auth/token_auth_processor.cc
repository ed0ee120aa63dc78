#include "auth/token_auth_processor.h"

#include <grpc/grpc_security_constants.h>
#include <openssl/crypto.h>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace fusedlayer::server::auth {
namespace {

constexpr absl::string_view kFusedLayerPrefix = "/fusedlayer.v1.FusedLayer/";

absl::string_view View(grpc::string_ref s) { return absl::string_view(s.data(), s.size()); }

}  // namespace

bool RightForMethod(absl::string_view path, uint8_t* right) {
  // Probes and tooling: health (Check/Watch) and reflection (v1 and v1alpha) stay open.
  if (absl::StartsWith(path, "/grpc.health.v1.Health/") ||
      absl::StartsWith(path, "/grpc.reflection.v1alpha.ServerReflection/") ||
      absl::StartsWith(path, "/grpc.reflection.v1.ServerReflection/")) {
    *right = kRightNone;
    return true;
  }
  if (!absl::StartsWith(path, kFusedLayerPrefix)) return false;
  const absl::string_view method = path.substr(kFusedLayerPrefix.size());
  // The shared-memory, residual-session and call-ring RPCs act only on the caller's own regions,
  // sessions and rings (auth/caller_identity.h).
  if (method == "MhcSeam" || method == "SwaNormQuant" || method == "GetServerInfo" || method == "ListWeightSets" ||
      method == "RegisterSystemSharedMemory" || method == "SystemSharedMemoryStatus" ||
      method == "UnregisterSystemSharedMemory" || method == "RegisterCudaSharedMemory" ||
      method == "CudaSharedMemoryStatus" || method == "UnregisterCudaSharedMemory" || method == "OpenResidualSession" ||
      method == "ListResidualSessions" || method == "CloseResidualSession" || method == "OpenCallRing") {
    *right = kRightCompute;
    return true;
  }
  if (method == "LoadWeights" || method == "UnloadWeightSet" || method == "CommitWeightSets") {
    *right = kRightAdmin;
    return true;
  }
  return false;  // a method added to the proto must be given a right here before anyone may call it
}

TokenAuthProcessor::TokenAuthProcessor(std::vector<TokenEntry> tokens, std::vector<IdentityEntry> identities)
    : tokens_(std::move(tokens)), identities_(std::move(identities)) {}

uint8_t TokenAuthProcessor::CertificateRights(const grpc::AuthContext& context) const {
  if (identities_.empty()) return kRightNone;
  uint8_t rights = kRightNone;
  // gRPC sets peer_spiffe_id only for a certificate with exactly one URI SAN that is a SPIFFE ID,
  // and x509_subject for every verified peer certificate. Properties exist only after a handshake
  // that verified the certificate (--tls_client_ca makes it required).
  for (const grpc::string_ref& id : context.FindPropertyValues(GRPC_PEER_SPIFFE_ID_PROPERTY_NAME)) {
    for (const IdentityEntry& e : identities_) {
      if (e.kind == IdentityEntry::Kind::kSpiffeId && View(id) == e.value) rights |= e.rights;
    }
  }
  for (const grpc::string_ref& subject : context.FindPropertyValues(GRPC_X509_SUBJECT_PROPERTY_NAME)) {
    for (const IdentityEntry& e : identities_) {
      if (e.kind == IdentityEntry::Kind::kSubject && View(subject) == e.value) rights |= e.rights;
    }
  }
  return rights;
}

uint8_t TokenAuthProcessor::RightsOf(absl::string_view token) const {
  const TokenDigest d = DigestToken(token);
  uint8_t rights = kRightNone;
  for (const TokenEntry& e : tokens_) {
    // Branch-free accumulate: every entry is compared whatever matched before.
    const uint8_t match = static_cast<uint8_t>(CRYPTO_memcmp(d.data(), e.digest.data(), d.size()) == 0);
    rights |= static_cast<uint8_t>(-match) & e.rights;
  }
  return rights;
}

grpc::Status TokenAuthProcessor::Process(const InputMetadata& auth_metadata, grpc::AuthContext* context,
                                         OutputMetadata* consumed_auth_metadata, OutputMetadata* /*response_metadata*/) {
  absl::string_view path;
  if (auto it = auth_metadata.find(":path"); it != auth_metadata.end()) path = View(it->second);
  uint8_t needed = kRightNone;
  const bool known = RightForMethod(path, &needed);

  // Every authorization header is looked at, whatever its shape, and none is consumed: the handlers
  // need the one a call carried to know which token it acts as (auth/caller_identity.h). The
  // AuthContext given here belongs to the connection, not the call (gRPC 1.51's server auth filter
  // passes the channel's context), so a per-call identity cannot ride in it: two tokens on one
  // connection would read as whichever called first. A call that reaches a handler carried at most
  // one header, and a valid token in it; CallerOf (caller_identity.h) reads it only as a digest.
  (void)consumed_auth_metadata;
  int headers = 0;
  absl::string_view value;
  for (auto [it, end] = auth_metadata.equal_range("authorization"); it != end; ++it) {
    value = View(it->second);
    ++headers;
  }

  if (known && needed == kRightNone) return grpc::Status::OK;  // health, reflection

  uint8_t rights = CertificateRights(*context);
  bool authenticated = rights != kRightNone;
  if (headers > 1) {
    // Which one would count is a proxy's or library's accident: refuse rather than guess.
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                        absl::StrCat(headers, " authorization headers: send exactly one `authorization: Bearer <token>`"));
  }
  if (headers == 1) {
    // RFC 7235: the scheme is case-insensitive; one space, then the token.
    if (!(value.size() > 7 && absl::EqualsIgnoreCase(value.substr(0, 7), "bearer "))) {
      return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                          "the authorization header is not `Bearer <token>` (the only scheme this server accepts)");
    }
    if (tokens_.empty()) {
      return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                          "this server checks no bearer tokens (no --auth_tokens_file): send none, authenticate with "
                          "the client certificate");
    }
    const uint8_t token_rights = RightsOf(value.substr(7));
    if (token_rights == kRightNone) return grpc::Status(grpc::StatusCode::UNAUTHENTICATED, "invalid bearer token");
    rights |= token_rights;
    authenticated = true;
  }
  if (!authenticated) {
    if (identities_.empty()) {
      return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                          "missing credentials: send metadata `authorization: Bearer <token>`");
    }
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                        tokens_.empty()
                            ? "the client certificate's identity (SPIFFE ID or subject) is not in --auth_identities_file"
                            : "the client certificate's identity (SPIFFE ID or subject) is not in --auth_identities_file "
                              "and no `authorization: Bearer <token>` was sent");
  }
  if (!known) {
    return grpc::Status(grpc::StatusCode::PERMISSION_DENIED, absl::StrCat("no right grants calling ", path));
  }
  if ((rights & needed) == 0) {
    return grpc::Status(grpc::StatusCode::PERMISSION_DENIED,
                        absl::StrCat("the caller's rights (", RightsName(rights), ") do not include ", RightsName(needed),
                                     ", which ", path.substr(path.rfind('/') + 1), " needs"));
  }
  return grpc::Status::OK;
}

}  // namespace fusedlayer::server::auth
