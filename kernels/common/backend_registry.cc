// Backend construction by name, and the DeviceBuffer handle.
#include "absl/strings/str_cat.h"
#include "fusedlayer/backend.h"

#if FUSEDLAYER_HAS_GPU
#include "gpu_backend_factory.h"
#endif

namespace fusedlayer {

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& o) noexcept {
  if (this != &o) {
    Reset();
    data_ = o.data_;
    bytes_ = o.bytes_;
    free_ = std::move(o.free_);
    o.data_ = nullptr;
    o.bytes_ = 0;
    o.free_ = nullptr;
  }
  return *this;
}

void DeviceBuffer::Reset() {
  if (data_ != nullptr && free_) free_(data_);
  data_ = nullptr;
  bytes_ = 0;
  free_ = nullptr;
}

// Host-accessible backends need neither staging nor lanes: the server hands them host views.
absl::StatusOr<DeviceBuffer> Backend::AllocateHostStaging(size_t) {
  return absl::UnimplementedError(absl::StrCat("the ", std::string(kind()), " backend has no host staging (host-accessible)"));
}

absl::StatusOr<DeviceBuffer> Backend::PageLockHostMemory(void*, size_t) {
  return absl::UnimplementedError(absl::StrCat("the ", std::string(kind()), " backend does not page-lock host memory"));
}

absl::StatusOr<IpcExportedBuffer> Backend::AllocateIpcExportable(size_t) {
  return absl::UnimplementedError(absl::StrCat("the ", std::string(kind()), " backend has no CUDA IPC"));
}

absl::StatusOr<DeviceBuffer> Backend::ImportIpcMemory(std::string_view) {
  return absl::UnimplementedError(absl::StrCat("the ", std::string(kind()), " backend has no CUDA IPC"));
}

absl::Status Lane::EnqueueHostWrite(uint32_t*, uint32_t) {
  return absl::UnimplementedError("this lane cannot write host memory from the device");
}

absl::StatusOr<std::unique_ptr<Lane>> Backend::CreateLane() {
  return absl::UnimplementedError(absl::StrCat("the ", std::string(kind()), " backend has no lanes"));
}

int VisibleGpuCount() {
#if FUSEDLAYER_HAS_GPU
  return GpuDeviceCount();
#else
  return 0;
#endif
}

absl::StatusOr<std::unique_ptr<Backend>> CreateBackend(std::string_view kind, const BackendOptions& options) {
  if (kind == "cpu") return CreateCpuBackend(options);
#if FUSEDLAYER_HAS_GPU
  if (kind == "auto") {
    auto gpu = CreateGpuBackend(options);
    if (gpu.ok()) return gpu;
    return CreateCpuBackend(options);
  }
  if (kind == "cuda" || kind == "hip") {
    if (kind != GpuBackendKind()) {
      return absl::NotFoundError(absl::StrCat("backend '", std::string(kind), "' was not compiled in (this build has '",
                                              std::string(GpuBackendKind()), "')"));
    }
    return CreateGpuBackend(options);
  }
#else
  if (kind == "auto") return CreateCpuBackend(options);
  if (kind == "cuda" || kind == "hip") {
    return absl::NotFoundError(absl::StrCat("backend '", std::string(kind),
                                            "' was not compiled in: rebuild with -DFUSEDLAYER_CUDA=ON or "
                                            "-DFUSEDLAYER_HIP=ON"));
  }
#endif
  return absl::InvalidArgumentError(absl::StrCat("unknown backend '", std::string(kind), "' (want auto, cpu, cuda or hip)"));
}

}  // namespace fusedlayer
