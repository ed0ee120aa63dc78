// The lifecycle of weight sets inside the server: build (validate + prepare on every serving
// device's backend), warm up on each, publish atomically (a set is visible on all devices or on
// none), unload; and the state derived from the loaded sets: per-op fused capability (per device
// and combined: gauges, GetServerInfo, startup warnings), per-op health, resident bytes per device,
// and the WeightSetInfo list. The manager's own work runs on the primary device's executor thread
// ("the executor" below), each device's backend work on that device's executor; readers get
// snapshots under a mutex.
#pragma once

#include <array>
#include <chrono>
#include <map>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "config.h"
#include "runtime/executor.h"
#include "runtime/serving_devices.h"
#include "exec/op_serving.h"
#include "exec/weight_store.h"
#include "fusedlayer/backend.h"
#include "fusedlayer/v1/fusedlayer.pb.h"
#include "metrics/metrics.h"
#include "weights/weight_set.h"

namespace fusedlayer::server {

class WeightManager {
 public:
  WeightManager(const ServerConfig& config, ServingDevices& devices, Metrics& metrics, OpServingListener& health);
  // Frees, here, the parts whose last reference dropped off their executor and are still waiting.
  ~WeightManager();

  // Executor thread only. Build + warm-up + publish: nothing is visible unless all succeed.
  // ALREADY_EXISTS when the name is taken and !header.replace; BuildWeightSet's codes otherwise;
  // INTERNAL when the warm-up fails.
  // `may_publish`, when given, is asked after the warm-up, just before publishing: a non-OK status
  // (the upload's client cancelled, the server started draining) is returned and nothing is published.
  // `payload_sha256`: the payload's digest when the caller already computed it (BuildWeightSet).
  absl::StatusOr<v1::WeightSetInfo> InstallOnWorker(const v1::WeightSetHeader& header, std::string_view payload,
                                                    std::string source,
                                                    const std::function<absl::Status()>& may_publish = nullptr,
                                                    std::optional<std::string> payload_sha256 = std::nullopt);
  // With header.stage() set, InstallOnWorker builds and warms up the set but publishes nothing: the set
  // waits under the stage until CommitStagedOnWorker (all or nothing across the sets of a manifest).
  // Executor thread only. Publishes every set staged under `stage` in one step (WeightStore::
  // PublishGroup), or drops them all when `discard`; the stage is consumed either way. NOT_FOUND for
  // an unknown stage, ALREADY_EXISTS as for Publish (nothing published). Returns the published sets'
  // infos, by name.
  absl::StatusOr<std::vector<v1::WeightSetInfo>> CommitStagedOnWorker(std::string_view stage, bool discard);
  // Executor thread only. NOT_FOUND for an unknown name; returns the bytes freed (the memory is
  // released once in-flight calls holding the set finish).
  absl::StatusOr<uint64_t> UnloadOnWorker(std::string_view name);
  // Any thread but the executor's: InstallOnWorker on the executor, waiting for it (startup).
  absl::StatusOr<v1::WeightSetInfo> InstallAndWait(const v1::WeightSetHeader& header, std::string payload,
                                                   std::string source);

  // Any thread. The backend memory of a published set is always freed on the executor, whichever
  // thread drops its last reference: a gRPC thread that held a set (a refused compute call,
  // Contains) while it was unloaded or replaced hands it to the executor instead of freeing it.
  absl::StatusOr<std::shared_ptr<const WeightSet>> Get(std::string_view name) const;
  bool Contains(std::string_view name) const;
  std::vector<v1::WeightSetInfo> Infos() const;
  std::vector<v1::OpCapability> Capabilities() const;
  // The same for one device (its ordinal), and the weight bytes resident there.
  std::vector<v1::OpCapability> CapabilitiesOn(size_t device) const;
  uint64_t ResidentBytesOn(size_t device) const;
  // End of startup: one WARNING line per op whose fused path is unavailable; from now on changes
  // of an op's capability (after a load or unload) are logged.
  void FinishStartup();

 private:
  // Per device: the prepared parts whose last reference dropped off the device's executor, waiting
  // to be freed on it (shared with the parts' deleters, which may run after the manager is gone).
  struct DeferredRelease;
  void FreeParkedOnWorker();

  // Sets uploaded under a stage id, built and warmed up, not yet published (executor thread only).
  struct Stage {
    std::vector<WeightStore::Staged> sets;
    std::chrono::steady_clock::time_point touched;  // last upload to it
  };
  // A stage whose client went away (crashed between uploads) holds device memory for nothing: one
  // without an upload for this long is dropped at the next staging or commit.
  static constexpr std::chrono::minutes kAbandonedStageAge{10};
  void DropAbandonedStagesOnWorker();
  absl::StatusOr<v1::WeightSetInfo> StageOnWorker(const v1::WeightSetHeader& header,
                                                  std::shared_ptr<const WeightSet> set);

  // Recomputes capability, health, infos and resident bytes from the store (executor thread).
  void RefreshOnWorker();
  // The wire description of a set on this server (kill switch applied). Executor thread.
  v1::WeightSetInfo InfoOf(const WeightSet& set) const;

  const ServerConfig& config_;
  ServingDevices& devices_;
  Executor& executor_;  // the primary device's
  Metrics& metrics_;
  OpServingListener& health_;
  std::vector<std::shared_ptr<DeferredRelease>> deferred_;  // by device ordinal
  WeightStore store_;
  std::map<std::string, Stage, std::less<>> stages_;  // executor thread only

  mutable std::mutex mu_;  // guards the snapshots below
  std::vector<v1::WeightSetInfo> infos_;
  std::array<v1::OpCapability, 2> capabilities_;
  std::vector<std::array<v1::OpCapability, 2>> device_capabilities_;  // by device ordinal
  std::vector<uint64_t> device_resident_bytes_;                       // by device ordinal
  bool started_ = false;
};

}  // namespace fusedlayer::server
