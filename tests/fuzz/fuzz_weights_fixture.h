// Small, valid weight material shared by the fuzz targets and the seed-corpus generator: a tiny
// weight set (mHC n = 4, C = 256; SWA Q = 256, D = 128, wq_b N = 128) as safetensors files in a
// directory, and as packed sets built on the CPU backend. Deterministic (fixed seed), so a crash
// found by the fuzzer reproduces from its input alone.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "weights/safetensors_writer.h"
#include "weights/weight_set.h"

namespace fusedlayer::fuzz {

inline constexpr int kHcMult = 4;
inline constexpr int64_t kHidden = 256;
inline constexpr int64_t kQRank = 256;
inline constexpr int64_t kHeadDim = 128;
inline constexpr int64_t kWqbRows = 128;

// The tensors of the small set in safetensors form, named by their weight-set names. `fnuz`
// selects e4m3fnuz for wq_b (else e4m3fn).
std::vector<server::SafetensorsEntry> SmallSetEntries(bool fnuz);

// A packed set holding SmallSetEntries: `variant` 0 = e4m3fn, fp32 row-major scales;
// 1 = e4m3fnuz, ue8m0 column-major TMA scales, no wq_b, no norm weight.
server::PackedWeightSet SmallPackedSet(int variant);

// Creates a fresh directory under $TMPDIR (or /tmp) and returns its path; aborts on failure.
std::string MakeTempDir(const char* prefix);

}  // namespace fusedlayer::fuzz
