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

v1::OpCapability CapabilityFor(Op op, bool disabled, Backend& backend,
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
      if (!set->mhc) continue;
      s = backend.MhcFusedSupport(*set->mhc, MhcShapeQuery{MhcStage::kSeam, MhcMode::kShifted, false, 1});
    } else {
      if (!set->swa) continue;
      s = backend.SwaFusedSupport(*set->swa, SwaShapeQuery{1});
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

std::string ReasonName(const v1::OpCapability& cap) {
  // The proto enum names are the metric label values, upper-cased and prefixed.
  std::string s = v1::FallbackReason_Name(cap.reason()).substr(std::string_view("FALLBACK_REASON_").size());
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

}  // namespace

// The backend memory (device memory on a GPU) of a set must be freed on the executor, the one
// thread that drives the backend. A published set's last reference may drop anywhere: on a gRPC
// thread that got the set and then refused the call, or that asked Contains, while the set was
// unloaded or replaced. Its deleter then parks the set here and queues a control task that frees
// it on the executor; if that task cannot be queued (stopping), the next install or unload frees
// it, or the manager's destructor (shutdown, after the executor stopped).
struct WeightManager::DeferredRelease {
  std::mutex mu;
  Executor* executor = nullptr;  // null once the manager is gone: free where the reference dropped
  std::vector<std::shared_ptr<const WeightSet>> parked;

  // Executor thread (or the manager's destructor).
  void FreeParked() {
    std::vector<std::shared_ptr<const WeightSet>> sets;
    {
      std::lock_guard<std::mutex> lock(mu);
      sets.swap(parked);
    }
    sets.clear();  // outside the lock: freeing may take a while on a device
  }
};

WeightManager::WeightManager(const ServerConfig& config, Backend& backend, Executor& executor, Metrics& metrics,
                             OpServingListener& health)
    : config_(config),
      backend_(backend),
      executor_(executor),
      metrics_(metrics),
      health_(health),
      deferred_(std::make_shared<DeferredRelease>()) {
  deferred_->executor = &executor_;
  for (Op op : kAllOps) {
    capabilities_[static_cast<int>(op)] = CapabilityFor(op, config_.fused_disabled(op), backend_, {});
    metrics_.SetFusedAvailable(op, capabilities_[static_cast<int>(op)].fused_available());
  }
}

WeightManager::~WeightManager() {
  {
    std::lock_guard<std::mutex> lock(deferred_->mu);
    deferred_->executor = nullptr;
  }
  deferred_->FreeParked();
}

std::shared_ptr<const WeightSet> WeightManager::FreedOnExecutor(std::shared_ptr<const WeightSet> set) {
  const WeightSet* raw = set.get();
  // The returned pointer shares ownership through its own control block; its deleter runs when the
  // last copy of it drops and disposes of `inner`, the only other reference (this function's caller
  // holds none after publishing).
  return std::shared_ptr<const WeightSet>(
      raw, [deferred = deferred_, inner = std::move(set)](const WeightSet*) mutable {
        std::unique_lock<std::mutex> lock(deferred->mu);
        if (deferred->executor == nullptr || deferred->executor->OnWorker()) {
          lock.unlock();
          inner.reset();
          return;
        }
        deferred->parked.push_back(std::move(inner));
        // Under the lock: the manager (and so the executor) cannot go away meanwhile. The task
        // holds only `deferred`; if it cannot be queued it is dropped here, which frees nothing.
        (void)deferred->executor->SubmitControl([deferred](double) { deferred->FreeParked(); });
      });
}

absl::StatusOr<v1::WeightSetInfo> WeightManager::InstallOnWorker(const v1::WeightSetHeader& header,
                                                                 std::string_view payload, std::string source,
                                                                 const std::function<absl::Status()>& may_publish,
                                                                 std::optional<std::string> payload_sha256) {
  deferred_->FreeParked();  // any a failed SubmitControl left behind
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
  absl::StatusOr<std::shared_ptr<const WeightSet>> built =
      BuildWeightSet(backend_, header, payload, std::move(source), std::move(payload_sha256));
  if (!built.ok()) return built.status();
  // From here on every reference is one to the published form (and this one drops on the executor).
  std::shared_ptr<const WeightSet> set = FreedOnExecutor(*std::move(built));
  if (set->mhc) {
    if (absl::Status s = WarmUpMhc(backend_, *set->mhc); !s.ok()) {
      return absl::InternalError(absl::StrCat("weight set '", set->name, "': ", s.message()));
    }
  }
  if (set->swa) {
    if (absl::Status s = WarmUpSwa(backend_, *set->swa); !s.ok()) {
      return absl::InternalError(absl::StrCat("weight set '", set->name, "': ", s.message()));
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
  LogInfo("loaded weight set '", set->name, "' from ", set->source, ": ", set->mhc ? "mhc " : "",
          set->swa ? "swa " : "", set->resident_bytes, " bytes resident");
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
  deferred_->FreeParked();
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
            set->mhc ? "mhc " : "", set->swa ? "swa " : "", set->resident_bytes, " bytes resident");
  }
  return infos;
}

v1::WeightSetInfo WeightManager::InfoOf(const WeightSet& set) const {
  v1::WeightSetInfo info = ToInfo(set, backend_);
  // ToInfo answers for the backend; the operator's kill switch overrides it on this server.
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
  deferred_->FreeParked();
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
        metrics_.ObserveQueue(queue_seconds);
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

void WeightManager::FinishStartup() {
  std::lock_guard<std::mutex> lock(mu_);
  started_ = true;
  for (const v1::OpCapability& cap : capabilities_) {
    if (cap.fused_available() && !cap.detail().empty()) LogInfo("fused ", cap.op(), " path: ", cap.detail());
    if (!cap.fused_available()) {
      LogWarning("fused ", cap.op(), " path UNAVAILABLE on backend ", std::string(backend_.kind()), " (", ReasonName(cap),
                 "): ", cap.detail(), "; requests will run unfused");
    }
  }
}

void WeightManager::RefreshOnWorker() {
  std::vector<std::shared_ptr<const WeightSet>> sets = store_.List();
  std::vector<v1::WeightSetInfo> infos;
  uint64_t resident = 0;
  std::array<bool, 2> serving{};
  for (const auto& set : sets) {
    infos.push_back(InfoOf(*set));
    resident += set->resident_bytes;
    // Every published set was warmed up before Publish, so "loaded" means "warmed".
    serving[0] = serving[0] || set->mhc != nullptr;
    serving[1] = serving[1] || set->swa != nullptr;
  }
  std::array<v1::OpCapability, 2> caps;
  for (Op op : kAllOps) caps[static_cast<int>(op)] = CapabilityFor(op, config_.fused_disabled(op), backend_, sets);

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
  }
  for (Op op : kAllOps) {
    metrics_.SetFusedAvailable(op, capabilities_[static_cast<int>(op)].fused_available());
    health_.SetOpServing(op, serving[static_cast<int>(op)]);
  }
  metrics_.SetResidentBytes(resident);
}

}  // namespace fusedlayer::server
