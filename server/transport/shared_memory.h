// System shared memory transport (same host): the registry of the regions clients register, and
// the per-request transfer that reads input tensors from them and writes outputs into them.
//
// Why the CPU never touches a mapping of a region: the object belongs to the client, and any
// process holding it can ftruncate it smaller at any time. A CPU access to a mapping of the
// truncated part raises SIGBUS (a kernel reading an input, a copy writing an output), which would
// kill the server, and no check before the access can close that race; a SIGBUS guard (sigsetjmp
// around every access) would have to cover the CPU backend's worker threads and every kernel. So
// the CPU moves bytes only with pread/pwrite on the descriptor opened at registration: a shrunk
// object makes pread return short, a FAILED_PRECONDITION for that request. The one mapping is for a
// GPU's copy engines (SharedMemoryRegion::LockForDevice): page-locked at registration, read and
// written only by DMA, which reaches the locked pages even after a truncation and cannot fault.
// The only server addresses derived from client numbers are a region's own mapping plus a
// bounds-checked offset (Triton's CVE-2025-23319 chain ended in read/write access to memory
// through a registered region). The pread path costs one copy per direction (page cache <-> the
// request's buffers); the locked path none.
//
// Ownership: a region belongs to the identity that registered it (auth/caller_identity.h); region
// names live in a per-identity namespace, so another identity's region is NOT_FOUND, exactly as a
// name never registered (its existence does not leak). An object (device, inode) registered by one
// identity cannot be registered by another while the first holds it (PERMISSION_DENIED).
//
// Vanished objects: the object is looked up again by its key (stat of /dev/shm/KEY) at every use;
// when it was unlinked or replaced by a new object of the same name, the registration is dropped
// (descriptor closed, bytes given back) and the request fails with FAILED_PRECONDITION. The same
// check at Status and Register frees the regions of a client that died and whose objects were
// removed; regions whose objects still exist stay registered until their identity unregisters them
// (they count against its limits: docs/operations.md) or, with --shared_memory_idle_seconds, until no
// request has used them for that long (a client that died without unregistering: its page-locked
// mapping and its share of the limits come back).
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "auth/unix_peers.h"
#include "common/annotated_mutex.h"
#include "common/periodic_task.h"
#include "runtime/device_range.h"
#include "runtime/host_staging_pool.h"
#include "runtime/output_buffers.h"
#include "fusedlayer/v1/fusedlayer.pb.h"
#include "metrics/component_metrics.h"
#include "prometheus/counter.h"
#include "prometheus/gauge.h"
#include "prometheus/registry.h"
#include "transport/cuda_shared_memory.h"
#include "transport/region_table.h"

namespace fusedlayer::server::transport {

// Object offsets of every tensor (region offset + reference offset) are multiples of this: the
// widest vector load of the kernels and a cache line, so a later zero-copy path (a mapping the
// kernels read, a page-locked region a GPU copies from) needs no new rule.
inline constexpr uint64_t kSharedMemoryAlignment = 64;

// `ref` against a region that starts `region_offset` bytes into its object (or allocation) and is
// `region_bytes` long: INVALID_ARGUMENT when [offset, offset + byte_size) is not inside the region
// (overflow included) or the object offset is not a multiple of kSharedMemoryAlignment. `kind`
// names the region's kind in the message ("shared-memory", "CUDA shared-memory").
absl::Status CheckRefInRegion(const v1::SharedMemoryRef& ref, uint64_t region_offset, uint64_t region_bytes,
                              const char* tensor, const char* kind);

struct SharedMemoryLimits {
  bool enabled = false;              // --allow_shared_memory
  int64_t max_regions = 64;          // per identity (--shared_memory_max_regions)
  uint64_t max_bytes = uint64_t{16} << 30;  // registered bytes per identity (--shared_memory_max_bytes)
  // Registered bytes, all identities, mapped and page-locked (--shared_memory_locked_bytes; 0 = none).
  uint64_t max_locked_bytes = 0;
  // A region no request has used for this long is unregistered (--shared_memory_idle_seconds; 0 = never).
  double idle_seconds = 0;
  // Regions all identities may hold registered together: each keeps a descriptor open, and the
  // process's descriptors are shared with gRPC's listeners and connections (common/descriptors.h).
  // 0 = no bound. `total_regions_origin` says how it was derived, for the refusal's message.
  int64_t max_total_regions = 0;
  std::string total_regions_origin;
};

// The page-locked bytes of shared-memory regions, against --shared_memory_locked_bytes. Shared by
// the registry and its locked regions: a region gives its bytes back when it is freed, which may
// be after the registry is gone (an in-flight request holding it); the gauge is detached then.
class PinnedBytes {
 public:
  explicit PinnedBytes(prometheus::Gauge* gauge) : gauge_(gauge) {}
  // Takes `bytes` when they fit under `limit`; false (nothing taken) otherwise.
  bool TryReserve(uint64_t bytes, uint64_t limit);
  void GiveBack(uint64_t bytes);
  void DetachGauge();

