// Prometheus series of shadow verification (README "Shadow verification", docs/shadow.md), on the
// service's registry. Every op x output series (and every op series) is pre-created at 0, as the
// service's other metrics are, so rate() and increase() see the first mismatch and dashboards show
// 0 instead of "no data" while sampling is off.
#pragma once

#include <array>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "config.h"
#include "prometheus/counter.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"

namespace fusedlayer::server::shadow {

// The outputs of each op, as the "output" label.
inline constexpr std::string_view kMhcOutputs[] = {"new_residual", "new_pre_mix", "new_post_mix",
                                                    "new_comb_mix", "y",           "aux"};
inline constexpr std::string_view kSwaOutputs[] = {"q_fp8", "q_scale", "kv", "q_proj"};
inline constexpr int kMaxOutputs = 6;

// Where a dump attempt ended, as the "result" label of fusedlayer_shadow_dumps_total.
enum class DumpResult : uint8_t { kWritten = 0, kLimitReached = 1, kError = 2 };
inline constexpr int kNumDumpResults = 3;
const char* DumpResultName(DumpResult r);  // "written", "limit_reached", "error"

// One output's comparison as the metrics count it (shadow/compare.h judges it).
struct ComparedOutput {
  std::string_view output;  // the response field, as the "output" label
  bool mismatch = false;
  double max_abs_diff = 0;
  int64_t max_ulp_distance = 0;
};

class ShadowMetrics {
 public:
  // `devices`: the serving devices' labels, by ordinal: the comparison and error series carry the
  // `device` the compared call ran on (a GPU that computes wrong shows as that device's mismatches).
  ShadowMetrics(prometheus::Registry& registry, const std::vector<std::string>& devices);

  // One comparison (sampled or verify) of a call that ran on `device` (its ordinal):
  // comparisons_total, and per output the two histograms and, on a mismatch, mismatches_total.
  void RecordComparison(size_t device, Op op, std::span<const ComparedOutput> outputs);
  void RecordDropped(Op op) { dropped_[static_cast<int>(op)]->Increment(); }
  void RecordError(size_t device, Op op) { devices_[device].errors[static_cast<int>(op)]->Increment(); }
  void RecordDump(Op op, DumpResult r) { dumps_[static_cast<int>(op)][static_cast<int>(r)]->Increment(); }
  void SetQueued(size_t jobs, uint64_t bytes) {
    queued_jobs_->Set(static_cast<double>(jobs));
    queued_bytes_->Set(static_cast<double>(bytes));
  }

 private:
  // Index of `output` in the op's list, -1 when unknown.
  static int OutputIndex(Op op, std::string_view output);

  // The series of the calls one device ran, [op] and [op][output].
  struct DeviceSeries {
    std::array<prometheus::Counter*, 2> comparisons{};
    std::array<prometheus::Counter*, 2> errors{};
    std::array<std::array<prometheus::Counter*, kMaxOutputs>, 2> mismatches{};
    std::array<std::array<prometheus::Histogram*, kMaxOutputs>, 2> max_abs_diff{};
    std::array<std::array<prometheus::Histogram*, kMaxOutputs>, 2> ulp_distance{};
  };
  std::vector<DeviceSeries> devices_;  // by device ordinal
  std::array<prometheus::Counter*, 2> dropped_{};
  std::array<std::array<prometheus::Counter*, kNumDumpResults>, 2> dumps_{};
  prometheus::Gauge* queued_jobs_;
  prometheus::Gauge* queued_bytes_;
};

}  // namespace fusedlayer::server::shadow
