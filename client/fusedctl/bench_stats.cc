#include "client/fusedctl/bench_stats.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "client/fusedctl/cli_options.h"
#include "client/lib/latency_stats.h"

namespace fusedlayer::client {

void BenchStats::Add(const CallOutcome& o) {
  if (!o.status.ok()) {
    const absl::StatusCode code = o.status.code();
    if (errors_[code]++ == 0) first_error_[code] = OneLine(o.status.message());
    return;
  }
  latencies_.push_back(o.round_trip_seconds);
  if (o.completed_by_device) {
    ++completed_by_device_;  // its server time ends at the launch: not mixed with the others'
    to_launch_.push_back(o.report.server_seconds());
  } else {
    kernel_.push_back(o.report.kernel_seconds());
    server_.push_back(o.report.server_seconds());
  }
  queue_.push_back(o.report.queue_seconds());
  if (o.report.has_stages() && !o.completed_by_device) {
    const v1::StageSeconds& st = o.report.stages();
    decode_.push_back(st.decode());
    copy_in_.push_back(st.copy_in());
    device_.push_back(st.device());
    copy_out_.push_back(st.copy_out());
    response_.push_back(st.response());
  }
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
  for (auto [mine, theirs] : {std::pair{&decode_, &other.decode_}, {&copy_in_, &other.copy_in_},
                              {&device_, &other.device_}, {&copy_out_, &other.copy_out_},
                              {&response_, &other.response_}}) {
    mine->insert(mine->end(), theirs->begin(), theirs->end());
  }
  fused_ += other.fused_;
  completed_by_device_ += other.completed_by_device_;
  to_launch_.insert(to_launch_.end(), other.to_launch_.begin(), other.to_launch_.end());
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

namespace {

// "123 B" when every call had the same size (the expected case), "120..123 B" otherwise.
std::string ByteRange(uint64_t lo, uint64_t hi) {
  return lo == hi ? absl::StrCat(lo, " B") : absl::StrCat(lo, "..", hi, " B");
}

std::string Ratio(double num, double den) { return den > 0 ? absl::StrFormat("%.2fx", num / den) : "n/a"; }

// "1 connection", "4 connections"
std::string Connections(int n) { return absl::StrCat(n, n == 1 ? " connection" : " connections"); }

}  // namespace

std::string BenchStats::Format(const RunInfo& info) const {
  const double t = info.elapsed_seconds > 0 ? info.elapsed_seconds : 1e-9;
  const double rps = double(ok()) / t;
  std::string s;
  absl::StrAppend(&s, absl::StrFormat("requests     %d ok, %d failed in %.3f s\n", ok(), failed(), info.elapsed_seconds));
  if (info.connections > 0) absl::StrAppend(&s, "connections  ", info.connections, " (calls spread round robin)\n");
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
    if (server_.empty()) {  // every completion written by the GPU stream: no server or kernel time
      absl::StrAppend(&s, "server side  queue p50 ", FormatSeconds(q.p50), " p99 ", FormatSeconds(q.p99),
                      " (server and kernel times: see the completions line)\n");
    } else {
      absl::StrAppend(&s, "server side  kernel p50 ", FormatSeconds(k.p50), " p99 ", FormatSeconds(k.p99),
                      "; server p50 ", FormatSeconds(sv.p50), " p99 ", FormatSeconds(sv.p99), "; queue p50 ",
                      FormatSeconds(q.p50), " p99 ", FormatSeconds(q.p99), "\n");
    }
    if (!decode_.empty()) {
      // Where the server time went (ExecutionReport.stages): each stage's own p50, beside server p50.
      absl::StrAppend(&s, "stages p50   decode ", FormatSeconds(SummarizeLatencies(decode_).p50), "  queue ",
                      FormatSeconds(q.p50), "  copy_in ", FormatSeconds(SummarizeLatencies(copy_in_).p50),
                      "  device ", FormatSeconds(SummarizeLatencies(device_).p50), "  copy_out ",
                      FormatSeconds(SummarizeLatencies(copy_out_).p50), "  response ",
                      FormatSeconds(SummarizeLatencies(response_).p50), "  (server p50 ", FormatSeconds(sv.p50),
                      ")\n");
    }
  }
  if (completed_by_device_ > 0) {
    absl::StrAppend(&s, absl::StrFormat("completions  %d of %d written by the GPU stream after the kernels; their "
                                        "server time to the launch p50 %s (the server side line: the others)\n",
                                        completed_by_device_, ok(), FormatSeconds(SummarizeLatencies(to_launch_).p50)));
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


std::string BenchStats::FormatEchoFloor(const BenchStats& call, const BenchStats& echo, const EchoFloorInfo& info) {
  std::string s;
  absl::StrAppend(&s, "echo floor   bare gRPC echo over ", info.transport,
                  info.connections > 0 ? absl::StrCat(", ", Connections(info.connections)) : "",
                  ", same channel options, same concurrency and duration\n");
  absl::StrAppend(&s, "echo bytes   request ", ByteRange(info.echo_request_bytes_min, info.echo_request_bytes_max),
                  " (server received), response ",
                  ByteRange(info.echo_response_bytes_min, info.echo_response_bytes_max),
                  " (client received); call request ", info.call_request_bytes, " B, response ",
                  info.call_response_bytes, " B\n");
  const double echo_t = info.echo_elapsed_seconds > 0 ? info.echo_elapsed_seconds : 1e-9;
  const double call_t = info.call_elapsed_seconds > 0 ? info.call_elapsed_seconds : 1e-9;
  const double echo_rps = double(echo.ok()) / echo_t, call_rps = double(call.ok()) / call_t;
  absl::StrAppend(&s, absl::StrFormat("echo         %d ok, %d failed in %.3f s, %.1f req/s\n", echo.ok(), echo.failed(),
                                      info.echo_elapsed_seconds, echo_rps));
  for (const auto& [code, n] : echo.errors_) {
    absl::StrAppend(&s, absl::StrFormat("echo error   %s: %d (first: %s)\n", absl::StatusCodeToString(code), n,
                                        echo.first_error_.at(code)));
  }
  const LatencySummary e = SummarizeLatencies(echo.latencies_);
  const LatencySummary c = SummarizeLatencies(call.latencies_);
  if (e.count > 0) {
    absl::StrAppend(&s, "echo latency p50 ", FormatSeconds(e.p50), "  p90 ", FormatSeconds(e.p90), "  p99 ",
                    FormatSeconds(e.p99), "  max ", FormatSeconds(e.max), "  mean ", FormatSeconds(e.mean), "\n");
  }
  if (e.count > 0 && c.count > 0) {
    absl::StrAppend(&s, "vs floor     round trip / echo: p50 ", Ratio(c.p50, e.p50), "  p90 ", Ratio(c.p90, e.p90),
                    "  p99 ", Ratio(c.p99, e.p99), "; req/s call / echo ", Ratio(call_rps, echo_rps), "\n");
  }
  return s;
}

}  // namespace fusedlayer::client
