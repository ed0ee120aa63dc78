// The thin CUDA/HIP portability header for device code and the GPU backend. Shared kernel code
// spells gpu* names and FL_* helpers, never cuda*/hip* directly, and never assumes 32-lane warps:
// kWarpSize is 32 on NVIDIA and the wavefront size (64 on CDNA) on AMD.
#pragma once

#include <cstdint>

#include "fusedlayer/portability.h"

#if defined(__HIPCC__) || defined(FUSEDLAYER_HIP_BUILD)
#include <hip/hip_runtime.h>
#define FL_HIP 1
using gpuStream_t = hipStream_t;
using gpuEvent_t = hipEvent_t;
using gpuError_t = hipError_t;
#define gpuSuccess hipSuccess
#define gpuGetLastError hipGetLastError
#define gpuGetErrorString hipGetErrorString
#define gpuMalloc hipMalloc
#define gpuFree hipFree
#define gpuMemcpy hipMemcpy
#define gpuMemcpyAsync hipMemcpyAsync
#define gpuMemsetAsync hipMemsetAsync
#define gpuMemcpyHostToDevice hipMemcpyHostToDevice
#define gpuMemcpyDeviceToHost hipMemcpyDeviceToHost
#define gpuMemcpyDeviceToDevice hipMemcpyDeviceToDevice
#define gpuStreamCreateWithFlags hipStreamCreateWithFlags
#define gpuStreamNonBlocking hipStreamNonBlocking
#define gpuStreamDestroy hipStreamDestroy
#define gpuStreamSynchronize hipStreamSynchronize
#define gpuEventCreate hipEventCreate
#define gpuEventCreateWithFlags hipEventCreateWithFlags
#define gpuEventDisableTiming hipEventDisableTiming
#define gpuEventDestroy hipEventDestroy
#define gpuEventRecord hipEventRecord
#define gpuEventSynchronize hipEventSynchronize
#define gpuEventElapsedTime hipEventElapsedTime
#define gpuGetDeviceCount hipGetDeviceCount
#define gpuSetDevice hipSetDevice
#define gpuGetDeviceProperties hipGetDeviceProperties
#define gpuDeviceProp hipDeviceProp_t
#define gpuFuncSetAttribute hipFuncSetAttribute
#define gpuDeviceSynchronize hipDeviceSynchronize
#define gpuErrorMemoryAllocation hipErrorOutOfMemory
#define gpuPeekAtLastError hipPeekAtLastError
#define gpuFuncGetAttributes hipFuncGetAttributes
using gpuFuncAttributes = hipFuncAttributes;
#define gpuMemset hipMemset
#define gpuGetDevice hipGetDevice
#define gpuMemGetInfo hipMemGetInfo
using gpuGraph_t = hipGraph_t;
using gpuGraphExec_t = hipGraphExec_t;
#define gpuStreamBeginCapture hipStreamBeginCapture
#define gpuStreamEndCapture hipStreamEndCapture
#define gpuStreamCaptureModeThreadLocal hipStreamCaptureModeThreadLocal
#define gpuGraphLaunch hipGraphLaunch
#define gpuGraphDestroy hipGraphDestroy
#define gpuGraphExecDestroy hipGraphExecDestroy
using gpuMemPool_t = hipMemPool_t;
#define gpuMallocAsync hipMallocAsync
#define gpuFreeAsync hipFreeAsync
#define gpuDeviceGetDefaultMemPool hipDeviceGetDefaultMemPool
#define gpuMemPoolSetAttribute hipMemPoolSetAttribute
#define gpuMemPoolTrimTo hipMemPoolTrimTo
#define gpuMemPoolAttrReleaseThreshold hipMemPoolAttrReleaseThreshold
#define gpuFreeHost hipHostFree
// Portable: page-locked for every device of the process (a server serving several GPUs stages
// every device's requests in one pool).
inline hipError_t gpuHostAlloc(void** p, size_t bytes) { return hipHostMalloc(p, bytes, hipHostMallocPortable); }
// Mapped: the device can address the memory (gpuStreamWriteValue32 stores into it); portable: for
// every device of the process.
inline hipError_t gpuHostRegister(void* p, size_t bytes) {
  return hipHostRegister(p, bytes, hipHostRegisterMapped | hipHostRegisterPortable);
}
// After the work queued on `stream` so far, the device stores `value` into `host_word` (4 bytes of
// host memory registered with gpuHostRegister), with a memory barrier before it: a host that sees
// the value sees everything that work wrote.
inline hipError_t gpuStreamWriteValue32(hipStream_t stream, void* host_word, uint32_t value) {
  void* device_word = nullptr;
  if (hipError_t err = hipHostGetDevicePointer(&device_word, host_word, 0); err != hipSuccess) return err;
  return hipStreamWriteValue32(stream, device_word, value, 0);
}
#define gpuHostUnregister hipHostUnregister
using gpuIpcMemHandle_t = hipIpcMemHandle_t;
#define gpuIpcGetMemHandle hipIpcGetMemHandle
#define gpuIpcCloseMemHandle hipIpcCloseMemHandle
inline hipError_t gpuIpcOpenMemHandle(void** p, hipIpcMemHandle_t h) {
  return hipIpcOpenMemHandle(p, h, hipIpcMemLazyEnablePeerAccess);
}
#else
#include <cuda_runtime.h>
#define FL_HIP 0
using gpuStream_t = cudaStream_t;
using gpuEvent_t = cudaEvent_t;
using gpuError_t = cudaError_t;
#define gpuSuccess cudaSuccess
#define gpuGetLastError cudaGetLastError
#define gpuGetErrorString cudaGetErrorString
#define gpuMalloc cudaMalloc
#define gpuFree cudaFree
#define gpuMemcpy cudaMemcpy
#define gpuMemcpyAsync cudaMemcpyAsync
#define gpuMemsetAsync cudaMemsetAsync
#define gpuMemcpyHostToDevice cudaMemcpyHostToDevice
#define gpuMemcpyDeviceToHost cudaMemcpyDeviceToHost
#define gpuMemcpyDeviceToDevice cudaMemcpyDeviceToDevice
#define gpuStreamCreateWithFlags cudaStreamCreateWithFlags
#define gpuStreamNonBlocking cudaStreamNonBlocking
#define gpuStreamDestroy cudaStreamDestroy
#define gpuStreamSynchronize cudaStreamSynchronize
#define gpuEventCreate cudaEventCreate
#define gpuEventCreateWithFlags cudaEventCreateWithFlags
#define gpuEventDisableTiming cudaEventDisableTiming
#define gpuEventDestroy cudaEventDestroy
#define gpuEventRecord cudaEventRecord
#define gpuEventSynchronize cudaEventSynchronize
#define gpuEventElapsedTime cudaEventElapsedTime
#define gpuGetDeviceCount cudaGetDeviceCount
#define gpuSetDevice cudaSetDevice
#define gpuGetDeviceProperties cudaGetDeviceProperties
#define gpuDeviceProp cudaDeviceProp
#define gpuFuncSetAttribute cudaFuncSetAttribute
#define gpuDeviceSynchronize cudaDeviceSynchronize
#define gpuErrorMemoryAllocation cudaErrorMemoryAllocation
#define gpuPeekAtLastError cudaPeekAtLastError
#define gpuFuncGetAttributes cudaFuncGetAttributes
using gpuFuncAttributes = cudaFuncAttributes;
#define gpuMemset cudaMemset
#define gpuGetDevice cudaGetDevice
#define gpuMemGetInfo cudaMemGetInfo
using gpuGraph_t = cudaGraph_t;
using gpuGraphExec_t = cudaGraphExec_t;
#define gpuStreamBeginCapture cudaStreamBeginCapture
#define gpuStreamEndCapture cudaStreamEndCapture
#define gpuStreamCaptureModeThreadLocal cudaStreamCaptureModeThreadLocal
#define gpuGraphLaunch cudaGraphLaunch
#define gpuGraphDestroy cudaGraphDestroy
#define gpuGraphExecDestroy cudaGraphExecDestroy
using gpuMemPool_t = cudaMemPool_t;
#define gpuMallocAsync cudaMallocAsync
#define gpuFreeAsync cudaFreeAsync
#define gpuDeviceGetDefaultMemPool cudaDeviceGetDefaultMemPool
#define gpuMemPoolSetAttribute cudaMemPoolSetAttribute
#define gpuMemPoolTrimTo cudaMemPoolTrimTo
#define gpuMemPoolAttrReleaseThreshold cudaMemPoolAttrReleaseThreshold
#define gpuFreeHost cudaFreeHost
// Portable: page-locked for every device of the process (a server serving several GPUs stages
// every device's requests in one pool).
inline cudaError_t gpuHostAlloc(void** p, size_t bytes) { return cudaHostAlloc(p, bytes, cudaHostAllocPortable); }
// Mapped: the device can address the memory (gpuStreamWriteValue32 stores into it); portable: for
// every device of the process.
inline cudaError_t gpuHostRegister(void* p, size_t bytes) {
  return cudaHostRegister(p, bytes, cudaHostRegisterMapped | cudaHostRegisterPortable);
}
// After the work queued on `stream` so far, the device stores `value` into `host_word` (4 bytes of
// host memory registered with gpuHostRegister), with a memory barrier before it: a host that sees
// the value sees everything that work wrote. A stream memory operation (cuStreamWriteValue32): no
// kernel launch, and no host thread involved once it is queued. The runtime API has none, so the
// driver's entry point is looked up once (no link-time dependency on libcuda).
cudaError_t gpuStreamWriteValue32(cudaStream_t stream, void* host_word, uint32_t value);  // gpu_context.cc
#define gpuHostUnregister cudaHostUnregister
using gpuIpcMemHandle_t = cudaIpcMemHandle_t;
#define gpuIpcGetMemHandle cudaIpcGetMemHandle
#define gpuIpcCloseMemHandle cudaIpcCloseMemHandle
inline cudaError_t gpuIpcOpenMemHandle(void** p, cudaIpcMemHandle_t h) {
  return cudaIpcOpenMemHandle(p, h, cudaIpcMemLazyEnablePeerAccess);
}
#endif

