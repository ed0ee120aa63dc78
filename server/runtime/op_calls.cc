#include "runtime/op_calls.h"

#include <utility>

#include "common/status_macros.h"
#include "runtime/device_staging.h"
#include "runtime/host_staging_pool.h"

namespace fusedlayer::server {
namespace {

// The default path's stages (DeviceStaging: copies in, synchronous run, copies back; on a
// host-accessible backend the copies are no-ops and everything is the run): Next(stage) adds the
// time since the previous boundary to `stage`.
class StageClock {
 public:
  explicit StageClock(StageTimes* times) : times_(times), last_(std::chrono::steady_clock::now()) {}
  void Next(double StageTimes::*stage) {
    if (times_ == nullptr) return;
    const auto now = std::chrono::steady_clock::now();
    times_->*stage += SecondsBetween(last_, now);
    last_ = now;
  }

 private:
  StageTimes* const times_;
  std::chrono::steady_clock::time_point last_;
};

// The lane path (op_calls.h): stage, enqueue the op, queue the copies back, wait once.
template <typename Args, typename Enqueue>
absl::StatusOr<RunStats> RunOnLane(const ExecTarget& target, const Args& dev, LaneStaging& staging,
                                   Enqueue&& enqueue) {
  const auto t0 = std::chrono::steady_clock::now();
  absl::Status launched = staging.Stage();
  const auto staged = std::chrono::steady_clock::now();
  if (target.times != nullptr) target.times->copy_in += SecondsBetween(t0, staged);
  if (launched.ok()) launched = enqueue(dev);
  if (launched.ok()) launched = staging.EnqueueCopiesBack();
  // Whatever the answer's enqueueing gives, the run goes on: a transport whose answer could not be
  // enqueued answers after the wait, as every other.
  if (launched.ok() && target.answer_on_device) target.answer_on_device(*target.lane);
  absl::StatusOr<RunStats> waited = staging.Finish(/*copy_out=*/launched.ok(), target.times, staged, target.outputs);
  if (!launched.ok()) return launched;  // a validation or allocation error, as the default path reports it
  return waited;
}

}  // namespace

absl::StatusOr<RunStats> RunMhcCall(const ExecTarget& target, const PreparedMhcWeights& weights, const MhcArgs& host,
                                    Path path) {
  MhcArgs dev = host;
  const auto inputs = {std::pair{&dev.x, &host.x}, {&dev.residual, &host.residual}, {&dev.post_mix, &host.post_mix},
                       {&dev.comb_mix, &host.comb_mix}, {&dev.pre_mix, &host.pre_mix}};
  const auto outputs = {std::pair{&dev.new_residual, &host.new_residual}, {&dev.new_pre_mix, &host.new_pre_mix},
                        {&dev.new_post_mix, &host.new_post_mix}, {&dev.new_comb_mix, &host.new_comb_mix},
                        {&dev.y, &host.y}, {&dev.aux, &host.aux}};
  if (target.lane != nullptr) {
    LaneStaging staging(*target.lane, *target.staging, target.pinned_inputs, target.pinned_outputs,
                        target.resident);
    for (auto [dst, src] : inputs) staging.Input(*src, dst);
    for (auto [dst, src] : outputs) staging.Output(*src, dst);
    return RunOnLane(target, dev, staging,
                     [&](const MhcArgs& a) { return target.lane->EnqueueMhc(weights, a, path); });
  }
  StageClock clock(target.times);
  DeviceStaging staging(target.backend, target.resident);
  for (auto [dst, src] : inputs) {
    FL_ASSIGN_OR_RETURN(*dst, staging.Input(*src));
  }
  for (auto [dst, src] : outputs) {
    FL_ASSIGN_OR_RETURN(*dst, staging.Output(*src));
  }
  clock.Next(&StageTimes::copy_in);
  absl::StatusOr<RunStats> stats = target.backend.RunMhc(weights, dev, path);
  clock.Next(&StageTimes::device);
  if (!stats.ok()) return stats.status();
  if (absl::Status s = staging.CopyOutputsBack(); !s.ok()) return s;
  clock.Next(&StageTimes::copy_out);
  return stats;
}

absl::StatusOr<RunStats> RunSwaCall(const ExecTarget& target, const PreparedSwaWeights& weights, const SwaArgs& host,
                                    Path path) {
  SwaArgs dev = host;
  const auto outputs = {std::pair{&dev.q_fp8, &host.q_fp8}, {&dev.q_scale, &host.q_scale}, {&dev.kv, &host.kv},
                        {&dev.q_proj, &host.q_proj}};
  if (target.lane != nullptr) {
    LaneStaging staging(*target.lane, *target.staging, target.pinned_inputs, target.pinned_outputs,
                        target.resident);
    staging.Input(host.qr_kv, &dev.qr_kv);
    for (auto [dst, src] : outputs) staging.Output(*src, dst);
    return RunOnLane(target, dev, staging,
                     [&](const SwaArgs& a) { return target.lane->EnqueueSwa(weights, a, path); });
  }
  StageClock clock(target.times);
  DeviceStaging staging(target.backend, target.resident);
  FL_ASSIGN_OR_RETURN(dev.qr_kv, staging.Input(host.qr_kv));
  for (auto [dst, src] : outputs) {
    FL_ASSIGN_OR_RETURN(*dst, staging.Output(*src));
  }
  clock.Next(&StageTimes::copy_in);
  absl::StatusOr<RunStats> stats = target.backend.RunSwa(weights, dev, path);
  clock.Next(&StageTimes::device);
  if (!stats.ok()) return stats.status();
  if (absl::Status s = staging.CopyOutputsBack(); !s.ok()) return s;
  clock.Next(&StageTimes::copy_out);
  return stats;
}

}  // namespace fusedlayer::server
