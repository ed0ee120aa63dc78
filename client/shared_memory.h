// Client side of the system shared-memory transport (proto: RegisterSystemSharedMemory, Tensor
// .shared_memory, OutputPlacement; server: server/transport/shared_memory.h).
//
// A ClientSharedMemory is one POSIX shared-memory object that this process creates (a random,
// unguessable name, mode 0600, O_EXCL), maps, and registers as one region. A request is moved into
// it: every inline input is copied into the mapping and replaced by its reference, and every output
// the call produces gets a placement, so neither travels in the messages. After the call the
// outputs are read from the mapping. On destruction it unregisters the region, unmaps and unlinks
// the object (a process that dies without that leaves the region registered until its identity
// unregisters it or the object is removed; docs/operations.md).
//
// One request at a time per object (Prepare resets the layout); callers running several requests
// concurrently use one object each.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "client/fusedlayer_client.h"

namespace fusedlayer::client {

inline constexpr uint64_t kSharedMemoryAlignment = 64;  // the server's rule for object offsets

// Output bytes of a call (the sizes the server gives the outputs), for sizing a region.
uint64_t MhcRequestSharedBytes(const v1::MhcSeamRequest& request, const v1::MhcConfig& mhc);
uint64_t SwaRequestSharedBytes(const v1::SwaNormQuantRequest& request, const v1::SwaConfig& swa, int64_t wq_b_rows);

class ClientSharedMemory {
 public:
  // Creates, maps and registers an object of `bytes` bytes (rounded up to the alignment).
  static absl::StatusOr<std::unique_ptr<ClientSharedMemory>> Create(const FusedLayerClient& client, uint64_t bytes);
  ~ClientSharedMemory();
  ClientSharedMemory(const ClientSharedMemory&) = delete;
  ClientSharedMemory& operator=(const ClientSharedMemory&) = delete;

  // Moves the request's inline inputs into the region and places its outputs there.
  absl::Status Prepare(v1::MhcSeamRequest& request, const v1::MhcConfig& mhc);
  absl::Status Prepare(v1::SwaNormQuantRequest& request, const v1::SwaConfig& swa, int64_t wq_b_rows);
  // Replaces every output of the response that lies in this region by its bytes (inline), so the
  // response reads as a TCP one.
  absl::Status Fetch(v1::MhcSeamResponse& response) const;
  absl::Status Fetch(v1::SwaNormQuantResponse& response) const;

  const std::string& region_name() const { return name_; }
  const std::string& key() const { return key_; }
  uint64_t byte_size() const { return bytes_; }
  char* data() const { return data_; }

 private:
  ClientSharedMemory(const FusedLayerClient& client, std::string name, std::string key, char* data, uint64_t bytes);
  // The next aligned range of `bytes` bytes (ResourceExhausted when the object is too small).
  absl::StatusOr<uint64_t> Take(uint64_t bytes);
  absl::Status PlaceInput(v1::Tensor* t);
  absl::Status PlaceOutput(const char* name, uint64_t bytes, google::protobuf::RepeatedPtrField<v1::OutputPlacement>* out);
  absl::Status FetchTensor(v1::Tensor* t) const;

  const FusedLayerClient& client_;
  const std::string name_, key_;
  char* const data_;
  const uint64_t bytes_;
  uint64_t used_ = 0;
  bool registered_ = true;
};

}  // namespace fusedlayer::client
