// Entry points of the GPU backend for the backend registry (kernels/common/backend_registry.cc).
#pragma once

#include <memory>
#include <string_view>

#include "absl/status/statusor.h"
#include "fusedlayer/backend.h"

namespace fusedlayer {

// The CUDA or HIP backend on options.device_index. Unavailable (with the reason) when no usable
// device is present, so CreateBackend("auto") falls back to the CPU.
absl::StatusOr<std::unique_ptr<Backend>> CreateGpuBackend(const BackendOptions& options);

// GPUs the runtime reports (0 when it reports an error: no driver, no device).
int GpuDeviceCount();

// "cuda" or "hip": the GPU backend compiled into this build.
std::string_view GpuBackendKind();

}  // namespace fusedlayer
