// GpuContext: device selection, the backend's stream, device properties and scratch memory.
#include "gpu_context.h"

#include <cstring>

#include "absl/strings/str_cat.h"

namespace fusedlayer::gpu {

void GpuFreeDeleter::operator()(void* p) const {
  // gpuFree synchronises with the device, so memory still read by queued kernels is never reused
  // early. Errors cannot be reported from a destructor; a failing free leaks at worst.
  if (p != nullptr) (void)gpuFree(p);
}

absl::Status GpuStatus(gpuError_t err, const char* what) {
  if (err == gpuSuccess) return absl::OkStatus();
  std::string msg = absl::StrCat(what, ": ", gpuGetErrorString(err));
  if (err == gpuErrorMemoryAllocation) return absl::ResourceExhaustedError(msg);
  return absl::InternalError(msg);
}

absl::StatusOr<GpuMemory> GpuAlloc(size_t bytes) {
  if (bytes == 0) return GpuMemory();
  void* p = nullptr;
  gpuError_t err = gpuMalloc(&p, bytes);
  if (err != gpuSuccess) {
    (void)gpuGetLastError();  // clear the sticky-free error state of the runtime API
    if (err == gpuErrorMemoryAllocation) {
      return absl::ResourceExhaustedError(absl::StrCat("device allocation of ", bytes, " bytes failed: out of memory"));
    }
    return GpuStatus(err, "gpuMalloc");
  }
  return GpuMemory(p);
}

absl::StatusOr<GpuMemory> GpuUpload(const void* host, size_t bytes, GpuContext& ctx) {
  auto mem = GpuAlloc(bytes);
  if (!mem.ok() || bytes == 0) return mem;
  absl::Status s = GpuStatus(gpuMemcpyAsync(mem->get(), host, bytes, gpuMemcpyHostToDevice, ctx.stream), "upload");
  if (s.ok()) s = GpuStatus(gpuStreamSynchronize(ctx.stream), "upload sync");
  if (!s.ok()) return s;
  return mem;
}

absl::StatusOr<std::unique_ptr<GpuContext>> GpuContext::Create(int device) {
  int count = 0;
  gpuError_t err = gpuGetDeviceCount(&count);
  if (err != gpuSuccess || count == 0) {
    (void)gpuGetLastError();
    return absl::UnavailableError(absl::StrCat(
        "no GPU device available", err != gpuSuccess ? absl::StrCat(" (", gpuGetErrorString(err), ")") : ""));
  }
  if (device < 0 || device >= count) {
    return absl::UnavailableError(absl::StrCat("GPU device index ", device, " out of range: ", count, " device(s) present"));
  }
  if (absl::Status s = GpuStatus(gpuSetDevice(device), "gpuSetDevice"); !s.ok()) {
    return absl::UnavailableError(s.message());
  }
  gpuDeviceProp prop;
  std::memset(&prop, 0, sizeof(prop));
  if (absl::Status s = GpuStatus(gpuGetDeviceProperties(&prop, device), "gpuGetDeviceProperties"); !s.ok()) {
    return absl::UnavailableError(s.message());
  }
  auto ctx = std::make_unique<GpuContext>();
  ctx->device = device;
  ctx->sm_count = prop.multiProcessorCount;
  ctx->l2_bytes = size_t(prop.l2CacheSize);
  ctx->name = prop.name;
#if FL_HIP
  ctx->max_smem_per_block_optin = int(prop.sharedMemPerBlock);  // HIP 5.2 has no opt-in limit
  // gcnArchName is e.g. "gfx90a:sramecc+:xnack-": the target id before the first ':'.
  std::string gcn = prop.gcnArchName;
  ctx->arch = gcn.substr(0, gcn.find(':'));
  ctx->cc_major = prop.major;
  ctx->cc_minor = prop.minor;
#else
  ctx->max_smem_per_block_optin = int(prop.sharedMemPerBlockOptin);
  ctx->cc_major = prop.major;
  ctx->cc_minor = prop.minor;
  ctx->arch = absl::StrCat("sm_", prop.major, prop.minor);
#endif
  if (absl::Status s = GpuStatus(gpuStreamCreateWithFlags(&ctx->stream, gpuStreamNonBlocking), "stream create");
      !s.ok()) {
    ctx->stream = nullptr;
    return absl::UnavailableError(s.message());
  }
  return ctx;
}

absl::StatusOr<std::unique_ptr<GpuContext>> GpuContext::CreateSibling() const {
  if (absl::Status s = GpuStatus(gpuSetDevice(device), "gpuSetDevice"); !s.ok()) return s;
  auto ctx = std::make_unique<GpuContext>();
  ctx->device = device;
  ctx->sm_count = sm_count;
  ctx->cc_major = cc_major;
  ctx->cc_minor = cc_minor;
  ctx->arch = arch;
  ctx->name = name;
  ctx->l2_bytes = l2_bytes;
  ctx->max_smem_per_block_optin = max_smem_per_block_optin;
  if (absl::Status s = GpuStatus(gpuStreamCreateWithFlags(&ctx->stream, gpuStreamNonBlocking), "stream create");
      !s.ok()) {
    ctx->stream = nullptr;
    return s;
  }
  return ctx;
}

GpuContext::~GpuContext() {
  if (stream != nullptr) (void)gpuStreamSynchronize(stream);
  wq_b_lt.reset();  // may hold a library handle and device memory used on the stream
  if (stream != nullptr) (void)gpuStreamDestroy(stream);
  for (void* w : workspace_) {
    if (w != nullptr) (void)gpuFree(w);
  }
}

void* GpuContext::Workspace(size_t bytes, Scratch block) {
  const int i = int(block);
  if (bytes <= workspace_bytes_[i]) return workspace_[i];
  // Work queued on the stream may still use the old block: gpuFree waits for the device.
  if (workspace_[i] != nullptr) (void)gpuFree(workspace_[i]);
  workspace_[i] = nullptr;
  workspace_bytes_[i] = 0;
  void* p = nullptr;
  if (gpuMalloc(&p, bytes) != gpuSuccess) {
    (void)gpuGetLastError();
    return nullptr;
  }
  workspace_[i] = p;
  workspace_bytes_[i] = bytes;
  return workspace_[i];
}

}  // namespace fusedlayer::gpu

#if !FL_HIP
cudaError_t gpuStreamWriteValue32(cudaStream_t stream, void* host_word, uint32_t value) {
  // CUresult cuStreamWriteValue32(CUstream, CUdeviceptr, cuuint32_t, unsigned int): CUstream is
  // cudaStream_t, CUdeviceptr a 64-bit integer; CUDA_SUCCESS is 0.
  using WriteValue32 = int (*)(cudaStream_t, unsigned long long, unsigned int, unsigned int);
  static const WriteValue32 write_value = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuStreamWriteValue32", &fn, 12000, cudaEnableDefault, &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      (void)cudaGetLastError();
      fn = nullptr;
    }
    return reinterpret_cast<WriteValue32>(fn);
  }();
  if (write_value == nullptr) return cudaErrorNotSupported;
  void* device_word = nullptr;
  if (cudaError_t err = cudaHostGetDevicePointer(&device_word, host_word, 0); err != cudaSuccess) return err;
  return write_value(stream, reinterpret_cast<unsigned long long>(device_word), value, 0) == 0 ? cudaSuccess
                                                                                           : cudaErrorUnknown;
}
#endif
