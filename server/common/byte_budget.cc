#include "common/byte_budget.h"

#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <string>

namespace fusedlayer::server {
namespace {

// The number in a cgroup limit file, or 0 for "max", a missing file or anything unparsable.
uint64_t ReadCgroupLimit(const char* path) {
  std::ifstream in(path);
  std::string text;
  if (!(in >> text) || text.empty() || text == "max") return 0;
  uint64_t value = 0;
  for (char ch : text) {
    if (ch < '0' || ch > '9') return 0;
    if (__builtin_mul_overflow(value, uint64_t{10}, &value) ||
        __builtin_add_overflow(value, static_cast<uint64_t>(ch - '0'), &value)) {
      return 0;
    }
  }
  return value;
}

}  // namespace

uint64_t AvailableMemoryBytes() {
  const long pages = sysconf(_SC_PHYS_PAGES);
  const long page_size = sysconf(_SC_PAGESIZE);
  uint64_t bytes = pages > 0 && page_size > 0 ? static_cast<uint64_t>(pages) * static_cast<uint64_t>(page_size) : 0;
  for (const char* path : {"/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"}) {
    const uint64_t limit = ReadCgroupLimit(path);
    // cgroup v1 reports "no limit" as a huge page-rounded number: the min with physical memory drops it.
    if (limit > 0) bytes = bytes == 0 ? limit : std::min(bytes, limit);
  }
  return bytes;
}

}  // namespace fusedlayer::server
