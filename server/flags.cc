#include "flags.h"

#include <algorithm>
#include <cstdint>
#include <set>
#include <string>
#include <vector>

#include "absl/flags/commandlineflag.h"
#include "absl/flags/flag.h"
#include "absl/flags/reflection.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/log.h"

ABSL_FLAG(std::string, address, "0.0.0.0:50051",
          "gRPC listen address: host:port, unix:/path/to.sock (unix domain socket) or unix-abstract:NAME "
          "(Linux abstract socket)");
ABSL_FLAG(std::string, metrics_address, "0.0.0.0:9464",
          "Prometheus /metrics listen address (host:port); empty disables the HTTP endpoint");
ABSL_FLAG(std::string, backend, "auto", "compute backend: auto (a GPU when present, else cpu), cpu, cuda, hip");
ABSL_FLAG(std::string, devices, "",
          "the devices one server serves on: empty = the first (GPU 0, or one CPU device), all = every GPU this "
          "process sees, or a list of GPU indices 0,1,...; on the CPU backend a list of N numbers splits the cores "
          "into N devices. Weight sets are resident on every device; a call runs on the device of its CUDA "
          "shared-memory tensors or session, on the one it names (device_id), else on the least-loaded");
ABSL_FLAG(bool, demo_weights, false,
          "load the seeded random demo weight sets v41-flash/demo and v4-pro/demo at startup");
ABSL_FLAG(std::string, weights_manifest, "", "JSON manifest of weight sets (safetensors) to load at startup");
ABSL_FLAG(std::string, disable_fused, "",
          "comma-separated ops whose fused path is switched off (mhc, swa): the operator kill switch");
ABSL_FLAG(int64_t, fused_max_tokens, int64_t{1} << 20,
          "largest token count the fused paths run; above it requests fall back (too_many_tokens)");
ABSL_FLAG(int64_t, max_tokens, int64_t{1} << 20, "largest token count accepted; above it INVALID_ARGUMENT");
ABSL_FLAG(int64_t, max_message_bytes, int64_t{1} << 30,
          "largest gRPC message received or sent, bytes (T=4096 at C=7168 needs ~470 MB)");
ABSL_FLAG(int32_t, queue_capacity, 64, "device executor queue length; when full, RESOURCE_EXHAUSTED");
ABSL_FLAG(int64_t, max_batch_tokens, 0,
          "dynamic batching: compatible queued requests share one launch up to this many tokens (0: off; 64 is "
          "a decode-sized budget)");
ABSL_FLAG(int64_t, max_queue_delay_us, 0,
          "dynamic batching: how long (microseconds) a request may wait for compatible ones to join its launch "
          "(0: only requests already queued)");
ABSL_FLAG(int64_t, executor_spin_us, -1,
          "how long (microseconds) an idle executor worker polls its queue before it sleeps, so a request that "
          "arrives meanwhile starts without a thread wake-up (one worker spins at a time, only after work; 0: never; "
          "-1 = auto: 500 on a GPU; on the CPU backend --call_ring_spin_us with --allow_call_rings, else 0)");
ABSL_FLAG(int32_t, device_lanes, 0,
          "GPU: lanes (streams, each with its own executor worker) per device, so one request's copies overlap "
          "another's kernel; 0 = auto (4), at most 16. The CPU backend always runs one worker");
ABSL_FLAG(uint64_t, host_staging_bytes, uint64_t{1} << 30,
          "GPU: bound on the page-locked host staging memory the lanes hold (in use + kept for reuse); a request "
          "whose tensors need more is RESOURCE_EXHAUSTED");
ABSL_FLAG(int32_t, host_copy_threads, -1,
          "GPU: helper threads that split a large host memcpy into pinned staging (a request's data read from the "
          "socket, or staged for the device) when no other copy is being split (-1 = auto: half the cores, "
          "at most 7, none below 4 cores; 0 = none; at most 64). Lowers a large call's latency (docs/operations.md)");
