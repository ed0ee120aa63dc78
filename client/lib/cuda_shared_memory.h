// Client side of the CUDA shared-memory transport (proto: RegisterCudaSharedMemory, Tensor
// .cuda_shared_memory; server: server/transport/cuda_shared_memory.h), for a process on the
// server's host and GPU.
//
// A ClientCudaSharedMemory is one device allocation of this process, made through the library's
// Backend (AllocateIpcExportable: cudaMalloc + cudaIpcGetMemHandle on a GPU), registered as one
// region by its IPC handle. Prepare copies a request's inline inputs to it and places every output
// there, so no tensor byte travels in the messages and the server's kernels read and write this
// allocation in place; Fetch copies the outputs back into the response. Backend copies are
// synchronous, so the inputs are complete on the device before the request is sent (the contract).
// On destruction it unregisters the region, then frees the allocation.
//
// One request at a time per allocation (Prepare resets the layout).
#pragma once

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "client/lib/fusedlayer_client.h"
#include "client/lib/shared_memory.h"
#include "fusedlayer/backend.h"

namespace fusedlayer::client {

class ClientCudaSharedMemory final : public ClientRegion {
 public:
  // Allocates `bytes` (rounded up to the alignment) of exportable device memory on `backend`'s GPU
  // and registers it. `backend` must outlive the region.
  static absl::StatusOr<std::unique_ptr<ClientCudaSharedMemory>> Create(const FusedLayerClient& client,
                                                                        Backend& backend, uint64_t bytes);
  ~ClientCudaSharedMemory() override;

  // The allocation's first byte (a device address of this process).
  char* device_data() const { return static_cast<char*>(memory_.buffer.data()); }

 private:
  ClientCudaSharedMemory(const FusedLayerClient& client, Backend& backend, std::string name, IpcExportedBuffer memory,
                         uint64_t bytes);
  absl::Status Write(uint64_t at, const char* src, uint64_t n) override;
  absl::Status Read(uint64_t at, char* dst, uint64_t n) const override;

  const FusedLayerClient& client_;
  Backend& backend_;
  IpcExportedBuffer memory_;
  bool registered_ = true;
};

}  // namespace fusedlayer::client
