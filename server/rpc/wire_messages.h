// The compute RPCs' messages on the wire. MhcSeam and SwaNormQuant are registered as raw callback
// methods (rpc/service.h): gRPC hands over the request's bytes and takes the response's as a
// ByteBuffer, so the server decides how tensors get in and out of protobuf:
//   - the request is parsed here from gRPC's slices (what gRPC's generated handler would do, now
//     on the call's own clock: it is part of the decode stage), and its slices are freed at once;
//   - the response is the message (without the tensor data the call keeps outside it,
//     runtime/output_buffers.h) followed by one more occurrence of each such output's Tensor field
//     holding only its `data` (proto/fusedlayer/wire/tensor_patch.h: every parser reads one message
//     with dtype, shape and data). The data goes to gRPC as slices over the outputs' own memory: no copy.
//   - on a device backend the request is read instead (ReadWireRequest): the data of its tensors
//     goes from gRPC's slices straight into one block of page-locked memory, which the lane copies
//     to the device from as it is (runtime/device_staging.h), and only the rest is parsed by protobuf.
//     One host pass over the tensor bytes instead of two (the parse into the message, then the
//     copy into staging): on the H200 each pass over an mHC seam C = 7168 T = 64 (4.4 MiB) cost
//     ~0.5 ms of its ~1.3 ms server time.
#pragma once

#include <cstdint>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "codec/wire_tensor_data.h"
#include "runtime/host_staging_pool.h"
#include "runtime/output_buffers.h"
#include "fusedlayer/v1/fusedlayer.pb.h"
#include "google/protobuf/message.h"
#include "grpcpp/support/byte_buffer.h"

namespace fusedlayer::server {

// Parses `wire` into `request` and empties `wire` (its memory is freed as soon as it is parsed).
// INVALID_ARGUMENT naming the message type when the bytes are not a valid message of it.
absl::Status ParseWireRequest(grpc::ByteBuffer* wire, google::protobuf::Message* request);

// Reads `wire` into `request` like ParseWireRequest (same result, same errors, `wire` emptied),
// except that the `data` of each non-repeated Tensor field of the request (a top-level tensor with
// a dtype) goes into a block from `pool` (`data`, each tensor aligned to kAlign), copied there
// from gRPC's slices by `copier`, instead of into the message. Everything else is parsed by protobuf.
// A tensor field that occurs more than once is merged as protobuf merges it (the C++ client's
// shared requests send each tensor's data as one more occurrence). Where the reader cannot do that
// it leaves the whole request to ParseWireRequest (`data` empty): no block free in the pool right
// now (it never waits), or a request whose tensors protobuf would resolve by order (`data` twice
// or with `shared_memory`), a tensor with data but no dtype, an unknown field in a tensor, groups,
// malformed bytes (protobuf then gives the error).
absl::Status ReadWireRequest(grpc::ByteBuffer* wire, google::protobuf::Message* request, HostStagingPool* pool,
                             ParallelCopy* copier, WireTensorData* data);

// The bytes EncodeWireResponse produces for `message` and `outputs`.
uint64_t WireResponseBytes(const google::protobuf::Message& message, const OutputBuffers& outputs);

// `message`, then each output as its Tensor field holding only `data` (see above), into `wire`.
// Outputs smaller than a few KiB are copied; larger ones are sent from their memory, which each
// slice keeps alive (OutputBuffers::Buffer::owner) until gRPC has written it.
void EncodeWireResponse(const google::protobuf::Message& message, const OutputBuffers& outputs,
                        grpc::ByteBuffer* wire);

}  // namespace fusedlayer::server
