#include "server.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <thread>

#include "absl/strings/str_cat.h"
#include "auth/transport_security.h"
#include "grpc/grpc.h"  // GRPC_ARG_* channel argument names
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/health_check_service_interface.h"
#include "grpcpp/resource_quota.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server_builder.h"
#include "common/byte_budget.h"
#include "common/descriptors.h"
#include "common/log.h"
#include "fusedlayer/wire/tsan_annotations.h"
#include "prometheus/exposer.h"
#include "rpc/undecodable_requests.h"

#ifndef FUSEDLAYER_VERSION_STRING
#error "FUSEDLAYER_VERSION_STRING must be defined by the build"
#endif

namespace fusedlayer::server {

const char* ServerVersion() { return FUSEDLAYER_VERSION_STRING; }

namespace {

// Makes `path` free for a unix: listener. gRPC 1.51 unlinks whatever socket is at the path before
// bind, a live one included, so a second server would silently take the socket of a running one;
// and it fails with a bare "cannot listen" on any other file. So: nothing there, fine; a socket
// nobody accepts on (a crashed server's leftover), removed; a socket someone serves on, or a file
// that is not a socket, an error naming it.
absl::Status PrepareUnixSocketPath(const std::string& address, const std::string& path) {
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0) {
    if (errno == ENOENT) return absl::OkStatus();
    return absl::UnavailableError(
        absl::StrCat("--address=", address, ": cannot stat ", path, ": ", std::strerror(errno)));
  }
  if (!S_ISSOCK(st.st_mode)) {
    return absl::FailedPreconditionError(
        absl::StrCat("--address=", address, ": ", path, " exists and is not a socket (not removing it)"));
  }
  sockaddr_un sa;
  const socklen_t sa_len = UnixSocketAddress(address, &sa);
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return absl::UnavailableError(absl::StrCat("socket(AF_UNIX): ", std::strerror(errno)));
  const bool live = ::connect(fd, reinterpret_cast<const sockaddr*>(&sa), sa_len) == 0;
  const int connect_errno = errno;
  ::close(fd);
  if (live) {
    return absl::UnavailableError(
        absl::StrCat("--address=", address, ": another process is accepting connections on ", path));
  }
  if (connect_errno != ECONNREFUSED) {
    return absl::UnavailableError(absl::StrCat("--address=", address, ": cannot probe the existing socket ", path,
                                               ": ", std::strerror(connect_errno)));
  }
  if (::unlink(path.c_str()) != 0 && errno != ENOENT) {
    return absl::UnavailableError(
        absl::StrCat("--address=", address, ": cannot remove the stale socket ", path, ": ", std::strerror(errno)));
  }
  LogInfo("removed the stale socket ", path, " (no process accepted connections on it)");
  return absl::OkStatus();
}

std::vector<shadow::ShadowDevice> ShadowDevicesOf(const ServingDevices& devices) {
  std::vector<shadow::ShadowDevice> out;
  for (size_t d = 0; d < devices.size(); ++d) {
    out.push_back({devices[d].backend.get(), devices[d].executor.get(), devices[d].label});
  }
  return out;
}

}  // namespace

absl::StatusOr<std::unique_ptr<FusedLayerServer>> FusedLayerServer::Start(
    ServerConfig config, std::unique_ptr<Backend> backend,
    std::vector<std::pair<PackedWeightSet, std::string>> initial_sets) {
  std::vector<DeviceCandidate> devices;
  devices.push_back(DeviceCandidate::Of(std::move(backend)));
  return Start(std::move(config), std::move(devices), std::move(initial_sets));
}

