#include "client/transport_credentials.h"

#include <fstream>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"

namespace fusedlayer::client {
namespace {

absl::StatusOr<std::string> ReadFile(const std::string& what, const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::InvalidArgumentError(absl::StrCat(what, " ", path, ": cannot open the file"));
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) return absl::InvalidArgumentError(absl::StrCat(what, " ", path, ": cannot read the file"));
  return ss.str();
}

}  // namespace

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> TlsChannelCredentials(const TlsFiles& files) {
  if (files.cert.empty() != files.key.empty()) {
    return absl::InvalidArgumentError("a TLS client certificate and its key must be given together");
  }
  grpc::SslCredentialsOptions options;
  if (!files.ca.empty()) {
    absl::StatusOr<std::string> ca = ReadFile("TLS CA", files.ca);
    if (!ca.ok()) return ca.status();
    options.pem_root_certs = *std::move(ca);
  }
  if (!files.cert.empty()) {
    absl::StatusOr<std::string> cert = ReadFile("TLS client certificate", files.cert);
    if (!cert.ok()) return cert.status();
    absl::StatusOr<std::string> key = ReadFile("TLS client key", files.key);
    if (!key.ok()) return key.status();
    options.pem_cert_chain = *std::move(cert);
    options.pem_private_key = *std::move(key);
  }
  return grpc::SslCredentials(options);
}

absl::StatusOr<std::string> ReadBearerTokenFile(const std::string& path) {
  absl::StatusOr<std::string> contents = ReadFile("token file", path);
  if (!contents.ok()) return contents.status();
  const std::string token(absl::StripAsciiWhitespace(*contents));
  if (token.empty()) return absl::InvalidArgumentError(absl::StrCat("token file ", path, " is empty"));
  for (const char ch : token) {
    // The message never quotes the token.
    if (ch <= ' ' || ch > '~') {
      return absl::InvalidArgumentError(
          absl::StrCat("token file ", path, " must hold just the token (found whitespace or a non-ASCII byte inside)"));
    }
  }
  return token;
}

}  // namespace fusedlayer::client
