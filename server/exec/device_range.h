// A range of backend (device) memory that a call's views may point into and that the server keeps
// on the device between calls (a residual session's state, transport/residual_sessions.h): views
// inside it are handed to the kernels as they are, never staged or copied (exec/device_staging.h).
#pragma once

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

}  // namespace fusedlayer::server
