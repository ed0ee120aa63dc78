#include "auth/small_file.h"

#include <fstream>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace fusedlayer::server::auth {

absl::StatusOr<std::string> ReadSmallFile(const std::string& path, absl::string_view what) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::InvalidArgumentError(absl::StrCat(path, ": cannot open the ", what));
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) return absl::InvalidArgumentError(absl::StrCat(path, ": cannot read the ", what));
  return ss.str();
}

EntryLines::EntryLines(absl::string_view contents, absl::string_view source)
    : lines_(absl::StrSplit(contents, '\n')), source_(source) {}

bool EntryLines::Next(absl::string_view* line) {
  while (next_ < lines_.size()) {
    const absl::string_view stripped = absl::StripAsciiWhitespace(lines_[next_]);
    ++next_;
    if (stripped.empty() || stripped.front() == '#') continue;
    line_no_ = static_cast<int>(next_);
    *line = stripped;
    return true;
  }
  return false;
}

absl::Status EntryLines::Error(absl::string_view why) const {
  return absl::InvalidArgumentError(absl::StrCat(source_, ":", line_no_, ": ", why));
}

}  // namespace fusedlayer::server::auth
