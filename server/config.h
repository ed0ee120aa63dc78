// Server configuration: everything main.cc reads from flags, as a plain struct so tests (and
// embedders) can build a server without touching global flags.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace fusedlayer::server {

// The two ops the service serves; values double as the "op" metric label.
enum class Op : uint8_t { kMhc = 0, kSwa = 1 };
inline constexpr Op kAllOps[] = {Op::kMhc, Op::kSwa};
const char* OpName(Op op);  // "mhc", "swa"

// What --address names: a TCP host:port, a unix domain socket path ("unix:/run/fl.sock") or a
// Linux abstract socket name ("unix-abstract:fusedlayer", no file).
enum class ListenKind : uint8_t { kTcp, kUnix, kUnixAbstract };
ListenKind ListenKindOf(std::string_view address);
// The filesystem path of a unix: address ("unix:/run/fl.sock" -> "/run/fl.sock"); empty otherwise.
std::string UnixSocketPath(std::string_view address);
// The name of a unix-abstract: address ("unix-abstract:fl" -> "fl"); empty otherwise.
std::string UnixAbstractName(std::string_view address);

// What --executor_spin_us=-1 means on a device backend with lanes: longer than the ~150-350 us
// between one response and a closed-loop caller's next request on the H200 host, so a per-layer
// caller's next request finds a worker awake.
inline constexpr int64_t kAutoExecutorSpinUs = 500;

// The device indices --devices names: "" = {0}; "all" = 0 .. visible_gpus-1 (at least {0}: a CPU
// server, or none visible, whose start-up check then reports it); otherwise distinct non-negative
// integers, at most 64. INVALID_ARGUMENT naming what is wrong.
absl::StatusOr<std::vector<int>> ParseDeviceList(const std::string& spec, int visible_gpus);

