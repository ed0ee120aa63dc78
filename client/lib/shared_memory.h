// Client side of the shared-memory transports (proto: RegisterSystemSharedMemory,
// RegisterCudaSharedMemory, Tensor.shared_memory / .cuda_shared_memory, OutputPlacement; server:
// server/transport/shared_memory.h, server/transport/cuda_shared_memory.h).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "client/lib/fusedlayer_client.h"
#include "google/protobuf/message.h"

namespace fusedlayer::client {

inline constexpr uint64_t kSharedMemoryAlignment = 64;  // the server's rule for object offsets

// Output bytes of a call (the sizes the server gives the outputs), for sizing a region.
uint64_t MhcRequestSharedBytes(const v1::MhcSeamRequest& request, const v1::MhcConfig& mhc);
uint64_t SwaRequestSharedBytes(const v1::SwaNormQuantRequest& request, const v1::SwaConfig& swa, int64_t wq_b_rows);

// One registered region that requests are moved into: every inline input is written into the
// region and replaced by its reference, and every output the call produces gets a placement there,
// so neither travels in the messages; Fetch reads the outputs back into the response. What the
// region is (a POSIX shared-memory object, ClientSharedMemory; a device allocation exported over
// CUDA IPC, client/lib/cuda_shared_memory.h) is the subclass's: it moves the bytes.
// An output a region holds for a request: where ClientRegion::Prepare placed it, and what it is.
struct PlacedOutput {
  std::string name;  // the response field
  v1::DataType dtype = v1::DATA_TYPE_UNSPECIFIED;
  std::vector<int64_t> shape;
  uint64_t offset = 0;
  uint64_t bytes = 0;
};

class ClientRegion {
 public:
  virtual ~ClientRegion() = default;
  ClientRegion(const ClientRegion&) = delete;
  ClientRegion& operator=(const ClientRegion&) = delete;

  // Moves the request's inline inputs into the region and places its outputs there.
  absl::Status Prepare(v1::MhcSeamRequest& request, const v1::MhcConfig& mhc);
  absl::Status Prepare(v1::SwaNormQuantRequest& request, const v1::SwaConfig& swa, int64_t wq_b_rows);
  // Replaces every output of the response that lies in this region by its bytes (inline), so the
  // response reads as a TCP one.
  absl::Status Fetch(v1::MhcSeamResponse& response) const;
  absl::Status Fetch(v1::SwaNormQuantResponse& response) const;
  // Sets every output the last Prepare placed (its dtype, shape and bytes) in `response`, for a
  // call that returns no response message: a call ring's (the completion says only how it went).
  absl::Status FetchPlaced(google::protobuf::Message& response) const;

  const std::string& region_name() const { return name_; }
  uint64_t byte_size() const { return bytes_; }

 protected:
  // `cuda`: references go in the cuda_shared_memory fields, else in shared_memory.
  ClientRegion(std::string name, uint64_t bytes, bool cuda) : name_(std::move(name)), bytes_(bytes), cuda_(cuda) {}
  // [at, at + n) of the region (bounds checked by the caller) from / to this process's memory.
  virtual absl::Status Write(uint64_t at, const char* src, uint64_t n) = 0;
  virtual absl::Status Read(uint64_t at, char* dst, uint64_t n) const = 0;

 private:
  // The next aligned range of `bytes` bytes (ResourceExhausted when the region is too small).
  absl::StatusOr<uint64_t> Take(uint64_t bytes);
  absl::Status PlaceInput(v1::Tensor* t);
  absl::Status PlaceOutput(PlacedOutput output, google::protobuf::RepeatedPtrField<v1::OutputPlacement>* out);
  absl::Status FetchTensor(v1::Tensor* t) const;
  v1::SharedMemoryRef* MutableRef(v1::Tensor* t) const;

  const std::string name_;
  const uint64_t bytes_;
  const bool cuda_;
  uint64_t used_ = 0;
  std::vector<PlacedOutput> placed_;  // the last Prepare's outputs
};

// A POSIX shared-memory object that this process creates (a random, unguessable name, mode 0600,
// O_EXCL), maps, and registers as one region. On destruction it unregisters the region, unmaps and
// unlinks the object (a process that dies without that leaves the region registered until its
// identity unregisters it or the object is removed; docs/operations.md).
//
// One request at a time per object (Prepare resets the layout); callers running several requests
// concurrently use one object each.
class ClientSharedMemory final : public ClientRegion {
 public:
  // Creates, maps and registers an object of `bytes` bytes (rounded up to the alignment).
  static absl::StatusOr<std::unique_ptr<ClientSharedMemory>> Create(const FusedLayerClient& client, uint64_t bytes);
  ~ClientSharedMemory() override;

  const std::string& key() const { return key_; }
  char* data() const { return data_; }

 private:
  ClientSharedMemory(const FusedLayerClient& client, std::string name, std::string key, char* data, uint64_t bytes);
  absl::Status Write(uint64_t at, const char* src, uint64_t n) override;
  absl::Status Read(uint64_t at, char* dst, uint64_t n) const override;

  const FusedLayerClient& client_;
  const std::string key_;
  char* const data_;
  bool registered_ = true;
};

}  // namespace fusedlayer::client