absl::StatusOr<std::unique_ptr<FusedLayerServer>> FusedLayerServer::Start(
    ServerConfig config, std::vector<DeviceCandidate> candidates,
    std::vector<std::pair<PackedWeightSet, std::string>> initial_sets) {
  if (absl::Status s = config.Validate(); !s.ok()) return s;
  const ListenKind listen_kind = ListenKindOf(config.address);
  // Certificates and tokens are checked before any weight is loaded: a typo fails in milliseconds.
  absl::StatusOr<auth::ServerSecurity> security = auth::MakeServerSecurity(config);
  if (!security.ok()) return security.status();
  // Likewise the socket path, before weights load for minutes.
  if (listen_kind == ListenKind::kUnix) {
    if (absl::Status s = PrepareUnixSocketPath(config.address, UnixSocketPath(config.address)); !s.ok()) return s;
  }
  if (config.allow_shared_memory) {
    const DescriptorBudget descriptors = DescriptorBudgetFor(config.descriptor_reserve);
    if (descriptors.regions < 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--allow_shared_memory: no descriptors left for shared-memory regions (", descriptors.Describe(),
          "): raise RLIMIT_NOFILE (ulimit -n, LimitNOFILE=) or lower --descriptor_reserve"));
    }
    LogInfo("shared-memory regions: at most ", descriptors.regions,
            " registered at once by all identities, one descriptor each (descriptor budget: ", descriptors.Describe(),
            ")");
  }
  std::unique_ptr<FusedLayerServer> srv(new FusedLayerServer(std::move(config)));
  const ServerConfig& cfg = srv->config_;
  BatchingOptions batching;
  batching.max_batch_tokens = cfg.max_batch_tokens;
  batching.max_queue_delay = std::chrono::microseconds(cfg.max_queue_delay_us);

  // Each device's start-up check: its backend was made, its lanes can be created. One that fails
  // is reported and left out; the server serves on the others.
  srv->devices_ = std::make_unique<ServingDevices>();
  ServingDevices& devices = *srv->devices_;
  std::vector<std::pair<std::unique_ptr<Backend>, DeviceCandidate*>> usable;
  for (DeviceCandidate& c : candidates) {
    if (!c.backend.ok()) {
      LogError("device ", c.label, " left out: ", c.backend.status().message());
      devices.AddLeftOut(LeftOutDevice{c.device_id, c.label, std::string(c.backend.status().message())});
      continue;
    }
    usable.emplace_back(*std::move(c.backend), &c);
  }
  // Every device left out: the start fails, naming each one's error.
  auto none_serves = [&devices] {
    std::string why;
    for (const LeftOutDevice& d : devices.left_out()) absl::StrAppend(&why, why.empty() ? "" : "; ", d.label, ": ", d.error);
    return absl::UnavailableError(absl::StrCat("no device passed its start-up check (", why, ")"));
  };
  if (usable.empty()) return none_serves();
  Backend& first = *usable.front().first;
  const ServerIdentity identity{ServerVersion(), std::string(first.kind()), first.device_name(), first.arch()};
  LogInfo("fusedlayer ", identity.version, ": backend ", identity.backend, ", device ", identity.device, ", arch ",
          identity.arch);

  // The memory the defaults are derived from (config.h's Effective*), and where it was read.
  const MemoryLimit memory = AvailableMemory();
  LogInfo("memory: ", memory.bytes, " bytes (", memory.source.empty() ? "unknown: defaults assume 16 GiB" : memory.source,
          "); defaults from it: --max_inflight_bytes ", cfg.EffectiveMaxInflightBytes(), ", --grpc_memory_quota_bytes ",
          cfg.EffectiveGrpcMemoryQuotaBytes(), ", --max_upload_buffer_bytes ", cfg.EffectiveMaxUploadBufferBytes(),
          ", --residual_session_total_bytes ", cfg.EffectiveResidualSessionTotalBytes());
  // Each serving device gets its series as it joins (Metrics::AddDevice: the same ordinal).
  srv->metrics_ = std::make_unique<Metrics>(identity.version, identity.backend, identity.arch);
  for (auto& [backend, candidate] : usable) {
    // One staging pool for every device (page-locked for all of them): the primary's.
    HostStagingPool* shared = devices.empty() ? nullptr : devices.primary().lanes->staging();
    absl::StatusOr<std::unique_ptr<DeviceLanes>> lanes =
        DeviceLanes::Create(*backend, cfg.device_lanes, static_cast<size_t>(cfg.host_staging_bytes),
                            devices.empty() ? srv->metrics_->registry().get() : nullptr, cfg.host_copy_threads,
                            devices.empty() ? static_cast<size_t>(cfg.request_staging_bytes) : 0, shared);
    if (!lanes.ok()) {
      LogError("device ", candidate->label, " left out: ", lanes.status().message());
      devices.AddLeftOut(LeftOutDevice{candidate->device_id, candidate->label, std::string(lanes.status().message())});
      continue;
    }
    auto device = std::make_unique<ServingDevice>();
    device->device_id = candidate->device_id;
    device->label = candidate->label;
    device->kind = std::string(backend->kind());
    device->name = backend->device_name();
    device->backend = std::move(backend);
    device->lanes = std::move(*lanes);
    // Auto: spin on a GPU; on the CPU backend, whose kernels want every core, only where call rings
    // are on (a ring client asked for latency), as long as the ring poller spins.
    const int64_t spin_us = cfg.executor_spin_us >= 0 ? cfg.executor_spin_us
                            : device->lanes->lanes() > 0 ? kAutoExecutorSpinUs
                            : cfg.allow_call_rings       ? cfg.call_ring_spin_us
                                                         : 0;
    device->executor = std::make_unique<Executor>(static_cast<size_t>(cfg.queue_capacity), batching,
                                                  device->lanes->workers(),
                                                  SpinOptions{std::chrono::microseconds(spin_us)});
    LogInfo("device ", device->label, " (", device->name, "): ", device->lanes->lanes(),
            " lane(s) (--device_lanes), executor ", device->executor->workers(), " worker(s), idle spin ", spin_us,
            " us (--executor_spin_us)");
    srv->metrics_->AddDevice(device->label);
    devices.Add(std::move(device));
  }
  if (devices.empty()) return none_serves();
  if (devices.primary().lanes->lanes() > 0) {
    LogInfo("pinned staging up to ", cfg.host_staging_bytes, " bytes (--host_staging_bytes, shared by the ",
            devices.size(), " device(s)), ", devices.primary().lanes->staging()->copier().helper_threads(),
            " host copy helper threads (--host_copy_threads), requests read into pinned memory up to ",
            cfg.request_staging_bytes, " bytes (--request_staging_bytes)");
  }
  if (!cfg.metrics_address.empty()) {
    try {
      srv->exposer_ = std::make_unique<prometheus::Exposer>(cfg.metrics_address);
    } catch (const std::exception& e) {
      return absl::UnavailableError(
          absl::StrCat("cannot serve metrics on ", cfg.metrics_address, " (--metrics_address): ", e.what()));
    }
    srv->exposer_->RegisterCollectable(srv->metrics_->registry());
    const std::vector<int> ports = srv->exposer_->GetListeningPorts();
    srv->metrics_port_ = ports.empty() ? 0 : ports.front();
    LogInfo("metrics on http://", cfg.metrics_address, "/metrics (port ", srv->metrics_port_, ")");
  }
  Backend& be = *devices.primary().backend;
  for (size_t d = 0; d < devices.size(); ++d) srv->health_.SetDeviceServing(devices[d].label, true);
  for (const LeftOutDevice& left : devices.left_out()) srv->health_.SetDeviceServing(left.label, false);

  shadow::ShadowOptions shadow_options;
  shadow_options.sample_rate = cfg.shadow_sample_rate;
  shadow_options.queue_size = cfg.shadow_queue_size;
  shadow_options.queue_max_bytes = static_cast<uint64_t>(cfg.shadow_queue_max_bytes);
  shadow_options.dump_dir = cfg.shadow_dump_dir;
  shadow_options.dump_max_files = cfg.shadow_dump_max_files;
  shadow_options.dump_max_bytes = static_cast<uint64_t>(cfg.shadow_dump_max_bytes);
  shadow_options.verify_dump_max_files = cfg.verify_dump_max_files;
  shadow_options.verify_dump_max_bytes = static_cast<uint64_t>(cfg.verify_dump_max_bytes);
  shadow_options.backend = identity.backend;
  absl::StatusOr<std::unique_ptr<shadow::ShadowVerifier>> verifier =
      shadow::ShadowVerifier::Create(std::move(shadow_options), ShadowDevicesOf(devices), *srv->metrics_->registry());
  if (!verifier.ok()) return verifier.status();
  srv->shadow_ = std::move(*verifier);
  srv->weights_ = std::make_unique<WeightManager>(cfg, devices, *srv->metrics_, srv->health_);
  for (auto& [packed, source] : initial_sets) {
    const std::string name = packed.first.name();
    absl::StatusOr<v1::WeightSetInfo> info =
        srv->weights_->InstallAndWait(packed.first, std::move(packed.second), source);
    if (!info.ok()) {
      return absl::Status(info.status().code(),
                          absl::StrCat("loading weight set '", name, "' from ", source, ": ", info.status().message()));
    }
  }
  srv->weights_->FinishStartup();

  // A plaintext address is accepted by the server itself (rpc/plaintext_listener.h): a unix
  // socket's calls know their peer's user, and a TCP listener keeps accepting after the process ran
  // out of descriptors. Bound here, accepted from once gRPC runs. A TCP address in another form
  // than HOST:PORT (ipv4:, dns:///...) is left to gRPC's listener.
  if (security->plaintext_open) {
    absl::StatusOr<std::unique_ptr<PlaintextListener>> listener = PlaintextListener::Listen(cfg.address);
    if (listener.ok()) {
      srv->plaintext_listener_ = std::move(*listener);
    } else if (listen_kind != ListenKind::kTcp || listener.status().code() != absl::StatusCode::kUnimplemented) {
      return listener.status();
    }
  }
  const bool unix_peers = srv->plaintext_listener_ && listen_kind != ListenKind::kTcp;
  srv->service_ = std::make_unique<FusedLayerService>(
      cfg, identity, devices, *srv->weights_, *srv->metrics_, *srv->shadow_,
      unix_peers ? &srv->plaintext_listener_->peers() : nullptr);
  if (cfg.allow_call_rings) {
    ring::CallRingOptions rings;
    rings.socket_path = cfg.call_ring_socket;
    if (rings.socket_path.empty()) {
      rings.socket_path = listen_kind == ListenKind::kUnix ? UnixSocketPath(cfg.address) + ".rings"
                                                           : absl::StrCat("/tmp/fusedlayer-", ::getpid(), ".rings");
    }
    rings.max_rings = static_cast<int>(cfg.call_ring_max_rings);
    rings.max_per_identity = static_cast<int>(cfg.call_ring_max_per_identity);
    rings.max_slots = static_cast<uint32_t>(cfg.call_ring_max_slots);
    rings.spin_us = cfg.call_ring_spin_us;
    // Auto: one poller per 8 cores, 1 to 4 (a spinning poller holds a core while its calls come).
    rings.pollers = cfg.call_ring_pollers > 0
                        ? static_cast<int>(cfg.call_ring_pollers)
                        : std::clamp(static_cast<int>(std::thread::hardware_concurrency()) / 8, 1, 4);
    // The primary's backend page-locks ring memory for every device of the process.
    if (!be.host_accessible()) rings.device = &be;
    absl::StatusOr<std::unique_ptr<ring::CallRingService>> started =
        ring::CallRingService::Start(std::move(rings), srv->service_->engine(), *srv->metrics_);
    if (!started.ok()) return started.status();
    srv->call_rings_ = std::move(*started);
    srv->service_->AttachCallRings(srv->call_rings_.get());
  }
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  if (!srv->plaintext_listener_) builder.AddListeningPort(cfg.address, security->credentials, &srv->port_);
  builder.SetMaxReceiveMessageSize(static_cast<int>(cfg.max_message_bytes));
  builder.SetMaxSendMessageSize(static_cast<int>(cfg.max_message_bytes));
  // gRPC's own buffers (messages being received, transport) are bounded by the quota, and a client
  // connection's concurrent calls by the stream limit: without them a flood of large requests is
  // limited only by the kernel's OOM killer (docs/operations.md, "Memory admission").
  grpc::ResourceQuota quota("fusedlayer");
  quota.Resize(static_cast<size_t>(cfg.EffectiveGrpcMemoryQuotaBytes()));
  builder.SetResourceQuota(quota);
  builder.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS, cfg.max_concurrent_streams);
  if (cfg.max_connection_age_seconds > 0) {
    // Long-lived HTTP/2 connections pin a client to the replicas it first resolved; ageing them
    // out lets dns:/// + round_robin clients pick up new replicas (the grace lets calls finish).
    builder.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_AGE_MS, static_cast<int>(cfg.max_connection_age_seconds * 1000));
    builder.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_AGE_GRACE_MS, static_cast<int>(cfg.drain_seconds * 1000));
  }
  // gRPC answers a unary request it cannot parse UNIMPLEMENTED with no message; the interceptor
  // makes it INVALID_ARGUMENT naming the request type, as the compute RPCs answer.
  // Not in ThreadSanitizer builds: gRPC builds each call's interceptor state on one of its threads
  // and runs the interceptor on another, ordered inside the uninstrumented libgrpc
  // (fusedlayer/wire/tsan_annotations.h), where no hand-off of ours could announce it; TSan would report
  // every admin call. The interceptor is tested in the other builds (UndecodableRequests).