struct ServerConfig {
  // host:port, unix:PATH or unix-abstract:NAME (see ListenKind).
  std::string address = "0.0.0.0:50051";
  std::string metrics_address = "0.0.0.0:9464";  // empty: no Exposer (metrics still collected)
  std::string backend = "auto";
  // --devices: "" (the first device), "all", or a comma-separated list of device indices
  // (ParseDeviceList).
  std::string devices;
  bool demo_weights = false;
  std::string weights_manifest;
  bool disable_fused_mhc = false;  // --disable_fused=mhc
  bool disable_fused_swa = false;  // --disable_fused=swa
  int64_t fused_max_tokens = int64_t{1} << 20;
  int64_t max_tokens = int64_t{1} << 20;
  int64_t max_message_bytes = int64_t{1} << 30;
  int queue_capacity = 64;
  // Dynamic batching (server/runtime/executor.h): token budget of one launch (0: off, the default, as
  // Triton's dynamic batcher is off until configured; 64 is a decode-sized budget) and how long the
  // first request of a batch may wait for compatible ones (0: only those already queued).
  int64_t max_batch_tokens = 0;
  int64_t max_queue_delay_us = 0;
  // Idle spinning of the executor's workers (server/runtime/executor.h, SpinOptions): microseconds a
  // worker polls its empty queue before sleeping, one worker at a time. 0: never; -1 (default):
  // kAutoExecutorSpinUs on a device backend with lanes, 0 on a host-accessible backend (the CPU
  // backend's kernels need every core).
  int64_t executor_spin_us = -1;
  // Device lanes (server/runtime/device_lanes.h): streams per GPU, each with its own executor worker,
  // so one request's copies overlap another's kernel. 0 = auto (4 on a GPU); a host-accessible
  // backend (CPU) always has one worker. At most 16.
  int device_lanes = 0;
  // The bound on page-locked host staging memory the lanes hold (in use + kept for reuse); a
  // request whose tensors need more is RESOURCE_EXHAUSTED. GPU backends only.
  uint64_t host_staging_bytes = uint64_t{1} << 30;
  // Helper threads that split the host copies into and out of staging (runtime/parallel_copy.h):
  // -1 = auto (half the cores, at most 7, none below 4 cores; the default), 0 = each copy on
  // its caller alone. One call is split at a time (runtime/parallel_copy.h), so under load the helpers
  // idle rather than take cores from gRPC's threads (docs/operations.md). GPU backends only. At most 64.
  int host_copy_threads = -1;
  // The bound on page-locked host memory that compute requests' tensor data is read into straight
  // from gRPC's buffers (rpc/wire_messages.h, ReadWireRequest), so the lanes copy it to the device
  // from there. When it is taken, a request is parsed as usual instead (never waits). 0 = off.
  // GPU backends only.
  uint64_t request_staging_bytes = uint64_t{256} << 20;
  // Compute admission by memory (docs/operations.md): the request and response bytes of every
  // compute call admitted and not yet finished (queued, running or sending) stay under this; a call
  // that would go over is refused with RESOURCE_EXHAUSTED before its response is allocated.
  // 0 = a quarter of the memory available to the process (EffectiveMaxInflightBytes).
  uint64_t max_inflight_bytes = 0;
  // gRPC's own memory (transport buffers, messages being received) is capped by a ResourceQuota
  // of this many bytes; 0 = half of the available memory. Streams per HTTP/2 connection are capped
  // by max_concurrent_streams (the client's further calls wait in its transport).
  uint64_t grpc_memory_quota_bytes = 0;
  int max_concurrent_streams = 128;
  // LoadWeights (docs/operations.md): the payload bytes all uploads buffer at once stay under
  // max_upload_buffer_bytes (0 = a quarter of the available memory), counted as chunks arrive;
  // at most max_concurrent_uploads streams are open at once.
  uint64_t max_upload_buffer_bytes = 0;
  int max_concurrent_uploads = 4;
  // A LoadWeights stream that delivers no WeightChunk for this long is finished with
  // DEADLINE_EXCEEDED and its buffered bytes are released: a client that sends a header and stalls
  // cannot hold an upload slot (and its bytes) until its own deadline. In [1, 3600].
  int upload_idle_timeout_seconds = 30;
  int cpu_threads = 0;
  // glibc malloc arenas (mallopt M_ARENA_MAX, set before any thread starts); 0 = glibc's default of
  // 8 per core. Each gRPC, executor and CPU-pool thread otherwise gets an arena of its own, and the
  // multi-megabyte tensor and upload buffers freed in them stay resident: with the default a 60 s
  // soak with weight-set churn grew the RSS by 72 MiB, with 2 arenas by none (docs/operations.md).
  int malloc_arena_max = 2;
  // glibc M_MMAP_THRESHOLD and M_TRIM_THRESHOLD (bytes; 0 = glibc's dynamic defaults). With the
  // defaults a seam call's multi-megabyte request/response blocks were either mmap'd and munmap'd or
  // trimmed back to the kernel after every call, so every call page-faulted ~5.7 MiB in again (1455
  // minor faults per mHC T=64 call, ~0.9 ms of its 2.5 ms server time); keeping them in the heap up
  // to these sizes makes the pages stay warm, at the cost of that much more idle RSS
  // (docs/operations.md#malloc-thresholds). glibc caps the mmap threshold at 32 MiB on 64-bit.
  int64_t malloc_mmap_threshold_bytes = int64_t{32} << 20;
  int64_t malloc_trim_threshold_bytes = int64_t{64} << 20;
  double drain_seconds = 30;
  double max_connection_age_seconds = 0;  // 0: connections never age out
  // Largest LoadWeights payload accepted (bytes): the biggest DeepSeek weight part is far smaller
  // (mhc.fn at n=4, C=7168 is 2.6 MB), so this only guards the host against a hostile header.
  uint64_t max_weight_payload_bytes = uint64_t{16} << 30;
  // Transport security (server/auth/transport_security.h, docs/security.md). PEM file paths; all
  // empty: plaintext. tls_cert + tls_key: TLS; plus tls_client_ca: mutual TLS.
  std::string tls_cert;
  std::string tls_key;
  std::string tls_client_ca;
  // Bearer tokens with their rights (server/auth/token_file.h); empty: no token check.
  std::string auth_tokens_file;
  // Client-certificate identities with their rights (server/auth/identity_file.h); needs mutual TLS.
  std::string auth_identities_file;
  // TLS or mutual TLS without a token file authorizes everyone who completes the handshake for
  // every RPC (LoadWeights, UnloadWeightSet included): refused at startup unless this is set.
  bool allow_unauthenticated_tls = false;
  // System shared memory (server/transport/shared_memory.h, docs/operations.md): off unless set,
  // because it only works for clients on this host; limits per identity (regions and registered bytes).
  bool allow_shared_memory = false;
  int64_t shared_memory_max_regions = 64;
  // Descriptors of RLIMIT_NOFILE's soft limit kept for everything but shared-memory regions (gRPC's
  // listeners and connections, weight files, logs, metrics); regions of all identities together may
  // hold the rest (common/descriptors.h).
  int64_t descriptor_reserve = 256;
  uint64_t shared_memory_max_bytes = uint64_t{16} << 30;
  // On a device backend with lanes: registered bytes (all identities) mapped and page-locked so the
  // device copies inputs from where they lie (transport/shared_memory.h); 0 = never.
  uint64_t shared_memory_locked_bytes = uint64_t{8} << 30;
  // Regions (system / CUDA) no request has used for this long are unregistered; 0 = never.
  double shared_memory_idle_seconds = 0;
  double cuda_shared_memory_idle_seconds = 0;
  // CUDA shared memory (server/transport/cuda_shared_memory.h, docs/operations.md): off unless set,
  // and only on a GPU backend; per-identity limits.
  bool allow_cuda_shared_memory = false;
  int64_t cuda_shared_memory_max_regions = 64;
  uint64_t cuda_shared_memory_max_bytes = uint64_t{64} << 30;
  // Residual sessions (transport/residual_sessions.h, docs/operations.md): per identity, sessions
  // open and backend bytes they hold (0 sessions: off); closed after this long without a call.
  int64_t residual_session_max_sessions = 64;
  uint64_t residual_session_max_bytes = uint64_t{4} << 30;
  double residual_session_idle_seconds = 600;
  // Bytes the sessions of all identities may hold together; 0: a quarter of memory.
  uint64_t residual_session_total_bytes = 0;
  // Call rings (server/ring/, docs/operations.md "Call rings"): off unless set (clients on this host
  // only); where they are handed over (empty: <unix socket path>.rings for a unix: address, else
  // /tmp/fusedlayer-<pid>.rings), and their limits.
  bool allow_call_rings = false;
  std::string call_ring_socket;
  int64_t call_ring_max_rings = 64;
  int64_t call_ring_max_per_identity = 16;
  int64_t call_ring_max_slots = 64;
  int64_t call_ring_spin_us = 100;
  int64_t call_ring_pollers = 0;  // 0 = auto (server.cc)
  // Shadow verification (server/shadow/, docs/shadow.md): the fraction of fused requests re-run
  // unfused off the critical path and compared; its bounded queue; mismatch dumps.
  double shadow_sample_rate = 0;
  int64_t shadow_queue_size = 4;
  int64_t shadow_queue_max_bytes = int64_t{256} << 20;
  std::string shadow_dump_dir;  // empty: no dumps
  int64_t shadow_dump_max_files = 32;
  int64_t shadow_dump_max_bytes = int64_t{1} << 30;
  // verify = true (the client asks for the unfused comparison in its own call): it doubles the
  // device work of the call, so at most max_inflight_verify such calls are admitted at once
  // (queued or running; 0 switches verify off); their mismatch dumps go to <shadow_dump_dir>/verify
  // under their own bounds, so clients cannot use up the sampled dumps' budget.
  int max_inflight_verify = 2;
  int64_t verify_dump_max_files = 8;
  int64_t verify_dump_max_bytes = int64_t{256} << 20;

  // max_inflight_bytes, or its memory-derived default.
  uint64_t EffectiveMaxInflightBytes() const;
  // grpc_memory_quota_bytes, or its memory-derived default.
  uint64_t EffectiveGrpcMemoryQuotaBytes() const;
  // max_upload_buffer_bytes, or its memory-derived default.
  uint64_t EffectiveMaxUploadBufferBytes() const;
  // residual_session_total_bytes, or its memory-derived default.
  uint64_t EffectiveResidualSessionTotalBytes() const;
  bool fused_disabled(Op op) const { return op == Op::kMhc ? disable_fused_mhc : disable_fused_swa; }
  // InvalidArgument when a limit is out of range (checked once at startup).
  absl::Status Validate() const;
};

// Parses the --disable_fused list ("", "mhc", "swa", "mhc,swa"); InvalidArgument on unknown ops.
absl::Status ParseDisableFused(std::string_view list, ServerConfig& config);

}  // namespace fusedlayer::server
