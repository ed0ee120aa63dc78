#include "rpc/wire_messages.h"

#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/wire_format_lite.h"
#include "grpcpp/support/proto_buffer_reader.h"
#include "grpcpp/support/slice.h"

namespace fusedlayer::server {
namespace {

using google::protobuf::internal::WireFormatLite;
using google::protobuf::io::CodedOutputStream;

// Tensor.data's field number (proto/fusedlayer/v1/fusedlayer.proto).
constexpr int kTensorDataField = 3;
// Outputs below this size are copied next to the headers: a slice of their own would cost more
// than the copy (and they are the fp32 mixes and scales, a few hundred bytes at decode sizes).
constexpr size_t kCopyBelowBytes = 4096;

uint32_t LengthDelimitedKey(int field) {
  return WireFormatLite::MakeTag(field, WireFormatLite::WIRETYPE_LENGTH_DELIMITED);
}

// The Tensor submessage of one output holding only `data`: its size on the wire, not counting the
// outer field's key and length.
uint64_t PatchBodyBytes(const OutputBuffers::Buffer& b) {
  return CodedOutputStream::VarintSize32(LengthDelimitedKey(kTensorDataField)) + CodedOutputStream::VarintSize64(b.bytes) +
         b.bytes;
}

uint64_t PatchBytes(const OutputBuffers::Buffer& b) {
  const uint64_t body = PatchBodyBytes(b);
  return CodedOutputStream::VarintSize32(LengthDelimitedKey(b.field)) + CodedOutputStream::VarintSize64(body) + body;
}

void AppendVarint(std::string* out, uint64_t v) {
  uint8_t buf[10];
  const uint8_t* end = CodedOutputStream::WriteVarint64ToArray(v, buf);
  out->append(reinterpret_cast<const char*>(buf), static_cast<size_t>(end - buf));
}

// A slice over an output's memory: the slice holds a reference to the memory's owner until gRPC
// unrefs the slice (written to the socket, or the call failed).
grpc::Slice SliceOver(const OutputBuffers::Buffer& b) {
  auto* owner = new std::shared_ptr<const void>(b.owner);
  return grpc::Slice(b.data, b.bytes, [](void* p) { delete static_cast<std::shared_ptr<const void>*>(p); }, owner);
}

}  // namespace

absl::Status ParseWireRequest(grpc::ByteBuffer* wire, google::protobuf::Message* request) {
  bool parsed = false;
  {
    grpc::ProtoBufferReader reader(wire);
    parsed = reader.status().ok() && request->ParseFromZeroCopyStream(&reader);
  }
  wire->Clear();
  if (!parsed) {
    request->Clear();
    return absl::InvalidArgumentError(
        absl::StrCat("the request is not a valid ", request->GetDescriptor()->full_name(), " message"));
  }
  return absl::OkStatus();
}

uint64_t WireResponseBytes(const google::protobuf::Message& message, const OutputBuffers& outputs) {
  uint64_t bytes = message.ByteSizeLong();
  for (const OutputBuffers::Buffer& b : outputs.buffers()) bytes += PatchBytes(b);
  return bytes;
}

void EncodeWireResponse(const google::protobuf::Message& message, const OutputBuffers& outputs,
                        grpc::ByteBuffer* wire) {
  std::vector<grpc::Slice> slices;
  // The message itself, serialized into a slice of its own.
  grpc::Slice head(message.ByteSizeLong());
  message.SerializeWithCachedSizesToArray(const_cast<uint8_t*>(head.begin()));
  slices.push_back(std::move(head));
  // Then the outputs: headers and small outputs gathered in `pending`, large outputs by reference.
  std::string pending;
  auto flush = [&] {
    if (pending.empty()) return;
    slices.emplace_back(pending.data(), pending.size());  // copies
    pending.clear();
  };
  for (const OutputBuffers::Buffer& b : outputs.buffers()) {
    AppendVarint(&pending, LengthDelimitedKey(b.field));
    AppendVarint(&pending, PatchBodyBytes(b));
    AppendVarint(&pending, LengthDelimitedKey(kTensorDataField));
    AppendVarint(&pending, b.bytes);
    if (b.bytes < kCopyBelowBytes) {
      pending.append(b.data, b.bytes);
      continue;
    }
    flush();
    slices.push_back(SliceOver(b));
  }
  flush();
  *wire = grpc::ByteBuffer(slices.data(), slices.size());
}

}  // namespace fusedlayer::server
