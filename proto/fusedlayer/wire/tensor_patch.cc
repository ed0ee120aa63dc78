#include "fusedlayer/wire/tensor_patch.h"

#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/wire_format_lite.h"

namespace fusedlayer::wire {
namespace {

using google::protobuf::internal::WireFormatLite;
using google::protobuf::io::CodedOutputStream;

uint32_t LengthDelimitedKey(int field) {
  return WireFormatLite::MakeTag(field, WireFormatLite::WIRETYPE_LENGTH_DELIMITED);
}

// The Tensor submessage holding only `data`: its size, not counting the outer field's key and length.
uint64_t BodyBytes(uint64_t data_bytes) {
  return CodedOutputStream::VarintSize32(LengthDelimitedKey(kTensorDataField)) +
         CodedOutputStream::VarintSize64(data_bytes) + data_bytes;
}

void AppendVarint(std::string* out, uint64_t v) {
  uint8_t buf[10];
  const uint8_t* end = CodedOutputStream::WriteVarint64ToArray(v, buf);
  out->append(reinterpret_cast<const char*>(buf), static_cast<size_t>(end - buf));
}

}  // namespace

uint64_t TensorPatchBytes(int field, uint64_t data_bytes) {
  const uint64_t body = BodyBytes(data_bytes);
  return CodedOutputStream::VarintSize32(LengthDelimitedKey(field)) + CodedOutputStream::VarintSize64(body) + body;
}

void AppendTensorPatchHeader(std::string* out, int field, uint64_t data_bytes) {
  AppendVarint(out, LengthDelimitedKey(field));
  AppendVarint(out, BodyBytes(data_bytes));
  AppendVarint(out, LengthDelimitedKey(kTensorDataField));
  AppendVarint(out, data_bytes);
}

}  // namespace fusedlayer::wire
