// The backend interface: what the server (and tests, and benchmarks) call. A backend owns a device
// (the host CPU, one CUDA or HIP GPU), its memory and its kernels. The server sees only this header:
// no CUDA or HIP type leaks out of kernels/.
//
// Thread safety (what may run concurrently):
//   - The Backend's own methods (Allocate, Copy*, Prepare*, Run*) use its default context (a GPU
//     backend: one stream, one scratch set): call them from one thread at a time. The server calls
//     them only from control and background tasks and verify runs, which its executor serialises.
//     *FusedSupport, kind/device_name/arch/host_accessible, max_lanes and AllocateHostStaging are
//     safe from any thread at any time.
//   - Each Lane (CreateLane) is driven by one thread at a time, its owner; different lanes run at
//     the same time as each other and as the default context (a GPU: separate streams, scratch
//     blocks, library handles and events; the device overlaps their copies and kernels).
//   - Prepared weights are immutable after Prepare* returns: any lane and the default context may
//     read them at once. Their memory is freed when the last owner drops them, so an owner must
//     outlive every Wait of the work that reads them (the server's requests hold a reference to
//     their weight set until their response is built).
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "fusedlayer/fallback.h"
#include "fusedlayer/mhc.h"
#include "fusedlayer/swa.h"

namespace fusedlayer {

// Owning handle on backend memory (host memory for the CPU backend). Move-only.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(void* data, size_t bytes, std::function<void(void*)> free_fn)
      : data_(data), bytes_(bytes), free_(std::move(free_fn)) {}
  DeviceBuffer(DeviceBuffer&& o) noexcept { *this = std::move(o); }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() { Reset(); }

  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }
  void Reset();

 private:
  void* data_ = nullptr;
  size_t bytes_ = 0;
  std::function<void(void*)> free_;
};

// CUDA IPC: the bytes of a cudaIpcMemHandle_t (and hipIpcMemHandle_t).
inline constexpr size_t kIpcHandleBytes = 64;
struct IpcExportedBuffer {
  DeviceBuffer buffer;
  std::string handle;  // kIpcHandleBytes
};

// Weights of one weight set, uploaded and laid out the way this backend's kernels want them
// (e.g. fn split into tensor-core operands on a GPU). Immutable once created.
class PreparedMhcWeights {
 public:
  virtual ~PreparedMhcWeights() = default;
  virtual const MhcHyperParams& params() const = 0;
  virtual bool has_norm_weight() const = 0;
  virtual size_t resident_bytes() const = 0;
};

class PreparedSwaWeights {
 public:
  virtual ~PreparedSwaWeights() = default;
  virtual const SwaHyperParams& params() const = 0;
  virtual size_t resident_bytes() const = 0;
  // What computes the wq_b projection of this set, fixed at load (e.g. "cuBLASLt: algo ..." or
  // "our kernel (e4m3fnuz has no cuBLASLt data type on NVIDIA)"); empty without wq_b. Reported in
  // WeightSetInfo so an operator sees a slow fallback without reading logs.
  virtual std::string wq_b_implementation() const = 0;
};

struct RunStats {
  double kernel_seconds = 0;  // device time of the op's kernels (events on a GPU, wall time on CPU)
};

struct BackendOptions {
  int num_threads = 0;           // CPU backend: worker threads (0 = hardware concurrency)
  int device_index = 0;          // GPU backends
  // Largest token count the fused paths accept (the contract's limit is 2^20, DeepGEMM's
  // kNumMaxTokens). Operators may lower it (--fused_max_tokens), e.g. where measurements show the
  // unfused path faster at large T; requests above it fall back with reason too_many_tokens.
  int64_t fused_max_tokens = int64_t{1} << 20;
};

class Lane;

class Backend {
 public:
  virtual ~Backend() = default;

  virtual std::string_view kind() const = 0;  // "cpu", "cuda", "hip"
  virtual std::string device_name() const = 0;  // "cpu (2 threads)", "NVIDIA H200"
  virtual std::string arch() const = 0;         // "x86_64", "sm_90", "gfx90a"
  // True when backend memory is ordinary host memory (CPU): the server may then build views on
  // its own buffers and skip the copies.
  virtual bool host_accessible() const = 0;

  // Memory for request tensors. ResourceExhausted when the device is out of memory.
  virtual absl::StatusOr<DeviceBuffer> Allocate(size_t bytes) = 0;
  // Page-locked host memory the device copies from and to asynchronously (a lane's staging;
  // the server pools and bounds it, server/runtime/host_staging_pool.h). ResourceExhausted when the
  // system refuses it. A host-accessible backend needs none: Unimplemented.
  virtual absl::StatusOr<DeviceBuffer> AllocateHostStaging(size_t bytes);
  // Page-locks `bytes` of host memory the caller already has at `p` (a mapping of a client's
  // shared-memory region), so that lanes copy to and from it by DMA as from AllocateHostStaging's
  // memory. The returned buffer (data() == p) unlocks it when destroyed; it frees nothing. The
  // device's copies then reach the locked pages without the CPU touching them. Unimplemented on a
  // host-accessible backend; another error when the system refuses (e.g. locked-memory limits).
  virtual absl::StatusOr<DeviceBuffer> PageLockHostMemory(void* p, size_t bytes);
  // CUDA IPC (same host, same GPU: server/transport/cuda_shared_memory.h). The GPU this backend
  // runs on, or -1 (no GPU).
  virtual int device_index() const { return -1; }
  // Device memory that another process can open (ImportIpcMemory there): a plain allocation (not
  // from a stream-ordered pool, which IPC handles cannot name) and its handle, kIpcHandleBytes long.
  // For clients and tests that hand buffers to a server. Unimplemented without IPC.
  virtual absl::StatusOr<IpcExportedBuffer> AllocateIpcExportable(size_t bytes);
  // Opens a handle another process exported: the returned buffer is the whole allocation as this
  // process sees it (data() its first byte, bytes() its size as the driver reports it, so bounds are
  // never taken from the client) and closes the handle when destroyed. InvalidArgument for a handle
  // of the wrong length or one the driver refuses; Unimplemented without IPC. Opening one handle
  // twice in a process is the caller's to avoid (the registry shares one opening per handle).
  virtual absl::StatusOr<DeviceBuffer> ImportIpcMemory(std::string_view handle);
  // How many lanes this backend can run concurrently; 0: none (host-accessible backends run on
  // their default context, with their own internal parallelism).
  virtual int max_lanes() const { return 0; }
  // A new lane (see Lane). Unimplemented where max_lanes() is 0.
  virtual absl::StatusOr<std::unique_ptr<Lane>> CreateLane();
  virtual absl::Status CopyToDevice(void* dst, const void* src, size_t bytes) = 0;
  virtual absl::Status CopyToHost(void* dst, const void* src, size_t bytes) = 0;

