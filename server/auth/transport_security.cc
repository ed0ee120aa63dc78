#include "auth/transport_security.h"

#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/pem.h>
#include <openssl/x509.h>

#include <sys/stat.h>

#include <fstream>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "auth/identity_file.h"
#include "auth/token_auth_processor.h"
#include "auth/token_file.h"
#include "common/log.h"

namespace fusedlayer::server::auth {
namespace {

absl::StatusOr<std::string> ReadFile(const std::string& flag, const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::InvalidArgumentError(absl::StrCat("--", flag, "=", path, ": cannot open the file"));
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) return absl::InvalidArgumentError(absl::StrCat("--", flag, "=", path, ": cannot read the file"));
  return ss.str();
}

// A secret (token file, TLS key) that other local users can read is a secret no longer: one WARNING.
void WarnIfReadableByOthers(const std::string& flag, const std::string& path) {
  struct stat st {};
  if (stat(path.c_str(), &st) != 0) return;  // reading it reports the problem
  if ((st.st_mode & (S_IRWXG | S_IRWXO)) != 0) {
    LogWarning("--", flag, "=", path, " is readable by group or others (mode ",
               absl::StrFormat("%04o", st.st_mode & 07777), "); make it chmod 600, owned by the server's user");
  }
}

struct BioDeleter { void operator()(BIO* b) const { BIO_free(b); } };
struct X509Deleter { void operator()(X509* x) const { X509_free(x); } };
struct PkeyDeleter { void operator()(EVP_PKEY* k) const { EVP_PKEY_free(k); } };
using BioPtr = std::unique_ptr<BIO, BioDeleter>;
using X509Ptr = std::unique_ptr<X509, X509Deleter>;
using PkeyPtr = std::unique_ptr<EVP_PKEY, PkeyDeleter>;

BioPtr MemBio(const std::string& pem) { return BioPtr(BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size()))); }

// The first certificate of a PEM bundle; null when there is none. gRPC would only fail later, at
// BuildAndStart, with a generic "cannot listen": parsing here lets the error name the flag.
X509Ptr FirstCertificate(const std::string& pem) {
  BioPtr bio = MemBio(pem);
  X509Ptr cert(bio ? PEM_read_bio_X509(bio.get(), nullptr, nullptr, nullptr) : nullptr);
  ERR_clear_error();
  return cert;
}

absl::Status CheckKeyPair(const ServerConfig& c, const std::string& cert_pem, const std::string& key_pem) {
  X509Ptr cert = FirstCertificate(cert_pem);
  if (!cert) return absl::InvalidArgumentError(absl::StrCat("--tls_cert=", c.tls_cert, ": no PEM certificate in the file"));
  BioPtr bio = MemBio(key_pem);
  // No passphrase callback: an encrypted key cannot be served unattended, so it is an error.
  PkeyPtr key(bio ? PEM_read_bio_PrivateKey(bio.get(), nullptr, nullptr, const_cast<char*>("")) : nullptr);
  ERR_clear_error();
  if (!key) {
    return absl::InvalidArgumentError(
        absl::StrCat("--tls_key=", c.tls_key, ": no unencrypted PEM private key in the file"));
  }
  if (X509_check_private_key(cert.get(), key.get()) != 1) {
    ERR_clear_error();
    return absl::InvalidArgumentError(
        absl::StrCat("--tls_key=", c.tls_key, " does not match the certificate in --tls_cert=", c.tls_cert));
  }
  return absl::OkStatus();
}

}  // namespace

bool IsLocalOnlyAddress(absl::string_view address) {
  if (absl::StartsWith(address, "unix:") || absl::StartsWith(address, "unix-abstract:")) return true;
  absl::string_view host;
  if (absl::StartsWith(address, "[")) {
    const size_t close = address.find(']');
    if (close == absl::string_view::npos) return false;
    host = address.substr(1, close - 1);
  } else {
    const size_t colon = address.rfind(':');
    host = colon == absl::string_view::npos ? address : address.substr(0, colon);
  }
  if (host == "localhost" || host == "::1") return true;
  // 127.0.0.0/8, written as a dotted quad.
  const std::vector<absl::string_view> octets = absl::StrSplit(host, '.');
  if (octets.size() != 4 || octets[0] != "127") return false;
  for (absl::string_view o : octets) {
    int v = 0;
    if (o.empty() || o.size() > 3 || !absl::SimpleAtoi(o, &v) || v < 0 || v > 255) return false;
  }
  return true;
}

