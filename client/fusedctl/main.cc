// fusedctl: command-line client of the fusedlayer service.
//
//   fusedctl [--target=host:port|unix:/path/to.sock] COMMAND [flags]
//
// Exit status: 0 on success (health: only when SERVING), 1 on an error from the server or the
// command, 2 on a usage error. Errors print one line: "fusedctl: error: CODE: message".
#include <algorithm>
#include <cstdlib>
#include <iostream>
#include <set>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "client/lib/checkpoint_import.h"
#include "client/fusedctl/cli_options.h"
#include "client/lib/cuda_shared_memory.h"
#include "client/fusedctl/commands.h"
#include "client/lib/fusedlayer_client.h"
#include "client/lib/transport_credentials.h"
#include "fusedlayer/backend.h"
#include "weights/demo_weights.h"

// Global flags.
ABSL_FLAG(std::string, target, "localhost:50051",
          "Server address: host:port, unix:/path/to.sock, unix-abstract:NAME (or any gRPC target URI)");
ABSL_FLAG(absl::Duration, deadline, absl::Seconds(60), "Deadline of each call (LoadWeights: max of this and 10m)");
ABSL_FLAG(int64_t, max_message_bytes, int64_t{1} << 30, "Largest message sent or received, bytes");
// Transport security (docs/security.md). Any --tls_* flag switches the channel to TLS.
ABSL_FLAG(std::string, tls_ca, "", "TLS: PEM CA bundle that signed the server certificate (default: system roots)");
ABSL_FLAG(std::string, tls_cert, "", "mutual TLS: PEM client certificate chain (with --tls_key)");
ABSL_FLAG(std::string, tls_key, "", "mutual TLS: PEM client private key");
ABSL_FLAG(std::string, tls_server_name, "", "TLS: name to verify in the server certificate instead of the target host");
ABSL_FLAG(std::string, token_file, "",
          "file holding just the bearer token (default: the FUSEDCTL_TOKEN environment variable, if set)");

// Command flags (each command accepts only its own; see `fusedctl help`).
ABSL_FLAG(std::string, service, "", "health: service name (\"\" = whole server; e.g. fusedlayer.mhc)");
ABSL_FLAG(bool, replace, false, "load: atomically replace weight sets of the same name");
ABSL_FLAG(int64_t, chunk_bytes, 4 << 20, "load: payload bytes per stream message");
ABSL_FLAG(std::string, weight_set, "", "seam/swa/bench: weight set name");
ABSL_FLAG(int64_t, tokens, 16, "seam/swa/bench: tokens per request (T or M)");
ABSL_FLAG(std::string, mode, "", "seam/bench: shifted (default) | normal");
ABSL_FLAG(std::string, stage, "", "seam/bench: seam (default) | first | head");
ABSL_FLAG(bool, no_pre_mix, false, "seam/bench: omit pre_mix (shifted: collapse selects stream 0)");
ABSL_FLAG(bool, capture_aux, false, "seam/bench: also return aux (seam stage)");
ABSL_FLAG(std::string, path, "", "seam/swa/bench: auto (default) | require_fused | force_unfused");
ABSL_FLAG(std::string, input, "", "seam/swa: safetensors file with the request tensors (named as the fields)");
ABSL_FLAG(std::string, output, "",
          "seam/swa: write the response tensors to this safetensors file; import-checkpoint: the manifest to write "
          "(default manifest.json)");
ABSL_FLAG(std::string, layers, "", "import-checkpoint: only layers A-B (inclusive) or A (default: all, with head)");
ABSL_FLAG(std::string, prefix, "",
          "import-checkpoint: name the sets PREFIX/L0/attn, ..., PREFIX/head (two models on one server)");
ABSL_FLAG(int64_t, row_stride, 0, "swa/bench: qr_kv row stride in elements (0 = Q + D)");
ABSL_FLAG(std::string, op, "", "bench: mhc | swa");
ABSL_FLAG(int32_t, concurrency, 1, "bench: concurrent callers");
ABSL_FLAG(int32_t, connections, 0,
          "bench: connections the calls are spread over, round robin, 1..64 (0 = chosen from --concurrency: one per "
          "4 callers, at most 8; 1 for a unix: target); the echo floor uses as many");
