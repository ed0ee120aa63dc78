// CUDA shared memory (same host, same GPU): the registry of device buffers that clients export
// from their own process with cudaIpcGetMemHandle, which the kernels then read and write in place.
// A request that references them moves no tensor byte through the socket or the host: its views
// point into the client's allocation and the lanes hand them to the kernels untouched
// (runtime/device_range.h, ExecTarget::resident).
//
// What the server trusts and what it does not:
//   - The bounds come from the driver, never the client: an opened handle is the whole allocation
//     as Backend::ImportIpcMemory reports it, and every region and every reference is checked
//     against it (overflow included) before anything is launched. A kernel that ran past a client's
//     allocation would fault the server's device context for every client.
//   - A handle is opened once per process (cudaIpcOpenMemHandle), at registration, and shared by the
//     regions registered on it; it is closed when its last region is unregistered and the last
//     request that references it completed (requests hold the region). An opening keeps the client's
//     allocation alive after the client exits, so a client that dies without unregistering holds
//     that GPU memory until its identity unregisters the region or, with
//     --cuda_shared_memory_idle_seconds, until no request has used the region for that long.
//   - Ownership as for system shared memory (transport/shared_memory.h): a region belongs to the
//     identity that registered it, names are per identity, another identity's region is NOT_FOUND,
//     and a handle registered by one identity cannot be registered by another (PERMISSION_DENIED).
//   - Synchronisation (the contract in the proto): the client completes its inputs before it sends
//     the request; the response is sent after the lane's Wait(), so after the kernels that wrote the
//     client's outputs completed.
//   - The server knows nothing about CUDA: it opens handles through its Backend, and a backend
//     without IPC (the CPU backend) makes every registration FAILED_PRECONDITION.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/annotated_mutex.h"
#include "common/periodic_task.h"
#include "runtime/device_range.h"
#include "fusedlayer/backend.h"
#include "fusedlayer/v1/fusedlayer.pb.h"
#include "metrics/component_metrics.h"
#include "prometheus/registry.h"
#include "transport/region_table.h"

namespace fusedlayer::server::transport {

struct CudaSharedMemoryLimits {
  bool enabled = false;                     // --allow_cuda_shared_memory
  int64_t max_regions = 64;                 // per identity (--cuda_shared_memory_max_regions)
  uint64_t max_bytes = uint64_t{64} << 30;  // per identity: the allocations its regions keep open (--cuda_shared_memory_max_bytes)
  double idle_seconds = 0;  // unregistered after this long unused (--cuda_shared_memory_idle_seconds; 0 = never)
};

// One registered region: a byte range of a client's device allocation, opened in this process.
class CudaSharedMemoryRegion {
 public:
  CudaSharedMemoryRegion(std::string name, std::string handle, std::shared_ptr<const DeviceBuffer> allocation,
                         int device_id, uint64_t offset, uint64_t byte_size)
      : name_(std::move(name)),
        handle_(std::move(handle)),
        allocation_(std::move(allocation)),
        device_id_(device_id),
        offset_(offset),
        byte_size_(byte_size) {}

  const std::string& name() const { return name_; }
  const std::string& handle() const { return handle_; }  // the IPC handle's bytes (the registry's key)
  int device_id() const { return device_id_; }
  uint64_t offset() const { return offset_; }  // in the allocation
  uint64_t byte_size() const { return byte_size_; }
  // The allocation the region lies in (two references overlap only within one allocation).
  const DeviceBuffer* allocation() const { return allocation_.get(); }
  // The region's first byte, a DEVICE address: for the kernels only, never read by the CPU.
  const char* device_data() const { return static_cast<const char*>(allocation_->data()) + offset_; }