 private:
  std::mutex mu_;
  uint64_t bytes_ = 0;
  prometheus::Gauge* gauge_;
};

// One registered region: the object's descriptor (never a mapping) and where the region lies.
class SharedMemoryRegion {
 public:
  SharedMemoryRegion(int fd, std::string name, std::string key, uint64_t offset, uint64_t byte_size, dev_t dev,
                     ino_t ino);
  ~SharedMemoryRegion();  // closes the descriptor (in-flight requests hold a reference until done)
  SharedMemoryRegion(const SharedMemoryRegion&) = delete;
  SharedMemoryRegion& operator=(const SharedMemoryRegion&) = delete;

  const std::string& name() const { return name_; }
  const std::string& key() const { return key_; }
  uint64_t offset() const { return offset_; }
  uint64_t byte_size() const { return byte_size_; }
  std::pair<dev_t, ino_t> object() const { return {dev_, ino_}; }

  // FAILED_PRECONDITION when the key no longer names this object (removed or replaced).
  absl::Status CheckStillNamed() const;
  // FAILED_PRECONDITION when the object is now shorter than the region's end.
  absl::Status CheckSize() const;
  // [at, at + n) of the region (bounds already checked by the caller) from / to the object.
  // A short read or write (the object shrank meanwhile) is FAILED_PRECONDITION.
  absl::Status Read(uint64_t at, char* dst, uint64_t n, const char* tensor) const;
  absl::Status Write(uint64_t at, const char* src, uint64_t n, const char* tensor) const;

  // Device backends: maps the region (MAP_SHARED) and page-locks the mapping through `locker`, so
  // that a lane's copy engine reads inputs where they lie. Called once, at registration, before
  // the region is shared with any request; false (nothing kept) when the system refuses.
  bool LockForDevice(Backend& locker);
  // Undoes LockForDevice (no-op when not locked). Only while no request can see the region.
  void Unlock();
  // A registered locked region: its bytes go back to `budget` when it is destroyed, after its
  // unlock (the last in-flight request holding it may outlive its registration). Before sharing.
  void GiveBackWhenFreed(std::shared_ptr<PinnedBytes> budget) { pinned_budget_ = std::move(budget); }
  // The region's first byte in its page-locked mapping, or null when not locked. FOR THE DEVICE'S
  // COPIES ONLY: the CPU never reads or writes through it. A client that truncates its object
  // makes any CPU access to the mapping a SIGBUS; the device's DMA goes to the pages locked at
  // registration, which stay allocated while locked, so it cannot fault (stale bytes at worst,
  // and only for the client that shrank its own object; the size is checked at every use).
  const char* device_visible() const { return locked_data_; }

 private:
  const int fd_;
  const std::string name_, key_;
  const uint64_t offset_, byte_size_;
  const dev_t dev_;
  const ino_t ino_;
  void* map_ = nullptr;  // LockForDevice's mapping (page-aligned, covers the region)
  size_t map_bytes_ = 0;
  DeviceBuffer lock_;    // unlocks the mapping when reset (before munmap)
  const char* locked_data_ = nullptr;
  std::shared_ptr<PinnedBytes> pinned_budget_;  // GiveBackWhenFreed
};

// A reference resolved against its region: bounds and alignment checked.
struct ResolvedRef {
  std::shared_ptr<const SharedMemoryRegion> region;
  uint64_t offset = 0;     // in the region
  uint64_t byte_size = 0;
};

// `ref` against `region`: INVALID_ARGUMENT when [offset, offset + byte_size) is not inside the
// region (overflow included) or the object offset is not a multiple of kSharedMemoryAlignment.
absl::StatusOr<ResolvedRef> CheckRange(std::shared_ptr<const SharedMemoryRegion> region, const v1::SharedMemoryRef& ref,
                                       const char* tensor);

class SharedMemoryRegistry {
 public:
  // `locker`: the device backend whose lanes copy from regions page-locked through it, or null
  // (the CPU backend, or no lanes): no region is then mapped.
  SharedMemoryRegistry(SharedMemoryLimits limits, prometheus::Registry& metrics, Backend* locker = nullptr);
  ~SharedMemoryRegistry();  // a region an in-flight request still holds no longer sets the gauge