ABSL_FLAG(std::string, duration, "10", "bench: measured duration, seconds (or e.g. 10s, 1m)");
ABSL_FLAG(uint64_t, seed, 0, "seam/swa/bench/soak: random input seed (0 = fresh, printed)");
ABSL_FLAG(std::string, warmup, "5", "soak: warm-up at full concurrency before the RSS baseline, seconds (0 = none)");
ABSL_FLAG(int64_t, server_pid, 0, "soak: server process id (same host) whose VmRSS is read before and after");
ABSL_FLAG(std::string, lb_policy, "",
          "gRPC load balancing over the addresses --target resolves to: pick_first (gRPC's default) or round_robin "
          "(e.g. --target=ipv4:127.0.0.1:50051,127.0.0.1:50052 for one server per GPU, or dns:///svc:50051)");
ABSL_FLAG(int32_t, cuda_device, 0,
          "--transport=cuda_ipc: the GPU this process allocates its tensors on (the server runs the call there)");
ABSL_FLAG(int32_t, device_id, -1,
          "seam/swa: run on this device of the server (fusedctl info lists them; -1 = the server chooses: the "
          "device of the call's CUDA shared memory or session, else the least-loaded)");
ABSL_FLAG(bool, verify, false,
          "seam/swa: also run the unfused path on the server and return the fused-vs-unfused comparison");
ABSL_FLAG(std::string, dump, "", "replay: a shadow-verification mismatch dump (safetensors, --shadow_dump_dir)");
ABSL_FLAG(bool, echo_floor, false,
          "bench: then run a bare gRPC echo of the same request/response sizes over the same channel options, "
          "started in-process on loopback (a unix socket for unix targets), at the same concurrency and duration, "
          "and print its latency and req/s next to the call's (the transport floor)");
ABSL_FLAG(bool, copy_requests, false,
          "bench: serialize each request with protobuf (a copy of every tensor byte per call, the generated stub's "
          "way) instead of sending one shared request's tensor data by reference (FusedLayerClient's shared-request "
          "calls); for comparing the two");
ABSL_FLAG(std::string, transport, "tcp",
          "seam/swa/bench: tcp (tensors in the messages), shm (tensors in a POSIX shared-memory object this "
          "process creates and registers; same host, server started with --allow_shared_memory), cuda_ipc "
          "(tensors in device memory of this process on the server's GPU, used by the server's kernels in place; "
          "server started with --allow_cuda_shared_memory), ring and ring_cuda_ipc (the shm / cuda_ipc regions, "
          "the call through a call ring in shared memory instead of an RPC; server started with "
          "--allow_call_rings; bench's comparison row is the RPC over the same regions); bench --op=mhc also: "
          "session (x only per call, the residual and mixes kept in a residual session on the server)");
ABSL_FLAG(std::string, session, "",
          "seam: run the call in this residual session of the caller's (x only; the residual and mixes stay on "
          "the server between calls). --stage=first opens it (T = --tokens) when it is not open and starts the "
          "stream; seam and head continue it (T = the session's). Close it with close-session NAME");
ABSL_FLAG(bool, return_state, false, "seam --session: also return new_residual and the new mixes");
ABSL_FLAG(int32_t, max_rss_growth_mb, 64, "soak: fail when the server RSS grows by more than this, MiB");
ABSL_FLAG(bool, churn, false,
          "soak: one more client that loads a demo weight set as soak/churn and unloads it, again and again "
          "(needs the admin right)");
ABSL_FLAG(std::string, compute_token_file, "",
          "soak: file holding a token with only the compute right; adds its compute calls (OK) and its "
          "UnloadWeightSet (PERMISSION_DENIED) to the mix");

