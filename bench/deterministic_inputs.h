// Cheap deterministic input generator for the CPU benchmarks and probes (SplitMix64): the inputs
// only need to be non-zero, varied and have outliers, and the same seed must give the same inputs
// on every run; drawing 10^8 normal variates with <random> would dominate the set-up time.
#pragma once

#include <cstdint>

#include "fusedlayer/numeric.h"

namespace fusedlayer::bench {

struct Gen {
  uint64_t s;
  uint64_t Next() {
    uint64_t z = (s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  float Uniform(float lo, float hi) { return lo + (hi - lo) * float(Next() >> 40) * (1.0f / 16777216.0f); }
  // bf16 bits of |v| in [0.25, 2), random sign, 1 in 128 an outlier x16: never zero.
  uint16_t Bf16() {
    const uint64_t r = Next();
    float v = 0.25f + 1.75f * float(r >> 40) * (1.0f / 16777216.0f);
    if ((r & 1) != 0) v = -v;
    if (((r >> 1) & 127) == 0) v *= 16.0f;
    return FloatToBf16(v);
  }
};

}  // namespace fusedlayer::bench
