// Client-side transport security helpers: TLS / mutual-TLS channel credentials from PEM files and
// the bearer token from a file or the environment (fusedctl's --tls_* and --token_file flags).
// docs/security.md describes the server side and how to make certificates.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "grpcpp/security/credentials.h"

namespace fusedlayer::client {

struct TlsFiles {
  std::string ca;    // PEM CA bundle that signed the server certificate; empty: the system roots
  std::string cert;  // PEM client certificate chain (mutual TLS); needs `key`
  std::string key;   // PEM client private key
};

// grpc::SslCredentials from the files. InvalidArgument naming the file when one cannot be read, or
// when only one of cert/key is given.
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> TlsChannelCredentials(const TlsFiles& files);

// The token from `path` (the file holds just the token; surrounding whitespace and one trailing
// newline are dropped; comments are not allowed: the server's --auth_tokens_file format is a
// different file). InvalidArgument when it cannot be read, is empty, or has inner whitespace.
absl::StatusOr<std::string> ReadBearerTokenFile(const std::string& path);

// True when a gRPC target never leaves this machine: unix: / unix-abstract: addresses and hosts
// that are loopback (localhost, 127.0.0.0/8, ::1), also behind the dns:///, ipv4: and ipv6: schemes.
// A bearer token is sent over plaintext only to such a target (FusedLayerClient::Connect).
bool IsLoopbackTarget(const std::string& target);

}  // namespace fusedlayer::client
