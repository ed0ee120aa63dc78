#include "common/log.h"

#include <cstdio>
#include <mutex>

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace fusedlayer::server {

void LogLine(LogLevel level, std::string_view message) {
  static std::mutex mu;
  const char tag = level == LogLevel::kInfo ? 'I' : level == LogLevel::kWarning ? 'W' : 'E';
  const std::string when = absl::FormatTime("%Y-%m-%dT%H:%M:%E6SZ", absl::Now(), absl::UTCTimeZone());
  std::lock_guard<std::mutex> lock(mu);
  std::fprintf(stderr, "%c %s %.*s\n", tag, when.c_str(), static_cast<int>(message.size()), message.data());
  std::fflush(stderr);
}

}  // namespace fusedlayer::server
