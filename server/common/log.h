// Minimal leveled logging to stderr. Abseil 20220623 (Debian 12) has no logging library, and the
// server logs only a handful of lines (startup, capability warnings, kernel errors, shutdown), so a
// formatted write under a mutex is all that is needed.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

#include "absl/strings/str_cat.h"

namespace fusedlayer::server {

enum class LogLevel { kInfo, kWarning, kError };

// Writes "<L> <UTC time> <message>\n" atomically with respect to other log lines.
void LogLine(LogLevel level, std::string_view message);

// A client-supplied string (request_id, a weight-set name not yet validated) made safe to log or
// echo: at most `max_bytes` of it, with control characters, quotes, backslashes and non-ASCII bytes
// C-escaped (\n, \x1b, ...), so it can neither forge log lines nor grow them without bound;
// "...(N bytes)" marks a cut.
std::string ClientString(std::string_view s, size_t max_bytes = 128);

template <typename... Args>
void LogInfo(const Args&... args) { LogLine(LogLevel::kInfo, absl::StrCat(args...)); }
template <typename... Args>
void LogWarning(const Args&... args) { LogLine(LogLevel::kWarning, absl::StrCat(args...)); }
template <typename... Args>
void LogError(const Args&... args) { LogLine(LogLevel::kError, absl::StrCat(args...)); }

}  // namespace fusedlayer::server