ABSL_FLAG(uint64_t, request_staging_bytes, uint64_t{256} << 20,
          "GPU: bound on the page-locked host memory that compute requests' tensor data is read into from the "
          "socket's buffers, for the lanes to copy to the device without a staging copy; when it is taken a "
          "request is parsed as usual. 0 = off; else at least 1 MiB");
ABSL_FLAG(uint64_t, max_inflight_bytes, 0,
          "compute admission: request + response bytes of all admitted compute calls (queued, running, "
          "sending) stay under this; beyond it RESOURCE_EXHAUSTED before anything is allocated. "
          "0 = a quarter of the memory available (physical or cgroup limit)");
ABSL_FLAG(uint64_t, grpc_memory_quota_bytes, 0,
          "gRPC ResourceQuota: memory for transport buffers and messages being received; 0 = half of "
          "the memory available");
ABSL_FLAG(int32_t, max_concurrent_streams, 128, "HTTP/2 streams (concurrent calls) per client connection");
ABSL_FLAG(uint64_t, max_weight_payload_bytes, uint64_t{16} << 30,
          "largest LoadWeights payload accepted, bytes; a header announcing more is RESOURCE_EXHAUSTED");
ABSL_FLAG(uint64_t, max_upload_buffer_bytes, 0,
          "payload bytes all LoadWeights streams may buffer at once (counted as chunks arrive); beyond it "
          "RESOURCE_EXHAUSTED. 0 = a quarter of the memory available");
ABSL_FLAG(int32_t, max_concurrent_uploads, 4, "LoadWeights streams open at once; more are RESOURCE_EXHAUSTED");
ABSL_FLAG(int32_t, upload_idle_timeout_seconds, 30,
          "a LoadWeights stream that sends no chunk for this long is ended with DEADLINE_EXCEEDED and its "
          "buffered bytes released (1 to 3600)");
ABSL_FLAG(int32_t, cpu_threads, 0, "CPU backend worker threads (0 = all cores)");
ABSL_FLAG(int32_t, malloc_arena_max, 2,
          "glibc malloc arenas at most (M_ARENA_MAX; 0 = glibc's default, 8 per core): fewer arenas keep the "
          "large tensor and upload buffers from pinning memory in many per-thread arenas");
ABSL_FLAG(int64_t, malloc_mmap_threshold_bytes, int64_t{32} << 20,
          "glibc M_MMAP_THRESHOLD (0 to 33554432; 0 = glibc's dynamic default): blocks below it come from "
          "the heap and are reused, so a call's multi-megabyte tensors are not mmap'd and page-faulted in "
          "again on every call");
ABSL_FLAG(int64_t, malloc_trim_threshold_bytes, int64_t{64} << 20,
          "glibc M_TRIM_THRESHOLD (0 to 2147483647; 0 = glibc's dynamic default): free memory a heap keeps "
          "before giving it back to the kernel; the server's idle RSS may stay up to about this much per "
          "arena above its live data");
ABSL_FLAG(double, drain_seconds, 30, "on SIGTERM/SIGINT, how long in-flight calls may take to finish (0 to 3600)");
ABSL_FLAG(double, max_connection_age_seconds, 0,
          "close client connections (GOAWAY, after a grace of --drain_seconds) after this age so clients "
          "re-resolve and spread over new replicas; 0 = never");

// Transport security (docs/security.md, server/auth/transport_security.h).
ABSL_FLAG(std::string, tls_cert, "", "PEM certificate chain of the server; with --tls_key enables TLS");
ABSL_FLAG(std::string, tls_key, "", "PEM private key (unencrypted) matching --tls_cert");
ABSL_FLAG(std::string, tls_client_ca, "",
          "PEM CA bundle: require and verify client certificates signed by it (mutual TLS; needs --tls_cert)");
ABSL_FLAG(std::string, auth_tokens_file, "",
          "bearer-token file, one `<token> <rights>` per line, rights compute|admin|compute,admin; without "
          "TLS only a loopback --address is allowed");

ABSL_FLAG(std::string, auth_identities_file, "",
          "mutual TLS: file of client-certificate identities (spiffe://... or subject:<DN>) and their rights "
          "(compute, admin); combined with --auth_tokens_file, a call has the rights of both (docs/security.md)");
