#include "metrics/shadow_metrics.h"

#include <string>

#include "prometheus/family.h"

namespace fusedlayer::server::shadow {
namespace {

using prometheus::Histogram;

// |fused - unfused|: exactly 0 (the common case for bitwise outputs) gets its own bucket, then
// decades from 1e-9 (far below any fp32 mix difference that matters) to 1e3.
Histogram::BucketBoundaries AbsDiffBuckets() {
  Histogram::BucketBoundaries b = {0};
  for (double v = 1e-9; v < 2e3; v *= 10) b.push_back(v);
  return b;
}
// Ulp (fp8: code step) distance: 0, 1, 2, 4, ... 2^24 (fp32 scales one binade apart are 2^23 ulp).
Histogram::BucketBoundaries UlpBuckets() {
  Histogram::BucketBoundaries b = {0};
  for (double v = 1; v <= double(1 << 24); v *= 2) b.push_back(v);
  return b;
}

}  // namespace

const char* DumpResultName(DumpResult r) {
  switch (r) {
    case DumpResult::kWritten: return "written";
    case DumpResult::kLimitReached: return "limit_reached";
    case DumpResult::kError: return "error";
  }
  return "unknown";
}

ShadowMetrics::ShadowMetrics(prometheus::Registry& reg, const std::vector<std::string>& devices) {
  auto& comparisons = prometheus::BuildCounter()
                          .Name("fusedlayer_shadow_comparisons_total")
                          .Help("Fused runs compared against an unfused run of the same inputs (sampled or verify)")
                          .Register(reg);
  auto& mismatches = prometheus::BuildCounter()
                         .Name("fusedlayer_shadow_mismatches_total")
                         .Help("Shadow comparisons in which this output was outside the fused-vs-unfused tolerance")
                         .Register(reg);
  auto& abs_diff = prometheus::BuildHistogram()
                       .Name("fusedlayer_shadow_max_abs_diff")
                       .Help("Largest |fused - unfused| of an output per comparison")
                       .Register(reg);
  auto& ulp = prometheus::BuildHistogram()
                  .Name("fusedlayer_shadow_ulp_distance")
                  .Help("Largest ulp (fp8: code step) distance of an output per comparison")
                  .Register(reg);
  auto& dropped = prometheus::BuildCounter()
                      .Name("fusedlayer_shadow_dropped_total")
                      .Help("Sampled requests not shadow-verified because the shadow queue was full")
                      .Register(reg);
  auto& errors = prometheus::BuildCounter()
                     .Name("fusedlayer_shadow_errors_total")
                     .Help("Shadow jobs whose unfused run failed (no comparison was made)")
                     .Register(reg);
  auto& dumps = prometheus::BuildCounter()
                    .Name("fusedlayer_shadow_dumps_total")
                    .Help("Mismatch dumps (--shadow_dump_dir), by result")
                    .Register(reg);
  queued_jobs_ = &prometheus::BuildGauge()
                      .Name("fusedlayer_shadow_queued_jobs")
                      .Help("Shadow jobs waiting or running (bounded by --shadow_queue_size)")
                      .Register(reg)
                      .Add({});
  queued_bytes_ = &prometheus::BuildGauge()
                       .Name("fusedlayer_shadow_queued_bytes")
                       .Help("Host bytes held by shadow jobs (bounded by --shadow_queue_max_bytes)")
                       .Register(reg)
                       .Add({});
  for (Op op : kAllOps) {
    const int o = static_cast<int>(op);
    const std::string name = OpName(op);
    dropped_[o] = &dropped.Add({{"op", name}});
    for (int r = 0; r < kNumDumpResults; ++r) {
      dumps_[o][r] = &dumps.Add({{"op", name}, {"result", DumpResultName(static_cast<DumpResult>(r))}});
    }
  }
  for (const std::string& device : devices) {
    DeviceSeries& d = devices_.emplace_back();
    for (Op op : kAllOps) {
      const int o = static_cast<int>(op);
      const std::string name = OpName(op);
      d.comparisons[o] = &comparisons.Add({{"op", name}, {"device", device}});
      d.errors[o] = &errors.Add({{"op", name}, {"device", device}});
      int i = 0;
      auto add = [&](std::string_view output) {
        const std::string out(output);
        d.mismatches[o][i] = &mismatches.Add({{"op", name}, {"output", out}, {"device", device}});
        d.max_abs_diff[o][i] = &abs_diff.Add({{"op", name}, {"output", out}, {"device", device}}, AbsDiffBuckets());
        d.ulp_distance[o][i] = &ulp.Add({{"op", name}, {"output", out}, {"device", device}}, UlpBuckets());
        ++i;
      };
      if (op == Op::kMhc) {
        for (std::string_view out : kMhcOutputs) add(out);
      } else {
        for (std::string_view out : kSwaOutputs) add(out);
      }
    }
  }
}

int ShadowMetrics::OutputIndex(Op op, std::string_view output) {
  int i = 0;
  if (op == Op::kMhc) {
    for (std::string_view o : kMhcOutputs) {
      if (o == output) return i;
      ++i;
    }
  } else {
    for (std::string_view o : kSwaOutputs) {
      if (o == output) return i;
      ++i;
    }
  }
  return -1;
}

void ShadowMetrics::RecordComparison(size_t device, Op op, std::span<const ComparedOutput> outputs) {
  const int o = static_cast<int>(op);
  DeviceSeries& d = devices_[device];
  for (const ComparedOutput& c : outputs) {
    const int i = OutputIndex(op, c.output);
    if (i < 0) continue;
    if (c.mismatch) d.mismatches[o][i]->Increment();
    d.max_abs_diff[o][i]->Observe(c.max_abs_diff);
    d.ulp_distance[o][i]->Observe(static_cast<double>(c.max_ulp_distance));
  }
  // Last: a scrape that sees N comparisons also sees their mismatches and observations.
  d.comparisons[o]->Increment();
}

}  // namespace fusedlayer::server::shadow
