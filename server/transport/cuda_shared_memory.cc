#include "transport/cuda_shared_memory.h"

#include <limits>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "prometheus/family.h"
#include "transport/shared_memory.h"

namespace fusedlayer::server::transport {

CudaSharedMemoryRegistry::CudaSharedMemoryRegistry(CudaSharedMemoryLimits limits, prometheus::Registry& metrics,
                                                   std::vector<Backend*> importers)
    : limits_(limits),
      importers_(std::move(importers)),
      metrics_(CudaSharedMemoryMetrics::Register(metrics)),
      regions_(RegionTableSpec{"CUDA shared-memory", "--cuda_shared_memory_max_regions",
                               "--cuda_shared_memory_idle_seconds", limits.max_regions, limits.idle_seconds},
               RegionTableMetrics{metrics_.regions, metrics_.registered_bytes, metrics_.expired}) {
  // Last: the reaper may run as soon as it exists.
  if (limits_.enabled && limits_.idle_seconds > 0) {
    reaper_.emplace(ReaperPeriod(limits_.idle_seconds), [this] { ExpireIdle(std::chrono::steady_clock::now()); });
  }
}

absl::Status CudaSharedMemoryRegistry::CheckEnabled() const {
  if (!limits_.enabled) {
    return absl::FailedPreconditionError(
        "CUDA shared memory is off on this server: start it with --allow_cuda_shared_memory (same host and GPU "
        "only), or send the tensors inline");
  }
  if (importers_.empty() || importers_.front()->device_index() < 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("CUDA shared memory needs a GPU backend; this server runs the ",
                     !importers_.empty() ? std::string(importers_.front()->kind()) : std::string("no"), " backend"));
  }
  return absl::OkStatus();
}

absl::Status CudaSharedMemoryRegistry::CheckRegisterLocked(const std::string& identity,
                                                           const v1::RegisterCudaSharedMemoryRequest& req,
                                                           uint64_t allocation_bytes) {
  if (absl::Status s = regions_.CheckNameFree(identity, req.name()); !s.ok()) return s;
  auto opened = handles_.find(req.raw_handle());
  if (opened != handles_.end() && opened->second.regions > 0 && opened->second.identity != identity) {
    // Says nothing about who: only that the allocation is taken.
    return absl::PermissionDeniedError("this CUDA IPC handle is registered by another identity");
  }
  if (absl::Status s = regions_.CheckRoomForOneMore(identity); !s.ok()) return s;
  const Regions::Usage have = regions_.usage(identity);
  // An opened handle keeps its whole allocation alive, whatever part of it the regions name (a
  // client that exits leaves it to the server until the last region goes): the identity is charged
  // the allocation, once per handle, when its first region on it is registered.
  const bool held = opened != handles_.end() && opened->second.regions > 0;
  const uint64_t charge = held ? 0 : allocation_bytes;
  if (charge > limits_.max_bytes - have.bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "a region of this CUDA allocation keeps all of its ", charge, " bytes open in the server, which would bring "
        "this identity to more than ", limits_.max_bytes,
        " bytes (--cuda_shared_memory_max_bytes; its registrations hold ", have.bytes, " open)"));
  }
  return absl::OkStatus();
}

