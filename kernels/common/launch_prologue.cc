#include "fusedlayer/launch_prologue.h"

#include "absl/strings/str_cat.h"

namespace fusedlayer {
namespace {

absl::Status FusedUnsupported(const char* op, const FusedSupport& support) {
  return absl::FailedPreconditionError(absl::StrCat("fused ", op, " path unsupported (",
                                                    FallbackReasonName(support.reason), "): ", support.detail));
}

}  // namespace

absl::Status MhcLaunchPrologue(const PreparedMhcWeights& weights, const MhcArgs& args, Path path,
                               absl::FunctionRef<FusedSupport(const MhcShapeQuery&)> fused_support) {
  if (!args.contract_checked) {
    if (absl::Status s = ValidateMhcArgs(weights.params(), weights.has_norm_weight(), args); !s.ok()) return s;
  }
  if (path == Path::kFused) {
    const FusedSupport support = fused_support(MhcShapeQuery{args.stage, args.mode, args.capture_aux, args.tokens});
    if (!support.supported) return FusedUnsupported("mHC", support);
  }
  return absl::OkStatus();
}

absl::Status SwaLaunchPrologue(const PreparedSwaWeights& weights, const SwaArgs& args, Path path,
                               absl::FunctionRef<FusedSupport(const SwaShapeQuery&)> fused_support) {
  if (!args.contract_checked) {
    if (absl::Status s = ValidateSwaArgs(weights.params(), args); !s.ok()) return s;
  }
  if (path == Path::kFused) {
    const FusedSupport support = fused_support(SwaShapeQuery{args.tokens});
    if (!support.supported) return FusedUnsupported("SWA", support);
  }
  return absl::OkStatus();
}

}  // namespace fusedlayer
