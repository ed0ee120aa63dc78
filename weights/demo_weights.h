// Built-in demo weight sets (--demo_weights): seeded random values of realistic magnitude in
// DeepSeek shapes, so a fresh server answers both ops at once.
//
//   "v41-flash/demo"  mhc: hc_mult 4, hidden 5120, hc_norm_eps = norm_eps = 1e-20 (V4.1, shifted
//                     mode), with norm_weight; swa: Q 1280, D 512, e4m3fn, fp32 scales, row-major,
//                     with a small wq_b (N = 1024)
//   "v4-pro/demo"     mhc: hc_mult 4, hidden 7168, default epsilons, with norm_weight;
//                     swa: Q 1536, D 512, e4m3fn, ue8m0 scales, column_major_tma, no wq_b
//
// Values: fn ~ N(0, 1/sqrt(K)); scale ~ U[0.5, 2]; base ~ N(0, 0.1); norm weights ~ U[0.5, 1.5]
// (bf16); wq_b drawn N(0, 0.02) and block-quantised like a DeepSeek checkpoint: per 128x128 block a
// power-of-two scale >= amax / 448 and fp8 codes of w / scale (never a NaN code).
// The generator uses only mt19937_64's raw output (specified by the standard), so a seed gives the
// same bytes with every standard library.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "weights/weight_set.h"

namespace fusedlayer::server {

inline constexpr char kDemoFlashSetName[] = "v41-flash/demo";
inline constexpr char kDemoProSetName[] = "v4-pro/demo";
// The seed the server uses for --demo_weights.
inline constexpr uint64_t kDefaultDemoSeed = 20260401;

// Both demo sets, packed (payload_bytes and sha256 filled). Fails only if OpenSSL fails.
absl::StatusOr<std::vector<PackedWeightSet>> MakeDemoWeightSets(uint64_t seed = kDefaultDemoSeed);

}  // namespace fusedlayer::server
