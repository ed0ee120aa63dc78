#include "common/descriptors.h"

#include <sys/resource.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/log.h"

namespace fusedlayer::server {
namespace {

// An unlimited soft limit is not a number of descriptors anyone can hold: counted as the kernel's
// usual nr_open.
constexpr int64_t kUnlimited = int64_t{1} << 20;

int64_t AsCount(rlim_t limit) {
  return limit == RLIM_INFINITY ? kUnlimited : static_cast<int64_t>(std::min<rlim_t>(limit, kUnlimited));
}

}  // namespace

std::string DescriptorBudget::Describe() const {
  return absl::StrCat("RLIMIT_NOFILE soft limit ", soft_limit, " less --descriptor_reserve=", reserve);
}

void RaiseDescriptorLimit() {
  struct rlimit limit;
  if (::getrlimit(RLIMIT_NOFILE, &limit) != 0) {
    LogWarning("getrlimit(RLIMIT_NOFILE): ", std::strerror(errno));
    return;
  }
  if (limit.rlim_cur == limit.rlim_max) return;
  const rlim_t before = limit.rlim_cur;
  limit.rlim_cur = limit.rlim_max;
  if (::setrlimit(RLIMIT_NOFILE, &limit) != 0) {
    LogWarning("cannot raise RLIMIT_NOFILE's soft limit from ", AsCount(before), " to ", AsCount(limit.rlim_max),
               ": ", std::strerror(errno));
    return;
  }
  LogInfo("descriptors: RLIMIT_NOFILE soft limit raised from ", AsCount(before), " to its hard limit ",
          AsCount(limit.rlim_max));
}

DescriptorBudget DescriptorBudgetFor(int64_t reserve) {
  DescriptorBudget budget;
  budget.reserve = reserve;
  struct rlimit limit;
  budget.soft_limit = ::getrlimit(RLIMIT_NOFILE, &limit) == 0 ? AsCount(limit.rlim_cur) : kUnlimited;
  budget.regions = std::max<int64_t>(0, budget.soft_limit - reserve);
  return budget;
}

}  // namespace fusedlayer::server