  bool enabled() const { return limits_.enabled; }
  // Whether registration page-locks regions (a device backend with lanes, a budget above 0).
  bool locks_regions() const { return locker_ != nullptr && limits_.max_locked_bytes > 0; }

  // The RPCs (rpc/shared_memory_rpcs.cc); `identity` is the caller's (auth/caller_identity.h).
  // `caller`: the credentials of a unix-socket caller (auth/unix_peers.h), or null (TCP, tokens):
  // an object that caller could not open read-write itself is PERMISSION_DENIED.
  absl::Status Register(const std::string& identity, const v1::RegisterSystemSharedMemoryRequest& request,
                        const auth::UnixPeer* caller = nullptr);
  absl::StatusOr<v1::SystemSharedMemoryStatusResponse> Status(const std::string& identity, const std::string& name);
  absl::StatusOr<v1::UnregisterSystemSharedMemoryResponse> Unregister(const std::string& identity,
                                                                     const std::string& name);

  // `ref` as `identity` sees it, for tensor `tensor` (error messages): NOT_FOUND for a name the
  // identity has not registered, FAILED_PRECONDITION for an object that vanished or shrank,
  // INVALID_ARGUMENT for a range outside the region (overflow included) or a misaligned offset.
  absl::StatusOr<ResolvedRef> Resolve(const std::string& identity, const v1::SharedMemoryRef& ref, const char* tensor);
  // The region `name` of `identity`, its key and size checked (Resolve without the range checks).
  absl::StatusOr<std::shared_ptr<const SharedMemoryRegion>> Lookup(const std::string& identity, const std::string& name,
                                                                   const char* tensor);

  // Unregisters the regions (all identities) that no request has used since `now` - idle_seconds
  // (registration counts as a use); the reaper's step, every ReaperPeriod when idle_seconds > 0.
  void ExpireIdle(std::chrono::steady_clock::time_point now);

 private:
  using Regions = RegionTable<SharedMemoryRegion>;
  absl::Status CheckEnabled() const;
  // RESOURCE_EXHAUSTED when the regions of all identities hold the descriptor budget; OK otherwise.
  absl::Status CheckDescriptorBudgetLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void EraseLocked(Regions::iterator it) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Why `identity` may not register `region` under req.name() now (name taken, object another
  // identity's, its limits), or OK.
  absl::Status CheckRegistrableLocked(const std::string& identity, const v1::RegisterSystemSharedMemoryRequest& req,
                                      const SharedMemoryRegion& region) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Drops the identity's regions whose objects were removed (a client that died, then cleanup).
  void PruneVanishedLocked(const std::string& identity) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const SharedMemoryLimits limits_;
  Backend* const locker_;
  const SharedMemoryMetrics metrics_;  // metrics/component_metrics.h
  Mutex mu_;
  // The regions; each identity is charged its regions' bytes.
  Regions regions_ ABSL_GUARDED_BY(mu_);
  // Which identity holds each registered object, and in how many regions.
  std::map<std::pair<dev_t, ino_t>, std::pair<std::string, int>> object_owners_ ABSL_GUARDED_BY(mu_);
  // Page-locked bytes against --shared_memory_locked_bytes: reserved before a region is locked,
  // given back when its registration fails, or when the region is freed (not when it is
  // unregistered: an in-flight request may hold its pinned pages longer).
  const std::shared_ptr<PinnedBytes> pinned_;
  // Runs ExpireIdle (idle_seconds > 0); declared last, so it stops before anything it uses goes.
  std::optional<PeriodicTask> reaper_;
};

// One compute request's shared-memory tensors: inputs read into owned, aligned staging buffers at
// decode (reactor thread), outputs written from the call's output buffers after the run (executor),
// then replaced in the response by their references. Tensors in CUDA shared memory
// (transport/cuda_shared_memory.h) are neither read nor written here: the kernels use them where
// they lie (DeviceInput, PlaceDeviceOutput, device_ranges()). Not thread-safe; one per request.
class TensorTransfer {
 public:
  // Either registry may be null: its references are then FAILED_PRECONDITION (none accepted here).
  TensorTransfer(SharedMemoryRegistry* registry, CudaSharedMemoryRegistry* cuda, std::string identity);

