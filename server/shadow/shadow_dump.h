// Mismatch dumps (--shadow_dump_dir): one self-describing safetensors file per mismatching case, so
// `fusedctl replay --dump=FILE` can re-send it to a server offline (docs/shadow.md "Dump format").
//
//   tensors:      request.<field>   every input tensor of the request, as sent (e.g. request.x,
//                                   request.residual, request.qr_kv with its full row stride)
//                 fused.<output>    the fused path's outputs as returned to the client
//                 unfused.<output>  the shadow unfused run's outputs
//   __metadata__: format = "fusedlayer-shadow-dump/1", op, weight_set, request_id, backend, device,
//                 and for mhc stage / mode / capture_aux, mismatched_outputs (comma-separated),
//                 summary (the log line's diff summary)
//
// Bounded in count (--shadow_dump_max_files) and total bytes (--shadow_dump_max_bytes). The policy
// is stop-when-full: the first dumps are kept (the first mismatch after a rollout is the one to
// read) and later ones are skipped and counted (fusedlayer_shadow_dumps_total{result=
// "limit_reached"}) until an operator empties the directory; files already in the directory at
// startup count against the bound, so restarts cannot grow it.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "fusedlayer/v1/fusedlayer.pb.h"

namespace fusedlayer::server::shadow {

inline constexpr char kDumpFormat[] = "fusedlayer-shadow-dump/1";
inline constexpr char kDumpPrefix[] = "shadow-";
inline constexpr char kDumpSuffix[] = ".safetensors";

struct DumpCase {
  std::string op;  // "mhc", "swa"; part of the file name
  std::string request_id;
  std::vector<std::pair<std::string, const v1::Tensor*>> tensors;  // name -> tensor (not owned)
  std::map<std::string, std::string> metadata;
};

class ShadowDumpWriter {
 public:
  // Creates `dir` when missing and counts the dumps already in it. InvalidArgument when the
  // directory cannot be created or written (checked at startup).
  static absl::StatusOr<std::unique_ptr<ShadowDumpWriter>> Open(const std::string& dir, int64_t max_files,
                                                                uint64_t max_bytes);

  // Writes one case; its path on success. ResourceExhausted when the file would exceed either bound
  // (nothing is written), another error when the write failed. Thread-safe.
  absl::StatusOr<std::string> Write(const DumpCase& c);

  int64_t files() const;
  uint64_t bytes() const;

 private:
  ShadowDumpWriter(std::string dir, int64_t max_files, uint64_t max_bytes)
      : dir_(std::move(dir)), max_files_(max_files), max_bytes_(max_bytes) {}

  const std::string dir_;
  const int64_t max_files_;
  const uint64_t max_bytes_;
  mutable std::mutex mu_;
  int64_t files_ = 0;
  uint64_t bytes_ = 0;
  uint64_t seq_ = 0;
};

}  // namespace fusedlayer::server::shadow
