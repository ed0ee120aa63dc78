// Thin portability layer: the only place that knows whether we are compiled by a host compiler,
// nvcc (CUDA) or hipcc (HIP). Everything else spells FL_HOST_DEVICE / FL_DEVICE / FL_INLINE.
#pragma once

#if defined(__CUDACC__) || defined(__HIPCC__)
#define FL_HOST_DEVICE __host__ __device__
#define FL_DEVICE __device__
#define FL_GPU_COMPILER 1
#else
#define FL_HOST_DEVICE
#define FL_DEVICE
#define FL_GPU_COMPILER 0
#endif

#define FL_INLINE inline
#define FL_FORCE_INLINE inline __attribute__((always_inline))
