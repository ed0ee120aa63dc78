// The one enumeration of reasons why a request ran the unfused path. Shared by the response
// (proto enum), the metrics (label values) and the logs (same strings).
#pragma once

#include <array>
#include <optional>
#include <string>
#include <string_view>

namespace fusedlayer {

enum class Path : uint8_t { kFused = 0, kUnfused = 1 };
const char* PathName(Path p);  // "fused", "unfused"

enum class FallbackReason : uint8_t {
  kDisabledByConfig = 0,        // operator kill switch (--disable_fused=mhc,swa)
  kClientForcedUnfused,         // path_preference = FORCE_UNFUSED
  kBackendHasNoFusedKernel,     // the backend has no fused kernel for this op (or stage)
  kDeviceArchUnsupported,       // the device architecture lacks what the fused kernel needs
  kHcMultUnsupported,           // fused mHC is specialised for hc_mult = 4
  kHiddenSizeUnsupported,       // C (or Q/D) is not a multiple of the fused kernel's tile
  kTooManyTokens,               // T beyond the fused kernel's index / token limit
  kAuxCaptureRequested,         // capture_aux asked on a backend whose fused kernel has no aux output
  kWorkspaceUnavailable,        // the fused kernel's workspace could not be allocated
  kFusedKernelError,            // the fused launch failed; the request was re-run unfused
};
inline constexpr int kNumFallbackReasons = 10;

const char* FallbackReasonName(FallbackReason r);  // snake_case, e.g. "too_many_tokens"
std::optional<FallbackReason> ParseFallbackReason(std::string_view name);
std::array<FallbackReason, kNumFallbackReasons> AllFallbackReasons();

// Answer of a backend's capability query: fused supported, or the reason it is not, with a
// human-readable detail for logs ("C = 4000 is not a multiple of 1024").
struct FusedSupport {
  bool supported = true;
  FallbackReason reason = FallbackReason::kBackendHasNoFusedKernel;
  std::string detail;

  static FusedSupport Yes() { return {}; }
  static FusedSupport No(FallbackReason r, std::string detail) { return {false, r, std::move(detail)}; }
};

}  // namespace fusedlayer