 private:
  const std::string name_, handle_;
  const std::shared_ptr<const DeviceBuffer> allocation_;  // closes the handle when the last holder lets go
  const int device_id_;
  const uint64_t offset_, byte_size_;
};

class CudaSharedMemoryRegistry {
 public:
  // `importers`: the backends whose kernels use the regions, one per GPU the server serves on (a
  // region is opened by the one whose device_index() is its device_id); empty or without a GPU:
  // registration is refused.
  CudaSharedMemoryRegistry(CudaSharedMemoryLimits limits, prometheus::Registry& metrics,
                           std::vector<Backend*> importers);
  CudaSharedMemoryRegistry(CudaSharedMemoryLimits limits, prometheus::Registry& metrics, Backend* importer)
      : CudaSharedMemoryRegistry(limits, metrics,
                                 importer != nullptr ? std::vector<Backend*>{importer} : std::vector<Backend*>{}) {}

  // --allow_cuda_shared_memory and a backend that opens IPC handles.
  bool enabled() const { return limits_.enabled && !importers_.empty() && importers_.front()->device_index() >= 0; }
  // The first GPU's id (-1: none).
  int device_id() const { return importers_.empty() ? -1 : importers_.front()->device_index(); }

  // The RPCs (rpc/shared_memory_rpcs.cc); `identity` is the caller's (auth/caller_identity.h).
  absl::Status Register(const std::string& identity, const v1::RegisterCudaSharedMemoryRequest& request);
  absl::StatusOr<v1::CudaSharedMemoryStatusResponse> Status(const std::string& identity, const std::string& name);
  absl::StatusOr<v1::UnregisterCudaSharedMemoryResponse> Unregister(const std::string& identity,
                                                                   const std::string& name);

  // The region `name` of `identity`, for tensor `tensor` (error messages): NOT_FOUND for a name the
  // identity has not registered, FAILED_PRECONDITION when CUDA shared memory is off.
  absl::StatusOr<std::shared_ptr<const CudaSharedMemoryRegion>> Lookup(const std::string& identity,
                                                                      const std::string& name, const char* tensor);

  // Unregisters the regions (all identities) that no request has used since `now` - idle_seconds
  // (registration counts as a use); the reaper's step, every ReaperPeriod when idle_seconds > 0.
  void ExpireIdle(std::chrono::steady_clock::time_point now);

 private:
  // One opened handle: shared by the regions registered on it, kept (weakly) after its last region
  // went while a request still holds it, so the handle is never opened twice in this process.
  struct Opened {
    std::weak_ptr<const DeviceBuffer> allocation;
    std::string identity;  // who holds it while regions > 0
    int regions = 0;
    uint64_t bytes = 0;  // the allocation's, charged to `identity` while regions > 0
  };
  absl::Status CheckEnabled() const;
  // Name free, handle not another identity's, the identity's limits: before and after the opening.
  // `allocation_bytes`: the size of the allocation the handle opens (or, before it is opened, the
  // least it can be).
  absl::Status CheckRegisterLocked(const std::string& identity, const v1::RegisterCudaSharedMemoryRequest& req,
                                   uint64_t allocation_bytes) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  using Regions = RegionTable<const CudaSharedMemoryRegion>;
  void EraseLocked(Regions::iterator it) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const CudaSharedMemoryLimits limits_;
  const std::vector<Backend*> importers_;
  const CudaSharedMemoryMetrics metrics_;  // metrics/component_metrics.h
  // Registrations one at a time (opening a handle takes milliseconds; it is done outside mu_, so
  // compute requests' lookups never wait for it).
  Mutex register_mu_ ABSL_ACQUIRED_BEFORE(mu_);
  Mutex mu_;
  // The regions; each identity is charged the allocations its regions keep open, each handle once.
  Regions regions_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, Opened> handles_ ABSL_GUARDED_BY(mu_);  // by the handle's bytes
  // Runs ExpireIdle (idle_seconds > 0); declared last, so it stops before anything it uses goes.
  std::optional<PeriodicTask> reaper_;
};

}  // namespace fusedlayer::server::transport