namespace {

using namespace fusedlayer::client;  // NOLINT: a main file

constexpr int kExitError = 1;
constexpr int kExitUsage = 2;
constexpr int kExitReproduced = 3;  // replay: the fused-vs-unfused mismatch reproduced

std::string Usage() {
  std::string s =
      "fusedctl: command-line client of the fusedlayer service.\n\n"
      "usage: fusedctl [--target=host:port|unix:PATH] [--deadline=60s] [--tls_ca=PEM [--tls_cert=PEM --tls_key=PEM]\n"
      "                [--tls_server_name=NAME]] [--token_file=FILE | env FUSEDCTL_TOKEN] COMMAND [flags]\n\n"
      "commands:\n";
  for (const CommandInfo& c : Commands()) absl::StrAppend(&s, "  fusedctl ", c.usage, "\n");
  absl::StrAppend(&s, "\nexit status: 0 ok (health: SERVING), 1 error, 2 usage error, 3 replay: mismatch reproduced");
  return s;
}

int UsageError(const std::string& message) {
  std::cerr << "fusedctl: usage error: " << OneLine(message) << "\n(run `fusedctl --help` for usage)\n";
  return kExitUsage;
}

// fusedctl import-checkpoint DIR [--output=FILE] [--layers=A-B] [--prefix=P]: prints the sets written and any
// notes (what was left out and why); exit 1 with one error line when the folder cannot be imported.
int RunImportCheckpoint(const std::string& dir) {
  CheckpointImportOptions options;
  options.checkpoint_dir = dir;
  if (const std::string output = absl::GetFlag(FLAGS_output); !output.empty()) options.output_path = output;
  if (const std::string layers = absl::GetFlag(FLAGS_layers); !layers.empty()) {
    absl::StatusOr<LayerRange> range = ParseLayerRange(layers);
    if (!range.ok()) return UsageError(std::string(range.status().message()));
    options.layers = *range;
  }
  options.prefix = absl::GetFlag(FLAGS_prefix);
  absl::StatusOr<CheckpointImportResult> result = ImportCheckpoint(options);
  if (!result.ok()) {
    std::cerr << ErrorLine(result.status()) << "\n";
    return kExitError;
  }
  std::cout << "wrote " << result->manifest_path << ": " << result->set_names.size() << " weight sets ("
            << result->dialect << " tensor names)";
  if (!result->set_names.empty()) {
    std::cout << ", " << result->set_names.front() << " .. " << result->set_names.back();
  }
  std::cout << "\n";
  if (!result->head_tensors_path.empty()) std::cout << "wrote " << result->head_tensors_path << " (head set)\n";
  for (const std::string& note : result->notes) std::cout << "note: " << note << "\n";
  std::cout << "load it with: fusedctl load " << result->manifest_path << "  (or --weights_manifest)\n";
  return 0;
}

// soak, with the churn set made here (fusedctl_lib does not link the weights library): the smaller
// demo set, renamed.
absl::Status RunSoakCommand(const FusedLayerClient& client, const CommandLine& cl) {
  if (!cl.churn) return RunSoak(client, cl, std::cout);
  absl::StatusOr<std::vector<fusedlayer::server::PackedWeightSet>> demo = fusedlayer::server::MakeDemoWeightSets();
  if (!demo.ok()) return demo.status();
  const fusedlayer::server::PackedWeightSet* smallest = &demo->front();
  for (const fusedlayer::server::PackedWeightSet& s : *demo) {
    if (s.second.size() < smallest->second.size()) smallest = &s;
  }
  ChurnSet churn{smallest->first, smallest->second};
  churn.header.set_name("soak/churn");  // the name is not part of the payload's digest
  churn.header.set_replace(false);
  return RunSoak(client, cl, std::cout, &churn);
}

}  // namespace