ABSL_FLAG(bool, allow_unauthenticated_tls, false,
          "accept --tls_cert (or mutual TLS) without --auth_tokens_file: everyone who completes the TLS "
          "handshake may then call every RPC, LoadWeights and UnloadWeightSet included");

// System shared memory (server/transport/shared_memory.h, docs/operations.md).
ABSL_FLAG(bool, allow_shared_memory, false,
          "accept RegisterSystemSharedMemory and tensors in registered POSIX shared-memory regions (clients on "
          "this host only); off: those calls are FAILED_PRECONDITION");
ABSL_FLAG(int64_t, shared_memory_max_regions, 64, "shared-memory regions one identity may hold registered (1 to 4096)");
ABSL_FLAG(int64_t, descriptor_reserve, 256,
          "descriptors of RLIMIT_NOFILE (whose soft limit the server raises to the hard limit at start) kept for "
          "listeners, connections, weight files and logs; the shared-memory regions of all identities together may "
          "hold the rest, one descriptor each, and a registration beyond that is RESOURCE_EXHAUSTED (16 to 1048576)");
ABSL_FLAG(uint64_t, shared_memory_max_bytes, uint64_t{16} << 30,
          "bytes of shared-memory regions one identity may hold registered");
ABSL_FLAG(uint64_t, shared_memory_locked_bytes, uint64_t{8} << 30,
          "on a device backend: bytes of registered regions (all identities) the server maps and page-locks so "
          "that the device reads inputs where they lie; regions beyond it are read with pread; 0 = never");
ABSL_FLAG(double, shared_memory_idle_seconds, 0,
          "a shared-memory region that no request has used for this long is unregistered, as if its identity had "
          "unregistered it (frees what a client that died left registered); 0 = never (0 to 604800)");

// CUDA shared memory (server/transport/cuda_shared_memory.h, docs/operations.md).
ABSL_FLAG(bool, allow_cuda_shared_memory, false,
          "accept RegisterCudaSharedMemory and tensors in clients' device buffers on this GPU (CUDA IPC: clients on "
          "this host only; the kernels read and write them in place); off, or on a CPU backend: those calls are "
          "FAILED_PRECONDITION");
ABSL_FLAG(int64_t, cuda_shared_memory_max_regions, 64,
          "CUDA shared-memory regions one identity may hold registered (1 to 4096)");
ABSL_FLAG(uint64_t, cuda_shared_memory_max_bytes, uint64_t{64} << 30,
          "device memory one identity's CUDA shared-memory regions may keep open: each registered handle's whole "
          "allocation, counted once (the memory is the client's, but the server's opening keeps it alive)");
ABSL_FLAG(double, cuda_shared_memory_idle_seconds, 0,
          "a CUDA shared-memory region that no request has used for this long is unregistered, closing its IPC "
          "opening once no other region uses it (the GPU memory of a client that died without unregistering is "
          "held by that opening); 0 = never (0 to 604800)");

// Residual sessions (server/transport/residual_sessions.h, docs/operations.md).
ABSL_FLAG(int64_t, residual_session_max_sessions, 64,
          "residual sessions one identity may hold open (0 to 65536); 0: sessions are off (FAILED_PRECONDITION)");
ABSL_FLAG(uint64_t, residual_session_max_bytes, uint64_t{4} << 30,
          "device (backend) bytes the residual sessions of one identity may hold");
ABSL_FLAG(uint64_t, residual_session_total_bytes, 0,
          "device (backend) bytes the residual sessions of all identities may hold together; 0 = a quarter of the "
          "host's memory");
ABSL_FLAG(double, residual_session_idle_seconds, 600,
          "a residual session without a call for this long is closed and its memory freed (1 to 86400)");

// Call rings (server/ring/, docs/operations.md).
ABSL_FLAG(bool, allow_call_rings, false,
          "accept OpenCallRing: clients on this host call the ops through a ring of slots in shared memory instead "
          "of one RPC each (their tensors in registered shared-memory regions); off: OpenCallRing is "
          "FAILED_PRECONDITION");
