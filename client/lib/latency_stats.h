// Latency percentiles for `fusedctl bench`.
//
// Nearest-rank definition (no interpolation): the p-th percentile of n sorted samples is the
// sample at rank ceil(p/100 * n) (1-based), so every reported value is a latency that was actually
// observed, p100 is the maximum and p0 the minimum.
#pragma once

#include <cstdint>
#include <vector>

namespace fusedlayer::client {

// `sorted` must be ascending and non-empty; p in [0, 100].
double NearestRankPercentile(const std::vector<double>& sorted, double p);

struct LatencySummary {
  int64_t count = 0;
  double mean = 0, p50 = 0, p90 = 0, p99 = 0, max = 0, min = 0;  // seconds; all 0 when count == 0
};

// Sorts a copy of the samples.
LatencySummary SummarizeLatencies(std::vector<double> seconds);

}  // namespace fusedlayer::client
