// libFuzzer target: the two files that grant rights, parsed from arbitrary text:
// ParseTokenFile (--auth_tokens_file) and ParseIdentityFile (--auth_identities_file), both on every
// input. Neither may crash; besides, each aborts on a broken promise:
//   - an error without a message, or not naming the source;
//   - a token file error that quotes a token (a first field of 16+ characters that occurs only
//     once in the input: errors describe a token, never repeat it, since logs are less private);
//   - an accepted file whose entry count differs from its non-comment lines, with rights outside
//     {compute, admin, compute,admin}, a repeated token digest, or an identity that is empty, too
//     long or not printable ASCII.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_split.h"
#include "auth/identity_file.h"
#include "auth/token_file.h"

namespace {

namespace auth = fusedlayer::server::auth;

[[noreturn]] void Fail(const char* what, absl::string_view detail) {
  std::fprintf(stderr, "fuzz_auth_files: %s: %.*s\n", what, static_cast<int>(detail.size()), detail.data());
  std::abort();
}

// Lines the parsers take as entries (neither blank nor comment), and their first fields.
std::vector<absl::string_view> EntryLines(absl::string_view text, std::vector<absl::string_view>* first_fields) {
  std::vector<absl::string_view> lines;
  for (absl::string_view raw : absl::StrSplit(text, '\n')) {
    const absl::string_view line = absl::StripAsciiWhitespace(raw);
    if (line.empty() || line.front() == '#') continue;
    lines.push_back(line);
    const std::vector<absl::string_view> fields = absl::StrSplit(line, absl::ByAnyChar(" \t"), absl::SkipEmpty());
    if (!fields.empty()) first_fields->push_back(fields.front());
  }
  return lines;
}

bool ValidRights(uint8_t r) { return r == auth::kRightCompute || r == auth::kRightAdmin || r == (auth::kRightCompute | auth::kRightAdmin); }

size_t Occurrences(absl::string_view text, absl::string_view what) {
  size_t n = 0;
  for (size_t at = text.find(what); at != absl::string_view::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const absl::string_view text(reinterpret_cast<const char*>(data), size);
  std::vector<absl::string_view> first_fields;
  const std::vector<absl::string_view> lines = EntryLines(text, &first_fields);

  absl::StatusOr<std::vector<auth::TokenEntry>> tokens = auth::ParseTokenFile(text, "tokens");
  if (!tokens.ok()) {
    const absl::string_view m = tokens.status().message();
    if (!absl::StartsWith(m, "tokens")) Fail("token error without the source", m);
    for (absl::string_view f : first_fields) {
      if (f.size() >= auth::kMinTokenLength && Occurrences(text, f) == 1 && absl::StrContains(m, f)) {
        Fail("token error quotes a token", m);
      }
    }
  } else {
    if (tokens->size() != lines.size()) Fail("token entries != entry lines", text);
    for (size_t i = 0; i < tokens->size(); ++i) {
      if (!ValidRights((*tokens)[i].rights)) Fail("token rights out of range", text);
      for (size_t j = 0; j < i; ++j) {
        if ((*tokens)[i].digest == (*tokens)[j].digest) Fail("a token accepted twice", text);
      }
    }
  }

  absl::StatusOr<std::vector<auth::IdentityEntry>> ids = auth::ParseIdentityFile(text, "identities");
  if (!ids.ok()) {
    if (!absl::StartsWith(ids.status().message(), "identities")) Fail("identity error without the source", ids.status().message());
  } else {
    if (ids->size() != lines.size()) Fail("identity entries != entry lines", text);
    for (const auth::IdentityEntry& e : *ids) {
      if (!ValidRights(e.rights)) Fail("identity rights out of range", text);
      if (e.value.empty() || e.value.size() > auth::kMaxIdentityLength) Fail("identity length", e.value);
      for (char c : e.value) {
        if (static_cast<unsigned char>(c) < 0x20 || static_cast<unsigned char>(c) > 0x7e) Fail("identity not printable", e.value);
      }
    }
  }
  return 0;
}
