// Parsing and validation helpers of `fusedctl`, free of flags and I/O so they are unit-tested.
#pragma once

#include <cstdint>
#include <set>
#include <string>
#include "absl/strings/string_view.h"
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "fusedlayer/v1/fusedlayer.pb.h"

namespace fusedlayer::client {

namespace v1 = ::fusedlayer::v1;

// --path=auto|require_fused|force_unfused
absl::StatusOr<v1::PathPreference> ParsePathPreference(absl::string_view s);
// --mode=shifted|normal
absl::StatusOr<v1::MhcMode> ParseMhcMode(absl::string_view s);
// --stage=seam|first|head
absl::StatusOr<v1::MhcStage> ParseMhcStage(absl::string_view s);

enum class BenchOp { kMhc, kSwa };
// --op=mhc|swa (the metrics' op label values)
absl::StatusOr<BenchOp> ParseBenchOp(absl::string_view s);

// Lower-case names as in the metrics labels and the server log: "fused", "too_many_tokens", "none",
// "auto", "shifted", "seam", "e4m3fn", "ue8m0", "column_major_tma".
std::string PathName(v1::ExecutionPath p);
std::string ReasonName(v1::FallbackReason r);
std::string PathPreferenceName(v1::PathPreference p);
std::string MhcModeName(v1::MhcMode m);
std::string MhcStageName(v1::MhcStage s);
std::string Fp8FormatName(v1::Fp8Format f);
std::string ScaleFormatName(v1::ScaleFormat f);
std::string ScaleLayoutName(v1::ScaleLayout l);

// The commands and, for each, the command-specific flags it accepts. Global flags (--target,
// --deadline, --max_message_bytes) apply to all commands.
struct CommandInfo {
  std::string name;
  std::string usage;                 // "seam --weight_set=NAME [--tokens=T] ..."
  int positional_args = 0;           // exact number of positional arguments after the command
  std::vector<std::string> flags;    // command-specific flags it accepts
};
const std::vector<CommandInfo>& Commands();
const CommandInfo* FindCommand(absl::string_view name);
// Every command-specific flag name (the union of CommandInfo::flags).
std::set<std::string> AllCommandFlags();

// --duration: plain seconds ("10", "2.5") or an Abseil duration ("10s", "1m30s"); positive.
absl::StatusOr<absl::Duration> ParseDurationFlag(absl::string_view s);

// Rejects a command-specific flag set on the command line that the command does not use (a typo
// such as `fusedctl swa --stage=head` would otherwise be ignored silently), and a wrong number of
// positional arguments. InvalidArgument with a one-line message.
absl::Status CheckCommandLine(const CommandInfo& command, const std::set<std::string>& specified_flags,
                              size_t positional_args);

// Names of the flags written on the command line (`--name`, `--name=value`, `-name`, and `--noname`
// for booleans, which counts as `name`), scanning up to a bare `--`. Abseil 20220623 keeps
// CommandLineFlag::IsSpecifiedOnCommandLine private, and comparing with the default value cannot
// tell `--tokens=16` from no flag.
std::set<std::string> FlagsOnCommandLine(const std::vector<std::string>& argv, const std::set<std::string>& known);

// Replaces newlines so an error prints as one line.
std::string OneLine(absl::string_view s);
// "fusedctl: error: UNAVAILABLE: failed to connect to all addresses ..."
std::string ErrorLine(const absl::Status& status);

// "12.3 us", "4.56 ms", "1.23 s"
std::string FormatSeconds(double s);
// "1.5 KiB", "4.0 MiB"
std::string FormatBytes(double bytes);

}  // namespace fusedlayer::client
