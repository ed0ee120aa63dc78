// Test support for gpu_swa_tests (swa_quant_check.cu): checks n random and edge-case (amax, v)
// pairs of the SWA kernels' quantization arithmetic (scale, reciprocal, Markstein quotient, clamp,
// fp8 conversion) bitwise against the contract's formulas with IEEE division and the software fp8
// encoder; adds the number of mismatching codes and scales to *bad (a device counter).
#pragma once

#include <cstdint>

#include "fusedlayer/numeric.h"
#include "gpu_runtime.h"

namespace fusedlayer::gpu {

gpuError_t SwaCheckQuantEncoding(uint64_t seed, int64_t n, Fp8Format fmt, bool ue8m0, unsigned long long* bad,
                                 gpuStream_t stream);

}  // namespace fusedlayer::gpu