  // ---- CUDA shared memory ----
  // The device address of input `ref` (`bytes` long, checked against ref.byte_size) in the caller's
  // CUDA shared-memory region: the kernels read it there. Its region joins device_ranges().
  absl::StatusOr<char*> DeviceInput(const v1::SharedMemoryRef& ref, uint64_t bytes, const char* tensor);
  // The device address where output `tensor` (response field `field`, `bytes` long) is written by
  // the kernels: it must not overlap another output or an input in CUDA shared memory (the kernels
  // read the inputs while they write; a fused launch that fails is re-run unfused on them).
  // WriteOutputs replaces the tensor's data in the response by the reference.
  absl::StatusOr<char*> PlaceDeviceOutput(const v1::SharedMemoryRef& ref, v1::Tensor* tensor, const char* name,
                                          int field, uint64_t bytes);
  // Whether any tensor lies in CUDA shared memory (such a request is not batched: batch assembly
  // memcpy's inputs and outputs on the host).
  bool uses_device_memory() const { return !device_regions_.empty(); }
  // The GPU of its CUDA shared-memory tensors (all on one), or -1 when it has none.
  int device_id() const { return device_regions_.empty() ? -1 : device_regions_.front()->device_id(); }
  // The CUDA shared-memory regions the request's tensors lie in (ExecTarget::resident).
  const DeviceRanges& device_ranges() const { return device_ranges_; }
  // Whether every output the request places lies in CUDA shared memory (and there is one): the
  // kernels write them where they lie, and WriteOutputs has nothing to write or check.
  bool outputs_all_on_device() const { return outputs_.empty() && !device_outputs_.empty(); }

  // On a device backend: read the inputs (at most `input_bytes` in all, SharedMemoryInputBytes)
  // into one page-locked block of `pool` instead of ordinary memory, so that the lane copies them
  // to the device from where they were read, with no staging memcpy (runtime/device_staging.h). Never
  // waits: when the pool has no block free, the inputs go to ordinary memory as before.
  void ReadInputsIntoPinned(HostStagingPool* pool, uint64_t input_bytes);
  // On a device backend, before decode, in place of ReadInputsIntoPinned: when every input of the
  // request (`inputs`; absent ones, without data or reference, are skipped) references one
  // page-locked region (SharedMemoryRegion::LockForDevice), laid out so that a lane copies them
  // in one piece (each 64-byte aligned relative to the first, their span at most twice their
  // bytes plus a page), the inputs are used where they lie: ReadInput reads nothing and returns
  // the input's device-visible address, and pinned_inputs() is their span, marked device_only, which
  // the lane copies to the device by DMA. Nothing on the CPU reads those addresses: such a request
  // is not batched (batch assembly memcpy's inputs), and shared-memory requests are never verified
  // or shadowed. False (nothing changed) otherwise.
  bool UseInputsInPlace(const std::vector<std::pair<const char*, const v1::Tensor*>>& inputs);
  bool inputs_in_place() const { return in_place_.begin != nullptr; }
  // The inputs' page-locked span: the block they were read into, or their span in a page-locked
  // region (UseInputsInPlace); empty without either.
  HostRange pinned_inputs() const;

