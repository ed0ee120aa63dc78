// What every backend checks before it launches an op, in one place (DeepGEMM's API tier): the
// arguments against the op's contract (ValidateMhcArgs / ValidateSwaArgs), then, on the fused
// path, the backend's own fused-support answer for their shape. Each backend's launcher calls it
// first (CPU: cpu/*_cpu.cc, CUDA and HIP: gpu/*_launch*), so the checks and their errors are the
// same whichever backend runs.
//
// Arguments their caller already checked against the contract (args.contract_checked: the server
// checks a request's when it decodes it, before anything is allocated or queued) are not checked
// again, so a request is validated once on its way to the kernels.
#pragma once

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "fusedlayer/backend.h"
#include "fusedlayer/fallback.h"
#include "fusedlayer/mhc.h"
#include "fusedlayer/swa.h"

namespace fusedlayer {

// InvalidArgument as ValidateMhcArgs (unless args.contract_checked); FailedPrecondition naming the reason when `path` is fused
// and `fused_support` says no. Nothing is launched on an error.
absl::Status MhcLaunchPrologue(const PreparedMhcWeights& weights, const MhcArgs& args, Path path,
                               absl::FunctionRef<FusedSupport(const MhcShapeQuery&)> fused_support);
absl::Status SwaLaunchPrologue(const PreparedSwaWeights& weights, const SwaArgs& args, Path path,
                               absl::FunctionRef<FusedSupport(const SwaShapeQuery&)> fused_support);

}  // namespace fusedlayer