int main(int argc, char** argv) {
  // As in the server (server/main.cc): Debian's Abseil runs absl::Mutex's deadlock detector by
  // default, which every lock inside gRPC pays for; fusedctl measures latency, so it is off.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  absl::SetProgramUsageMessage(Usage());
  // Copied before parsing, to find which flags were written (FlagsOnCommandLine).
  const std::vector<std::string> raw_args(argv, argv + argc);
  std::vector<char*> positional = absl::ParseCommandLine(argc, argv);
  if (positional.size() < 2) return UsageError("no command given");
  const std::string command_name = positional[1];
  if (command_name == "help") {
    std::cout << Usage() << "\n";
    return 0;
  }
  const CommandInfo* command = FindCommand(command_name);
  if (command == nullptr) return UsageError(absl::StrCat("unknown command '", command_name, "'"));

  const std::set<std::string> specified = FlagsOnCommandLine(raw_args, AllCommandFlags());
  CommandLine cl;
  cl.args.assign(positional.begin() + 2, positional.end());
  if (absl::Status s = CheckCommandLine(*command, specified, cl.args.size()); !s.ok()) {
    return UsageError(std::string(s.message()));
  }

  // import-checkpoint works on local files only: no channel, no TLS or token flags involved.
  if (command->name == "import-checkpoint") return RunImportCheckpoint(cl.args.at(0));

  cl.target = absl::GetFlag(FLAGS_target);
  cl.service = absl::GetFlag(FLAGS_service);
  cl.replace = absl::GetFlag(FLAGS_replace);
  cl.chunk_bytes = absl::GetFlag(FLAGS_chunk_bytes);
  cl.weight_set = absl::GetFlag(FLAGS_weight_set);
  cl.tokens = absl::GetFlag(FLAGS_tokens);
  cl.tokens_set = specified.count("tokens") > 0;
  cl.mode = absl::GetFlag(FLAGS_mode);
  cl.stage = absl::GetFlag(FLAGS_stage);
  cl.no_pre_mix = absl::GetFlag(FLAGS_no_pre_mix);
  cl.capture_aux = absl::GetFlag(FLAGS_capture_aux);
  cl.path = absl::GetFlag(FLAGS_path);
  cl.input = absl::GetFlag(FLAGS_input);
  cl.output = absl::GetFlag(FLAGS_output);
  cl.row_stride = absl::GetFlag(FLAGS_row_stride);
  cl.op = absl::GetFlag(FLAGS_op);
  cl.concurrency = absl::GetFlag(FLAGS_concurrency);
  absl::StatusOr<absl::Duration> duration = ParseDurationFlag(absl::GetFlag(FLAGS_duration));
  if (!duration.ok()) return UsageError(std::string(duration.status().message()));
  cl.duration = *duration;
  cl.seed = absl::GetFlag(FLAGS_seed);
  absl::StatusOr<absl::Duration> warmup = absl::GetFlag(FLAGS_warmup) == "0"
                                              ? absl::StatusOr<absl::Duration>(absl::ZeroDuration())
                                              : ParseDurationFlag(absl::GetFlag(FLAGS_warmup));
  if (!warmup.ok()) return UsageError(std::string(warmup.status().message()));
  cl.warmup = *warmup;
  cl.server_pid = absl::GetFlag(FLAGS_server_pid);
  cl.max_rss_growth_mb = absl::GetFlag(FLAGS_max_rss_growth_mb);
  cl.churn = absl::GetFlag(FLAGS_churn);
  cl.compute_token_file = absl::GetFlag(FLAGS_compute_token_file);
  cl.dump = absl::GetFlag(FLAGS_dump);
  cl.verify = absl::GetFlag(FLAGS_verify);
  cl.device_id = absl::GetFlag(FLAGS_device_id);
  cl.echo_floor = absl::GetFlag(FLAGS_echo_floor);
  cl.copy_requests = absl::GetFlag(FLAGS_copy_requests);
  cl.transport = absl::GetFlag(FLAGS_transport);
  cl.session = absl::GetFlag(FLAGS_session);
  cl.return_state = absl::GetFlag(FLAGS_return_state);
  // --transport=cuda_ipc: this process's GPU (the compute library's backend, created at first use),
  // whose exportable allocations the server opens by their IPC handles.
  cl.cuda_regions = [](const fusedlayer::client::FusedLayerClient& client,
                       uint64_t bytes) -> absl::StatusOr<std::unique_ptr<fusedlayer::client::ClientRegion>> {
    static absl::StatusOr<std::unique_ptr<fusedlayer::Backend>>* const gpu = [] {
      fusedlayer::BackendOptions on;
      on.device_index = absl::GetFlag(FLAGS_cuda_device);
      auto* b = new absl::StatusOr<std::unique_ptr<fusedlayer::Backend>>(fusedlayer::CreateBackend("cuda", on));
      if (!b->ok()) *b = fusedlayer::CreateBackend("hip", on);
      return b;
    }();
    if (!gpu->ok()) {
      return absl::FailedPreconditionError(
          absl::StrCat("--transport=cuda_ipc needs a GPU on this host: ", gpu->status().message()));
    }
    absl::StatusOr<std::unique_ptr<fusedlayer::client::ClientCudaSharedMemory>> region =
        fusedlayer::client::ClientCudaSharedMemory::Create(client, ***gpu, bytes);
    if (!region.ok()) return region.status();
    return std::unique_ptr<fusedlayer::client::ClientRegion>(std::move(*region));
  };
  if (cl.chunk_bytes <= 0) return UsageError("--chunk_bytes must be positive");
  if (cl.tokens < 0) return UsageError("--tokens must be >= 0");
  if (cl.row_stride < 0) return UsageError("--row_stride must be >= 0");

  const std::string& n = command->name;
  ClientOptions options;
  if (n == "bench") {
    // Only bench sizes the pool from its callers: the other commands make one call at a time (soak
    // measures the server's memory and keeps the connection count it always had).
    const int connections = absl::GetFlag(FLAGS_connections);
    if (connections < 0 || connections > kMaxConnections) {
      return UsageError(absl::StrCat("--connections=", connections, " is outside 0..", kMaxConnections,
                                     " (0: chosen from --concurrency)"));
    }
    options.connections = connections;
    options.expected_concurrency = std::max(1, cl.concurrency);  // bench itself rejects --concurrency < 1
  }
  options.deadline = absl::GetFlag(FLAGS_deadline);
  options.load_balancing = absl::GetFlag(FLAGS_lb_policy);
  options.load_deadline = std::max(options.deadline, options.load_deadline);
  options.max_message_bytes = absl::GetFlag(FLAGS_max_message_bytes);
  const TlsFiles tls{absl::GetFlag(FLAGS_tls_ca), absl::GetFlag(FLAGS_tls_cert), absl::GetFlag(FLAGS_tls_key)};
  options.tls_server_name = absl::GetFlag(FLAGS_tls_server_name);
  if (!tls.ca.empty() || !tls.cert.empty() || !tls.key.empty() || !options.tls_server_name.empty()) {
    absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> credentials = TlsChannelCredentials(tls);
    if (!credentials.ok()) return UsageError(std::string(credentials.status().message()));
    options.credentials = *std::move(credentials);
  }
  // A token on the command line would show in `ps` and shell history: only a file or the environment.
  if (const std::string token_file = absl::GetFlag(FLAGS_token_file); !token_file.empty()) {
    absl::StatusOr<std::string> token = ReadBearerTokenFile(token_file);
    if (!token.ok()) return UsageError(std::string(token.status().message()));
    options.bearer_token = *std::move(token);
  } else if (const char* env = std::getenv("FUSEDCTL_TOKEN"); env != nullptr && *env != '\0') {
    options.bearer_token = std::string(absl::StripAsciiWhitespace(env));
  }
  absl::StatusOr<std::unique_ptr<FusedLayerClient>> client = FusedLayerClient::Connect(cl.target, options);
  if (!client.ok()) return UsageError(std::string(client.status().message()));

  absl::Status status;
  bool serving = false;
  if (n == "info") status = RunInfo(**client, cl, std::cout);
  else if (n == "health") status = RunHealth(**client, cl, std::cout, &serving);
  else if (n == "load") status = RunLoad(**client, cl, std::cout);
  else if (n == "list") status = RunList(**client, cl, std::cout);
  else if (n == "unload") status = RunUnload(**client, cl, std::cout);
  else if (n == "sessions") status = RunSessions(**client, cl, std::cout);
  else if (n == "close-session") status = RunCloseSession(**client, cl, std::cout);
  else if (n == "seam") status = RunSeam(**client, cl, std::cout);
  else if (n == "swa") status = RunSwa(**client, cl, std::cout);
  else if (n == "bench") status = RunBench(**client, cl, std::cout);
  else if (n == "soak") status = RunSoakCommand(**client, cl);
  bool reproduced = false;
  if (n == "replay") status = RunReplay(**client, cl, std::cout, &reproduced);
  std::cout.flush();
  if (!status.ok()) {
    std::cerr << ErrorLine(status) << "\n";
    return kExitError;
  }
  if (n == "health" && !serving) return kExitError;
  if (n == "replay" && reproduced) return kExitReproduced;
  return 0;
}
