// SHA-256 of weight payloads (OpenSSL EVP). The digest is written as 64 lower-case hex digits, the
// form WeightSetHeader.sha256 uses on the wire.
#pragma once

#include <memory>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"

struct evp_md_ctx_st;  // OpenSSL's EVP_MD_CTX; kept out of this header so users need no OpenSSL headers

namespace fusedlayer::server {

// Incremental hasher, for payloads that arrive in chunks (LoadWeights). Not thread-safe.
// OpenSSL can fail (allocation, a FIPS provider refusing the digest): such a failure is remembered
// and reported by FinishHex() as INTERNAL, so callers check one status at the end.
class Sha256 {
 public:
  Sha256();
  ~Sha256();
  Sha256(const Sha256&) = delete;
  Sha256& operator=(const Sha256&) = delete;

  void Update(std::string_view data);
  // The digest of everything passed to Update(). The hasher cannot be used afterwards.
  absl::StatusOr<std::string> FinishHex();

 private:
  struct CtxDeleter {
    void operator()(evp_md_ctx_st* ctx) const;
  };
  std::unique_ptr<evp_md_ctx_st, CtxDeleter> ctx_;
  bool ok_ = false;
  bool finished_ = false;
};

// One-shot digest of `data` as lower-case hex.
absl::StatusOr<std::string> Sha256Hex(std::string_view data);

// True when `s` is 64 lower-case hex digits (the only digest form accepted on the wire).
bool IsSha256Hex(std::string_view s);

}  // namespace fusedlayer::server