  // Reads the input `ref` of `bytes` bytes (dtype x shape, checked against ref.byte_size) and
  // returns its staging buffer, aligned to kSharedMemoryAlignment and valid as long as this object.
  absl::StatusOr<char*> ReadInput(const v1::SharedMemoryRef& ref, uint64_t bytes, const char* tensor);
  // Records that output `tensor` (response field `field`, `bytes` long, its data in the call's
  // OutputBuffers or in the message) goes to `ref` after the run: byte_size must be `bytes`, and it
  // must not overlap another placed output.
  // When the request's inputs are used in place (UseInputsInPlace) and `ref` lies in the same
  // page-locked region, returns the output's device-visible address there: the run's output view
  // must be pointed at it (the lane's device copies it back there, ExecTarget::pinned_outputs) and
  // WriteOutputs writes nothing for it. Null otherwise (written with pwrite after the run).
  absl::StatusOr<char*> PlaceOutput(const v1::SharedMemoryRef& ref, v1::Tensor* tensor, const char* name, int field,
                                    uint64_t bytes);
  // The region the outputs PlaceOutput placed in place lie in (device only), or empty.
  HostRange pinned_outputs() const { return outputs_in_place_ ? region_in_place_ : HostRange{}; }
  // After a successful run: writes every placed output from where the run left it (`external`,
  // the call's OutputBuffers, when it holds the output's field, else the tensor's message data),
  // then drops it from both and sets the tensor's shared_memory reference, so the response
  // carries the reference, not the bytes. Checks first that every object is still there and whole.
  absl::Status WriteOutputs(OutputBuffers* external);

  uint64_t staged_bytes() const { return staged_bytes_; }

 private:
  struct AlignedDelete {
    void operator()(char* p) const;
  };
  struct Output {
    ResolvedRef ref;
    v1::SharedMemoryRef proto;
    v1::Tensor* tensor;
    const char* name;
    int field;
    const char* in_place;  // written by the device where it lies (PlaceOutput), or null
  };
  absl::StatusOr<ResolvedRef> Resolve(const v1::SharedMemoryRef& ref, const char* tensor);
  // A CUDA shared-memory tensor: [begin, end) of one client allocation, in device addresses.
  struct DeviceTensor {
    const DeviceBuffer* allocation;
    const char* begin;
    const char* end;
    const char* name;
    v1::SharedMemoryRef proto;  // outputs: what the response carries
    v1::Tensor* tensor;         // outputs: the response's tensor
  };
  // `ref` resolved and range-checked in the caller's CUDA shared memory, `bytes` long.
  absl::StatusOr<DeviceTensor> ResolveDevice(const v1::SharedMemoryRef& ref, uint64_t bytes, const char* tensor,
                                             const char* role);

  SharedMemoryRegistry* const registry_;
  CudaSharedMemoryRegistry* const cuda_;
  const std::string identity_;
  std::vector<std::pair<std::string, std::shared_ptr<const SharedMemoryRegion>>> regions_;  // looked up
  std::vector<std::unique_ptr<char[], AlignedDelete>> staging_;
  HostStagingPool::Lease pinned_;  // ReadInputsIntoPinned's block, or none
  HostRange in_place_;             // UseInputsInPlace's span, or none
  HostRange region_in_place_;      // the whole page-locked region those inputs lie in
  bool outputs_in_place_ = false;  // some output placed there (PlaceOutput)
  absl::Status deferred_error_;    // a lookup UseInputsInPlace made failed: ReadInput's answer
  size_t pinned_used_ = 0;
  uint64_t staged_bytes_ = 0;
  std::vector<Output> outputs_;
  // CUDA shared memory: the regions looked up (held until the request is done), their device ranges,
  // and the tensors in them.
  std::vector<std::shared_ptr<const CudaSharedMemoryRegion>> device_regions_;
  DeviceRanges device_ranges_;
  std::vector<DeviceTensor> device_inputs_, device_outputs_;
};

// True when the request names any shared-memory tensor, system or CUDA (input or output placement).
bool UsesSharedMemory(const v1::MhcSeamRequest& request);
bool UsesSharedMemory(const v1::SwaNormQuantRequest& request);
// At least the bytes the request's shared-memory inputs will be staged in (admission, before reading),
// saturating at UINT64_MAX.
uint64_t SharedMemoryInputBytes(const v1::MhcSeamRequest& request);
uint64_t SharedMemoryInputBytes(const v1::SwaNormQuantRequest& request);
// The request's input tensors with their names (for TensorTransfer::UseInputsInPlace).
std::vector<std::pair<const char*, const v1::Tensor*>> InputTensors(const v1::MhcSeamRequest& request);
std::vector<std::pair<const char*, const v1::Tensor*>> InputTensors(const v1::SwaNormQuantRequest& request);

}  // namespace fusedlayer::server::transport
