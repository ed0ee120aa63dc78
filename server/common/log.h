// Minimal leveled logging to stderr. Abseil 20220623 (Debian 12) has no logging library, and the
// server logs only a handful of lines (startup, capability warnings, kernel errors, shutdown), so a
// formatted write under a mutex is all that is needed.
#pragma once

#include <string_view>

#include "absl/strings/str_cat.h"

namespace fusedlayer::server {

enum class LogLevel { kInfo, kWarning, kError };

// Writes "<L> <UTC time> <message>\n" atomically with respect to other log lines.
void LogLine(LogLevel level, std::string_view message);

template <typename... Args>
void LogInfo(const Args&... args) { LogLine(LogLevel::kInfo, absl::StrCat(args...)); }
template <typename... Args>
void LogWarning(const Args&... args) { LogLine(LogLevel::kWarning, absl::StrCat(args...)); }
template <typename... Args>
void LogError(const Args&... args) { LogLine(LogLevel::kError, absl::StrCat(args...)); }

}  // namespace fusedlayer::server
