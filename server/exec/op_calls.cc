#include "exec/op_calls.h"

#include <utility>

#include "common/status_macros.h"
#include "exec/device_staging.h"

namespace fusedlayer::server {

absl::StatusOr<RunStats> RunMhcCall(Backend& backend, const PreparedMhcWeights& weights, const MhcArgs& host,
                                    Path path) {
  DeviceStaging staging(backend);
  MhcArgs dev = host;
  for (auto [dst, src] : {std::pair{&dev.x, &host.x}, {&dev.residual, &host.residual}, {&dev.post_mix, &host.post_mix},
                          {&dev.comb_mix, &host.comb_mix}, {&dev.pre_mix, &host.pre_mix}}) {
    FL_ASSIGN_OR_RETURN(*dst, staging.Input(*src));
  }
  for (auto [dst, src] : {std::pair{&dev.new_residual, &host.new_residual}, {&dev.new_pre_mix, &host.new_pre_mix},
                          {&dev.new_post_mix, &host.new_post_mix}, {&dev.new_comb_mix, &host.new_comb_mix},
                          {&dev.y, &host.y}, {&dev.aux, &host.aux}}) {
    FL_ASSIGN_OR_RETURN(*dst, staging.Output(*src));
  }
  absl::StatusOr<RunStats> stats = backend.RunMhc(weights, dev, path);
  if (!stats.ok()) return stats.status();
  if (absl::Status s = staging.CopyOutputsBack(); !s.ok()) return s;
  return stats;
}

absl::StatusOr<RunStats> RunSwaCall(Backend& backend, const PreparedSwaWeights& weights, const SwaArgs& host,
                                    Path path) {
  DeviceStaging staging(backend);
  SwaArgs dev = host;
  FL_ASSIGN_OR_RETURN(dev.qr_kv, staging.Input(host.qr_kv));
  for (auto [dst, src] : {std::pair{&dev.q_fp8, &host.q_fp8}, {&dev.q_scale, &host.q_scale}, {&dev.kv, &host.kv},
                          {&dev.q_proj, &host.q_proj}}) {
    FL_ASSIGN_OR_RETURN(*dst, staging.Output(*src));
  }
  absl::StatusOr<RunStats> stats = backend.RunSwa(weights, dev, path);
  if (!stats.ok()) return stats.status();
  if (absl::Status s = staging.CopyOutputsBack(); !s.ok()) return s;
  return stats;
}

}  // namespace fusedlayer::server
