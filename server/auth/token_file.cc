#include "auth/token_file.h"

#include <openssl/evp.h>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "auth/small_file.h"

namespace fusedlayer::server::auth {
namespace {

// RFC 6750 b64token / token68: 1*( ALPHA / DIGIT / "-" / "." / "_" / "~" / "+" / "/" ) *"="
bool IsToken68(absl::string_view t) {
  size_t i = 0;
  while (i < t.size() && (absl::ascii_isalnum(static_cast<unsigned char>(t[i])) || t[i] == '-' || t[i] == '.' ||
                          t[i] == '_' || t[i] == '~' || t[i] == '+' || t[i] == '/')) {
    ++i;
  }
  if (i == 0) return false;
  while (i < t.size() && t[i] == '=') ++i;
  return i == t.size();
}

}  // namespace

absl::StatusOr<uint8_t> ParseRights(absl::string_view field) {
  uint8_t rights = kRightNone;
  for (absl::string_view r : absl::StrSplit(field, ',')) {
    uint8_t bit = kRightNone;
    if (r == "compute") {
      bit = kRightCompute;
    } else if (r == "admin") {
      bit = kRightAdmin;
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat("unknown right '", r, "' (want compute, admin or compute,admin)"));
    }
    if (rights & bit) return absl::InvalidArgumentError(absl::StrCat("right '", r, "' listed twice"));
    rights |= bit;
  }
  return rights;
}

TokenDigest DigestToken(absl::string_view token) {
  TokenDigest d{};
  unsigned int len = 0;
  // One-shot EVP digest; SHA-256 cannot fail on in-memory input short of a broken OpenSSL.
  EVP_Digest(token.data(), token.size(), d.data(), &len, EVP_sha256(), nullptr);
  return d;
}

std::string RightsName(uint8_t rights) {
  if (rights == (kRightCompute | kRightAdmin)) return "compute,admin";
  if (rights == kRightCompute) return "compute";
  if (rights == kRightAdmin) return "admin";
  return "none";
}

absl::StatusOr<std::vector<TokenEntry>> ParseTokenFile(absl::string_view contents, absl::string_view source) {
  std::vector<TokenEntry> entries;
  EntryLines lines(contents, source);  // stripped; blank and comment lines skipped
  for (absl::string_view line; lines.Next(&line);) {
    const std::vector<absl::string_view> fields = absl::StrSplit(line, absl::ByAnyChar(" \t"), absl::SkipEmpty());
    if (fields.size() != 2) {
      return lines.Error(absl::StrCat("expected `<token> <rights>`, got ", fields.size(), " field(s)"));
    }
    const absl::string_view token = fields[0];
    // The messages below describe the token, never quote it: the log may be less private than the file.
    if (token.size() < kMinTokenLength || token.size() > kMaxTokenLength) {
      return lines.Error(absl::StrCat("token has ", token.size(), " characters; want ", kMinTokenLength, " to ",
                                      kMaxTokenLength, " (e.g. `openssl rand -hex 32`)"));
    }
    if (!IsToken68(token)) {
      return lines.Error("token has characters outside A-Z a-z 0-9 - . _ ~ + / (and trailing =)");
    }
    absl::StatusOr<uint8_t> rights = ParseRights(fields[1]);
    if (!rights.ok()) return lines.Error(rights.status().message());
    TokenEntry entry{DigestToken(token), *rights};
    for (const TokenEntry& e : entries) {
      if (e.digest == entry.digest) return lines.Error("token already listed on an earlier line");
    }
    entries.push_back(entry);
  }
  if (entries.empty()) return absl::InvalidArgumentError(absl::StrCat(source, ": no tokens (every call would be refused)"));
  return entries;
}

absl::StatusOr<std::vector<TokenEntry>> LoadTokenFile(const std::string& path) {
  absl::StatusOr<std::string> contents = ReadSmallFile(path, "token file");
  if (!contents.ok()) return contents.status();
  return ParseTokenFile(*contents, path);
}

}  // namespace fusedlayer::server::auth
