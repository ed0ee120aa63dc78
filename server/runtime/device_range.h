// Backend (device) memory that a call's views may point into and that outlives the call: a
// residual session's state the server keeps between calls (transport/residual_sessions.h), or the
// client's own device buffers a request references in CUDA shared memory (transport/
// cuda_shared_memory.h). Views inside it are handed to the kernels as they are, never staged or
// copied (runtime/device_staging.h).
#pragma once

#include <array>
#include <cstddef>

namespace fusedlayer::server {

struct DeviceRange {
  const char* begin = nullptr;
  const char* end = nullptr;
  // True when [p, p + n) lies inside.
  bool Contains(const void* p, size_t n) const {
    const char* c = static_cast<const char*>(p);
    return begin != nullptr && c >= begin && c <= end && n <= static_cast<size_t>(end - c);
  }
};

// The device ranges of one call: a session's block, or each CUDA shared-memory region the request
// references (at most one per input and output tensor).
class DeviceRanges {
 public:
  static constexpr size_t kMax = 16;
  DeviceRanges() = default;
  DeviceRanges(DeviceRange r) { Add(r); }  // NOLINT: a session's one block
  // False (nothing added) when full.
  bool Add(DeviceRange r) {
    if (n_ == kMax) return false;
    ranges_[n_++] = r;
    return true;
  }
  bool empty() const { return n_ == 0; }
  // True when [p, p + n) lies inside one of the ranges.
  bool Contains(const void* p, size_t n) const {
    for (size_t i = 0; i < n_; ++i) {
      if (ranges_[i].Contains(p, n)) return true;
    }
    return false;
  }

 private:
  std::array<DeviceRange, kMax> ranges_{};
  size_t n_ = 0;
};

}  // namespace fusedlayer::server
