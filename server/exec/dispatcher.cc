#include "exec/dispatcher.h"

#include "absl/strings/str_cat.h"
#include "common/log.h"

namespace fusedlayer::server {

absl::StatusOr<PathDecision> ChoosePath(Op op, v1::PathPreference preference, bool disabled_by_config,
                                        absl::FunctionRef<FusedSupport()> fused_support) {
  PathDecision d;
  if (preference == v1::PATH_PREFERENCE_FORCE_UNFUSED) {
    d.path = Path::kUnfused;
    d.reason = FallbackReason::kClientForcedUnfused;
    d.detail = "path_preference = FORCE_UNFUSED";
    return d;
  }
  if (disabled_by_config) {
    d.path = Path::kUnfused;
    d.reason = FallbackReason::kDisabledByConfig;
    d.detail = absl::StrCat("the fused ", OpName(op), " path is switched off on this server (--disable_fused)");
  } else {
    FusedSupport s = fused_support();
    if (!s.supported) {
      d.path = Path::kUnfused;
      d.reason = s.reason;
      d.detail = std::move(s.detail);
    }
  }
  if (d.reason.has_value() && preference == v1::PATH_PREFERENCE_REQUIRE_FUSED) {
    return absl::FailedPreconditionError(absl::StrCat("REQUIRE_FUSED: the fused ", OpName(op), " path cannot run (",
                                                      FallbackReasonName(*d.reason), "): ", d.detail));
  }
  return d;
}

absl::StatusOr<DispatchOutcome> RunWithFallback(Op op, const PathDecision& decision, bool require_fused,
                                                const std::string& what,
                                                absl::FunctionRef<absl::StatusOr<RunStats>(Path)> run) {
  absl::StatusOr<RunStats> first = run(decision.path);
  if (first.ok()) return DispatchOutcome{decision, *first};
  // Bad arguments are the caller's fault on either path: no re-run, no alarm. Out of device memory
  // (staging buffers, workspace) is load, not a broken kernel: the unfused chain needs at least as
  // much memory, so it goes back to the client as RESOURCE_EXHAUSTED (retryable) instead of paging
  // as fused_kernel_error.
  if (decision.path == Path::kUnfused || absl::IsInvalidArgument(first.status()) ||
      absl::IsResourceExhausted(first.status())) {
    return first.status();
  }

  if (require_fused) {
    LogError("fused ", OpName(op), " kernel failed for ", what, " (REQUIRE_FUSED, not re-run): ",
             first.status().ToString());
    return absl::FailedPreconditionError(absl::StrCat("REQUIRE_FUSED: the fused ", OpName(op), " path failed (",
                                                      FallbackReasonName(FallbackReason::kFusedKernelError),
                                                      "): ", first.status().message()));
  }
  LogError("fused ", OpName(op), " kernel failed for ", what, "; re-running unfused (fused_kernel_error): ",
           first.status().ToString());
  absl::StatusOr<RunStats> second = run(Path::kUnfused);
  if (!second.ok()) {
    return absl::InternalError(absl::StrCat(OpName(op), " failed on both paths: fused: ", first.status().ToString(),
                                            "; unfused: ", second.status().ToString()));
  }
  DispatchOutcome out;
  out.decision.path = Path::kUnfused;
  out.decision.reason = FallbackReason::kFusedKernelError;
  out.decision.detail = absl::StrCat("fused launch failed: ", first.status().ToString());
  out.stats = *second;
  return out;
}

}  // namespace fusedlayer::server