#ifndef FUSEDLAYER_TSAN
  std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> interceptors;
  interceptors.push_back(UndecodableRequestInterceptorFactory());
  builder.experimental().SetInterceptorCreators(std::move(interceptors));
#endif
  builder.RegisterService(srv->service_.get());
  srv->server_ = builder.BuildAndStart();
  // BuildAndStart returns null when a port fails to bind. A TCP port of 0 after a "successful"
  // start is gRPC's other failure signal; a unix socket has no port (gRPC reports 1 for it).
  if (srv->plaintext_listener_) srv->port_ = srv->plaintext_listener_->port();
  if (srv->server_ == nullptr || (listen_kind == ListenKind::kTcp && srv->port_ == 0)) {
    return absl::UnavailableError(absl::StrCat("cannot listen on ", cfg.address, " (--address)"));
  }
  if (listen_kind != ListenKind::kTcp) srv->port_ = 0;
  if (srv->plaintext_listener_) srv->plaintext_listener_->Start(srv->server_.get());
  srv->health_.Attach(srv->server_->GetHealthCheckService());
  const char* peers = unix_peers ? "; callers identified by their user id, SO_PEERCRED" : "";
  const std::string where =
      listen_kind == ListenKind::kTcp
          ? absl::StrCat(" (port ", srv->port_, ")")
          : absl::StrCat(listen_kind == ListenKind::kUnix ? " (unix domain socket" : " (abstract unix socket", peers, ")");
  LogInfo("serving fusedlayer.v1.FusedLayer on ", cfg.address, where, ", queue capacity ", cfg.queue_capacity,
          ", max message ", cfg.max_message_bytes, " bytes, compute bytes in flight at most ",
          cfg.EffectiveMaxInflightBytes(), ", gRPC memory quota ", cfg.EffectiveGrpcMemoryQuotaBytes(),
          " bytes, ", cfg.max_concurrent_streams, " streams per connection");
  if (security->plaintext_open) {
    LogWarning("transport security: none (plaintext, no tokens): anyone who reaches ", cfg.address,
               " may call every RPC, LoadWeights and UnloadWeightSet included; see docs/security.md");
  } else if (security->unauthenticated_tls) {
    LogWarning("transport security: ", security->description,
               " WITHOUT tokens (--allow_unauthenticated_tls): everyone who completes the TLS handshake may call "
               "every RPC, LoadWeights and UnloadWeightSet included; see docs/security.md");
  } else {
    LogInfo("transport security: ", security->description);
  }
  return srv;
}

