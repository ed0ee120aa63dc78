#include "fusedlayer/fallback.h"

namespace fusedlayer {

const char* PathName(Path p) { return p == Path::kFused ? "fused" : "unfused"; }

const char* FallbackReasonName(FallbackReason r) {
  switch (r) {
    case FallbackReason::kDisabledByConfig: return "disabled_by_config";
    case FallbackReason::kClientForcedUnfused: return "client_forced_unfused";
    case FallbackReason::kBackendHasNoFusedKernel: return "backend_has_no_fused_kernel";
    case FallbackReason::kDeviceArchUnsupported: return "device_arch_unsupported";
    case FallbackReason::kHcMultUnsupported: return "hc_mult_unsupported";
    case FallbackReason::kHiddenSizeUnsupported: return "hidden_size_unsupported";
    case FallbackReason::kTooManyTokens: return "too_many_tokens";
    case FallbackReason::kAuxCaptureRequested: return "aux_capture_requested";
    case FallbackReason::kWorkspaceUnavailable: return "workspace_unavailable";
    case FallbackReason::kFusedKernelError: return "fused_kernel_error";
  }
  return "unknown";
}

std::array<FallbackReason, kNumFallbackReasons> AllFallbackReasons() {
  std::array<FallbackReason, kNumFallbackReasons> all{};
  for (int i = 0; i < kNumFallbackReasons; ++i) all[i] = static_cast<FallbackReason>(i);
  return all;
}

std::optional<FallbackReason> ParseFallbackReason(std::string_view name) {
  for (FallbackReason r : AllFallbackReasons()) {
    if (name == FallbackReasonName(r)) return r;
  }
  return std::nullopt;
}

}  // namespace fusedlayer
