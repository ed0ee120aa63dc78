#include "weights/sha256.h"

#include <openssl/evp.h>

#include "absl/strings/escaping.h"

namespace fusedlayer::server {

void Sha256::CtxDeleter::operator()(evp_md_ctx_st* ctx) const { EVP_MD_CTX_free(ctx); }

Sha256::Sha256() : ctx_(EVP_MD_CTX_new()) {
  ok_ = ctx_ != nullptr && EVP_DigestInit_ex(ctx_.get(), EVP_sha256(), nullptr) == 1;
}

Sha256::~Sha256() = default;

void Sha256::Update(std::string_view data) {
  if (!ok_ || finished_ || data.empty()) return;
  ok_ = EVP_DigestUpdate(ctx_.get(), data.data(), data.size()) == 1;
}

absl::StatusOr<std::string> Sha256::FinishHex() {
  if (finished_) return absl::FailedPreconditionError("Sha256::FinishHex called twice");
  finished_ = true;
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  if (!ok_ || EVP_DigestFinal_ex(ctx_.get(), digest, &len) != 1 || len != 32) {
    return absl::InternalError("OpenSSL SHA-256 failed");
  }
  return absl::BytesToHexString(absl::string_view(reinterpret_cast<const char*>(digest), len));
}

absl::StatusOr<std::string> Sha256Hex(std::string_view data) {
  Sha256 h;
  h.Update(data);
  return h.FinishHex();
}

bool IsSha256Hex(std::string_view s) {
  if (s.size() != 64) return false;
  for (char c : s) {
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  }
  return true;
}

}  // namespace fusedlayer::server
