// The tensor data of a request that was read outside its message. On a device backend a transport
// may read the tensors' bytes straight into one block of page-locked memory instead of into the
// message (gRPC: rpc/wire_messages.h ReadWireRequest), so that the lane copies them to the device
// from where they lie. Decoding (codec/request_codec.h) finds each tensor's bytes here.
#pragma once

#include <cstddef>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "runtime/host_staging_pool.h"
#include "fusedlayer/v1/fusedlayer.pb.h"
#include "google/protobuf/message.h"

namespace grpc {
class ByteBuffer;
}

namespace fusedlayer::server {

class ParallelCopy;

// The data of a request's tensors that ReadWireRequest put in a block of its own instead of the
// message (whose Tensor then has dtype and shape but no `data`). Must outlive every view of it.
class WireTensorData {
 public:
  // Each tensor starts on this boundary in the block (as LaneStaging lays out its staging).
  static constexpr size_t kAlign = 256;

  // Tensor `t`'s bytes when they are in the block; null when `t` holds its own (or has none).
  const std::string_view* Find(const v1::Tensor& t) const;
  // Puts every tensor's bytes back into its message and gives the block back: for requests whose
  // tensors are read from the messages (verify's comparison, shadow sampling).
  void MoveIntoMessages();
  // The block's bytes in use (empty when no tensor is in a block): a view inside it needs no
  // staging copy to reach the device.
  const char* begin() const { return block_.data(); }
  const char* end() const { return block_.data() == nullptr ? nullptr : block_.data() + used_; }
  size_t tensors() const { return tensors_.size(); }

 private:
  friend absl::Status ReadWireRequest(grpc::ByteBuffer*, google::protobuf::Message*, HostStagingPool*, ParallelCopy*,
                                      WireTensorData*);
  HostStagingPool::Lease block_;
  size_t used_ = 0;
  std::vector<std::pair<v1::Tensor*, std::string_view>> tensors_;
};

}  // namespace fusedlayer::server
