#include "config.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/strings/ascii.h"

namespace fusedlayer::server {

const char* OpName(Op op) { return op == Op::kMhc ? "mhc" : "swa"; }

absl::Status ServerConfig::Validate() const {
  if (address.empty()) return absl::InvalidArgumentError("--address must not be empty");
  if (fused_max_tokens < 0) {
    return absl::InvalidArgumentError(absl::StrCat("--fused_max_tokens must be >= 0, got ", fused_max_tokens));
  }
  if (max_tokens < 1) return absl::InvalidArgumentError(absl::StrCat("--max_tokens must be >= 1, got ", max_tokens));
  // gRPC takes int limits; protobuf cannot serialise a message of 2 GiB or more.
  if (max_message_bytes < 1024 || max_message_bytes > int64_t{INT32_MAX}) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max_message_bytes must be in [1024, 2^31 - 1], got ", max_message_bytes));
  }
  if (max_batch_tokens < 0 || max_batch_tokens > (int64_t{1} << 20)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max_batch_tokens must be in [0, 1048576], got ", max_batch_tokens));
  }
  // A minute is far beyond any useful batching delay; the bound keeps the conversion exact.
  if (max_queue_delay_us < 0 || max_queue_delay_us > 60'000'000) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max_queue_delay_us must be in [0, 60000000], got ", max_queue_delay_us));
  }
  if (queue_capacity < 1) {
    return absl::InvalidArgumentError(absl::StrCat("--queue_capacity must be >= 1, got ", queue_capacity));
  }
  if (cpu_threads < 0) return absl::InvalidArgumentError(absl::StrCat("--cpu_threads must be >= 0, got ", cpu_threads));
  if (!(max_connection_age_seconds >= 0) || max_connection_age_seconds > 1e6) {
    return absl::InvalidArgumentError(absl::StrCat("--max_connection_age_seconds must be in [0, 1e6], got ",
                                                   max_connection_age_seconds));
  }
  if (!(drain_seconds >= 0)) {
    return absl::InvalidArgumentError(absl::StrCat("--drain_seconds must be >= 0, got ", drain_seconds));
  }
  if (!(shadow_sample_rate >= 0 && shadow_sample_rate <= 1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--shadow_sample_rate must be in [0, 1], got ", shadow_sample_rate));
  }
  if (shadow_queue_size < 1 || shadow_queue_size > 1024) {
    return absl::InvalidArgumentError(absl::StrCat("--shadow_queue_size must be in [1, 1024], got ", shadow_queue_size));
  }
  if (shadow_queue_max_bytes < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--shadow_queue_max_bytes must be >= 1, got ", shadow_queue_max_bytes));
  }
  if (shadow_dump_max_files < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--shadow_dump_max_files must be >= 0, got ", shadow_dump_max_files));
  }
  if (shadow_dump_max_bytes < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--shadow_dump_max_bytes must be >= 0, got ", shadow_dump_max_bytes));
  }
  return absl::OkStatus();
}

absl::Status ParseDisableFused(std::string_view list, ServerConfig& config) {
  config.disable_fused_mhc = false;
  config.disable_fused_swa = false;
  for (absl::string_view item : absl::StrSplit(absl::string_view(list.data(), list.size()), ',', absl::SkipWhitespace())) {
    item = absl::StripAsciiWhitespace(item);
    if (item == "mhc") {
      config.disable_fused_mhc = true;
    } else if (item == "swa") {
      config.disable_fused_swa = true;
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat("--disable_fused: unknown op '", item, "' (want a comma-separated list of mhc, swa)"));
    }
  }
  return absl::OkStatus();
}

}  // namespace fusedlayer::server