void FusedLayerServer::Shutdown(std::chrono::system_clock::time_point deadline) {
  if (shut_down_) return;
  shut_down_ = true;
  health_.Shutdown();
  if (service_) service_->StartDraining();  // calls that race gRPC's GOAWAY: UNAVAILABLE, no new work
  // No request will come to join a batch being formed: it launches now, not after its queue delay
  // (which may be longer than the drain deadline, --max_queue_delay_us up to 60 s).
  if (devices_) {
    for (size_t d = 0; d < devices_->size(); ++d) (*devices_)[d].executor->EndQueueDelays();
  }
  LogInfo("draining: health NOT_SERVING, new calls refused with UNAVAILABLE");
  // Waits for in-flight RPCs (their executor tasks finish them) until the deadline, then cancels
  // what is left; queued tasks of cancelled calls are dropped at their launch check.
  if (plaintext_listener_) plaintext_listener_->Stop();  // no new connections, as gRPC's own listener at Shutdown
  if (server_) server_->Shutdown(deadline);
  // Rings: no more calls taken; the ones queued finish (or are dropped: their ring is closed) by
  // the deadline, before the executor stops.
  if (call_rings_) {
    call_rings_->Stop(std::chrono::steady_clock::now() +
                      std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                          std::max(deadline - std::chrono::system_clock::now(), std::chrono::system_clock::duration{0})));
  }
  if (devices_) devices_->StopExecutors();
  if (server_) server_->Wait();
  // Every call's OnDone has returned (UnaryCall::OnDone releases this key; tsan_annotations.h).
  if (metrics_) wire::TsanAcquireFrom(metrics_.get());
}

