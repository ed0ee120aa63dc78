#include "auth/token_auth_processor.h"

#include <openssl/crypto.h>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace fusedlayer::server::auth {
namespace {

constexpr absl::string_view kFusedLayerPrefix = "/fusedlayer.v1.FusedLayer/";
constexpr char kRightsProperty[] = "fusedlayer.rights";

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
  // The shared-memory RPCs act only on the caller's own regions (auth/caller_identity.h).
  if (method == "MhcSeam" || method == "SwaNormQuant" || method == "GetServerInfo" || method == "ListWeightSets" ||
      method == "RegisterSystemSharedMemory" || method == "SystemSharedMemoryStatus" ||
      method == "UnregisterSystemSharedMemory") {
    *right = kRightCompute;
    return true;
  }
  if (method == "LoadWeights" || method == "UnloadWeightSet") {
    *right = kRightAdmin;
    return true;
  }
  return false;  // a method added to the proto must be given a right here before anyone may call it
}

TokenAuthProcessor::TokenAuthProcessor(std::vector<TokenEntry> tokens) : tokens_(std::move(tokens)) {}

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

  absl::string_view token;
  bool has_token = false;
  auto auth = auth_metadata.find("authorization");
  if (auth != auth_metadata.end()) {
    // Not consumed: the handlers need it to know which token a call acts as (auth/caller_identity.h).
    // The AuthContext given here belongs to the connection, not the call (gRPC 1.51's server auth
    // filter passes the channel's context), so a per-call identity cannot ride in it: two tokens
    // on one connection would read as whichever called first. Only CallerIdentity reads the header,
    // and only as a digest; a call that reaches a handler carried a valid token.
    (void)consumed_auth_metadata;
    const absl::string_view value = View(auth->second);
    // RFC 7235: the scheme is case-insensitive; one space, then the token.
    if (value.size() > 7 && absl::EqualsIgnoreCase(value.substr(0, 7), "bearer ")) {
      token = value.substr(7);
      has_token = true;
    }
  }

  if (known && needed == kRightNone) return grpc::Status::OK;  // health, reflection
  if (!has_token) {
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                        "missing credentials: send metadata `authorization: Bearer <token>`");
  }
  const uint8_t rights = RightsOf(token);
  if (rights == kRightNone) return grpc::Status(grpc::StatusCode::UNAUTHENTICATED, "invalid bearer token");
  if (!known) {
    return grpc::Status(grpc::StatusCode::PERMISSION_DENIED, absl::StrCat("no right grants calling ", path));
  }
  if ((rights & needed) == 0) {
    return grpc::Status(grpc::StatusCode::PERMISSION_DENIED,
                        absl::StrCat("the token's rights (", RightsName(rights), ") do not include ", RightsName(needed),
                                     ", which ", path.substr(path.rfind('/') + 1), " needs"));
  }
  context->AddProperty(kRightsProperty, RightsName(rights));
  return grpc::Status::OK;
}

}  // namespace fusedlayer::server::auth
