#include "config.h"

#include <algorithm>
#include <tuple>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/strings/ascii.h"
#include "common/byte_budget.h"

namespace fusedlayer::server {

const char* OpName(Op op) { return op == Op::kMhc ? "mhc" : "swa"; }

// gRPC's URI prefixes for unix domain sockets (chttp2_server.cc in gRPC 1.51).
constexpr std::string_view kUnixPrefix = "unix:";
constexpr std::string_view kUnixAbstractPrefix = "unix-abstract:";
// sizeof(sockaddr_un::sun_path) on Linux. A path needs its terminating NUL in it, an abstract name
// its leading NUL: either way at most 107 bytes (gRPC 1.51 refuses longer ones with a generic error).
constexpr size_t kSunPathBytes = 108;

ListenKind ListenKindOf(std::string_view address) {
  if (address.substr(0, kUnixAbstractPrefix.size()) == kUnixAbstractPrefix) return ListenKind::kUnixAbstract;
  if (address.substr(0, kUnixPrefix.size()) == kUnixPrefix) return ListenKind::kUnix;
  return ListenKind::kTcp;
}

std::string UnixSocketPath(std::string_view address) {
  if (ListenKindOf(address) != ListenKind::kUnix) return "";
  return std::string(address.substr(kUnixPrefix.size()));
}

std::string UnixAbstractName(std::string_view address) {
  if (ListenKindOf(address) != ListenKind::kUnixAbstract) return "";
  return std::string(address.substr(kUnixAbstractPrefix.size()));
}

namespace {
// When the memory cannot be read at all (no /proc, no cgroup): a conservative 16 GiB machine.
uint64_t MemoryForDefaults() {
  const uint64_t bytes = AvailableMemoryBytes();
  return bytes > 0 ? bytes : uint64_t{16} << 30;
}
}  // namespace

uint64_t ServerConfig::EffectiveMaxInflightBytes() const {
  return max_inflight_bytes > 0 ? max_inflight_bytes : MemoryForDefaults() / 4;
}

uint64_t ServerConfig::EffectiveGrpcMemoryQuotaBytes() const {
  return grpc_memory_quota_bytes > 0 ? grpc_memory_quota_bytes : MemoryForDefaults() / 2;
}

uint64_t ServerConfig::EffectiveMaxUploadBufferBytes() const {
  return max_upload_buffer_bytes > 0 ? max_upload_buffer_bytes : MemoryForDefaults() / 4;
}

uint64_t ServerConfig::EffectiveResidualSessionTotalBytes() const {
  return residual_session_total_bytes > 0 ? residual_session_total_bytes : MemoryForDefaults() / 4;
}

absl::StatusOr<std::vector<int>> ParseDeviceList(const std::string& spec, int visible_gpus) {
  constexpr int kMaxDevices = 64;
  std::vector<int> ids;
  if (spec.empty()) return std::vector<int>{0};
  if (spec == "all") {
    for (int i = 0; i < std::max(visible_gpus, 1); ++i) ids.push_back(i);
    return ids;
  }
  for (absl::string_view part : absl::StrSplit(spec, ',')) {
    int id = -1;
    if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(part), &id) || id < 0 || id >= 1024) {
      return absl::InvalidArgumentError(absl::StrCat("--devices=", spec, ": \"", part,
                                                     "\" is not a device index (want all, or a list like 0,1)"));
    }
    if (std::find(ids.begin(), ids.end(), id) != ids.end()) {
      return absl::InvalidArgumentError(absl::StrCat("--devices=", spec, ": device ", id, " is listed twice"));
    }
    ids.push_back(id);
  }
  if (ids.size() > kMaxDevices) {
    return absl::InvalidArgumentError(absl::StrCat("--devices=", spec, ": at most ", kMaxDevices, " devices"));
  }
  return ids;
}

