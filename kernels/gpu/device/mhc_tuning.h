// Measurement knobs of the mHC GPU kernels, in one place. Each is a compile-time constant with the
// value that production builds use; a measurement build overrides one with -D... to time the
// alternative against the same source (kernels/gpu/DESIGN.md has the results). Nothing
// else in kernels/gpu reads a build-time switch.
#pragma once

// Minimum resident CTAs per SM of the 16-token-tile fused pass instances (register budget): 3 =
// up to 170 registers, no spills. 4 measured -11% at C = 7168, T = 128 (one wave instead of 1.13)
// but +1-2% at T <= 64 from spills; mhc_launch.cu picks the
// 4-CTA/SM instance itself where the grid exceeds one 3-CTA/SM wave.
#ifndef FL_MHC_TILE16_MIN_BLOCKS
#define FL_MHC_TILE16_MIN_BLOCKS 3
#endif

// 1: 16-token tiles request their first B fragments right after the data loads (kAhead in
// MhcFusedPassKernel). 0: B requested at the MMA loop, two steps ahead (the layout before fn went to bf16).
#ifndef FL_MHC_EARLY_B
#define FL_MHC_EARLY_B 1
#endif

// Token tiles of 16 (one m-tile per warp) up to this many tokens, 32 above. 64 instead measured
// +12 us at C = 7168, T = 1024. The choice may depend on T:
// both tile sizes run the same per-token arithmetic (BatchInvariance crosses the boundary).
#ifndef FL_MHC_SINGLE_TILE_MAX_TOKENS
#define FL_MHC_SINGLE_TILE_MAX_TOKENS 1024
#endif
