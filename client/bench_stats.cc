#include "client/bench_stats.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "client/cli_options.h"
#include "client/latency_stats.h"

namespace fusedlayer::client {

void BenchStats::Add(const CallOutcome& o) {
  if (!o.status.ok()) {
    const absl::StatusCode code = o.status.code();
    if (errors_[code]++ == 0) first_error_[code] = OneLine(o.status.message());
    return;
  }
  latencies_.push_back(o.round_trip_seconds);
  kernel_.push_back(o.report.kernel_seconds());
  server_.push_back(o.report.server_seconds());
  queue_.push_back(o.report.queue_seconds());
  if (o.report.path() == v1::EXECUTION_PATH_FUSED) {
    ++fused_;
  } else {
    ++fallbacks_[ReasonName(o.report.fallback_reason())];
  }
}

void BenchStats::Merge(const BenchStats& other) {
  latencies_.insert(latencies_.end(), other.latencies_.begin(), other.latencies_.end());
  kernel_.insert(kernel_.end(), other.kernel_.begin(), other.kernel_.end());
  server_.insert(server_.end(), other.server_.begin(), other.server_.end());
  queue_.insert(queue_.end(), other.queue_.begin(), other.queue_.end());
  fused_ += other.fused_;
  for (const auto& [k, v] : other.fallbacks_) fallbacks_[k] += v;
  for (const auto& [k, v] : other.errors_) errors_[k] += v;
  for (const auto& [k, v] : other.first_error_) first_error_.emplace(k, v);  // keeps ours if present
}

int64_t BenchStats::failed() const {
  int64_t n = 0;
  for (const auto& [_, v] : errors_) n += v;
  return n;
}

std::map<std::string, int64_t> BenchStats::errors() const {
  std::map<std::string, int64_t> out;
  for (const auto& [code, n] : errors_) out[absl::StatusCodeToString(code)] = n;
  return out;
}

absl::StatusCode BenchStats::MostFrequentError() const {
  absl::StatusCode best = absl::StatusCode::kOk;
  int64_t best_n = 0;
  for (const auto& [code, n] : errors_) {
    if (n > best_n) {
      best = code;
      best_n = n;
    }
  }
  return best;
}

double BenchStats::FusedHitRate() const { return ok() == 0 ? 0.0 : double(fused_) / double(ok()); }

std::string BenchStats::Format(const RunInfo& info) const {
  const double t = info.elapsed_seconds > 0 ? info.elapsed_seconds : 1e-9;
  const double rps = double(ok()) / t;
  std::string s;
  absl::StrAppend(&s, absl::StrFormat("requests     %d ok, %d failed in %.3f s\n", ok(), failed(), info.elapsed_seconds));
  absl::StrAppend(&s, absl::StrFormat("throughput   %.1f req/s, %.1f tokens/s, %s/s sent, %s/s received\n", rps,
                                      rps * double(info.tokens_per_request), FormatBytes(rps * double(info.request_bytes)),
                                      FormatBytes(rps * double(info.response_bytes))));
  const LatencySummary l = SummarizeLatencies(latencies_);
  if (l.count > 0) {
    absl::StrAppend(&s, "latency      p50 ", FormatSeconds(l.p50), "  p90 ", FormatSeconds(l.p90), "  p99 ",
                    FormatSeconds(l.p99), "  max ", FormatSeconds(l.max), "  mean ", FormatSeconds(l.mean),
                    "  (round trip, OK calls)\n");
    const LatencySummary k = SummarizeLatencies(kernel_), sv = SummarizeLatencies(server_),
                         q = SummarizeLatencies(queue_);
    absl::StrAppend(&s, "server side  kernel p50 ", FormatSeconds(k.p50), " p99 ", FormatSeconds(k.p99),
                    "; server p50 ", FormatSeconds(sv.p50), " p99 ", FormatSeconds(sv.p99), "; queue p50 ",
                    FormatSeconds(q.p50), " p99 ", FormatSeconds(q.p99), "\n");
  }
  absl::StrAppend(&s, absl::StrFormat("fused hit    %.2f%% (%d of %d OK responses)\n", 100.0 * FusedHitRate(), fused_, ok()));
  if (fallbacks_.empty()) {
    absl::StrAppend(&s, "fallbacks    none\n");
  } else {
    for (const auto& [reason, n] : fallbacks_) absl::StrAppend(&s, absl::StrFormat("fallback     %s: %d\n", reason, n));
  }
  if (errors_.empty()) {
    absl::StrAppend(&s, "errors       none\n");
  } else {
    for (const auto& [code, n] : errors_) {
      absl::StrAppend(&s, absl::StrFormat("error        %s: %d (first: %s)\n", absl::StatusCodeToString(code), n,
                                          first_error_.at(code)));
    }
  }
  return s;
}

}  // namespace fusedlayer::client
