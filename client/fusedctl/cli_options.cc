#include "client/fusedctl/cli_options.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/strip.h"

namespace fusedlayer::client {

namespace {

// "FALLBACK_REASON_TOO_MANY_TOKENS" -> "too_many_tokens" (the proto enum names are the reason
// names with a prefix, by construction of the API).
std::string StripLower(const std::string& enum_name, absl::string_view prefix) {
  std::string s = enum_name;
  if (absl::StartsWith(s, prefix)) s = s.substr(prefix.size());
  return absl::AsciiStrToLower(s);
}

template <typename E>
absl::StatusOr<E> ParseChoice(absl::string_view flag, absl::string_view s,
                              std::initializer_list<std::pair<absl::string_view, E>> choices) {
  std::vector<absl::string_view> names;
  for (const auto& [name, value] : choices) {
    if (s == name) return value;
    names.push_back(name);
  }
  return absl::InvalidArgumentError(
      absl::StrCat("--", flag, "=", s, " is not one of ", absl::StrJoin(names, "|")));
}

}  // namespace

absl::StatusOr<v1::PathPreference> ParsePathPreference(absl::string_view s) {
  return ParseChoice<v1::PathPreference>("path", s,
                                         {{"auto", v1::PATH_PREFERENCE_AUTO},
                                          {"require_fused", v1::PATH_PREFERENCE_REQUIRE_FUSED},
                                          {"force_unfused", v1::PATH_PREFERENCE_FORCE_UNFUSED}});
}

absl::StatusOr<v1::MhcMode> ParseMhcMode(absl::string_view s) {
  return ParseChoice<v1::MhcMode>("mode", s, {{"shifted", v1::MHC_MODE_SHIFTED}, {"normal", v1::MHC_MODE_NORMAL}});
}

absl::StatusOr<v1::MhcStage> ParseMhcStage(absl::string_view s) {
  return ParseChoice<v1::MhcStage>(
      "stage", s, {{"seam", v1::MHC_STAGE_SEAM}, {"first", v1::MHC_STAGE_FIRST}, {"head", v1::MHC_STAGE_HEAD}});
}

absl::StatusOr<BenchOp> ParseBenchOp(absl::string_view s) {
  return ParseChoice<BenchOp>("op", s, {{"mhc", BenchOp::kMhc}, {"swa", BenchOp::kSwa}});
}

std::string PathName(v1::ExecutionPath p) { return StripLower(v1::ExecutionPath_Name(p), "EXECUTION_PATH_"); }
std::string ReasonName(v1::FallbackReason r) { return StripLower(v1::FallbackReason_Name(r), "FALLBACK_REASON_"); }
std::string PathPreferenceName(v1::PathPreference p) {
  return StripLower(v1::PathPreference_Name(p), "PATH_PREFERENCE_");
}
std::string MhcModeName(v1::MhcMode m) { return StripLower(v1::MhcMode_Name(m), "MHC_MODE_"); }
std::string MhcStageName(v1::MhcStage s) { return StripLower(v1::MhcStage_Name(s), "MHC_STAGE_"); }
std::string Fp8FormatName(v1::Fp8Format f) { return StripLower(v1::Fp8Format_Name(f), "FP8_FORMAT_"); }
std::string ScaleFormatName(v1::ScaleFormat f) { return StripLower(v1::ScaleFormat_Name(f), "SCALE_FORMAT_"); }
std::string ScaleLayoutName(v1::ScaleLayout l) { return StripLower(v1::ScaleLayout_Name(l), "SCALE_LAYOUT_"); }

absl::StatusOr<absl::Duration> ParseDurationFlag(absl::string_view s) {
  absl::Duration d;
  double seconds = 0;
  if (absl::SimpleAtod(s, &seconds) && std::isfinite(seconds)) {
    d = absl::Seconds(seconds);
  } else if (!absl::ParseDuration(s, &d)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--duration=", s, " is not a duration (seconds, or e.g. 10s, 1m30s)"));
  }
  if (d <= absl::ZeroDuration() || d == absl::InfiniteDuration()) {
    return absl::InvalidArgumentError(absl::StrCat("--duration=", s, " must be positive and finite"));
  }
  return d;
}

const std::vector<CommandInfo>& Commands() {
  static const std::vector<CommandInfo> kCommands = {
      {"info", "info", 0, {}},
      {"health", "health [--service=NAME]", 0, {"service"}},
      {"load", "load MANIFEST.json [--replace] [--chunk_bytes=N]", 1, {"replace", "chunk_bytes"}},
      {"list", "list", 0, {}},
      {"unload", "unload NAME", 1, {}},
      {"sessions", "sessions", 0, {}},
      {"close-session", "close-session NAME", 1, {}},
      {"seam",
       "seam --weight_set=NAME [--tokens=T] [--mode=shifted|normal] [--stage=seam|first|head] [--no_pre_mix] "
       "[--capture_aux] [--path=auto|require_fused|force_unfused] [--input=FILE] [--output=FILE] [--seed=S] [--verify] "
       "[--transport=tcp|shm|cuda_ipc|ring|ring_cuda_ipc] [--session=NAME [--return_state]] [--device_id=D] "
       "[--cuda_device=G]",
       0,
       {"weight_set", "tokens", "mode", "stage", "no_pre_mix", "capture_aux", "path", "input", "output", "seed",
        "verify", "transport", "session", "return_state", "device_id", "cuda_device"}},
      {"swa",
       "swa --weight_set=NAME [--tokens=M] [--row_stride=S] [--path=...] [--input=FILE] [--output=FILE] [--seed=S] [--verify] "
       "[--transport=tcp|shm|cuda_ipc|ring|ring_cuda_ipc] [--device_id=D] [--cuda_device=G]",
       0,
       {"weight_set", "tokens", "row_stride", "path", "input", "output", "seed", "verify", "transport", "device_id",
        "cuda_device"}},
      {"bench",
       "bench --op=mhc|swa --weight_set=NAME --tokens=T --concurrency=N --duration=SECONDS [--connections=K] "
       "[--path=...] [--mode=...] [--stage=...] [--no_pre_mix] [--capture_aux] [--row_stride=S] [--seed=S] "
       "[--echo_floor] [--copy_requests] "
       "[--transport=tcp|shm|cuda_ipc|session|ring|ring_cuda_ipc] [--cuda_device=G]",
       0,
       {"op", "weight_set", "tokens", "concurrency", "connections", "duration", "path", "mode", "stage", "no_pre_mix",
        "capture_aux", "row_stride", "seed", "echo_floor", "copy_requests", "transport", "cuda_device"}},
      {"soak",
       "soak --concurrency=N --duration=SECONDS [--warmup=SECONDS] [--server_pid=PID] [--max_rss_growth_mb=MB] "
       "[--seed=S] [--churn] [--compute_token_file=FILE]",
       0,
       {"concurrency", "duration", "warmup", "server_pid", "max_rss_growth_mb", "seed", "churn", "compute_token_file"}},
      {"replay", "replay --dump=FILE (a shadow mismatch dump; exit 3 when the mismatch reproduces)", 0, {"dump"}},
      {"import-checkpoint",
       "import-checkpoint DIR [--output=manifest.json] [--layers=A-B] [--prefix=P] (a DeepSeek-V4/V4.1 folder -> a "
       "manifest of sets P/L0/attn, ...; no server)",
       1,
       {"output", "layers", "prefix"}},
  };
  return kCommands;
}

const CommandInfo* FindCommand(absl::string_view name) {
  for (const CommandInfo& c : Commands()) {
    if (c.name == name) return &c;
  }
  return nullptr;
}

std::set<std::string> AllCommandFlags() {
  std::set<std::string> all;
  for (const CommandInfo& c : Commands()) all.insert(c.flags.begin(), c.flags.end());
  return all;
}

absl::Status CheckCommandLine(const CommandInfo& command, const std::set<std::string>& specified_flags,
                              size_t positional_args) {
  if (positional_args != size_t(command.positional_args)) {
    return absl::InvalidArgumentError(absl::StrCat("'", command.name, "' takes ", command.positional_args,
                                                   " argument(s), got ", positional_args, "; usage: fusedctl ",
                                                   command.usage));
  }
  const std::set<std::string> all = AllCommandFlags();
  for (const std::string& f : specified_flags) {
    if (all.count(f) == 0) continue;  // a global flag
    if (std::find(command.flags.begin(), command.flags.end(), f) == command.flags.end()) {
      return absl::InvalidArgumentError(absl::StrCat("--", f, " does not apply to '", command.name,
                                                     "'; usage: fusedctl ", command.usage));
    }
  }
  return absl::OkStatus();
}

std::set<std::string> FlagsOnCommandLine(const std::vector<std::string>& argv, const std::set<std::string>& known) {
  std::set<std::string> out;
  for (size_t i = 1; i < argv.size(); ++i) {
    absl::string_view a = argv[i];
    if (a == "--") break;
    if (!absl::ConsumePrefix(&a, "--") && !absl::ConsumePrefix(&a, "-")) continue;
    std::string name(a.substr(0, a.find('=')));
    if (known.count(name) == 0 && absl::StartsWith(name, "no") && known.count(name.substr(2))) name = name.substr(2);
    if (known.count(name)) out.insert(name);
  }
  return out;
}

std::string OneLine(absl::string_view s) {
  std::string out = absl::StrReplaceAll(s, {{"\r\n", "; "}, {"\n", "; "}, {"\r", "; "}});
  return out;
}

std::string ErrorLine(const absl::Status& status) {
  return absl::StrCat("fusedctl: error: ", absl::StatusCodeToString(status.code()), ": ", OneLine(status.message()));
}

std::string FormatSeconds(double s) {
  if (!std::isfinite(s)) return "n/a";
  const double a = std::fabs(s);
  if (a < 1e-3) return absl::StrFormat("%.1f us", s * 1e6);
  if (a < 1.0) return absl::StrFormat("%.3f ms", s * 1e3);
  return absl::StrFormat("%.3f s", s);
}

std::string FormatBytes(double bytes) {
  static constexpr const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (std::fabs(bytes) >= 1024.0 && u < 4) {
    bytes /= 1024.0;
    ++u;
  }
  return u == 0 ? absl::StrFormat("%.0f B", bytes) : absl::StrFormat("%.1f %s", bytes, kUnits[u]);
}

}  // namespace fusedlayer::client
