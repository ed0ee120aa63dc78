// The output tensors of one compute call, kept in memory the server owns instead of in the
// response message's `bytes` fields, so the response goes to gRPC as slices over this memory
// (rpc/wire_response.h) rather than being zero-filled, written, and then copied again by protobuf
// serialization into gRPC's buffers:
//
//   CPU backend   the kernels write into uninitialised heap buffers, which the response's slices
//                 reference (no zero-fill, no serialization copy);
//   GPU lane      the outputs' copies back from the device land in the lane's pinned staging
//                 block, and the block itself is lent to the response (runtime/host_staging_pool.h
//                 Lend) instead of being memcpy'd into the heap buffers: the heap buffers are then
//                 dropped (runtime/device_staging.h LaneStaging::Finish).
//
// Each buffer is kept alive by a shared owner: the call holds one reference, and each slice of
// the response another, so the memory lives until gRPC has written it to the socket, whichever
// happens last. Owned by the call (rpc/unary_call.h); filled on the gRPC thread (Decode) and on
// the executor (the run), read when the response is encoded: the hand-offs between those threads
// order every access (one thread at a time). Knows nothing of gRPC or protobuf.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

namespace fusedlayer::server {

class OutputBuffers {
 public:
  struct Buffer {
    int field = 0;                      // the response message's field number of this output tensor
    size_t bytes = 0;
    char* data = nullptr;               // uninitialised until the op writes it
    std::shared_ptr<const void> owner;  // keeps `data` alive (a heap block, or a lent staging block)
  };

  // An uninitialised buffer of `bytes` for the output tensor at response field `field`; its data.
  // Null, and nothing allocated, for a field declared WrittenElsewhere. Throws std::bad_alloc when
  // out of memory (Decode turns it into RESOURCE_EXHAUSTED).
  char* Add(int field, size_t bytes);

  // The output at response field `field` will be written where the client placed it (CUDA shared
  // memory): Add gives it no buffer. Declared before the outputs are added.
  void WrittenElsewhere(int field) { elsewhere_.push_back(field); }

  // The output whose data is `was` now lives at `now`, kept alive by `owner` (a GPU lane's lent
  // staging block): the old buffer is freed. False when no output has data `was` and size `bytes`.
  bool Move(const void* was, size_t bytes, char* now, std::shared_ptr<const void> owner);

  // The buffer of the output at response field `field`, or null.
  const Buffer* Find(int field) const;
  // Drops the output at `field` (written elsewhere, e.g. to shared memory): the response does not carry it.
  void Remove(int field);

  const std::vector<Buffer>& buffers() const { return buffers_; }
  bool empty() const { return buffers_.empty(); }
  uint64_t bytes() const;  // of all outputs' data
  void Clear() {
    buffers_.clear();
    elsewhere_.clear();
  }

 private:
  std::vector<Buffer> buffers_;
  std::vector<int> elsewhere_;  // fields written where the client placed them (WrittenElsewhere)
};

}  // namespace fusedlayer::server
