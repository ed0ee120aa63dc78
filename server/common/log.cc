#include "common/log.h"

#include <cstdio>
#include <mutex>

#include "absl/strings/escaping.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace fusedlayer::server {

std::string ClientString(std::string_view s, size_t max_bytes) {
  const bool cut = s.size() > max_bytes;
  std::string out = absl::CHexEscape(absl::string_view(s.data(), cut ? max_bytes : s.size()));
  if (cut) absl::StrAppend(&out, "...(", s.size(), " bytes)");
  return out;
}

void LogLine(LogLevel level, std::string_view message) {
  static std::mutex mu;
  const char tag = level == LogLevel::kInfo ? 'I' : level == LogLevel::kWarning ? 'W' : 'E';
  const std::string when = absl::FormatTime("%Y-%m-%dT%H:%M:%E6SZ", absl::Now(), absl::UTCTimeZone());
  std::lock_guard<std::mutex> lock(mu);
  std::fprintf(stderr, "%c %s %.*s\n", tag, when.c_str(), static_cast<int>(message.size()), message.data());
  std::fflush(stderr);
}

}  // namespace fusedlayer::server
