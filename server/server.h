// Assembles a running fusedlayer server: backend, executor, weights, metrics (+ Exposer), health,
// the gRPC service with reflection. main.cc and the end-to-end tests both build servers this way.
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "config.h"
#include "runtime/executor.h"
#include "runtime/serving_devices.h"
#include "fusedlayer/backend.h"
#include "grpcpp/server.h"
#include "rpc/health.h"
#include "metrics/metrics.h"
#include "rpc/service.h"
#include "rpc/plaintext_listener.h"
#include "ring/call_rings.h"
#include "shadow/shadow_verifier.h"
#include "exec/weight_manager.h"
#include "weights/weight_set.h"

namespace prometheus {
class Exposer;
}

namespace fusedlayer::server {

// One device named in --devices, as its backend was made for it (main.cc, tests): a backend that
// could not be made keeps the device out of serving, reported with its error (GetServerInfo).
struct DeviceCandidate {
  int device_id = 0;
  std::string label;  // "cuda:1", "cpu:0"
  absl::StatusOr<std::unique_ptr<Backend>> backend;

  // A backend as the one device of a server (its own id and label).
  static DeviceCandidate Of(std::unique_ptr<Backend> backend) {
    const int id = DeviceIdOf(*backend);
    std::string label = DeviceLabel(backend->kind(), id);
    return DeviceCandidate{id, std::move(label), std::move(backend)};
  }
};

class FusedLayerServer {
 public:
  // Starts a server on `backend`: loads `initial_sets` (each built, warmed up and published; the
  // first failure aborts startup with its status), logs the per-op capability, starts gRPC on
  // config.address and the Exposer on config.metrics_address (when non-empty). A port of 0 in
  // either address picks a free port (see port() / metrics_port()). A unix: address replaces a
  // stale socket file at its path (one nobody accepts on) and refuses a live socket or another
  // file; gRPC removes the socket file again at shutdown.
  // Each device of `devices` that passes its start-up check (its backend was made and its lanes
  // can be created) serves; the others are logged and reported. UNAVAILABLE when none serves.
  static absl::StatusOr<std::unique_ptr<FusedLayerServer>> Start(
      ServerConfig config, std::vector<DeviceCandidate> devices,
      std::vector<std::pair<PackedWeightSet, std::string /*source*/>> initial_sets);
  // One device.
  static absl::StatusOr<std::unique_ptr<FusedLayerServer>> Start(
      ServerConfig config, std::unique_ptr<Backend> backend,
      std::vector<std::pair<PackedWeightSet, std::string /*source*/>> initial_sets);
  ~FusedLayerServer();  // Shutdown(now)

  // The TCP port gRPC listens on; 0 for unix: and unix-abstract: addresses (no port).
  int port() const { return port_; }
  int metrics_port() const { return metrics_port_; }
  // Where call rings are handed over (empty when --allow_call_rings is off).
  std::string call_ring_socket() const { return call_rings_ ? call_rings_->socket_path() : std::string(); }
  Metrics& metrics() { return *metrics_; }
  // The primary (first serving) device's backend, and all the serving devices.
  Backend& backend() { return *devices_->primary().backend; }
  ServingDevices& devices() { return *devices_; }
  const ServerConfig& config() const { return config_; }
  // Tasks waiting in the device executor's queue (tests use it to sequence back-pressure cases).
  size_t queued_tasks() const { return devices_->primary().executor->queued(); }
  // The primary device's executor and the shadow verifier (tests: the background lane's pause hook
  // and counters, the shadow queue).
  Executor& executor() { return *devices_->primary().executor; }
  shadow::ShadowVerifier& shadow() { return *shadow_; }

  // Health NOT_SERVING, then gRPC shutdown: in-flight calls may finish until `deadline`, after
  // which they are cancelled; then the executor drains and stops. Idempotent.
  void Shutdown(std::chrono::system_clock::time_point deadline);

 private:
  explicit FusedLayerServer(ServerConfig config);

  ServerConfig config_;
  std::unique_ptr<Metrics> metrics_;
  // Declared before the devices so it outlives the background tasks their executors drop at Stop.
  std::unique_ptr<shadow::ShadowVerifier> shadow_;
  // The serving devices: each one's backend, lanes and executor (runtime/serving_devices.h).
  std::unique_ptr<ServingDevices> devices_;
  Health health_;
  std::unique_ptr<WeightManager> weights_;
  // A plaintext address's own listener (rpc/plaintext_listener.h); before the service, which reads
  // its table of unix peers.
  std::unique_ptr<PlaintextListener> plaintext_listener_;
  std::unique_ptr<FusedLayerService> service_;
  // Call rings (--allow_call_rings): after the service, whose engine they submit to.
  std::unique_ptr<ring::CallRingService> call_rings_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<prometheus::Exposer> exposer_;
  int port_ = 0;
  int metrics_port_ = 0;
  bool shut_down_ = false;
};

// The version string compiled into this build (CMake project version).
const char* ServerVersion();

}  // namespace fusedlayer::server
