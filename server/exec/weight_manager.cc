#include "exec/weight_manager.h"

#include <algorithm>
#include <cctype>
#include <future>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "exec/dispatcher.h"
#include "common/log.h"
#include "exec/warmup.h"
#include "weights/string_view_compat.h"

namespace fusedlayer::server {
namespace {

// The op's fused capability on one device (`device`: its ordinal, the sets' entry for it).
v1::OpCapability CapabilityFor(Op op, bool disabled, const Backend& backend, size_t device,
                               const std::vector<std::shared_ptr<const WeightSet>>& sets) {
  v1::OpCapability cap;
  cap.set_op(OpName(op));
  if (disabled) {
    cap.set_fused_available(false);
    cap.set_reason(v1::FALLBACK_REASON_DISABLED_BY_CONFIG);
    cap.set_detail("switched off by --disable_fused");
    return cap;
  }
  bool any = false;
  for (const auto& set : sets) {
    FusedSupport s;
    if (op == Op::kMhc) {
      const PreparedMhcWeights* part = set->on(device).mhc.get();
      if (part == nullptr) continue;
      s = backend.MhcFusedSupport(*part, MhcShapeQuery{MhcStage::kSeam, MhcMode::kShifted, false, 1});
    } else {
      const PreparedSwaWeights* part = set->on(device).swa.get();
      if (part == nullptr) continue;
      s = backend.SwaFusedSupport(*part, SwaShapeQuery{1});
    }
    if (s.supported) {
      cap.set_fused_available(true);
      cap.set_reason(v1::FALLBACK_REASON_NONE);
      cap.clear_detail();
      return cap;
    }
    if (!any) {  // report the first set's reason
      cap.set_reason(ProtoFallbackReason(s.reason));
      cap.set_detail(absl::StrCat("weight set '", set->name, "': ", s.detail));
    }
    any = true;
  }
  if (!any) {
    // Nothing loaded can fall back, so nothing is reported missing: the gauge (and the
    // FusedCapabilityLost alert on it) speak about the weight sets this server actually serves.
    cap.set_fused_available(true);
    cap.set_reason(v1::FALLBACK_REASON_NONE);
    cap.set_detail(absl::StrCat("no weight set with an ", OpName(op),
                                " part is loaded; the backend is asked for each set as it loads"));
    return cap;
  }
  cap.set_fused_available(false);
  return cap;
}

// The server's capability for an op from its devices': available where every device has it; else
// the first device that does not, named in the detail when there are several.
v1::OpCapability CombinedCapability(const ServingDevices& devices, const std::vector<v1::OpCapability>& per_device) {
  for (size_t d = 0; d < per_device.size(); ++d) {
    if (per_device[d].fused_available()) continue;
    v1::OpCapability cap = per_device[d];
    if (devices.size() > 1) cap.set_detail(absl::StrCat(devices[d].label, ": ", cap.detail()));
    return cap;
  }
  return per_device.front();
}

std::string ReasonName(const v1::OpCapability& cap) {
  // The proto enum names are the metric label values, upper-cased and prefixed.
  std::string s = v1::FallbackReason_Name(cap.reason()).substr(std::string_view("FALLBACK_REASON_").size());
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

}  // namespace

// The backend memory (device memory on a GPU) of a set's parts must be freed on the executor of
// the device that holds them, the one place that drives its backend. A published part's last
// reference may drop anywhere: on a gRPC thread that got the set and then refused the call, or that
// asked Contains, while the set was unloaded or replaced; on another device's executor (a set
// built on several devices, one of which then failed). Its deleter then parks the part here and
// queues a control task that frees it on the device's executor; if that task cannot be queued
// (stopping), the next install or unload frees it, or the manager's destructor (shutdown, after the
// executors stopped).
struct WeightManager::DeferredRelease {
  std::mutex mu;
  Executor* executor = nullptr;  // null once the manager is gone: free where the reference dropped
  std::vector<std::shared_ptr<const void>> parked;