absl::Status CudaSharedMemoryRegistry::Register(const std::string& identity,
                                                const v1::RegisterCudaSharedMemoryRequest& req) {
  if (absl::Status s = CheckEnabled(); !s.ok()) return s;
  if (absl::Status s = CheckRegionName(req.name()); !s.ok()) return s;
  if (req.raw_handle().size() != kIpcHandleBytes) {
    return absl::InvalidArgumentError(absl::StrCat("raw_handle is ", req.raw_handle().size(),
                                                   " bytes; a cudaIpcMemHandle_t is ", kIpcHandleBytes));
  }
  Backend* importer = nullptr;
  std::string served;
  for (Backend* b : importers_) {
    if (b->device_index() == req.device_id()) importer = b;
    absl::StrAppend(&served, served.empty() ? "" : ", ", b->device_index());
  }
  if (importer == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("device_id ", req.device_id(), ": this server runs on GPU(s) ",
                                                   served,
                                                   " and uses memory of those GPUs only (GetServerInfo.devices)"));
  }
  if (req.byte_size() == 0) return absl::InvalidArgumentError("byte_size must be > 0");
  uint64_t end = 0;
  if (__builtin_add_overflow(req.offset(), req.byte_size(), &end)) {
    return absl::InvalidArgumentError(
        absl::StrCat("offset ", req.offset(), " + byte_size ", req.byte_size(), " overflows"));
  }
  if (req.offset() % kSharedMemoryAlignment != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("offset ", req.offset(), " is not a multiple of ", kSharedMemoryAlignment));
  }

  MutexLock registering(&register_mu_);
  std::shared_ptr<const DeviceBuffer> allocation;
  {
    MutexLock lock(&mu_);
    // (The allocation's size is known once it is opened: here its least, the region's end.)
    if (absl::Status s = CheckRegisterLocked(identity, req, end); !s.ok()) return s;
    auto opened = handles_.find(req.raw_handle());
    if (opened != handles_.end()) allocation = opened->second.allocation.lock();
  }
  if (allocation == nullptr) {
    // Outside mu_ (compute requests look regions up meanwhile); registrations wait on register_mu_,
    // so no other one opens this handle or takes this name before it is published below.
    absl::StatusOr<DeviceBuffer> imported = importer->ImportIpcMemory(req.raw_handle());
    if (!imported.ok()) {
      if (absl::IsUnimplemented(imported.status())) return absl::FailedPreconditionError(imported.status().message());
      return absl::InvalidArgumentError(absl::StrCat("raw_handle: ", imported.status().message()));
    }
    allocation = std::make_shared<const DeviceBuffer>(*std::move(imported));
  }
  if (end > allocation->bytes()) {
    // (A handle opened just now is closed again when `allocation` goes.)
    return absl::InvalidArgumentError(absl::StrCat("the region [", req.offset(), ", ", end,
                                                   ") lies outside the allocation, which is ", allocation->bytes(),
                                                   " bytes"));
  }

  MutexLock lock(&mu_);
  // Unregisters may have run meanwhile (they only free); checked again all the same.
  if (absl::Status s = CheckRegisterLocked(identity, req, allocation->bytes()); !s.ok()) return s;
  Opened& opened = handles_[req.raw_handle()];
  uint64_t charge = 0;  // the allocation, with the identity's first region on this handle
  if (opened.regions == 0) {
    opened.bytes = allocation->bytes();
    charge = opened.bytes;
  }
  opened.allocation = allocation;
  opened.identity = identity;
  opened.regions += 1;
  regions_.Add(identity, req.name(),
               std::make_shared<const CudaSharedMemoryRegion>(req.name(), req.raw_handle(), std::move(allocation),
                                                              req.device_id(), req.offset(), req.byte_size()),
               charge);
  // Handles whose regions are all gone and whose last request completed: forget them.
  for (auto it = handles_.begin(); it != handles_.end();) {
    it = it->second.regions == 0 && it->second.allocation.expired() ? handles_.erase(it) : std::next(it);
  }
  return absl::OkStatus();
}

void CudaSharedMemoryRegistry::EraseLocked(Regions::iterator it) {
  uint64_t uncharge = 0;
  if (auto opened = handles_.find(it->second.region->handle());
      opened != handles_.end() && --opened->second.regions == 0) {
    uncharge = opened->second.bytes;  // its last region: the allocation is no longer this identity's to hold
  }
  regions_.Erase(it, uncharge);  // the handle closes when its last region and in-flight request let go
}

void CudaSharedMemoryRegistry::ExpireIdle(std::chrono::steady_clock::time_point now) {
  MutexLock lock(&mu_);
  regions_.ExpireIdle(now, [this](Regions::iterator it) ABSL_NO_THREAD_SAFETY_ANALYSIS {
    LogInfo("CUDA shared-memory region '", it->second.region->name(), "' unregistered: no request used it for ",
            limits_.idle_seconds, " s (--cuda_shared_memory_idle_seconds)");
    EraseLocked(it);  // the handle closes once no region and no request in flight holds it
  });
}

absl::StatusOr<v1::CudaSharedMemoryStatusResponse> CudaSharedMemoryRegistry::Status(const std::string& identity,
                                                                                   const std::string& name) {
  if (absl::Status s = CheckEnabled(); !s.ok()) return s;
  if (!name.empty()) {
    if (absl::Status s = CheckRegionName(name); !s.ok()) return s;
  }
  MutexLock lock(&mu_);
  return regions_.List<v1::CudaSharedMemoryStatusResponse>(
      identity, name, [](const CudaSharedMemoryRegion& r, v1::CudaSharedMemoryRegion* info) {
        info->set_name(r.name());
        info->set_device_id(r.device_id());
        info->set_offset(r.offset());
        info->set_byte_size(r.byte_size());
      });
}

absl::StatusOr<v1::UnregisterCudaSharedMemoryResponse> CudaSharedMemoryRegistry::Unregister(
    const std::string& identity, const std::string& name) {
  if (absl::Status s = CheckEnabled(); !s.ok()) return s;
  MutexLock lock(&mu_);
  return regions_.Unregister<v1::UnregisterCudaSharedMemoryResponse>(
      identity, name, [this](Regions::iterator it) ABSL_NO_THREAD_SAFETY_ANALYSIS { EraseLocked(it); });
}

absl::StatusOr<std::shared_ptr<const CudaSharedMemoryRegion>> CudaSharedMemoryRegistry::Lookup(
    const std::string& identity, const std::string& name, const char* tensor) {
  if (absl::Status s = CheckEnabled(); !s.ok()) {
    return absl::FailedPreconditionError(absl::StrCat("tensor '", tensor, "': ", s.message()));
  }
  if (absl::Status s = CheckRegionName(name); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("tensor '", tensor, "': ", s.message()));
  }
  MutexLock lock(&mu_);
  absl::StatusOr<Regions::iterator> it = regions_.FindForRequest(identity, name, tensor);
  if (!it.ok()) return it.status();
  return (*it)->second.region;
}

}  // namespace fusedlayer::server::transport
