#include "rpc/wire_messages.h"

#include <algorithm>
#include <bit>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "fusedlayer/wire/tensor_patch.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/wire_format_lite.h"
#include "grpcpp/support/proto_buffer_reader.h"
#include "grpcpp/support/slice.h"

namespace fusedlayer::server {
namespace {

using google::protobuf::internal::WireFormatLite;
using google::protobuf::io::CodedOutputStream;

using wire::kTensorDataField;
// Outputs below this size are copied next to the headers: a slice of their own would cost more
// than the copy (and they are the fp32 mixes and scales, a few hundred bytes at decode sizes).
constexpr size_t kCopyBelowBytes = 4096;

uint32_t LengthDelimitedKey(int field) {
  return WireFormatLite::MakeTag(field, WireFormatLite::WIRETYPE_LENGTH_DELIMITED);
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

// Reads gRPC's slices of a request front to back (ReadWireRequest). Every read checks that the
// bytes are there: a truncated or hostile request makes it return false, never read past the end.
class SliceReader {
 public:
  explicit SliceReader(std::vector<grpc::Slice> slices) : slices_(std::move(slices)) {
    for (const grpc::Slice& s : slices_) remaining_ += s.size();
    Enter();
  }
  uint64_t remaining() const { return remaining_; }

  // A varint of at most `max_bytes` (<= 10) bytes; its bytes are appended to `echo` when set.
  bool ReadVarint(uint64_t* value, std::string* echo, int max_bytes = 10) {
    uint64_t v = 0;
    for (int i = 0; i < max_bytes; ++i) {
      if (remaining_ == 0) return false;
      const uint8_t b = *p_;
      Advance(1);
      if (echo != nullptr) echo->push_back(static_cast<char>(b));
      v |= static_cast<uint64_t>(b & 0x7f) << (7 * i);
      if ((b & 0x80) == 0) {
        if (i == 9 && b > 1) return false;  // more than 64 bits
        *value = v;
        return true;
      }
    }
    return false;
  }
  // What the reader decodes itself (instead of echoing the bytes for protobuf) must be refused
  // wherever protobuf would refuse it, or the reader would accept a request protobuf refuses
  // (fuzz_wire_reader found a 6-byte key that did just that). Protobuf 3.21 reads a key in at
  // most 5 bytes, and a length in at most 5 bytes and below 2^31 - 16 (parse_context.cc,
  // ReadTagFallback, ReadSizeFallback). Anything else returns false: the request is then left to
  // protobuf, whose verdict it gets.
  bool ReadKey(uint64_t* key) { return ReadVarint(key, nullptr, 5) && *key <= UINT32_MAX; }
  bool ReadLength(uint64_t* length) { return ReadVarint(length, nullptr, 5) && *length <= INT32_MAX - 16; }
  // The next n bytes appended to `out`.
  bool Append(std::string* out, uint64_t n) {
    if (n > remaining_) return false;
    while (n > 0) {
      const size_t k = std::min<uint64_t>(n, static_cast<size_t>(end_ - p_));
      out->append(reinterpret_cast<const char*>(p_), k);
      Advance(k);
      n -= k;
    }
    return true;
  }
  // The next n bytes to `dst`, as pieces for ParallelCopy::CopyPieces (copied later: the slices
  // stay alive as long as this reader).
  bool Gather(char* dst, uint64_t n, std::vector<ParallelCopy::Piece>* pieces) {
    if (n > remaining_) return false;
    while (n > 0) {
      const size_t k = std::min<uint64_t>(n, static_cast<size_t>(end_ - p_));
      pieces->push_back(ParallelCopy::Piece{dst, reinterpret_cast<const char*>(p_), k});
      Advance(k);
      dst += k;
      n -= k;
    }
    return true;
  }

 private:
  void Advance(size_t k) {
    p_ += k;
    remaining_ -= k;
    if (p_ == end_) {
      ++next_;
      Enter();
    }
  }
  // Moves to the next slice with bytes (or past the last).
  void Enter() {
    while (next_ < slices_.size() && slices_[next_].size() == 0) ++next_;
    if (next_ < slices_.size()) {
      p_ = slices_[next_].begin();
      end_ = slices_[next_].end();
    } else {
      p_ = end_ = nullptr;
    }
  }
  std::vector<grpc::Slice> slices_;
  size_t next_ = 0;
  const uint8_t* p_ = nullptr;
  const uint8_t* end_ = nullptr;
  uint64_t remaining_ = 0;
};

// The value of a field the reader does not move (its key already read), appended to `out` as it is.
bool CopyValue(SliceReader& in, int wire_type, std::string* out) {
  uint64_t v = 0;
  switch (wire_type) {
    case WireFormatLite::WIRETYPE_VARINT: return in.ReadVarint(&v, out);
    case WireFormatLite::WIRETYPE_FIXED64: return in.Append(out, 8);
    case WireFormatLite::WIRETYPE_FIXED32: return in.Append(out, 4);
    case WireFormatLite::WIRETYPE_LENGTH_DELIMITED: return in.ReadVarint(&v, out) && in.Append(out, v);
    default: return false;  // groups (deprecated; protobuf decides) and invalid wire types
  }
}

// Tensor's field numbers (proto/fusedlayer/v1/fusedlayer.proto).
constexpr int kTensorDTypeField = 1;
constexpr int kTensorShapeField = 2;
constexpr int kTensorSharedMemoryField = 4;

// The Tensor fields of `type` the reader moves the data of: singular, of type v1.Tensor. A bit per
// field number below 64 (the compute requests' are all below 16).
uint64_t TensorFields(const google::protobuf::Descriptor& type) {
  uint64_t fields = 0;
  for (int i = 0; i < type.field_count(); ++i) {
    const google::protobuf::FieldDescriptor* f = type.field(i);
    if (!f->is_repeated() && f->message_type() == v1::Tensor::descriptor() && f->number() < 64) {
      fields |= uint64_t{1} << f->number();
    }
  }
  return fields;
}

}  // namespace

absl::Status ReadWireRequest(grpc::ByteBuffer* wire, google::protobuf::Message* request, HostStagingPool* pool,
                             ParallelCopy* copier, WireTensorData* data) {
  const uint64_t tensor_fields = pool == nullptr ? 0 : TensorFields(*request->GetDescriptor());
  std::vector<grpc::Slice> slices;
  if (tensor_fields == 0 || !wire->Dump(&slices).ok()) return ParseWireRequest(wire, request);
  // Room for every byte of the request at its tensors' alignment: enough, whatever the layout.
  const size_t block_bytes = wire->Length() + WireTensorData::kAlign * (std::popcount(tensor_fields) + 1);
  absl::StatusOr<HostStagingPool::Lease> block = pool->TryAcquire(block_bytes);
  if (!block.ok()) return ParseWireRequest(wire, request);

  SliceReader in(std::move(slices));
  std::string skeleton;  // the request without the moved data, for protobuf
  skeleton.reserve(1024);
  std::vector<ParallelCopy::Piece> pieces;
  size_t used = 0;
  // Each Tensor field's occurrences: protobuf merges repeated occurrences of an embedded message
  // as if their bodies were one (the wire format's rule), which is how the C++ client sends a
  // shared request (the message, then each tensor's data as one more occurrence:
  // proto/fusedlayer/wire/tensor_patch.h). So the bodies without `data` are concatenated here, in
  // order, and the data recorded where it went.
  struct TensorState {
    int field = 0;
    std::string body;
    bool has_data = false, has_shared_memory = false;
    int32_t dtype = 0;
    size_t data_offset = 0;
    uint64_t data_bytes = 0;
  };
  std::vector<TensorState> tensors;  // in the order of their first occurrence
  // One occurrence of Tensor field `field`, `length` bytes: false to leave the request to protobuf.
  auto read_tensor = [&](int field, uint64_t length) -> bool {
    if (length > in.remaining()) return false;
    const uint64_t end = in.remaining() - length;
    auto it = std::find_if(tensors.begin(), tensors.end(), [&](const TensorState& t) { return t.field == field; });
    if (it == tensors.end()) it = tensors.insert(tensors.end(), TensorState{.field = field});
    TensorState& t = *it;
    while (in.remaining() > end) {
      uint64_t key = 0;
      if (!in.ReadKey(&key)) return false;
      const int number = static_cast<int>(key >> 3), type = static_cast<int>(key & 7);
      const bool length_delimited = type == WireFormatLite::WIRETYPE_LENGTH_DELIMITED;
      if (number == kTensorDataField) {
        // Once per tensor, and never beside a shared-memory reference (protobuf would resolve the
        // oneof by order: left to it).
        if (!length_delimited || t.has_data || t.has_shared_memory) return false;
        // The key and the length may not run past the tensor's end either (fuzz_wire_reader found
        // one that did: its data then took bytes of the enclosing message, which protobuf refuses).
        if (!in.ReadLength(&t.data_bytes) || in.remaining() < end || t.data_bytes > in.remaining() - end) {
          return false;
        }
        t.has_data = true;
        t.data_offset = (used + WireTensorData::kAlign - 1) / WireTensorData::kAlign * WireTensorData::kAlign;
        // Cannot happen (block_bytes has room for every byte at every alignment); never write past it.
        if (t.data_offset + t.data_bytes > block->bytes()) return false;
        if (!in.Gather(block->data() + t.data_offset, t.data_bytes, &pieces)) return false;
        used = t.data_offset + t.data_bytes;
        continue;
      }
      const bool known = (number == kTensorDTypeField && type == WireFormatLite::WIRETYPE_VARINT) ||
                         (number == kTensorShapeField && (type == WireFormatLite::WIRETYPE_VARINT || length_delimited)) ||
                         (number == kTensorSharedMemoryField && length_delimited);
      if (!known || (number == kTensorSharedMemoryField && t.has_data)) return false;
      t.has_shared_memory = t.has_shared_memory || number == kTensorSharedMemoryField;
      AppendVarint(&t.body, key);
      if (number == kTensorDTypeField) {
        uint64_t v = 0;
        if (!in.ReadVarint(&v, &t.body)) return false;
        t.dtype = static_cast<int32_t>(v);  // protobuf's enum conversion; the last one wins
      } else if (!CopyValue(in, type, &t.body)) {
        return false;
      }
      if (in.remaining() < end) return false;  // a field ran past the tensor's end
    }
    return true;
  };
  bool readable = true;
  while (readable && in.remaining() > 0) {
    uint64_t key = 0;
    readable = in.ReadKey(&key) && (key >> 3) != 0;
    if (!readable) break;
    const int number = static_cast<int>(key >> 3), type = static_cast<int>(key & 7);
    if (number < 64 && (tensor_fields >> number & 1) != 0) {
      uint64_t length = 0;
      readable = type == WireFormatLite::WIRETYPE_LENGTH_DELIMITED && in.ReadLength(&length) &&
                 read_tensor(number, length);
      continue;
    }
    AppendVarint(&skeleton, key);
    readable = CopyValue(in, type, &skeleton);
  }
  // The tensors after the other fields (fields of different numbers: their order does not matter),
  // each as one occurrence holding everything but its data.
  for (const TensorState& t : tensors) {
    // Data without a dtype: the tensor is reported as missing or mistyped from the message as
    // protobuf parses it (codec/request_codec.cc), with its data there.
    if (t.has_data && t.dtype == 0) readable = false;
    AppendVarint(&skeleton, LengthDelimitedKey(t.field));
    AppendVarint(&skeleton, t.body.size());
    skeleton += t.body;
  }
  // Anything the reader left to protobuf: the whole request, from gRPC's slices (still intact).
  if (!readable || !request->ParseFromString(skeleton)) {
    request->Clear();
    return ParseWireRequest(wire, request);
  }
  wire->Clear();
  copier->CopyPieces(pieces, ParallelCopy::Destination::kPinnedStaging);  // a pinned block
  data->block_ = std::move(*block);
  data->used_ = used;
  const google::protobuf::Reflection* reflection = request->GetReflection();
  for (const TensorState& t : tensors) {
    if (!t.has_data) continue;
    auto* tensor = static_cast<v1::Tensor*>(
        reflection->MutableMessage(request, request->GetDescriptor()->FindFieldByNumber(t.field)));
    data->tensors_.emplace_back(tensor, std::string_view(data->block_.data() + t.data_offset, t.data_bytes));
  }
  return absl::OkStatus();
}

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
  for (const OutputBuffers::Buffer& b : outputs.buffers()) bytes += wire::TensorPatchBytes(b.field, b.bytes);
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
    wire::AppendTensorPatchHeader(&pending, b.field, b.bytes);
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
