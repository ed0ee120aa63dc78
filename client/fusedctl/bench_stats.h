// Aggregation of `fusedctl bench` results: one BenchStats per caller thread (no locking on the hot
// path), merged at the end and formatted.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "fusedlayer/v1/fusedlayer.pb.h"

namespace fusedlayer::client {

namespace v1 = ::fusedlayer::v1;

struct CallOutcome {
  double round_trip_seconds = 0;
  absl::Status status;                 // OK or the call's error
  // Valid when status is OK:
  v1::ExecutionReport report;
  // A call ring's completion written by the GPU stream: the report's server time ends at the
  // launch and it has no kernel or device time.
  bool completed_by_device = false;
};

class BenchStats {
 public:
  void Add(const CallOutcome& outcome);
  void Merge(const BenchStats& other);

  int64_t ok() const { return int64_t(latencies_.size()); }
  int64_t failed() const;
  int64_t fused() const { return fused_; }
  // Fraction of OK responses whose report.path is FUSED (0 when there are none).
  double FusedHitRate() const;
  const std::vector<double>& latencies() const { return latencies_; }
  const std::map<std::string, int64_t>& fallbacks() const { return fallbacks_; }  // reason name -> count
  std::map<std::string, int64_t> errors() const;                                  // code name -> count
  // The most frequent error code (ties: the lowest code); OK when nothing failed.
  absl::StatusCode MostFrequentError() const;

  struct RunInfo {
    std::string op;                    // "mhc" / "swa"
    int64_t tokens_per_request = 0;
    uint64_t request_bytes = 0;        // serialized size of one request
    uint64_t response_bytes = 0;       // serialized size of one (probe) response
    double elapsed_seconds = 0;        // wall time of the measured window
    int connections = 0;               // connections the calls were spread over (0: not shown)
  };
  std::string Format(const RunInfo& info) const;

  // The echo-floor block of `fusedctl bench --echo_floor`: the bare echo's throughput and latency
  // next to the real call's (`call`, measured at the same concurrency), and round trip / echo.
  struct EchoFloorInfo {
    std::string transport;               // where the echo ran, e.g. "127.0.0.1 (plaintext)"
    uint64_t call_request_bytes = 0;     // the real call's serialized request
    uint64_t call_response_bytes = 0;    // ... and response (the probe's)
    uint64_t echo_request_bytes_min = 0, echo_request_bytes_max = 0;    // as the echo server received them
    uint64_t echo_response_bytes_min = 0, echo_response_bytes_max = 0;  // as the bench received them
    double call_elapsed_seconds = 0;
    double echo_elapsed_seconds = 0;
    int connections = 0;                 // connections the echo calls were spread over (0: not shown)
  };
  static std::string FormatEchoFloor(const BenchStats& call, const BenchStats& echo, const EchoFloorInfo& info);

 private:
  std::vector<double> latencies_;      // OK calls only
  std::vector<double> kernel_, server_, queue_;
  // ExecutionReport.stages of the OK calls that had them (a server older than stages sends none).
  std::vector<double> decode_, copy_in_, device_, copy_out_, response_;
  int64_t fused_ = 0;
  int64_t completed_by_device_ = 0;
  std::vector<double> to_launch_;  // server seconds of the completions written by the GPU stream
  std::map<std::string, int64_t> fallbacks_;
  std::map<absl::StatusCode, int64_t> errors_;
  std::map<absl::StatusCode, std::string> first_error_;  // first message seen per code
};

}  // namespace fusedlayer::client
