// The `fusedctl` commands. Each takes the connected client and the parsed command line, prints
// human-readable output to `out`, and returns a non-OK status on any failure (main prints it as one
// line with the gRPC code name and exits non-zero).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "client/lib/fusedlayer_client.h"
#include "client/lib/shared_memory.h"

namespace fusedlayer::client {

// Values of every fusedctl flag plus the positional arguments (flags are parsed once in main).
struct CommandLine {
  std::string target;
  std::vector<std::string> args;  // positional arguments after the command name

  std::string service;            // health
  bool replace = false;           // load
  int64_t chunk_bytes = 0;        // load
  std::string weight_set;         // seam, swa, bench
  int64_t tokens = 0;
  bool tokens_set = false;        // --tokens given explicitly (conflicts with --input)
  std::string mode, stage, path, op;
  bool no_pre_mix = false;
  bool capture_aux = false;
  std::string input, output;
  int64_t row_stride = 0;
  int concurrency = 1;
  absl::Duration duration = absl::Seconds(10);
  uint64_t seed = 0;              // 0 = fresh random seed (printed)
  absl::Duration warmup = absl::Seconds(5);  // soak
  int64_t server_pid = 0;                    // soak: 0 = do not watch the server's RSS
  int max_rss_growth_mb = 64;                // soak
  bool churn = false;                        // soak: one more client loading and unloading a weight set
  std::string compute_token_file;            // soak: a token with only the compute right (auth cases)
  std::string dump;                          // replay: a shadow mismatch dump (safetensors)
  bool verify = false;                       // seam, swa: request verify = true (shadow comparison)
  int device_id = -1;                        // seam, swa: the device the call names (-1: none)
  bool echo_floor = false;                   // bench: also measure a bare gRPC echo of the same sizes
  bool copy_requests = false;                // bench: protobuf-serialize every request (no shared request)
  std::string transport = "tcp";             // seam, swa, bench: tcp | shm (client/lib/shared_memory.h)
  std::string session;                       // seam: run in this residual session (x only per call)
  bool return_state = false;                 // seam --session: also return new_residual and the mixes
  // bench --transport=cuda_ipc: makes a registered CUDA shared-memory region of `bytes` bytes
  // (client/lib/cuda_shared_memory.h). Set by main, which links the compute library's GPU backend; null
  // where there is none (the transport is then FAILED_PRECONDITION).
  std::function<absl::StatusOr<std::unique_ptr<ClientRegion>>(const FusedLayerClient&, uint64_t bytes)> cuda_regions;
};

// --transport of seam and swa: true for shm and cuda_ipc (the tensors in a region of the caller's),
// false for tcp; InvalidArgument otherwise.
absl::StatusOr<bool> ParseRegionTransport(const std::string& transport);
// --transport=ring|ring_cuda_ipc: a region's call through a call ring instead of an RPC.
bool IsRingTransport(const std::string& transport);
// A registered region of `bytes` bytes for --transport=shm (a POSIX shared-memory object) or
// cuda_ipc (a device allocation of this process, cl.cuda_regions; FailedPrecondition without one).
absl::StatusOr<std::unique_ptr<ClientRegion>> MakeRegion(const FusedLayerClient& client, const CommandLine& cl,
                                                         uint64_t bytes);

absl::Status RunInfo(const FusedLayerClient& client, const CommandLine& cl, std::ostream& out);
// OK with *serving set; the caller exits 0 only when serving.
absl::Status RunHealth(const FusedLayerClient& client, const CommandLine& cl, std::ostream& out, bool* serving);
absl::Status RunLoad(const FusedLayerClient& client, const CommandLine& cl, std::ostream& out);
absl::Status RunList(const FusedLayerClient& client, const CommandLine& cl, std::ostream& out);
absl::Status RunUnload(const FusedLayerClient& client, const CommandLine& cl, std::ostream& out);
// The caller's residual sessions (docs/operations.md "Residual sessions"), and closing one.
absl::Status RunSessions(const FusedLayerClient& client, const CommandLine& cl, std::ostream& out);
absl::Status RunCloseSession(const FusedLayerClient& client, const CommandLine& cl, std::ostream& out);
absl::Status RunSeam(const FusedLayerClient& client, const CommandLine& cl, std::ostream& out);
absl::Status RunSwa(const FusedLayerClient& client, const CommandLine& cl, std::ostream& out);
absl::Status RunBench(const FusedLayerClient& client, const CommandLine& cl, std::ostream& out);
// A weight set for soak --churn to load and unload (main makes it from the demo sets, so this
// library does not depend on the weights library).
struct ChurnSet {
  v1::WeightSetHeader header;  // payload_bytes and sha256 filled in
  std::string payload;
};
// Mixed valid/invalid load with expected codes, latency and server RSS (soak.cc); with
// `churn` (--churn) one more client loads and unloads it throughout.
absl::Status RunSoak(const FusedLayerClient& client, const CommandLine& cl, std::ostream& out,
                     const ChurnSet* churn = nullptr);

// Re-sends the inputs of a shadow-verification mismatch dump (--shadow_dump_dir) with
// REQUIRE_FUSED and verify = true, and reports whether the new fused outputs equal the dumped ones
// bitwise and whether the mismatch reproduces (*reproduced; main exits 3 then).
absl::Status RunReplay(const FusedLayerClient& client, const CommandLine& cl, std::ostream& out, bool* reproduced);

// The Verification block of a response (seam/swa --verify, replay).
std::string FormatVerification(const v1::Verification& verification);

// Shared by the commands: the report block ("path  fused", "fallback ...", times).
std::string FormatReport(const v1::ExecutionReport& report, double round_trip_seconds);

}  // namespace fusedlayer::client