  // mHC ------------------------------------------------------------------------------------------
  virtual absl::StatusOr<std::unique_ptr<PreparedMhcWeights>> PrepareMhc(
      const MhcHyperParams& params, const MhcWeightsHost& weights) = 0;
  // Whether the fused path can run this request; otherwise the reason. Cheap, no side effects.
  virtual FusedSupport MhcFusedSupport(const PreparedMhcWeights& weights,
                                       const MhcShapeQuery& query) const = 0;
  // Runs the op on `path`. Validates the arguments first (InvalidArgument, nothing written).
  // Running the fused path where MhcFusedSupport says no is FailedPrecondition.
  virtual absl::StatusOr<RunStats> RunMhc(const PreparedMhcWeights& weights, const MhcArgs& args,
                                          Path path) = 0;

  // SWA ------------------------------------------------------------------------------------------
  virtual absl::StatusOr<std::unique_ptr<PreparedSwaWeights>> PrepareSwa(
      const SwaHyperParams& params, const SwaWeightsHost& weights) = 0;
  virtual FusedSupport SwaFusedSupport(const PreparedSwaWeights& weights,
                                       const SwaShapeQuery& query) const = 0;
  virtual absl::StatusOr<RunStats> RunSwa(const PreparedSwaWeights& weights, const SwaArgs& args,
                                          Path path) = 0;
};

// One in-order queue of device work with its own resources (a GPU: a stream, its scratch blocks,
// library handles and timing events). Work is enqueued without waiting; Wait() waits once for all
// of it. A request on a lane: host tensors memcpy'd into staging (Backend::AllocateHostStaging),
// EnqueueCopyToDevice of each input, Enqueue{Mhc,Swa}, EnqueueCopyToHost of each output into
// staging, Wait(), then the outputs read from staging. Until Wait() returns, the staging and
// device memory named by enqueued work must stay alive and the staging must not be touched.
class Lane {
 public:
  virtual ~Lane() = default;  // waits for the lane's queued work

  // Device memory whose release (the DeviceBuffer's destruction) is ordered after the work
  // already enqueued on this lane, so it may be dropped before Wait(). ResourceExhausted when out
  // of device memory.
  virtual absl::StatusOr<DeviceBuffer> Allocate(size_t bytes) = 0;
  // `host` must be staging memory from Backend::AllocateHostStaging or memory locked by
  // Backend::PageLockHostMemory.
  virtual absl::Status EnqueueCopyToDevice(void* device_dst, const void* host_src, size_t bytes) = 0;
  virtual absl::Status EnqueueCopyToHost(void* host_dst, const void* device_src, size_t bytes) = 0;
  // Validates the arguments (InvalidArgument / FailedPrecondition as Run* would, nothing enqueued)
  // and enqueues the op on `path` between timing events.
  virtual absl::Status EnqueueMhc(const PreparedMhcWeights& weights, const MhcArgs& args, Path path) = 0;
  virtual absl::Status EnqueueSwa(const PreparedSwaWeights& weights, const SwaArgs& args, Path path) = 0;
  // Waits for everything enqueued since the last Wait (one wait on an event of this lane, never a
  // device-wide synchronisation). kernel_seconds: device time of the op enqueued since the last
  // Wait (0 when none). An error of the queued work (a faulting kernel, a failed copy) is returned
  // here as Internal; the lane stays usable for the next request.
  virtual absl::StatusOr<RunStats> Wait() = 0;
  // After the work enqueued so far, the device stores `value` into `host_word` (host memory locked
  // by Backend::PageLockHostMemory), with a memory barrier before it: a host thread that sees the
  // value sees everything that work wrote, without a Wait (a completion word a client spins on).
  // If that work fails, the store does not happen. Unimplemented where the device cannot.
  virtual absl::Status EnqueueHostWrite(uint32_t* host_word, uint32_t value);
};

// The CPU backend, always available (kernels/cpu).
std::unique_ptr<Backend> CreateCpuBackend(const BackendOptions& options = {});

// The GPUs of the compiled-in GPU backend this process can see (CUDA_VISIBLE_DEVICES and the like
// apply); 0 without a GPU backend or a driver.
int VisibleGpuCount();

// "cpu", "cuda", "hip", or "auto" (a GPU backend when one was compiled in and a device is present,
// else the CPU). NotFound / Unavailable with a clear message when the kind cannot be had.
absl::StatusOr<std::unique_ptr<Backend>> CreateBackend(std::string_view kind,
                                                       const BackendOptions& options = {});

}  // namespace fusedlayer
