// fusedlayer_server: serves the fused DeepSeek-V4 layer ops over gRPC. Flags: flags.cc.
//
// Startup fails fast (exit 1, one clear line) on bad flags, an unavailable backend, a bad manifest
// or a port in use. SIGTERM/SIGINT drain: health goes NOT_SERVING at once, in-flight calls get up
// to --drain_seconds, then the process exits 0.
#include <malloc.h>
#include <signal.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <algorithm>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#if FUSEDLAYER_TCMALLOC
#include <gperftools/tcmalloc.h>
#endif

#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "flags.h"
#include "fusedlayer/backend.h"
#include "common/descriptors.h"
#include "common/log.h"
#include "server.h"
#include "weights/demo_weights.h"
#include "weights/manifest.h"
#if FUSEDLAYER_FAULT_INJECTION
#include "fault_injection.h"  // test-only builds (docs/operations.md)
#endif

namespace fs = fusedlayer::server;

namespace {

int Fail(const std::string& message) {
  fs::LogError(message);
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  // Debian's Abseil is built without NDEBUG, so absl::Mutex runs its lock-order (deadlock) detector
  // by default: every lock gRPC takes (it uses absl::Mutex inside) goes through one process-wide
  // graph under a global spinlock that all serving threads share (a nested lock pair costs ~4x
  // without contention), and a lock-order cycle it merely suspects would abort the server. Release
  // builds of Abseil have it off; so does this server (docs/operations.md, "Abseil's deadlock
  // detector").
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  absl::SetProgramUsageMessage("fusedlayer gRPC server: fused mHC seam and SWA norm+quant ops");
  // Abseil's --help shows only flags defined in a file named after the binary, and the server's live
  // in flags.cc: it printed "No flags matched" (and exited 1). --help lists them by purpose instead.
  for (int i = 1; i < argc; ++i) {
    for (const char* help : {"--help", "-help", "--helpshort", "-helpshort"}) {
      if (std::strcmp(argv[i], help) == 0) {
        std::fputs(fs::FlagsUsage(argv[0]).c_str(), stdout);
        return 0;
      }
    }
  }
  absl::ParseCommandLine(argc, argv);
  // Before anything opens descriptors: the regions' budget is derived from the raised soft limit.
  fs::RaiseDescriptorLimit();

  // Block the shutdown signals before any thread exists so that every thread inherits the mask and
  // the main thread alone receives them through sigwait.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  absl::StatusOr<fs::ServerConfig> config = fs::ConfigFromFlags();
  if (!config.ok()) return Fail(std::string(config.status().message()));
#if FUSEDLAYER_TCMALLOC
  // The server's allocator (CMakeLists.txt, FUSEDLAYER_TCMALLOC): glibc's tunables below do not apply.
  const char* tcmalloc_patch = "";
  int tcmalloc_major = 0, tcmalloc_minor = 0;
  tc_version(&tcmalloc_major, &tcmalloc_minor, &tcmalloc_patch);
  fs::LogInfo("memory allocator: tcmalloc ", tcmalloc_major, ".", tcmalloc_minor, tcmalloc_patch,
              " (gperftools); the --malloc_* flags apply to glibc's malloc and are not used");
  const bool glibc_malloc = false;
#else
  const bool glibc_malloc = true;
#endif
  // Before any thread exists (the backend's pool, gRPC's): a thread picks its arena on its first
  // allocation. Sanitizer runtimes replace malloc and ignore it (mallopt returns 0 there).
  if (glibc_malloc && config->malloc_arena_max > 0 && mallopt(M_ARENA_MAX, config->malloc_arena_max) != 1) {
    fs::LogInfo("--malloc_arena_max=", config->malloc_arena_max, " not applied (this malloc has no M_ARENA_MAX)");
  }
  // A call's tensors (4.4 MiB of mHC T=64 outputs, its request, gRPC's copies) are larger than
  // glibc's default thresholds keep in the heap: they were mmap'd/munmap'd or trimmed away after each
  // call and page-faulted in again by the next (docs/operations.md#malloc-thresholds). Setting either
  // also turns off glibc's dynamic mmap threshold, so both are set together.
  if (glibc_malloc && config->malloc_mmap_threshold_bytes > 0 &&
      mallopt(M_MMAP_THRESHOLD, static_cast<int>(config->malloc_mmap_threshold_bytes)) != 1) {
    fs::LogInfo("--malloc_mmap_threshold_bytes=", config->malloc_mmap_threshold_bytes, " not applied");
  }
  if (glibc_malloc && config->malloc_trim_threshold_bytes > 0 &&
      mallopt(M_TRIM_THRESHOLD, static_cast<int>(config->malloc_trim_threshold_bytes)) != 1) {
    fs::LogInfo("--malloc_trim_threshold_bytes=", config->malloc_trim_threshold_bytes, " not applied");
  }

#if FUSEDLAYER_FAULT_INJECTION
  fs::FaultInjectingBackend* faults = nullptr;
#endif
  // --devices: one backend per listed device. The first decides the kind (auto: a GPU when one
  // is present); a later device whose backend cannot be made is left out by the server, reported.
  // (--devices=all on the CPU backend: one device; a list of N splits the cores.)
  absl::StatusOr<std::vector<int>> device_ids =
      fs::ParseDeviceList(config->devices, config->backend == "cpu" ? 0 : fusedlayer::VisibleGpuCount());
  if (!device_ids.ok()) return Fail(std::string(device_ids.status().message()));
  fusedlayer::BackendOptions options;
  options.fused_max_tokens = config->fused_max_tokens;
  // CPU devices split the cores between them unless --cpu_threads says how many each gets.
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  options.num_threads = config->cpu_threads > 0 ? config->cpu_threads
                        : device_ids->size() > 1 ? std::max(1, cores / static_cast<int>(device_ids->size()))
                                                 : 0;
  std::vector<fs::DeviceCandidate> devices;
  std::string kind = config->backend;
  for (int id : *device_ids) {
    options.device_index = id;
    absl::StatusOr<std::unique_ptr<fusedlayer::Backend>> backend = fusedlayer::CreateBackend(kind, options);
    if (devices.empty()) {
      // The first device fails the start: the operator asked for a backend this host cannot give.
      if (!backend.ok()) return Fail(absl::StrCat("--backend=", config->backend, ": ", backend.status().message()));
      kind = std::string((*backend)->kind());  // every device of a server is of one kind
#if FUSEDLAYER_FAULT_INJECTION
      fs::FaultInjectingBackend* injecting = nullptr;
      backend = fs::WrapWithFaultInjectionFromFlag(*std::move(backend), &injecting);
      if (!backend.ok()) return Fail(std::string(backend.status().message()));
      faults = injecting;
#endif
    }
    devices.push_back(fs::DeviceCandidate{id, fs::DeviceLabel(kind, id), std::move(backend)});
  }

  std::vector<std::pair<fs::PackedWeightSet, std::string>> initial;
  if (config->demo_weights) {
    // A fixed seed: every server (and every client test) sees the same demo weights.
    absl::StatusOr<std::vector<fs::PackedWeightSet>> demo = fs::MakeDemoWeightSets(fs::kDefaultDemoSeed);
    if (!demo.ok()) return Fail(absl::StrCat("--demo_weights: ", demo.status().ToString()));
    for (fs::PackedWeightSet& set : *demo) initial.emplace_back(std::move(set), "demo");
  }
  if (!config->weights_manifest.empty()) {
    absl::StatusOr<std::vector<fs::PackedWeightSet>> sets = fs::LoadManifest(config->weights_manifest);
    if (!sets.ok()) {
      return Fail(absl::StrCat("--weights_manifest=", config->weights_manifest, ": ", sets.status().ToString()));
    }
    for (fs::PackedWeightSet& set : *sets) {
      initial.emplace_back(std::move(set), absl::StrCat("manifest:", config->weights_manifest));
    }
  }
  if (initial.empty()) {
    fs::LogWarning("no weight sets at startup (--demo_weights, --weights_manifest): load some with LoadWeights");
  }

  const double drain_seconds = config->drain_seconds;
  absl::StatusOr<std::unique_ptr<fs::FusedLayerServer>> server =
      fs::FusedLayerServer::Start(*std::move(config), std::move(devices), std::move(initial));
  if (!server.ok()) return Fail(server.status().ToString());
#if FUSEDLAYER_FAULT_INJECTION
  // Armed only now: startup uploads and warm-ups ran clean. Tests wait for this line.
  if (faults != nullptr) {
    faults->Arm();
    fs::LogWarning("fault injection armed");
  }
#endif

  int sig = 0;
  sigwait(&signals, &sig);
  fs::LogInfo("received ", sig == SIGTERM ? "SIGTERM" : "SIGINT", ": draining for up to ", drain_seconds, " s");
  const auto deadline = std::chrono::system_clock::now() +
                        std::chrono::duration_cast<std::chrono::system_clock::duration>(
                            std::chrono::duration<double>(drain_seconds));
  (*server)->Shutdown(deadline);
  server->reset();
  fs::LogInfo("shut down cleanly");
  return 0;
}
