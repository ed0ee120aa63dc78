#include "exec/device_staging.h"

namespace fusedlayer::server {

size_t ViewExtentBytes(const TensorView& v) {
  if (v.rank == 0 || v.numel() == 0) return 0;
  int64_t last = 0;
  for (int k = 0; k < v.rank; ++k) last += (v.shape[k] - 1) * v.stride[k];
  return static_cast<size_t>(last + 1) * DTypeSize(v.dtype);
}

absl::StatusOr<TensorView> DeviceStaging::Mirror(const TensorView& host, bool copy_in) {
  if (direct_ || host.empty_view()) return host;
  const size_t bytes = ViewExtentBytes(host);
  absl::StatusOr<DeviceBuffer> buf = backend_.Allocate(bytes);
  if (!buf.ok()) return buf.status();
  TensorView dev = host;
  dev.data = buf->data();
  if (copy_in && bytes > 0) {
    if (absl::Status s = backend_.CopyToDevice(dev.data, host.data, bytes); !s.ok()) return s;
  }
  buffers_.push_back(std::move(*buf));
  return dev;
}

absl::StatusOr<TensorView> DeviceStaging::Input(const TensorView& host) { return Mirror(host, /*copy_in=*/true); }

absl::StatusOr<TensorView> DeviceStaging::Output(const TensorView& host) {
  absl::StatusOr<TensorView> dev = Mirror(host, /*copy_in=*/false);
  if (dev.ok() && !direct_ && !host.empty_view()) outputs_.emplace_back(host, *dev);
  return dev;
}

absl::Status DeviceStaging::CopyOutputsBack() {
  for (const auto& [host, dev] : outputs_) {
    const size_t bytes = ViewExtentBytes(host);
    if (bytes == 0) continue;
    if (absl::Status s = backend_.CopyToHost(host.data, dev.data, bytes); !s.ok()) return s;
  }
  return absl::OkStatus();
}

}  // namespace fusedlayer::server
