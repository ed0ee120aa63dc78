// cuBLASLt, loaded at first use (dlopen) instead of at program start. CUDA builds only.
//
// Why not link it: libcublasLt.so.13 carries ~94 KB of thread-local storage. A library linked at
// start-up has its TLS carved out of every thread's stack, and civetweb (the /metrics endpoint,
// through prometheus-cpp) creates its threads with a ~100 KB stack, so its pthread_create fails and
// the server cannot serve metrics. A library loaded with dlopen keeps its TLS out of the thread
// stacks (glibc allocates it on first use in each thread). It also lets a CUDA build start on a host
// without cuBLAS: the wq_b projection then uses our own kernel (swa_launch.cc).
#pragma once

#include <cublasLt.h>

#include <string>

namespace fusedlayer::gpu {

// The entry points wq_b_cublaslt.cc uses. The *Init members are the library's *_internal
// functions behind cublasLt.h's inline cublasLt*Init wrappers (pass sizeof(*descriptor)).
struct CublasLtApi {
  decltype(&::cublasLtCreate) Create;
  decltype(&::cublasLtDestroy) Destroy;
  decltype(&::cublasLtGetStatusName) GetStatusName;
  decltype(&::cublasLtGetVersion) GetVersion;
  decltype(&::cublasLtMatmul) Matmul;
  decltype(&::cublasLtMatmulAlgoCapGetAttribute) MatmulAlgoCapGetAttribute;
  decltype(&::cublasLtMatmulAlgoCheck) MatmulAlgoCheck;
  decltype(&::cublasLtMatmulAlgoConfigGetAttribute) MatmulAlgoConfigGetAttribute;
  decltype(&::cublasLtMatmulAlgoGetHeuristic) MatmulAlgoGetHeuristic;
  decltype(&::cublasLtMatmulDescSetAttribute) MatmulDescSetAttribute;
  decltype(&::cublasLtMatmulPreferenceSetAttribute) MatmulPreferenceSetAttribute;
  decltype(&::cublasLtMatmulDescInit_internal) MatmulDescInit;
  decltype(&::cublasLtMatrixLayoutInit_internal) MatrixLayoutInit;
  decltype(&::cublasLtMatmulPreferenceInit_internal) MatmulPreferenceInit;
};

// The loaded library (libcublasLt.so.<major of the headers>), or nullptr with the reason in
// *why_not when the library or one of the symbols is missing. Loaded once per process; the
// library stays loaded. Thread-safe.
const CublasLtApi* LoadCublasLt(std::string* why_not = nullptr);

}  // namespace fusedlayer::gpu
