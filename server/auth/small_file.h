// The small line-per-entry text files of the server's auth flags (--auth_tokens_file,
// --auth_identities_file; formats in auth/token_file.h and auth/identity_file.h): reading one
// whole, and walking its entry lines with errors that name the file and the line. Both loaders and
// both parsers use these, so the two files read, skip and report alike.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace fusedlayer::server::auth {

// The whole contents of `path`, read as bytes (no newline translation: EntryLines strips a CR).
// `what` names the kind of file in the errors, e.g. "token file": InvalidArgument
// "<path>: cannot open the <what>" when it cannot be opened, "<path>: cannot read the <what>" when
// reading it fails. No size limit: these files hold a line per client.
absl::StatusOr<std::string> ReadSmallFile(const std::string& path, absl::string_view what);

// The entry lines of such a file's contents, in order: every '\n'-separated line stripped of
// surrounding ASCII white space (which also drops the CR of a CRLF file), except blank lines and
// comments (a line whose first non-blank character is '#'). Line numbers count every line from 1,
// blank and comment lines included. `contents` and `source` must outlive the reader.
//
//   EntryLines lines(contents, source);
//   for (absl::string_view line; lines.Next(&line);) {
//     if (bad) return lines.Error("why");
//   }
class EntryLines {
 public:
  // `source` names the file in Error()'s messages.
  EntryLines(absl::string_view contents, absl::string_view source);

  // Sets *line to the next entry line; false when there is none left.
  bool Next(absl::string_view* line);

  // InvalidArgument "<source>:<line number>: <why>" for the line Next() returned last.
  absl::Status Error(absl::string_view why) const;

 private:
  std::vector<absl::string_view> lines_;
  absl::string_view source_;
  size_t next_ = 0;  // index into lines_ of the line Next() looks at first; its number is next_ + 1
  int line_no_ = 0;  // number of the line Next() returned last
};

}  // namespace fusedlayer::server::auth
