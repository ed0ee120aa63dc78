#include "client/lib/transport_credentials.h"

#include <algorithm>
#include <fstream>
#include <sstream>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

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

namespace {

// The host of "host:port", "[v6]:port" or a bare host.
absl::string_view HostOf(absl::string_view hostport) {
  if (absl::ConsumePrefix(&hostport, "[")) return hostport.substr(0, hostport.find(']'));
  const size_t colon = hostport.rfind(':');
  // More than one colon and no brackets: a bare IPv6 address.
  if (colon != absl::string_view::npos && hostport.find(':') == colon) return hostport.substr(0, colon);
  return hostport;
}

bool IsLoopbackHost(absl::string_view host) {
  if (absl::AsciiStrToLower(host) == "localhost" || host == "::1") return true;
  std::vector<absl::string_view> octets = absl::StrSplit(host, '.');
  if (octets.size() != 4 || octets[0] != "127") return false;
  for (absl::string_view o : octets) {
    int v = 0;
    if (o.empty() || o.size() > 3 || !absl::SimpleAtoi(o, &v) || v < 0 || v > 255) return false;
  }
  return true;
}

}  // namespace

bool IsLoopbackTarget(const std::string& target) {
  absl::string_view t = target;
  if (absl::StartsWith(t, "unix:") || absl::StartsWith(t, "unix-abstract:")) return true;
  if (absl::ConsumePrefix(&t, "dns:")) {
    // dns:[//authority/]host[:port]: the authority names the resolver, not the target.
    if (absl::ConsumePrefix(&t, "//")) t = t.substr(std::min(t.size(), t.find('/') + 1));
  } else if (absl::ConsumePrefix(&t, "ipv4:") || absl::ConsumePrefix(&t, "ipv6:")) {
    // A list of addresses: every one must be loopback.
    for (absl::string_view a : absl::StrSplit(t, ',')) {
      if (!IsLoopbackHost(HostOf(a))) return false;
    }
    return !t.empty();
  }
  return IsLoopbackHost(HostOf(t));
}

}  // namespace fusedlayer::client