FusedLayerServer::FusedLayerServer(ServerConfig config) : config_(std::move(config)) {}

namespace {

// Destroys the Exposer without civetweb's poll round. civetweb (prometheus-cpp's HTTP server) polls
// its listening sockets in 2 s rounds and sees that it is being stopped only when a round ends, so
// destroying the Exposer took up to 2 s: every server stop after SIGTERM's drain, and every test
// that starts a server. A connection to the metrics port ends the round at once; one that arrives
// before the stop is an empty request civetweb closes. Where the metrics address is not reachable
// on loopback (a specific interface's address) the stop takes its round as before.
void StopExposer(std::unique_ptr<prometheus::Exposer>& exposer, int port) {
  if (!exposer) return;
  std::atomic<bool> stopped{false};
  std::thread waker([&stopped, port] {
    while (port > 0 && !stopped.load(std::memory_order_acquire)) {
      sockaddr_in v4{};
      v4.sin_family = AF_INET;
      v4.sin_port = htons(static_cast<uint16_t>(port));
      v4.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
      sockaddr_in6 v6{};
      v6.sin6_family = AF_INET6;
      v6.sin6_port = htons(static_cast<uint16_t>(port));
      v6.sin6_addr = in6addr_loopback;
      const std::pair<const sockaddr*, socklen_t> targets[] = {
          {reinterpret_cast<const sockaddr*>(&v4), sizeof(v4)}, {reinterpret_cast<const sockaddr*>(&v6), sizeof(v6)}};
      for (const auto& [addr, len] : targets) {
        const int fd = ::socket(addr->sa_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
        if (fd < 0) continue;
        (void)::connect(fd, addr, len);
        ::close(fd);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  });
  exposer.reset();
  stopped.store(true, std::memory_order_release);
  waker.join();
}

}  // namespace

FusedLayerServer::~FusedLayerServer() {
  Shutdown(std::chrono::system_clock::now());
  StopExposer(exposer_, metrics_port_);
}

}  // namespace fusedlayer::server
