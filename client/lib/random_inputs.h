// Random request inputs sized from a weight set's configuration: what `fusedctl seam/swa/bench`
// send when no input file is given, and what end-to-end tests use.
//
// Values follow the test rules of the project: fresh random draws (the caller seeds the generator),
// Normal(0, 1) activations with ~1% outliers scaled x16, and never a zero (a zero input hides
// unwritten or mis-indexed outputs). Mixes lie where a real model puts them:
//   post_mix in (0.2, 2)  (the model's 2·sigmoid range, away from 0),
//   comb_mix positive, rows and columns summing to ~1 (a few Sinkhorn sweeps, as Mix produces),
//   pre_mix positive in (0.05, 1) (sigmoid + eps).
#pragma once

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "fusedlayer/v1/fusedlayer.pb.h"

namespace fusedlayer::client {

namespace v1 = ::fusedlayer::v1;

// Activation values (bf16 bits): Normal(0, sigma), 1% outliers x`outlier`, no +-0.
std::vector<uint16_t> RandomActivationsBf16(std::mt19937_64& rng, size_t n, float sigma = 1.0f,
                                            float outlier = 16.0f);
// Uniform in the open interval (lo, hi), lo >= 0, never 0.
std::vector<float> RandomUniform(std::mt19937_64& rng, size_t n, float lo, float hi);
// [rows, n, n] positive matrices, each scaled towards doubly stochastic.
std::vector<float> RandomCombMix(std::mt19937_64& rng, int64_t rows, int n);

struct MhcRequestSpec {
  std::string weight_set;
  v1::MhcStage stage = v1::MHC_STAGE_SEAM;
  v1::MhcMode mode = v1::MHC_MODE_SHIFTED;
  int64_t tokens = 1;
  bool include_pre_mix = true;  // shifted seam/head only; false = "select stream 0"
  bool capture_aux = false;
  v1::PathPreference path = v1::PATH_PREFERENCE_AUTO;
};

struct SwaRequestSpec {
  std::string weight_set;
  int64_t tokens = 1;
  int64_t row_stride = 0;  // 0 = Q + D (dense); else >= Q + D, the extra columns are random too
  v1::PathPreference path = v1::PATH_PREFERENCE_AUTO;
};

// Largest request these generators build: protobuf cannot serialise a message of 2 GiB or more.
inline constexpr uint64_t kMaxRequestBytes = (uint64_t{1} << 31) - (uint64_t{1} << 20);

// Checks the spec against the config (stage/mode combinations the proto allows, tokens >= 0,
// row_stride, size limit). InvalidArgument with a one-line reason.
absl::Status ValidateMhcSpec(const v1::MhcConfig& config, const MhcRequestSpec& spec);
absl::Status ValidateSwaSpec(const v1::SwaConfig& config, const SwaRequestSpec& spec);

// A complete request with exactly the tensors the stage/mode needs (spec/mhc.md):
//   seam:  x, residual, post_mix, comb_mix (+ pre_mix when shifted and include_pre_mix)
//   first: x (the embedding)
//   head:  x, residual, post_mix, comb_mix (+ pre_mix when include_pre_mix)
absl::StatusOr<v1::MhcSeamRequest> RandomMhcRequest(const v1::MhcConfig& config, const MhcRequestSpec& spec,
                                                    std::mt19937_64& rng);
// qr_kv bf16 [M, row_stride].
absl::StatusOr<v1::SwaNormQuantRequest> RandomSwaRequest(const v1::SwaConfig& config, const SwaRequestSpec& spec,
                                                         std::mt19937_64& rng);

// Seed from std::random_device (fresh inputs every run); the caller prints it so a run can be
// reproduced with --seed.
uint64_t FreshSeed();

}  // namespace fusedlayer::client
