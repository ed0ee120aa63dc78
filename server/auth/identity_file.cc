#include "auth/identity_file.h"

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "auth/small_file.h"
#include "auth/token_file.h"

namespace fusedlayer::server::auth {
namespace {

constexpr absl::string_view kSpiffePrefix = "spiffe://";
constexpr absl::string_view kSubjectPrefix = "subject:";

// Printable ASCII only: what gRPC reports is the certificate's text as OpenSSL prints it (RFC 2253
// escapes the rest), and a control character in the file is a mistake, not an identity.
bool Printable(absl::string_view s) {
  for (char c : s) {
    if (static_cast<unsigned char>(c) < 0x20 || static_cast<unsigned char>(c) > 0x7e) return false;
  }
  return true;
}

}  // namespace

absl::StatusOr<std::vector<IdentityEntry>> ParseIdentityFile(absl::string_view contents, absl::string_view source) {
  std::vector<IdentityEntry> entries;
  EntryLines lines(contents, source);  // stripped; blank and comment lines skipped
  for (absl::string_view line; lines.Next(&line);) {
    // The rights are the last field; the identity is everything before it (a subject may hold spaces).
    const size_t split = line.find_last_of(" \t");
    if (split == absl::string_view::npos) return lines.Error("expected `<identity> <rights>`, got one field");
    const absl::string_view identity = absl::StripTrailingAsciiWhitespace(line.substr(0, split));
    const absl::string_view rights_field = line.substr(split + 1);
    if (identity.size() > kMaxIdentityLength) {
      return lines.Error(absl::StrCat("identity has ", identity.size(), " characters; at most ", kMaxIdentityLength));
    }
    if (!Printable(identity)) return lines.Error("identity has characters outside printable ASCII");
    IdentityEntry entry;
    if (absl::StartsWith(identity, kSpiffePrefix)) {
      entry.kind = IdentityEntry::Kind::kSpiffeId;
      entry.value = std::string(identity);
      const absl::string_view rest = identity.substr(kSpiffePrefix.size());
      if (rest.empty() || rest.front() == '/' || absl::StrContains(identity, ' ') || absl::StrContains(identity, '\t')) {
        return lines.Error("a SPIFFE ID is spiffe://<trust domain>/<path>, without spaces");
      }
    } else if (absl::StartsWith(identity, kSubjectPrefix)) {
      entry.kind = IdentityEntry::Kind::kSubject;
      entry.value = std::string(identity.substr(kSubjectPrefix.size()));
      if (entry.value.empty() || entry.value.find('=') == std::string::npos) {
        return lines.Error("subject:<distinguished name> needs a name, e.g. subject:CN=loader,O=Acme");
      }
    } else {
      return lines.Error("an identity starts with spiffe:// (a SPIFFE ID) or subject: (a certificate subject)");
    }
    absl::StatusOr<uint8_t> rights = ParseRights(rights_field);
    if (!rights.ok()) return lines.Error(rights.status().message());
    entry.rights = *rights;
    for (const IdentityEntry& e : entries) {
      if (e.kind == entry.kind && e.value == entry.value) return lines.Error("identity already listed on an earlier line");
    }
    entries.push_back(std::move(entry));
  }
  if (entries.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": no identities (every certificate would be refused)"));
  }
  return entries;
}

absl::StatusOr<std::vector<IdentityEntry>> LoadIdentityFile(const std::string& path) {
  absl::StatusOr<std::string> contents = ReadSmallFile(path, "identity file");
  if (!contents.ok()) return contents.status();
  return ParseIdentityFile(*contents, path);
}

}  // namespace fusedlayer::server::auth