  // The device's executor thread (or the manager's destructor).
  void FreeParked() {
    std::vector<std::shared_ptr<const void>> parts;
    {
      std::lock_guard<std::mutex> lock(mu);
      parts.swap(parked);
    }
    parts.clear();  // outside the lock: freeing may take a while on a device
  }

  // `part` as published: the same part, whose last reference frees it on this device's executor.
  static std::shared_ptr<const void> Hold(const std::shared_ptr<DeferredRelease>& deferred,
                                          std::shared_ptr<const void> part) {
    const void* raw = part.get();
    // The returned pointer shares ownership through its own control block; its deleter runs when
    // the last copy of it drops and disposes of `inner`, the only other reference.
    return std::shared_ptr<const void>(raw, [deferred, inner = std::move(part)](const void*) mutable {
      std::unique_lock<std::mutex> lock(deferred->mu);
      if (deferred->executor == nullptr || deferred->executor->OnWorker()) {
        lock.unlock();
        inner.reset();
        return;
      }
      deferred->parked.push_back(std::move(inner));
      // Under the lock: the manager (and so the executor) cannot go away meanwhile. The task holds
      // only `deferred`; if it cannot be queued it is dropped here, which frees nothing.
      (void)deferred->executor->SubmitControl([deferred](double) { deferred->FreeParked(); });
    });
  }
};

WeightManager::WeightManager(const ServerConfig& config, ServingDevices& devices, Metrics& metrics,
                             OpServingListener& health)
    : config_(config),
      devices_(devices),
      executor_(*devices.primary().executor),
      metrics_(metrics),
      health_(health),
      device_capabilities_(devices.size()) {
  for (size_t d = 0; d < devices_.size(); ++d) {
    deferred_.push_back(std::make_shared<DeferredRelease>());
    deferred_.back()->executor = devices_[d].executor.get();
  }
  for (Op op : kAllOps) {
    const int o = static_cast<int>(op);
    std::vector<v1::OpCapability> per_device;
    for (size_t d = 0; d < devices_.size(); ++d) {
      device_capabilities_[d][o] = CapabilityFor(op, config_.fused_disabled(op), *devices_[d].backend, d, {});
      per_device.push_back(device_capabilities_[d][o]);
      metrics_.SetFusedAvailable(static_cast<int>(d), op, per_device.back().fused_available());
    }
    capabilities_[o] = CombinedCapability(devices_, per_device);
  }
}

WeightManager::~WeightManager() {
  for (const auto& deferred : deferred_) {
    {
      std::lock_guard<std::mutex> lock(deferred->mu);
      deferred->executor = nullptr;
    }
    deferred->FreeParked();
  }
}

void WeightManager::FreeParkedOnWorker() {
  // Only the primary's parts may be freed here (this thread drives only its backend); the other
  // devices' parked parts have their own control task queued.
  deferred_.front()->FreeParked();
}

absl::StatusOr<v1::WeightSetInfo> WeightManager::InstallOnWorker(const v1::WeightSetHeader& header,
                                                                 std::string_view payload, std::string source,
                                                                 const std::function<absl::Status()>& may_publish,
                                                                 std::optional<std::string> payload_sha256) {
  FreeParkedOnWorker();  // any a failed SubmitControl left behind
  if (!header.stage().empty() && !IsValidWeightSetName(header.stage())) {
    return absl::InvalidArgumentError(absl::StrCat("weight set '", header.name(), "': stage \"",
                                                   absl::CHexEscape(header.stage().substr(0, 160)),
                                                   "\" is invalid: it must match [A-Za-z0-9._/-]{1,128}"));
  }
  // Fail fast before preparing (uploading) anything; Publish re-checks atomically.
  if (!header.replace() && store_.Get(header.name()).ok()) {
    return absl::AlreadyExistsError(
        absl::StrCat("weight set '", header.name(), "' is already loaded (set replace to swap it)"));
  }
  // Prepared on every serving device, each on its own executor, before anything is published: a
  // set is visible on all devices or on none. Each part is freed on its device's executor.
  std::vector<PrepareTarget> targets;
  for (size_t d = 0; d < devices_.size(); ++d) {
    ServingDevice& device = devices_[d];
    targets.push_back(PrepareTarget{
        device.backend.get(),
        [&device](absl::AnyInvocable<absl::Status() &&> work) {
          return ServingDevices::RunOnDevice(device, std::move(work));
        },
        [deferred = deferred_[d]](std::shared_ptr<const void> part) {
          return DeferredRelease::Hold(deferred, std::move(part));
        }});
  }
  absl::StatusOr<std::shared_ptr<const WeightSet>> built =
      BuildWeightSetOn(targets, header, payload, std::move(source), std::move(payload_sha256));
  if (!built.ok()) return built.status();
  std::shared_ptr<const WeightSet> set = *std::move(built);
  for (size_t d = 0; d < devices_.size(); ++d) {
    ServingDevice& device = devices_[d];
    const WeightSet::DeviceParts& parts = set->on(d);
    absl::Status warm = ServingDevices::RunOnDevice(device, [&]() -> absl::Status {
      if (parts.mhc) {
        if (absl::Status s = WarmUpMhc(*device.backend, *parts.mhc); !s.ok()) return s;
      }
      if (parts.swa) return WarmUpSwa(*device.backend, *parts.swa);
      return absl::OkStatus();
    });
    if (!warm.ok()) {
      return absl::InternalError(absl::StrCat("weight set '", set->name, "'",
                                              devices_.size() > 1 ? absl::StrCat(" on ", device.label) : "", ": ",
                                              warm.message()));
    }
  }
  if (may_publish) {
    if (absl::Status s = may_publish(); !s.ok()) {
      LogInfo("weight set '", set->name, "' not published: ", s.message());
      return s;
    }
  }
  if (!header.stage().empty()) return StageOnWorker(header, std::move(set));
  if (absl::StatusOr<std::shared_ptr<const WeightSet>> replaced = store_.Publish(set, header.replace());
      !replaced.ok()) {
    return replaced.status();
  }
  RefreshOnWorker();
  LogInfo("loaded weight set '", set->name, "' from ", set->source, ": ", set->has_mhc() ? "mhc " : "",
          set->has_swa() ? "swa " : "", set->resident_bytes, " bytes resident",
          devices_.size() > 1 ? absl::StrCat(" on ", devices_.size(), " devices") : "");
  return InfoOf(*set);
}

void WeightManager::DropAbandonedStagesOnWorker() {
  const auto now = std::chrono::steady_clock::now();
  for (auto it = stages_.begin(); it != stages_.end();) {
    if (now - it->second.touched < kAbandonedStageAge) {
      ++it;
      continue;
    }
    LogWarning("dropping stage '", it->first, "': ", it->second.sets.size(), " staged weight set(s) not committed within ",
               kAbandonedStageAge.count(), " minutes of their last upload");
    it = stages_.erase(it);  // on the executor: the sets' backend memory is freed here
  }
}

absl::StatusOr<v1::WeightSetInfo> WeightManager::StageOnWorker(const v1::WeightSetHeader& header,
                                                               std::shared_ptr<const WeightSet> set) {
  DropAbandonedStagesOnWorker();
  Stage& stage = stages_[header.stage()];
  stage.touched = std::chrono::steady_clock::now();
  for (const WeightStore::Staged& s : stage.sets) {
    if (s.set->name == set->name) {
      return absl::AlreadyExistsError(
          absl::StrCat("weight set '", set->name, "' is already staged under '", header.stage(), "'"));
    }
  }
  v1::WeightSetInfo info = InfoOf(*set);
  LogInfo("staged weight set '", set->name, "' under '", header.stage(), "' from ", set->source, ": ",
          set->resident_bytes, " bytes resident, published when the stage is committed");
  stage.sets.push_back({std::move(set), header.replace()});
  return info;
}

absl::StatusOr<std::vector<v1::WeightSetInfo>> WeightManager::CommitStagedOnWorker(std::string_view stage,
                                                                                   bool discard) {
  FreeParkedOnWorker();
  DropAbandonedStagesOnWorker();
  auto it = stages_.find(stage);
  if (it == stages_.end()) {
    return absl::NotFoundError(absl::StrCat("no weight set is staged under '", absl::CHexEscape(AbslView(stage.substr(0, 160))),
                                            "' (never uploaded, already committed or discarded, or abandoned)"));
  }
  std::vector<WeightStore::Staged> sets = std::move(it->second.sets);
  stages_.erase(it);
  if (discard) {
    LogInfo("discarded stage '", std::string(stage), "': ", sets.size(), " staged weight set(s)");
    return std::vector<v1::WeightSetInfo>{};
  }
  std::vector<std::shared_ptr<const WeightSet>> published;
  for (const WeightStore::Staged& s : sets) published.push_back(s.set);
  // The sets this replaces are dropped here, on the executor, once no request holds them.
  absl::StatusOr<std::vector<std::shared_ptr<const WeightSet>>> replaced = store_.PublishGroup(std::move(sets));
  if (!replaced.ok()) return replaced.status();
  RefreshOnWorker();
  std::sort(published.begin(), published.end(), [](const auto& a, const auto& b) { return a->name < b->name; });
  std::vector<v1::WeightSetInfo> infos;
  for (const auto& set : published) {
    infos.push_back(InfoOf(*set));
    LogInfo("loaded weight set '", set->name, "' from ", set->source, " (stage '", std::string(stage), "'): ",
            set->has_mhc() ? "mhc " : "", set->has_swa() ? "swa " : "", set->resident_bytes, " bytes resident");
  }
  return infos;
}

v1::WeightSetInfo WeightManager::InfoOf(const WeightSet& set) const {
  v1::WeightSetInfo info = ToInfo(set, *devices_.primary().backend, 0);
  // ToInfo answers for one device's backend: an op is available for the set where it is on every
  // device; otherwise the first device without it says why.
  for (size_t d = 1; d < devices_.size(); ++d) {
    const v1::WeightSetInfo other = ToInfo(set, *devices_[d].backend, d);
    for (int i = 0; i < info.capabilities_size() && i < other.capabilities_size(); ++i) {
      v1::OpCapability& cap = *info.mutable_capabilities(i);
      if (!cap.fused_available() || other.capabilities(i).fused_available()) continue;
      cap = other.capabilities(i);
      cap.set_detail(absl::StrCat(devices_[d].label, ": ", cap.detail()));
    }
  }
  // The operator's kill switch overrides the backends on this server.
  for (v1::OpCapability& cap : *info.mutable_capabilities()) {
    if (config_.fused_disabled(cap.op() == "mhc" ? Op::kMhc : Op::kSwa)) {
      cap.set_fused_available(false);
      cap.set_reason(v1::FALLBACK_REASON_DISABLED_BY_CONFIG);
      cap.set_detail("switched off by --disable_fused");
    }
  }
  return info;
}

absl::StatusOr<uint64_t> WeightManager::UnloadOnWorker(std::string_view name) {
  FreeParkedOnWorker();
  absl::StatusOr<uint64_t> freed = store_.Unload(name);
  if (!freed.ok()) return freed.status();
  RefreshOnWorker();
  LogInfo("unloaded weight set '", std::string(name), "' (", *freed, " bytes)");
  return *freed;
}

absl::StatusOr<v1::WeightSetInfo> WeightManager::InstallAndWait(const v1::WeightSetHeader& header,
                                                                std::string payload, std::string source) {
  std::promise<absl::StatusOr<v1::WeightSetInfo>> done;
  std::future<absl::StatusOr<v1::WeightSetInfo>> result = done.get_future();
  absl::Status submitted = executor_.SubmitControl(
      [this, &header, payload = std::move(payload), source = std::move(source), &done](double queue_seconds) mutable {
        metrics_.ObserveQueue(0, queue_seconds);
        done.set_value(InstallOnWorker(header, payload, std::move(source)));
      });
  if (!submitted.ok()) return submitted;
  return result.get();
}

absl::StatusOr<std::shared_ptr<const WeightSet>> WeightManager::Get(std::string_view name) const {
  return store_.Get(name);
}

bool WeightManager::Contains(std::string_view name) const { return store_.Get(name).ok(); }

std::vector<v1::WeightSetInfo> WeightManager::Infos() const {
  std::lock_guard<std::mutex> lock(mu_);
  return infos_;
}

std::vector<v1::OpCapability> WeightManager::Capabilities() const {
  std::lock_guard<std::mutex> lock(mu_);
  return {capabilities_.begin(), capabilities_.end()};
}

std::vector<v1::OpCapability> WeightManager::CapabilitiesOn(size_t device) const {
  std::lock_guard<std::mutex> lock(mu_);
  return {device_capabilities_[device].begin(), device_capabilities_[device].end()};
}

uint64_t WeightManager::ResidentBytesOn(size_t device) const {
  std::lock_guard<std::mutex> lock(mu_);
  return device_resident_bytes_.empty() ? 0 : device_resident_bytes_[device];
}

void WeightManager::FinishStartup() {
  std::lock_guard<std::mutex> lock(mu_);
  started_ = true;
  for (const v1::OpCapability& cap : capabilities_) {
    if (cap.fused_available() && !cap.detail().empty()) LogInfo("fused ", cap.op(), " path: ", cap.detail());
    if (!cap.fused_available()) {
      LogWarning("fused ", cap.op(), " path UNAVAILABLE on backend ", std::string(devices_.primary().backend->kind()), " (", ReasonName(cap),
                 "): ", cap.detail(), "; requests will run unfused");
    }
  }
}

void WeightManager::RefreshOnWorker() {
  std::vector<std::shared_ptr<const WeightSet>> sets = store_.List();
  std::vector<v1::WeightSetInfo> infos;
  std::vector<uint64_t> resident(devices_.size(), 0);
  std::array<bool, 2> serving{};
  for (const auto& set : sets) {
    infos.push_back(InfoOf(*set));
    for (size_t d = 0; d < devices_.size(); ++d) {
      const WeightSet::DeviceParts& parts = set->on(d);
      resident[d] += (parts.mhc ? parts.mhc->resident_bytes() : 0) + (parts.swa ? parts.swa->resident_bytes() : 0);
    }
    // Every published set was warmed up on every device before Publish, so "loaded" means "warmed".
    serving[0] = serving[0] || set->has_mhc();
    serving[1] = serving[1] || set->has_swa();
  }
  std::vector<std::array<v1::OpCapability, 2>> per_device(devices_.size());
  std::array<v1::OpCapability, 2> caps;
  for (Op op : kAllOps) {
    const int o = static_cast<int>(op);
    std::vector<v1::OpCapability> of_op;
    for (size_t d = 0; d < devices_.size(); ++d) {
      per_device[d][o] = CapabilityFor(op, config_.fused_disabled(op), *devices_[d].backend, d, sets);
      of_op.push_back(per_device[d][o]);
    }
    caps[o] = CombinedCapability(devices_, of_op);
  }

  {
    std::lock_guard<std::mutex> lock(mu_);
    for (Op op : kAllOps) {
      const int o = static_cast<int>(op);
      // After startup, say when an op's fused capability changes (a load or unload changed it).
      if (started_ && caps[o].fused_available() != capabilities_[o].fused_available()) {
        if (caps[o].fused_available()) {
          LogInfo("fused ", OpName(op), " path now available");
        } else {
          LogWarning("fused ", OpName(op), " path now UNAVAILABLE (", ReasonName(caps[o]), "): ", caps[o].detail());
        }
      }
    }
    infos_ = std::move(infos);
    capabilities_ = std::move(caps);
    device_capabilities_ = std::move(per_device);
    device_resident_bytes_ = resident;
  }
  for (Op op : kAllOps) {
    const int o = static_cast<int>(op);
    for (size_t d = 0; d < devices_.size(); ++d) {
      metrics_.SetFusedAvailable(static_cast<int>(d), op, device_capabilities_[d][o].fused_available());
    }
    health_.SetOpServing(op, serving[o]);
  }
  for (size_t d = 0; d < devices_.size(); ++d) metrics_.SetResidentBytes(static_cast<int>(d), resident[d]);
}

}  // namespace fusedlayer::server
