#include "client/lib/wire_request.h"

#include <string>
#include <utility>
#include <vector>

#include "fusedlayer/v1/fusedlayer.pb.h"
#include "fusedlayer/wire/tensor_patch.h"
#include "google/protobuf/field_mask.pb.h"
#include "google/protobuf/util/field_mask_util.h"
#include "grpcpp/support/slice.h"

namespace fusedlayer::client {
namespace {

using google::protobuf::FieldDescriptor;
using google::protobuf::util::FieldMaskUtil;

constexpr size_t kCopyBelowBytes = 4096;

bool IsTensorField(const FieldDescriptor* f) {
  return !f->is_repeated() && f->message_type() == v1::Tensor::descriptor();
}

}  // namespace

grpc::ByteBuffer EncodeRequestByReference(std::shared_ptr<const google::protobuf::Message> request) {
  const google::protobuf::Reflection* reflection = request->GetReflection();
  std::vector<const FieldDescriptor*> fields;
  reflection->ListFields(*request, &fields);
  // The message without its tensors' data: every field but those, and of each tensor its dtype,
  // shape and shared-memory reference.
  google::protobuf::FieldMask mask;
  std::vector<std::pair<int, const std::string*>> patches;  // (field number, data)
  for (const FieldDescriptor* f : fields) {
    if (!IsTensorField(f)) {
      mask.add_paths(f->name());
      continue;
    }
    const auto& t = static_cast<const v1::Tensor&>(reflection->GetMessage(*request, f));
    for (const char* part : {"dtype", "shape", "shared_memory"}) mask.add_paths(f->name() + "." + part);
    if (t.has_data()) patches.emplace_back(f->number(), &t.data());
  }
  std::unique_ptr<google::protobuf::Message> skeleton(request->New());
  FieldMaskUtil::MergeMessageTo(*request, mask, FieldMaskUtil::MergeOptions(), skeleton.get());

  std::vector<grpc::Slice> slices;
  grpc::Slice head(skeleton->ByteSizeLong());
  skeleton->SerializeWithCachedSizesToArray(const_cast<uint8_t*>(head.begin()));
  slices.push_back(std::move(head));
  std::string pending;  // headers and small tensors, copied
  auto flush = [&] {
    if (pending.empty()) return;
    slices.emplace_back(pending.data(), pending.size());
    pending.clear();
  };
  for (const auto& [field, data] : patches) {
    wire::AppendTensorPatchHeader(&pending, field, data->size());
    if (data->size() < kCopyBelowBytes) {
      pending += *data;
      continue;
    }
    flush();
    // Each slice holds a reference to the request until gRPC unrefs it.
    auto* owner = new std::shared_ptr<const google::protobuf::Message>(request);
    slices.emplace_back(const_cast<char*>(data->data()), data->size(),
                        [](void* p) { delete static_cast<std::shared_ptr<const google::protobuf::Message>*>(p); },
                        owner);
  }
  flush();
  return grpc::ByteBuffer(slices.data(), slices.size());
}

}  // namespace fusedlayer::client
