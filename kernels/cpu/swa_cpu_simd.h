// Function multiversioning for the CPU SWA hot loops. The library is built for the baseline ISA
// (x86-64 with SSE2); the row kernels and the GEMM micro-kernel are compiled once per listed ISA level
// (x86-64-v4: AVX-512 F/BW/DQ/VL; x86-64-v3: AVX2/FMA) and the loader picks the best the CPU has
// (GCC/Clang ifunc). v4 matters: the bf16 (16-bit lane) conversions need AVX-512 BW to use 512-bit
// registers, and measured ~1.5x faster than the AVX2 clone on the row kernels. Results are bitwise identical across
// the clones: the loops are written with a fixed accumulation order (explicit lanes, no reduction
// left to the vectoriser), only IEEE-exact operations are used, and these files are compiled with
// -ffp-contract=off (kernels/cpu/CMakeLists.txt) so no clone fuses a multiply into an add.
#pragma once

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(FUSEDLAYER_NO_MULTIVERSION)
#define FL_SWA_MULTIVERSION __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define FL_SWA_MULTIVERSION
#endif
