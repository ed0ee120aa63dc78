#include "common/byte_budget.h"

#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/str_split.h"

namespace fusedlayer::server {
namespace {

// The number in a cgroup limit file, or 0 for "max", a missing file or anything unparsable.
uint64_t ReadCgroupLimit(const std::string& path) {
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

MemoryLimit CgroupMemoryLimit(const std::string& cgroup_root, const std::string& proc_self_cgroup) {
  MemoryLimit found;
  auto consider = [&found](const std::string& path) {
    const uint64_t limit = ReadCgroupLimit(path);
    if (limit > 0 && (found.bytes == 0 || limit < found.bytes)) found = {limit, path};
  };
  // Each line is hierarchy-id:controllers:path; "0::path" is the v2 (unified) hierarchy. A limit
  // set on any ancestor applies too, so every level from the process's cgroup up to the mount's
  // root counts, and the smallest wins. Reading only the mount's root saw a container's own limit
  // (a cgroup namespace makes the container's cgroup the root) but no limit at all for a process
  // in a systemd slice or a v1 hierarchy without a namespace.
  std::ifstream in(proc_self_cgroup);
  std::string line;
  while (std::getline(in, line)) {
    const size_t first = line.find(':');
    const size_t second = first == std::string::npos ? std::string::npos : line.find(':', first + 1);
    if (second == std::string::npos) continue;
    const std::string id = line.substr(0, first);
    const std::string controllers = line.substr(first + 1, second - first - 1);
    const std::string path = line.substr(second + 1);
    std::vector<std::string> mounts;
    std::string file;
    if (id == "0" && controllers.empty()) {
      mounts = {cgroup_root};
      file = "memory.max";
    } else {
      bool memory = false;
      for (absl::string_view c : absl::StrSplit(controllers, ',')) memory = memory || c == "memory";
      if (!memory) continue;
      // v1 mounts a hierarchy at its controllers' names; memory is usually alone.
      mounts = {cgroup_root + "/memory"};
      if (controllers != "memory") mounts.push_back(cgroup_root + "/" + controllers);
      file = "memory.limit_in_bytes";
    }
    // The path must stay under the mount: no "..", ".", or empty components.
    if (path.empty() || path[0] != '/') continue;
    bool safe = true;
    for (absl::string_view part : absl::StrSplit(path.substr(1), '/', absl::SkipEmpty())) {
      safe = safe && part != ".." && part != ".";
    }
    if (!safe) continue;
    for (const std::string& mount : mounts) {
      // A path that does not exist under the mount (v1 without a cgroup namespace: the mount is
      // the container's own cgroup) has no files; its ancestors, the mount's root last, still count.
      std::string dir = path;
      while (!dir.empty() && dir.back() == '/') dir.pop_back();
      while (true) {
        consider(mount + dir + "/" + file);
        if (dir.empty()) break;
        dir.resize(dir.rfind('/'));
      }
    }
  }
  return found;
}

MemoryLimit AvailableMemory() {
  const long pages = sysconf(_SC_PHYS_PAGES);
  const long page_size = sysconf(_SC_PAGESIZE);
  MemoryLimit available;
  if (pages > 0 && page_size > 0) {
    available = {static_cast<uint64_t>(pages) * static_cast<uint64_t>(page_size), "physical memory"};
  }
  // cgroup v1 reports "no limit" as a huge page-rounded number: the min with physical memory drops it.
  const MemoryLimit cgroup = CgroupMemoryLimit("/sys/fs/cgroup", "/proc/self/cgroup");
  if (cgroup.bytes > 0 && (available.bytes == 0 || cgroup.bytes < available.bytes)) available = cgroup;
  return available;
}

uint64_t AvailableMemoryBytes() { return AvailableMemory().bytes; }

}  // namespace fusedlayer::server
