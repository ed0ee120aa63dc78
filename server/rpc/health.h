// grpc.health.v1 statuses of the server. Service names (docs/conventions.md):
//   ""                          overall: SERVING once started, NOT_SERVING while draining
//   "fusedlayer.v1.FusedLayer"  the API: same as overall
//   "fusedlayer.mhc"            SERVING while a warmed-up weight set with an mHC part is loaded
//   "fusedlayer.swa"            same for the SWA part
//   "fusedlayer.device.LABEL"   per device of --devices ("fusedlayer.device.cuda:1"): SERVING while
//                               it serves, NOT_SERVING for one left out at start-up (a probe or a
//                               rank's sidecar can ask for its own GPU)
// Kubernetes probes and load balancers check a named service; gRPC's default health service
// answers NOT_FOUND for a name never set, so every name is set explicitly at Attach().
#pragma once

#include <array>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "config.h"
#include "exec/op_serving.h"
#include "grpcpp/health_check_service_interface.h"

namespace fusedlayer::server {

inline constexpr char kHealthOverall[] = "";
inline constexpr char kHealthApi[] = "fusedlayer.v1.FusedLayer";
inline constexpr char kHealthMhc[] = "fusedlayer.mhc";
inline constexpr char kHealthSwa[] = "fusedlayer.swa";
inline constexpr char kHealthDevicePrefix[] = "fusedlayer.device.";
const char* HealthServiceName(Op op);

class Health final : public OpServingListener {
 public:
  // Binds to the started server's default health service and publishes every status.
  void Attach(grpc::HealthCheckServiceInterface* service);
  // Per-op readiness (weights loaded and warmed up). May be called before Attach().
  void SetOpServing(Op op, bool serving) override;
  // A device's status under "fusedlayer.device." + label. May be called before Attach().
  void SetDeviceServing(const std::string& label, bool serving);
  // Draining: every name NOT_SERVING, and later updates are ignored.
  void Shutdown();

 private:
  void PublishLocked();
  std::mutex mu_;
  grpc::HealthCheckServiceInterface* service_ = nullptr;
  std::array<bool, 2> op_serving_{};
  std::vector<std::pair<std::string, bool>> devices_;  // service name, serving
  bool shut_down_ = false;
};

}  // namespace fusedlayer::server
