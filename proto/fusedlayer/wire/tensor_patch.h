// Tensor data sent beside a serialized message instead of inside it, with no copy, by both sides of
// the compute RPCs: the server's responses (server/rpc/wire_messages.h) and the C++ client's
// requests (client/lib/wire_request.h).
//
// A message is serialized without the `data` of some of its Tensor fields; each such field then
// follows as one more occurrence holding only `data` (a "patch"). Protobuf merges repeated
// occurrences of a singular embedded message (the wire format's rule: "merge"), so every parser
// reads one message with dtype, shape and data, byte for byte what serializing the whole message
// would give to a reader. The data itself goes to gRPC as a slice over the sender's memory.
#pragma once

#include <cstdint>
#include <string>

namespace fusedlayer::wire {

// Tensor.data's field number (proto/fusedlayer/v1/fusedlayer.proto).
inline constexpr int kTensorDataField = 3;

// Bytes on the wire of a patch of Tensor field `field` with `data_bytes` bytes of data (keys,
// lengths and the data).
uint64_t TensorPatchBytes(int field, uint64_t data_bytes);

// Appends to `out` everything of that patch that comes before the data: the field's key and
// length, then data's key and length.
void AppendTensorPatchHeader(std::string* out, int field, uint64_t data_bytes);

}  // namespace fusedlayer::wire