absl::StatusOr<ServerSecurity> MakeServerSecurity(const ServerConfig& c) {
  if (c.tls_cert.empty() != c.tls_key.empty()) {
    return absl::InvalidArgumentError("--tls_cert and --tls_key must be given together (PEM certificate chain and key)");
  }
  const bool tls = !c.tls_cert.empty();
  if (!c.tls_client_ca.empty() && !tls) {
    return absl::InvalidArgumentError("--tls_client_ca (mutual TLS) needs --tls_cert and --tls_key");
  }

  if (!c.auth_identities_file.empty() && c.tls_client_ca.empty()) {
    return absl::InvalidArgumentError(
        "--auth_identities_file maps client certificates to rights: it needs mutual TLS (--tls_cert, --tls_key "
        "and --tls_client_ca, the CA that signs the client certificates)");
  }

  std::vector<TokenEntry> tokens;
  if (!c.auth_tokens_file.empty()) {
    WarnIfReadableByOthers("auth_tokens_file", c.auth_tokens_file);
    absl::StatusOr<std::vector<TokenEntry>> loaded = LoadTokenFile(c.auth_tokens_file);
    if (!loaded.ok()) return absl::InvalidArgumentError(absl::StrCat("--auth_tokens_file: ", loaded.status().message()));
    tokens = *std::move(loaded);
  }
  std::vector<IdentityEntry> identities;
  if (!c.auth_identities_file.empty()) {
    absl::StatusOr<std::vector<IdentityEntry>> loaded = LoadIdentityFile(c.auth_identities_file);
    if (!loaded.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("--auth_identities_file: ", loaded.status().message()));
    }
    identities = *std::move(loaded);
  }
  const size_t token_count = tokens.size(), identity_count = identities.size();
  std::shared_ptr<TokenAuthProcessor> processor;
  if (!tokens.empty() || !identities.empty()) {
    processor = std::make_shared<TokenAuthProcessor>(std::move(tokens), std::move(identities));
  }

  if (tls && !processor && !c.allow_unauthenticated_tls) {
    return absl::InvalidArgumentError(absl::StrCat(
        c.tls_client_ca.empty() ? "--tls_cert" : "--tls_cert with --tls_client_ca (mutual TLS)",
        " without --auth_tokens_file", c.tls_client_ca.empty() ? "" : " or --auth_identities_file",
        " authorizes everyone who completes the TLS handshake for every RPC, LoadWeights and UnloadWeightSet "
        "included: give --auth_tokens_file (rights per token)",
        c.tls_client_ca.empty() ? "" : " or --auth_identities_file (rights per client certificate)",
        ", or --allow_unauthenticated_tls to accept that"));
  }

  ServerSecurity out;
  if (tls) {
    absl::StatusOr<std::string> cert = ReadFile("tls_cert", c.tls_cert);
    if (!cert.ok()) return cert.status();
    absl::StatusOr<std::string> key = ReadFile("tls_key", c.tls_key);
    if (!key.ok()) return key.status();
    WarnIfReadableByOthers("tls_key", c.tls_key);
    if (absl::Status s = CheckKeyPair(c, *cert, *key); !s.ok()) return s;
    grpc::SslServerCredentialsOptions options(GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
    options.pem_key_cert_pairs.push_back({*key, *cert});
    if (!c.tls_client_ca.empty()) {
      absl::StatusOr<std::string> ca = ReadFile("tls_client_ca", c.tls_client_ca);
      if (!ca.ok()) return ca.status();
      if (!FirstCertificate(*ca)) {
        return absl::InvalidArgumentError(absl::StrCat("--tls_client_ca=", c.tls_client_ca, ": no PEM certificate in the file"));
      }
      options.pem_root_certs = *ca;
      options.client_certificate_request = GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY;
    }
    out.credentials = grpc::SslServerCredentials(options);
    out.description = c.tls_client_ca.empty() ? "TLS" : "mutual TLS (client certificates verified against --tls_client_ca)";
    out.unauthenticated_tls = !processor;
  } else if (processor) {  // tokens only: identities need mutual TLS (checked above)
    if (!IsLocalOnlyAddress(c.address)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--auth_tokens_file without TLS would send bearer tokens in clear text on --address=", c.address,
          ": add --tls_cert/--tls_key, or listen on loopback only (e.g. --address=127.0.0.1:50051)"));
    }
    out.credentials = grpc::experimental::LocalServerCredentials(absl::StartsWith(c.address, "unix") ? UDS : LOCAL_TCP);
    out.description = "plaintext, local connections only (no TLS)";
  } else {
    out.credentials = grpc::InsecureServerCredentials();
    out.description = "plaintext";
    out.plaintext_open = true;
  }
  if (processor) {
    out.credentials->SetAuthMetadataProcessor(processor);
    if (token_count > 0) absl::StrAppend(&out.description, " + bearer tokens (", token_count, " from --auth_tokens_file)");
    if (identity_count > 0) {
      absl::StrAppend(&out.description, " + client-certificate identities (", identity_count,
                      " from --auth_identities_file)");
    }
  }
  return out;
}

}  // namespace fusedlayer::server::auth
