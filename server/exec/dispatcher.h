// Path choice for one request, and the honest fallback around a failed fused launch.
//
// Order of precedence (the first that applies decides):
//   1. FORCE_UNFUSED                -> unfused, client_forced_unfused
//   2. op in --disable_fused        -> unfused, disabled_by_config
//   3. backend.XFusedSupport says no -> unfused, the backend's reason and detail
//   4. otherwise                     -> fused
// REQUIRE_FUSED turns any reason from 2-3 into FAILED_PRECONDITION naming the reason (nothing runs).
// A fused run that fails with anything but InvalidArgument or ResourceExhausted (out of memory: load,
// not a kernel bug; returned as is) is re-run unfused with reason
// fused_kernel_error and an ERROR log line (under REQUIRE_FUSED it is FAILED_PRECONDITION instead).
#pragma once

#include <optional>
#include <string>

#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "config.h"
#include "fusedlayer/backend.h"
#include "fusedlayer/fallback.h"
#include "fusedlayer/v1/fusedlayer.pb.h"

namespace fusedlayer::server {

struct PathDecision {
  Path path = Path::kFused;
  std::optional<FallbackReason> reason;  // set iff path == kUnfused
  std::string detail;
};

// Steps 1-4 above. FailedPrecondition under REQUIRE_FUSED when the fused path cannot run.
absl::StatusOr<PathDecision> ChoosePath(Op op, v1::PathPreference preference, bool disabled_by_config,
                                        absl::FunctionRef<FusedSupport()> fused_support);

struct DispatchOutcome {
  PathDecision decision;  // the path that produced the outputs, and why
  RunStats stats;
};

// Runs `run(decision.path)`; on a fused failure (not InvalidArgument / ResourceExhausted) re-runs unfused as described
// above. `what` names the request in log lines (op, weight set, request id). When the unfused
// re-run fails too the result is INTERNAL carrying both errors (a bug on both paths).
absl::StatusOr<DispatchOutcome> RunWithFallback(Op op, const PathDecision& decision, bool require_fused,
                                                const std::string& what,
                                                absl::FunctionRef<absl::StatusOr<RunStats>(Path)> run);

}  // namespace fusedlayer::server
