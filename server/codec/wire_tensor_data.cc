#include "codec/wire_tensor_data.h"

namespace fusedlayer::server {

const std::string_view* WireTensorData::Find(const v1::Tensor& t) const {
  for (const auto& [tensor, bytes] : tensors_) {
    if (tensor == &t) return &bytes;
  }
  return nullptr;
}

void WireTensorData::MoveIntoMessages() {
  for (const auto& [tensor, bytes] : tensors_) tensor->set_data(bytes.data(), bytes.size());
  tensors_.clear();
  block_.Release();
  used_ = 0;
}

}  // namespace fusedlayer::server