// cudaGraphInstantiate lost its error-node/log arguments in CUDA 12; HIP 5.x still has them.
inline gpuError_t gpuGraphInstantiate(gpuGraphExec_t* exec, gpuGraph_t graph) {
#if FL_HIP
  return hipGraphInstantiate(exec, graph, nullptr, nullptr, 0);
#else
  return cudaGraphInstantiate(exec, graph, 0);
#endif
}

namespace fusedlayer::gpu {

#if FL_HIP
#if defined(__AMDGCN_WAVEFRONT_SIZE)
inline constexpr int kWarpSize = __AMDGCN_WAVEFRONT_SIZE;
#else
inline constexpr int kWarpSize = 64;
#endif
#else
inline constexpr int kWarpSize = 32;
#endif

#if FL_GPU_COMPILER
// Correctly rounded fp32 division and square root, whatever the fast-math flags. The contracts
// (spec/swa.md, spec/mhc.md) specify IEEE division; nvcc's and clang's defaults are IEEE too, but
// spelling it out keeps a stray -use_fast_math / -ffast-math from silently changing the numerics.
__device__ __forceinline__ float DivRn(float a, float b) { return __fdiv_rn(a, b); }
__device__ __forceinline__ float SqrtRn(float a) { return __fsqrt_rn(a); }
__device__ __forceinline__ float RcpRn(float a) { return __frcp_rn(a); }

// 16-byte global load of data the kernel only reads (read-only / non-coherent path on NVIDIA).
__device__ __forceinline__ uint4 LoadReadOnly16(const void* p) {
#if FL_HIP
  return *static_cast<const uint4*>(p);
#else
  return __ldg(static_cast<const uint4*>(p));
#endif
}

// Butterfly shuffle within groups of `width` lanes (width a power of two <= kWarpSize).
template <typename T>
__device__ __forceinline__ T ShflXor(T v, int lane_mask, int width = kWarpSize) {
#if FL_HIP
  return __shfl_xor(v, lane_mask, width);
#else
  return __shfl_xor_sync(0xffffffffu, v, lane_mask, width);
#endif
}
template <typename T>
__device__ __forceinline__ T Shfl(T v, int src_lane, int width = kWarpSize) {
#if FL_HIP
  return __shfl(v, src_lane, width);
#else
  return __shfl_sync(0xffffffffu, v, src_lane, width);
#endif
}
// ---- Programmatic dependent launch (PDL), the one implementation for both ops --------------------
// On CUDA sm_90+ a kernel launched with the programmatic-stream-serialization attribute may be
// scheduled while the previous kernel on its stream is still finishing: what overlaps is launch,
// block scheduling and reads of weights, never activations, because every such kernel calls
// GridDependencyWait() (the previous grid has completed and its memory is visible) before its first
// access to anything a previous kernel may have written. Before that wait a kernel may read only
// weights: device buffers written once at upload, synchronously, before any launch can name them
// (GpuUpload), and never written again. A producer may call LaunchDependents() to let its dependent
// be scheduled early, and only after its own GridDependencyWait (otherwise a chain of such kernels,
// e.g. a graph of mHC seams, lets every later kernel in, each resident and waiting); the dependent's
// wait is still for the producer's whole grid. Both are no-ops on HIP and older targets.
__device__ __forceinline__ void GridDependencyWait() {
#if !FL_HIP && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void LaunchDependents() {
#if !FL_HIP && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
// Asks L2 for the 128-byte line holding `p` without waiting for it (prefetch.global.L2): a kernel
// warms the weights it will need after GridDependencyWait while the previous kernel still runs.
// A hint only (no-op on HIP); never for activations, which the previous kernel may still write.
__device__ __forceinline__ void PrefetchWeightL2(const void* p) {
#if !FL_HIP && defined(__CUDA_ARCH__)
  asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
#else
  (void)p;
#endif
}

// Launches `kernel` on `stream` and returns the launch's error. With `pdl` (CUDA) the launch
// carries the programmatic-stream-serialization attribute; HIP, or a launch that refuses the
// attribute, gets a plain launch (the kernel's GridDependencyWait is then trivially satisfied by
// stream order), so PDL is only ever a latency optimisation, never a condition for correctness.
template <typename... KArgs, typename... Args>
gpuError_t LaunchKernel(bool pdl, void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t dynamic_smem,
                        gpuStream_t stream, Args... args) {
#if !FL_HIP
  if (pdl) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = dynamic_smem;
    cfg.stream = stream;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    if (cudaLaunchKernelEx(&cfg, kernel, KArgs(args)...) == cudaSuccess) return cudaSuccess;
    (void)cudaGetLastError();  // refused: launch without the attribute below
  }
#else
  (void)pdl;
#endif
  kernel<<<grid, block, dynamic_smem, stream>>>(KArgs(args)...);
  return gpuGetLastError();
}
#endif

}  // namespace fusedlayer::gpu