ABSL_FLAG(std::string, call_ring_socket, "",
          "the unix socket where rings are handed over to their clients; empty: <socket path>.rings when --address "
          "is unix:<socket path>, else /tmp/fusedlayer-<pid>.rings");
ABSL_FLAG(int64_t, call_ring_max_rings, 64, "call rings open at once, all identities (1 to 4096)");
ABSL_FLAG(int64_t, call_ring_max_per_identity, 16,
          "call rings one identity may hold open (1 to 4096): e.g. one per thread or stream of a client process");
ABSL_FLAG(int64_t, call_ring_max_slots, 64, "slots (calls in flight) per call ring at most (1 to 1024)");
ABSL_FLAG(int64_t, call_ring_pollers, 0,
          "call-ring poller threads (0 to 64; 0 = auto: one per 8 CPU cores, 1 to 4): each ring is served by one, "
          "the one with the fewest rings when it opens; each spins while its rings' calls keep coming");
ABSL_FLAG(int64_t, call_ring_spin_us, 100,
          "the call-ring poller spins this long after the last call before it sleeps until a doorbell (0 to "
          "100000): a call that arrives while it spins is taken within a microsecond, one that arrives later costs "
          "a wake-up (~5-50 us); the spin costs a CPU core while calls keep coming");

// Shadow verification (server/shadow/, docs/shadow.md).
ABSL_FLAG(double, shadow_sample_rate, 0,
          "fraction (0 to 1) of requests that ran fused to re-run unfused after the response and compare "
          "(fusedlayer_shadow_* metrics); 0 = off");
ABSL_FLAG(int64_t, shadow_queue_size, 4,
          "shadow jobs held at most (waiting or running); a sampled request beyond it is dropped and counted");
ABSL_FLAG(int64_t, shadow_queue_max_bytes, int64_t{256} << 20,
          "host bytes the queued shadow jobs (copies of inputs and fused outputs) may hold at most");
ABSL_FLAG(std::string, shadow_dump_dir, "",
          "directory for mismatch dumps (safetensors, replayable with fusedctl replay); empty = no dumps");
ABSL_FLAG(int64_t, shadow_dump_max_files, 32, "most mismatch dumps kept in --shadow_dump_dir (then stop)");
ABSL_FLAG(int64_t, shadow_dump_max_bytes, int64_t{1} << 30,
          "most bytes of mismatch dumps in --shadow_dump_dir (then stop)");
ABSL_FLAG(int32_t, max_inflight_verify, 2,
          "compute calls with verify = true (each runs the op twice) admitted at once, queued or running; "
          "more are RESOURCE_EXHAUSTED; 0 switches verify off (FAILED_PRECONDITION)");
ABSL_FLAG(int64_t, verify_dump_max_files, 8,
          "most mismatch dumps of verify = true calls kept in <--shadow_dump_dir>/verify (then stop); apart "
          "from the sampled dumps' bounds");
ABSL_FLAG(int64_t, verify_dump_max_bytes, int64_t{256} << 20,
          "most bytes of mismatch dumps of verify = true calls in <--shadow_dump_dir>/verify (then stop)");

