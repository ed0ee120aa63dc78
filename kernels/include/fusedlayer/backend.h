// The backend interface: what the server (and tests, and benchmarks) call. A backend owns a device
// (the host CPU, one CUDA or HIP GPU), its memory and its kernels. The server sees only this header:
// no CUDA or HIP type leaks out of kernels/.
//
// Thread safety: one backend is driven by one executor thread at a time (the server's per-device
// executor). Prepared weights are immutable after Prepare* returns and may be shared between calls.
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

// The CPU backend, always available (kernels/cpu).
std::unique_ptr<Backend> CreateCpuBackend(const BackendOptions& options = {});

// "cpu", "cuda", "hip", or "auto" (a GPU backend when one was compiled in and a device is present,
// else the CPU). NotFound / Unavailable with a clear message when the kind cannot be had.
absl::StatusOr<std::unique_ptr<Backend>> CreateBackend(std::string_view kind,
                                                       const BackendOptions& options = {});

}  // namespace fusedlayer
