// See cublaslt_loader.h.
#include "cublaslt_loader.h"

#include <dlfcn.h>

#include "absl/strings/str_cat.h"

namespace fusedlayer::gpu {
namespace {

struct Loaded {
  CublasLtApi api{};
  bool ok = false;
  std::string why_not;
};

template <typename Fn>
bool Resolve(void* lib, const char* name, Fn* out, std::string* why_not) {
  void* sym = dlsym(lib, name);
  if (sym == nullptr) {
    *why_not = absl::StrCat("symbol ", name, " not found in libcublasLt");
    return false;
  }
  *out = reinterpret_cast<Fn>(sym);
  return true;
}

Loaded Load() {
  Loaded l;
  const std::string soname = absl::StrCat("libcublasLt.so.", CUBLAS_VER_MAJOR);
  void* lib = dlopen(soname.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    const char* err = dlerror();
    l.why_not = absl::StrCat("cannot load ", soname, ": ", err != nullptr ? err : "unknown error");
    return l;
  }
  CublasLtApi& a = l.api;
  std::string& w = l.why_not;
  l.ok = Resolve(lib, "cublasLtCreate", &a.Create, &w) && Resolve(lib, "cublasLtDestroy", &a.Destroy, &w) &&
         Resolve(lib, "cublasLtGetStatusName", &a.GetStatusName, &w) &&
         Resolve(lib, "cublasLtGetVersion", &a.GetVersion, &w) && Resolve(lib, "cublasLtMatmul", &a.Matmul, &w) &&
         Resolve(lib, "cublasLtMatmulAlgoCapGetAttribute", &a.MatmulAlgoCapGetAttribute, &w) &&
         Resolve(lib, "cublasLtMatmulAlgoCheck", &a.MatmulAlgoCheck, &w) &&
         Resolve(lib, "cublasLtMatmulAlgoConfigGetAttribute", &a.MatmulAlgoConfigGetAttribute, &w) &&
         Resolve(lib, "cublasLtMatmulAlgoGetHeuristic", &a.MatmulAlgoGetHeuristic, &w) &&
         Resolve(lib, "cublasLtMatmulDescSetAttribute", &a.MatmulDescSetAttribute, &w) &&
         Resolve(lib, "cublasLtMatmulPreferenceSetAttribute", &a.MatmulPreferenceSetAttribute, &w) &&
         Resolve(lib, "cublasLtMatmulDescInit_internal", &a.MatmulDescInit, &w) &&
         Resolve(lib, "cublasLtMatrixLayoutInit_internal", &a.MatrixLayoutInit, &w) &&
         Resolve(lib, "cublasLtMatmulPreferenceInit_internal", &a.MatmulPreferenceInit, &w);
  return l;  // the library stays loaded either way (dlclose of a CUDA library is not worth the risk)
}

}  // namespace

const CublasLtApi* LoadCublasLt(std::string* why_not) {
  static const Loaded loaded = Load();  // thread-safe one-time initialisation
  if (!loaded.ok) {
    if (why_not != nullptr) *why_not = loaded.why_not;
    return nullptr;
  }
  return &loaded.api;
}

}  // namespace fusedlayer::gpu
