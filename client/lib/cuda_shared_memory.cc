#include "client/lib/cuda_shared_memory.h"

#include <random>

#include "absl/strings/str_cat.h"

namespace fusedlayer::client {

absl::StatusOr<std::unique_ptr<ClientCudaSharedMemory>> ClientCudaSharedMemory::Create(const FusedLayerClient& client,
                                                                                      Backend& backend,
                                                                                      uint64_t bytes) {
  bytes = (bytes == 0 ? 1 : bytes + kSharedMemoryAlignment - 1) / kSharedMemoryAlignment * kSharedMemoryAlignment;
  absl::StatusOr<IpcExportedBuffer> memory = backend.AllocateIpcExportable(bytes);
  if (!memory.ok()) return memory.status();
  std::random_device rd;
  const std::string name = absl::StrCat("fl-cuda-", rd(), "-", rd());
  const std::string handle = memory->handle;
  std::unique_ptr<ClientCudaSharedMemory> region(
      new ClientCudaSharedMemory(client, backend, name, *std::move(memory), bytes));
  if (absl::Status s = client.RegisterCudaSharedMemory(name, handle, backend.device_index(), 0, bytes); !s.ok()) {
    region->registered_ = false;
    return s;  // the destructor frees the allocation
  }
  return region;
}

ClientCudaSharedMemory::ClientCudaSharedMemory(const FusedLayerClient& client, Backend& backend, std::string name,
                                               IpcExportedBuffer memory, uint64_t bytes)
    : ClientRegion(std::move(name), bytes, /*cuda=*/true), client_(client), backend_(backend), memory_(std::move(memory)) {}

ClientCudaSharedMemory::~ClientCudaSharedMemory() {
  // Unregistered first: the server closes its opening of the handle before the memory goes.
  if (registered_) (void)client_.UnregisterCudaSharedMemory(region_name());
}

absl::Status ClientCudaSharedMemory::Write(uint64_t at, const char* src, uint64_t n) {
  return backend_.CopyToDevice(device_data() + at, src, n);
}

absl::Status ClientCudaSharedMemory::Read(uint64_t at, char* dst, uint64_t n) const {
  return backend_.CopyToHost(dst, device_data() + at, n);
}

}  // namespace fusedlayer::client
