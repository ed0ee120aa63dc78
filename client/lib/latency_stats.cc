#include "client/lib/latency_stats.h"

#include <algorithm>
#include <cmath>
#include <numeric>

namespace fusedlayer::client {

double NearestRankPercentile(const std::vector<double>& sorted, double p) {
  if (sorted.empty()) return 0.0;
  p = std::clamp(p, 0.0, 100.0);
  const size_t n = sorted.size();
  // Rank in 1..n; computed in long double so that e.g. 0.99 * 100 does not land just above an
  // integer and skip a sample.
  long double exact = (long double)(p) / 100.0L * (long double)(n);
  size_t rank = size_t(std::ceil(exact - 1e-9L));
  rank = std::clamp<size_t>(rank, 1, n);
  return sorted[rank - 1];
}

LatencySummary SummarizeLatencies(std::vector<double> seconds) {
  LatencySummary s;
  if (seconds.empty()) return s;
  std::sort(seconds.begin(), seconds.end());
  s.count = int64_t(seconds.size());
  s.mean = std::accumulate(seconds.begin(), seconds.end(), 0.0) / double(seconds.size());
  s.min = seconds.front();
  s.max = seconds.back();
  s.p50 = NearestRankPercentile(seconds, 50);
  s.p90 = NearestRankPercentile(seconds, 90);
  s.p99 = NearestRankPercentile(seconds, 99);
  return s;
}

}  // namespace fusedlayer::client
