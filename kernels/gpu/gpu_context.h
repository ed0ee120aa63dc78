// Per-device state the GPU backend hands to every launcher: stream, device properties, workspace.
// Host-only header (no kernels here).
#pragma once

#include <cstddef>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gpu_runtime.h"

namespace fusedlayer::gpu {

// Owning pointer to device memory (gpuFree on destruction).
struct GpuFreeDeleter {
  void operator()(void* p) const;
};
using GpuMemory = std::unique_ptr<void, GpuFreeDeleter>;

struct GpuContext {
  // Selects `device`, creates a non-blocking stream and reads the properties. Unavailable when the
  // runtime reports no device (no driver, no GPU, device index out of range).
  static absl::StatusOr<std::unique_ptr<GpuContext>> Create(int device);
  // A context for a lane (backend.h): the same device and properties, its own non-blocking stream,
  // and (created on demand, as here) its own scratch blocks and library state, so launchers on
  // different contexts never share mutable state.
  absl::StatusOr<std::unique_ptr<GpuContext>> CreateSibling() const;

  int device = 0;
  gpuStream_t stream = nullptr;
  int sm_count = 0;
  int cc_major = 0, cc_minor = 0;  // CUDA compute capability (HIP: gcnArch major/minor)
  std::string arch;                // "sm_90", "gfx90a"
  std::string name;                // device name from the properties, e.g. "NVIDIA H200"
  size_t l2_bytes = 0;
  int max_smem_per_block_optin = 0;

  // Independent scratch blocks: a launcher's use of one never clobbers another's. kPrimary: the
  // unfused SWA bf16 q and the mHC split partials; kWqb: the wq_b projection's packed scales and
  // small-M operands (wq_b_cublaslt.cc), alive while the SWA chain's own workspace is too.
  enum class Scratch : int { kPrimary = 0, kWqb = 1, kCount = 2 };
  // Scratch memory owned by the backend, grown on demand and never shrunk, valid until the next
  // call that asks for more of the same block. Returns nullptr when the allocation fails: the
  // caller then reports workspace_unavailable instead of launching. Growing frees the old block
  // (gpuFree waits for queued work), so a graph capture must follow an eager call of the same or
  // larger shape (capture cannot allocate).
  void* Workspace(size_t bytes, Scratch block = Scratch::kPrimary);

  // Per-context state of an optional library, owned here and created by its user on first use
  // (CUDA: the cuBLASLt handle and workspace of the wq_b projection, wq_b_cublaslt.cc). Destroyed
  // after the stream is drained and before it is destroyed.
  struct Extension {
    virtual ~Extension() = default;
  };
  std::unique_ptr<Extension> wq_b_lt;

  ~GpuContext();
  GpuContext() = default;
  GpuContext(const GpuContext&) = delete;
  GpuContext& operator=(const GpuContext&) = delete;

 private:
  void* workspace_[int(Scratch::kCount)] = {};
  size_t workspace_bytes_[int(Scratch::kCount)] = {};
};

// absl::Status from a runtime error code (InternalError, or ResourceExhausted for out-of-memory).
absl::Status GpuStatus(gpuError_t err, const char* what);

// Device allocation: ResourceExhausted on out-of-memory, Internal on other runtime errors.
absl::StatusOr<GpuMemory> GpuAlloc(size_t bytes);
// Allocates and uploads `bytes` of host memory on ctx.stream, synchronously (weights, once per set).
absl::StatusOr<GpuMemory> GpuUpload(const void* host, size_t bytes, GpuContext& ctx);

}  // namespace fusedlayer::gpu
