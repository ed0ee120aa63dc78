// A compute request as gRPC bytes with its tensors' data sent from the request's own memory: the
// message without that data, then each tensor's data as a patch (proto/fusedlayer/wire/
// tensor_patch.h), the data as slices over the request's strings. What protobuf's serialization
// would copy (every tensor byte, once per call) is not copied; the server reads the same message.
// Used by FusedLayerClient's shared-request overloads (fusedlayer_client.h).
#pragma once

#include <memory>

#include "google/protobuf/message.h"
#include "grpcpp/support/byte_buffer.h"

namespace fusedlayer::client {

// `request`'s wire bytes. The slices keep `request` alive (a reference each) until gRPC lets go of
// them, which may be after the call returned (a failed call's bytes still queued in the transport).
// Tensors below a few KiB are copied next to the headers (a slice of their own costs more).
grpc::ByteBuffer EncodeRequestByReference(std::shared_ptr<const google::protobuf::Message> request);

}  // namespace fusedlayer::client