namespace fusedlayer::server {

absl::StatusOr<ServerConfig> ConfigFromFlags() {
  ServerConfig c;
  c.address = absl::GetFlag(FLAGS_address);
  c.metrics_address = absl::GetFlag(FLAGS_metrics_address);
  c.backend = absl::GetFlag(FLAGS_backend);
  c.devices = absl::GetFlag(FLAGS_devices);
  c.demo_weights = absl::GetFlag(FLAGS_demo_weights);
  c.weights_manifest = absl::GetFlag(FLAGS_weights_manifest);
  if (absl::Status s = ParseDisableFused(absl::GetFlag(FLAGS_disable_fused), c); !s.ok()) return s;
  c.fused_max_tokens = absl::GetFlag(FLAGS_fused_max_tokens);
  c.max_tokens = absl::GetFlag(FLAGS_max_tokens);
  c.max_message_bytes = absl::GetFlag(FLAGS_max_message_bytes);
  c.queue_capacity = absl::GetFlag(FLAGS_queue_capacity);
  c.max_batch_tokens = absl::GetFlag(FLAGS_max_batch_tokens);
  c.max_queue_delay_us = absl::GetFlag(FLAGS_max_queue_delay_us);
  c.executor_spin_us = absl::GetFlag(FLAGS_executor_spin_us);
  c.device_lanes = absl::GetFlag(FLAGS_device_lanes);
  c.host_staging_bytes = absl::GetFlag(FLAGS_host_staging_bytes);
  c.host_copy_threads = absl::GetFlag(FLAGS_host_copy_threads);
  c.request_staging_bytes = absl::GetFlag(FLAGS_request_staging_bytes);
  c.max_inflight_bytes = absl::GetFlag(FLAGS_max_inflight_bytes);
  c.grpc_memory_quota_bytes = absl::GetFlag(FLAGS_grpc_memory_quota_bytes);
  c.max_concurrent_streams = absl::GetFlag(FLAGS_max_concurrent_streams);
  c.max_weight_payload_bytes = absl::GetFlag(FLAGS_max_weight_payload_bytes);
  c.max_upload_buffer_bytes = absl::GetFlag(FLAGS_max_upload_buffer_bytes);
  c.max_concurrent_uploads = absl::GetFlag(FLAGS_max_concurrent_uploads);
  c.upload_idle_timeout_seconds = absl::GetFlag(FLAGS_upload_idle_timeout_seconds);
  c.cpu_threads = absl::GetFlag(FLAGS_cpu_threads);
  c.malloc_arena_max = absl::GetFlag(FLAGS_malloc_arena_max);
  c.malloc_mmap_threshold_bytes = absl::GetFlag(FLAGS_malloc_mmap_threshold_bytes);
  c.malloc_trim_threshold_bytes = absl::GetFlag(FLAGS_malloc_trim_threshold_bytes);
  c.drain_seconds = absl::GetFlag(FLAGS_drain_seconds);
  c.max_connection_age_seconds = absl::GetFlag(FLAGS_max_connection_age_seconds);
  c.tls_cert = absl::GetFlag(FLAGS_tls_cert);
  c.tls_key = absl::GetFlag(FLAGS_tls_key);
  c.tls_client_ca = absl::GetFlag(FLAGS_tls_client_ca);
  c.auth_tokens_file = absl::GetFlag(FLAGS_auth_tokens_file);
  c.auth_identities_file = absl::GetFlag(FLAGS_auth_identities_file);
  c.allow_unauthenticated_tls = absl::GetFlag(FLAGS_allow_unauthenticated_tls);
  c.allow_shared_memory = absl::GetFlag(FLAGS_allow_shared_memory);
  c.shared_memory_max_regions = absl::GetFlag(FLAGS_shared_memory_max_regions);
  c.descriptor_reserve = absl::GetFlag(FLAGS_descriptor_reserve);
  c.shared_memory_idle_seconds = absl::GetFlag(FLAGS_shared_memory_idle_seconds);
  c.allow_cuda_shared_memory = absl::GetFlag(FLAGS_allow_cuda_shared_memory);
  c.cuda_shared_memory_max_regions = absl::GetFlag(FLAGS_cuda_shared_memory_max_regions);
  c.cuda_shared_memory_idle_seconds = absl::GetFlag(FLAGS_cuda_shared_memory_idle_seconds);
  c.cuda_shared_memory_max_bytes = absl::GetFlag(FLAGS_cuda_shared_memory_max_bytes);
  c.shared_memory_max_bytes = absl::GetFlag(FLAGS_shared_memory_max_bytes);
  c.shared_memory_locked_bytes = absl::GetFlag(FLAGS_shared_memory_locked_bytes);
  c.residual_session_max_sessions = absl::GetFlag(FLAGS_residual_session_max_sessions);
  c.residual_session_max_bytes = absl::GetFlag(FLAGS_residual_session_max_bytes);
  c.residual_session_idle_seconds = absl::GetFlag(FLAGS_residual_session_idle_seconds);
  c.residual_session_total_bytes = absl::GetFlag(FLAGS_residual_session_total_bytes);
  c.allow_call_rings = absl::GetFlag(FLAGS_allow_call_rings);
  c.call_ring_socket = absl::GetFlag(FLAGS_call_ring_socket);
  c.call_ring_max_rings = absl::GetFlag(FLAGS_call_ring_max_rings);
  c.call_ring_max_per_identity = absl::GetFlag(FLAGS_call_ring_max_per_identity);
  c.call_ring_max_slots = absl::GetFlag(FLAGS_call_ring_max_slots);
  c.call_ring_spin_us = absl::GetFlag(FLAGS_call_ring_spin_us);
  c.call_ring_pollers = absl::GetFlag(FLAGS_call_ring_pollers);
  c.shadow_sample_rate = absl::GetFlag(FLAGS_shadow_sample_rate);
  c.shadow_queue_size = absl::GetFlag(FLAGS_shadow_queue_size);
  c.shadow_queue_max_bytes = absl::GetFlag(FLAGS_shadow_queue_max_bytes);
  c.shadow_dump_dir = absl::GetFlag(FLAGS_shadow_dump_dir);
  c.shadow_dump_max_files = absl::GetFlag(FLAGS_shadow_dump_max_files);
  c.shadow_dump_max_bytes = absl::GetFlag(FLAGS_shadow_dump_max_bytes);
  c.max_inflight_verify = absl::GetFlag(FLAGS_max_inflight_verify);
  c.verify_dump_max_files = absl::GetFlag(FLAGS_verify_dump_max_files);
  c.verify_dump_max_bytes = absl::GetFlag(FLAGS_verify_dump_max_bytes);
  // With authentication on, the unauthenticated /metrics endpoint must not default to every
  // interface. An explicit --metrics_address (even 0.0.0.0:9464) is the operator's choice and kept.
  // Abseil 20220623 exposes "was this flag set" only through this member (CommandLineFlag's is
  // private); it also sees --flagfile values, which scanning argv would not.
  const bool auth_on = !c.tls_client_ca.empty() || !c.auth_tokens_file.empty();
  if (auth_on && !FLAGS_metrics_address.IsSpecifiedOnCommandLine()) {
    c.metrics_address = "127.0.0.1:9464";
    LogInfo("authentication is on and --metrics_address was not given: metrics bind 127.0.0.1:9464 (loopback only)");
  }
  if (absl::Status s = c.Validate(); !s.ok()) return s;
  return c;
}

namespace {

struct FlagGroup {
  const char* title;
  std::vector<const char*> flags;
};

// Abseil's own --help lists only flags defined in a file named after the binary (fusedlayer_server.cc),
// which has none, so it printed "No flags matched". The groups follow docs/operations.md.
const std::vector<FlagGroup>& FlagGroups() {
  static const auto* groups = new std::vector<FlagGroup>{
      {"Serving", {"address", "metrics_address", "backend", "devices", "demo_weights", "weights_manifest", "drain_seconds",
                   "max_connection_age_seconds"}},
      {"Compute requests and admission",
       {"disable_fused", "fused_max_tokens", "max_tokens", "max_message_bytes", "queue_capacity",
        "max_inflight_bytes", "grpc_memory_quota_bytes", "max_concurrent_streams", "cpu_threads"}},
      {"Dynamic batching and the device data path",
       {"max_batch_tokens", "max_queue_delay_us", "executor_spin_us", "device_lanes", "host_staging_bytes",
        "host_copy_threads", "request_staging_bytes"}},
      {"Weight uploads (LoadWeights)",
       {"max_weight_payload_bytes", "max_upload_buffer_bytes", "max_concurrent_uploads",
        "upload_idle_timeout_seconds"}},
      {"Memory allocator (glibc malloc)",
       {"malloc_arena_max", "malloc_mmap_threshold_bytes", "malloc_trim_threshold_bytes"}},
      {"Transport security (docs/security.md)",
       {"tls_cert", "tls_key", "tls_client_ca", "auth_tokens_file", "auth_identities_file",
        "allow_unauthenticated_tls"}},
      {"System shared memory",
       {"allow_shared_memory", "shared_memory_max_regions", "shared_memory_max_bytes", "shared_memory_locked_bytes",
        "shared_memory_idle_seconds", "descriptor_reserve"}},
      {"CUDA shared memory",
       {"allow_cuda_shared_memory", "cuda_shared_memory_max_regions", "cuda_shared_memory_max_bytes",
        "cuda_shared_memory_idle_seconds"}},
      {"Residual sessions",
       {"residual_session_max_sessions", "residual_session_max_bytes", "residual_session_total_bytes",
        "residual_session_idle_seconds"}},
      {"Call rings (same-host data plane)",
       {"allow_call_rings", "call_ring_socket", "call_ring_max_rings", "call_ring_max_per_identity",
        "call_ring_max_slots", "call_ring_pollers", "call_ring_spin_us"}},
      {"Shadow verification and verify = true (docs/shadow.md)",
       {"shadow_sample_rate", "shadow_queue_size", "shadow_queue_max_bytes", "shadow_dump_dir",
        "shadow_dump_max_files", "shadow_dump_max_bytes", "max_inflight_verify", "verify_dump_max_files",
        "verify_dump_max_bytes"}},
  };
  return *groups;
}

// A flag defined by the server's own sources (not Abseil's, gRPC's or a library's).
bool IsServerFlag(const absl::CommandLineFlag& flag) {
  const std::string file = flag.Filename();
  return absl::StrContains(file, "server/flags.cc") || absl::StrContains(file, "server/fault_injection.cc");
}

void AppendFlag(const absl::CommandLineFlag& flag, std::string* out) {
  const std::string value = flag.DefaultValue();
  const bool is_string = flag.IsOfType<std::string>();
  absl::StrAppend(out, "  --", flag.Name(), "  (default: ", is_string ? absl::StrCat("\"", value, "\"") : value,
                  ")\n");
  // Wrapped at 100 columns under the name.
  constexpr size_t kWidth = 100;
  constexpr std::string_view kIndent = "      ";
  std::string line(kIndent);
  for (absl::string_view word : absl::StrSplit(flag.Help(), ' ', absl::SkipEmpty())) {
    if (line.size() > kIndent.size() && line.size() + 1 + word.size() > kWidth) {
      absl::StrAppend(out, line, "\n");
      line = std::string(kIndent);
    }
    if (line.size() > kIndent.size()) line += ' ';
    absl::StrAppend(&line, word);
  }
  if (line.size() > kIndent.size()) absl::StrAppend(out, line, "\n");
}

}  // namespace

std::string FlagsUsage(const std::string& program) {
  std::string out = absl::StrCat("fusedlayer gRPC server: fused mHC seam and SWA norm+quant ops\n\nUsage: ", program,
                                 " [--flag=value ...]\n");
  std::set<std::string> listed;
  for (const FlagGroup& group : FlagGroups()) {
    std::string section;
    for (const char* name : group.flags) {
      const absl::CommandLineFlag* flag = absl::FindCommandLineFlag(name);
      if (flag == nullptr) continue;
      listed.insert(std::string(flag->Name()));
      AppendFlag(*flag, &section);
    }
    if (!section.empty()) absl::StrAppend(&out, "\n", group.title, ":\n", section);
  }
  std::vector<const absl::CommandLineFlag*> other;
  for (const auto& [name, flag] : absl::GetAllFlags()) {
    if (IsServerFlag(*flag) && listed.count(std::string(flag->Name())) == 0) other.push_back(flag);
  }
  std::sort(other.begin(), other.end(), [](auto* a, auto* b) { return a->Name() < b->Name(); });
  if (!other.empty()) {
    absl::StrAppend(&out, "\nOther:\n");
    for (const absl::CommandLineFlag* flag : other) AppendFlag(*flag, &out);
  }
  absl::StrAppend(&out,
                  "\nFlags may also come from a file (--flagfile=PATH, one --flag=value a line). --helpfull lists "
                  "every flag of the binary, Abseil's and gRPC's included. docs/operations.md explains them.\n");
  return out;
}

}  // namespace fusedlayer::server
