// The compute RPCs' messages on the wire. MhcSeam and SwaNormQuant are registered as raw callback
// methods (rpc/service.h): gRPC hands over the request's bytes and takes the response's as a
// ByteBuffer, so the server decides how tensors get in and out of protobuf:
//   - the request is parsed here from gRPC's slices (what gRPC's generated handler would do, now
//     on the call's own clock: it is part of the decode stage), and its slices are freed at once;
//   - the response is the message (without the tensor data the call keeps outside it,
//     exec/output_buffers.h) followed by one more occurrence of each such output's Tensor field
//     holding only its `data`. Protobuf merges repeated occurrences of a singular message field
//     (the wire format's rule for embedded messages: "merge"), so every parser reads one message
//     with dtype, shape and data, byte for byte what serializing the whole message would give to
//     a reader. The data goes to gRPC as slices over the outputs' own memory: no copy.
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "exec/output_buffers.h"
#include "google/protobuf/message.h"
#include "grpcpp/support/byte_buffer.h"

namespace fusedlayer::server {

// Parses `wire` into `request` and empties `wire` (its memory is freed as soon as it is parsed).
// INVALID_ARGUMENT naming the message type when the bytes are not a valid message of it.
absl::Status ParseWireRequest(grpc::ByteBuffer* wire, google::protobuf::Message* request);

// The bytes EncodeWireResponse produces for `message` and `outputs`.
uint64_t WireResponseBytes(const google::protobuf::Message& message, const OutputBuffers& outputs);

// `message`, then each output as its Tensor field holding only `data` (see above), into `wire`.
// Outputs smaller than a few KiB are copied; larger ones are sent from their memory, which each
// slice keeps alive (OutputBuffers::Buffer::owner) until gRPC has written it.
void EncodeWireResponse(const google::protobuf::Message& message, const OutputBuffers& outputs,
                        grpc::ByteBuffer* wire);

}  // namespace fusedlayer::server