absl::Status ServerConfig::Validate() const {
  if (absl::StatusOr<std::vector<int>> ids = ParseDeviceList(devices, 0); !ids.ok()) return ids.status();
  if (address.empty()) return absl::InvalidArgumentError("--address must not be empty");
  if (const ListenKind kind = ListenKindOf(address); kind != ListenKind::kTcp) {
    const bool abstract = kind == ListenKind::kUnixAbstract;
    const size_t name_bytes = address.size() - (abstract ? kUnixAbstractPrefix : kUnixPrefix).size();
    // gRPC would only say "cannot listen" (or truncate silently) for these.
    if (name_bytes == 0) {
      return absl::InvalidArgumentError(absl::StrCat("--address=", address, ": the ",
                                                     abstract ? "abstract socket name" : "socket path", " is empty"));
    }
    if (name_bytes >= kSunPathBytes) {
      return absl::InvalidArgumentError(absl::StrCat("--address=", address, ": the ",
                                                     abstract ? "abstract socket name" : "socket path", " is ",
                                                     name_bytes, " bytes; a unix socket allows at most ",
                                                     kSunPathBytes - 1));
    }
  }
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
  // Spinning longer than 10 ms only burns a core: a request that far apart pays nothing for a wake-up.
  if (executor_spin_us < -1 || executor_spin_us > 10'000) {
    return absl::InvalidArgumentError(
        absl::StrCat("--executor_spin_us must be in [0, 10000] or -1 (auto), got ", executor_spin_us));
  }
  if (device_lanes < 0 || device_lanes > 16) {
    return absl::InvalidArgumentError(absl::StrCat("--device_lanes must be in [0, 16] (0: auto), got ", device_lanes));
  }
  if (host_copy_threads < -1 || host_copy_threads > 64) {
    return absl::InvalidArgumentError(
        absl::StrCat("--host_copy_threads must be -1 (auto) or in [0, 64], got ", host_copy_threads));
  }
  if (host_staging_bytes < (uint64_t{1} << 20)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--host_staging_bytes must be at least 1 MiB (1048576), got ", host_staging_bytes));
  }
  if (request_staging_bytes != 0 && request_staging_bytes < (uint64_t{1} << 20)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--request_staging_bytes must be 0 (off) or at least 1 MiB (1048576), got ", request_staging_bytes));
  }
  if (queue_capacity < 1) {
    return absl::InvalidArgumentError(absl::StrCat("--queue_capacity must be >= 1, got ", queue_capacity));
  }
  if (max_concurrent_streams < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max_concurrent_streams must be >= 1, got ", max_concurrent_streams));
  }
  // The quota must leave room for at least one message being received and one being sent.
  if (grpc_memory_quota_bytes != 0 && grpc_memory_quota_bytes < 2 * static_cast<uint64_t>(max_message_bytes)) {
    return absl::InvalidArgumentError(absl::StrCat("--grpc_memory_quota_bytes must be 0 (derived) or at least twice ",
                                                   "--max_message_bytes (", 2 * max_message_bytes, "), got ",
                                                   grpc_memory_quota_bytes));
  }
  if (max_concurrent_uploads < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max_concurrent_uploads must be >= 1, got ", max_concurrent_uploads));
  }
  if (upload_idle_timeout_seconds < 1 || upload_idle_timeout_seconds > 3600) {
    return absl::InvalidArgumentError(
        absl::StrCat("--upload_idle_timeout_seconds must be in [1, 3600], got ", upload_idle_timeout_seconds));
  }
  if (max_weight_payload_bytes < 1) {
    return absl::InvalidArgumentError("--max_weight_payload_bytes must be >= 1");
  }
  // Each registered region holds one open descriptor.
  if (shared_memory_max_regions < 1 || shared_memory_max_regions > 4096) {
    return absl::InvalidArgumentError(
        absl::StrCat("--shared_memory_max_regions must be in [1, 4096], got ", shared_memory_max_regions));
  }
  if (shared_memory_max_bytes < 1) return absl::InvalidArgumentError("--shared_memory_max_bytes must be >= 1");
  if (descriptor_reserve < 16 || descriptor_reserve > (int64_t{1} << 20)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--descriptor_reserve must be in [16, 1048576], got ", descriptor_reserve));
  }
  if (cuda_shared_memory_max_regions < 1 || cuda_shared_memory_max_regions > 4096) {
    return absl::InvalidArgumentError(absl::StrCat("--cuda_shared_memory_max_regions must be in [1, 4096], got ",
                                                   cuda_shared_memory_max_regions));
  }
  if (cuda_shared_memory_max_bytes < 1) {
    return absl::InvalidArgumentError("--cuda_shared_memory_max_bytes must be >= 1");
  }
  for (auto [flag, value] : {std::pair{"--shared_memory_idle_seconds", shared_memory_idle_seconds},
                             {"--cuda_shared_memory_idle_seconds", cuda_shared_memory_idle_seconds}}) {
    if (!(value >= 0 && value <= 604800)) {  // NaN fails too
      return absl::InvalidArgumentError(absl::StrCat(flag, " must be in [0, 604800] (0 = never), got ", value));
    }
  }
  for (const auto& [name, value, lo, hi] :
       {std::tuple<const char*, int64_t, int64_t, int64_t>{"call_ring_max_rings", call_ring_max_rings, 1, 4096},
        {"call_ring_max_per_identity", call_ring_max_per_identity, 1, 4096},
        {"call_ring_max_slots", call_ring_max_slots, 1, 1024},
        {"call_ring_spin_us", call_ring_spin_us, 0, 100000},
        {"call_ring_pollers", call_ring_pollers, 0, 64}}) {
    if (value < lo || value > hi) {
      return absl::InvalidArgumentError(absl::StrCat("--", name, " must be in [", lo, ", ", hi, "], got ", value));
    }
  }
  if (residual_session_max_sessions < 0 || residual_session_max_sessions > 65536) {
    return absl::InvalidArgumentError(absl::StrCat("--residual_session_max_sessions must be in [0, 65536], got ",
                                                   residual_session_max_sessions));
  }
  if (residual_session_max_bytes < 1) return absl::InvalidArgumentError("--residual_session_max_bytes must be >= 1");
  if (!(residual_session_idle_seconds >= 1 && residual_session_idle_seconds <= 86400)) {
    return absl::InvalidArgumentError(absl::StrCat("--residual_session_idle_seconds must be in [1, 86400], got ",
                                                   residual_session_idle_seconds));
  }
  if (malloc_arena_max < 0 || malloc_arena_max > 1024) {
    return absl::InvalidArgumentError(absl::StrCat("--malloc_arena_max must be in [0, 1024], got ", malloc_arena_max));
  }
  // glibc's mallopt refuses an mmap threshold above HEAP_MAX_SIZE / 2 (32 MiB on 64-bit).
  if (malloc_mmap_threshold_bytes < 0 || malloc_mmap_threshold_bytes > (int64_t{32} << 20)) {
    return absl::InvalidArgumentError(absl::StrCat("--malloc_mmap_threshold_bytes must be in [0, 33554432], got ",
                                                   malloc_mmap_threshold_bytes));
  }
  // mallopt takes an int; 4 GiB would not fit, 2 GiB - 1 does.
  if (malloc_trim_threshold_bytes < 0 || malloc_trim_threshold_bytes > INT32_MAX) {
    return absl::InvalidArgumentError(absl::StrCat("--malloc_trim_threshold_bytes must be in [0, 2147483647], got ",
                                                   malloc_trim_threshold_bytes));
  }
  if (cpu_threads < 0) return absl::InvalidArgumentError(absl::StrCat("--cpu_threads must be >= 0, got ", cpu_threads));
  if (!(max_connection_age_seconds >= 0) || max_connection_age_seconds > 1e6) {
    return absl::InvalidArgumentError(absl::StrCat("--max_connection_age_seconds must be in [0, 1e6], got ",
                                                   max_connection_age_seconds));
  }
  // Bounded: it becomes a millisecond int channel argument (GRPC_ARG_MAX_CONNECTION_AGE_GRACE_MS),
  // and a drain longer than an hour is no drain.
  if (!(drain_seconds >= 0 && drain_seconds <= 3600)) {
    return absl::InvalidArgumentError(absl::StrCat("--drain_seconds must be in [0, 3600], got ", drain_seconds));
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
  if (max_inflight_verify < 0 || max_inflight_verify > 1024) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max_inflight_verify must be in [0, 1024], got ", max_inflight_verify));
  }
  if (verify_dump_max_files < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--verify_dump_max_files must be >= 0, got ", verify_dump_max_files));
  }
  if (verify_dump_max_bytes < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--verify_dump_max_bytes must be >= 0, got ", verify_dump_max_bytes));
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
