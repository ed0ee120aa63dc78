// What ReadWireRequest (server/rpc/wire_messages.h) must have done with the tensors it moved out of
// a request it read: shared by the reader's unit tests (pipeline_test.cc) and its fuzz target
// (tests/fuzz/fuzz_wire_reader.cc).
#pragma once

#include <string>

#include "absl/strings/str_cat.h"
#include "fusedlayer/v1/fusedlayer.pb.h"
#include "google/protobuf/descriptor.h"
#include "rpc/wire_messages.h"

namespace fusedlayer::testing {

// Empty when every tensor `data` holds is one of `got`'s singular Tensor fields, with a dtype and
// no data left in the message, and its bytes inside the block on a WireTensorData::kAlign
// boundary; else what is wrong.
template <typename Request>
std::string MovedTensorsProblem(const Request& got, const server::WireTensorData& data) {
  const google::protobuf::Descriptor* type = Request::descriptor();
  size_t found = 0;
  for (int i = 0; i < type->field_count(); ++i) {
    const google::protobuf::FieldDescriptor* field = type->field(i);
    if (field->is_repeated() || field->message_type() != v1::Tensor::descriptor()) continue;
    const auto& t = static_cast<const v1::Tensor&>(got.GetReflection()->GetMessage(got, field));
    const std::string_view* moved = data.Find(t);
    if (moved == nullptr) continue;
    ++found;
    const std::string name(field->name());
    if (t.dtype() == 0) return name + ": moved without a dtype";
    if (!t.data().empty()) return name + ": its data is also in the message";
    if (moved->data() < data.begin() || moved->data() + moved->size() > data.end()) return name + ": outside the block";
    if ((moved->data() - data.begin()) % server::WireTensorData::kAlign != 0) return name + ": off its alignment";
  }
  if (found != data.tensors()) {
    return absl::StrCat(data.tensors(), " tensors moved, ", found, " of them the request's tensor fields");
  }
  return "";
}

}  // namespace fusedlayer::testing
