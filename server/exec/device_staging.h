// Moves one call's tensors between the request/response bytes (host) and the backend's memory.
// On a host-accessible backend (CPU) the host views are handed to the kernels as they are: no
// copies. Otherwise each input is allocated on the device and copied in, each output allocated,
// and CopyOutputsBack() copies the results into the response bytes after the run. Runs on the
// executor thread (it drives the backend).
#pragma once

#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "fusedlayer/backend.h"

namespace fusedlayer::server {

class DeviceStaging {
 public:
  explicit DeviceStaging(Backend& backend) : backend_(backend), direct_(backend.host_accessible()) {}

  // The view to give the backend for a host input / output view. Empty views (absent optional
  // tensors) pass through. ResourceExhausted when the device is out of memory.
  absl::StatusOr<TensorView> Input(const TensorView& host);
  absl::StatusOr<TensorView> Output(const TensorView& host);
  absl::Status CopyOutputsBack();

 private:
  absl::StatusOr<TensorView> Mirror(const TensorView& host, bool copy_in);

  Backend& backend_;
  const bool direct_;
  std::vector<DeviceBuffer> buffers_;
  std::vector<std::pair<TensorView, TensorView>> outputs_;  // (host, device)
};

// Bytes spanned by a view: from its first element to one past its last (strided rows included).
size_t ViewExtentBytes(const TensorView& v);

}  // namespace fusedlayer::server
