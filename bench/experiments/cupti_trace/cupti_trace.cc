// A CUPTI activity tracer loaded into an unmodified process through CUDA_INJECTION64_PATH (the
// CUDA runtime calls InitializeInjection when it initialises): every kernel, memcpy and CUDA
// runtime API call of the process is written to $CUPTI_TRACE_OUT as CSV. For machines without
// Nsight Systems (the device machine has only ncu, which does not show a timeline). Measurement
// only: never linked into fusedlayer. Build and use: run.sh next to this file.
//
// Records: K,start_ns,end_ns,stream,name   M<copyKind>,start_ns,end_ns,stream,bytes
//          R,start_ns,end_ns,thread,api_name
#include <cupti.h>

#include <cstdio>
#include <cstdlib>
#include <mutex>

#ifndef KERNEL_RECORD
#error "build with -DKERNEL_RECORD=CUpti_ActivityKernelN (the newest in cupti_activity.h)"
#endif
#ifndef MEMCPY_RECORD
#error "build with -DMEMCPY_RECORD=CUpti_ActivityMemcpyN"
#endif

namespace {

FILE* g_out = nullptr;
std::mutex g_mu;

void CUPTIAPI BufferRequested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *size = size_t{8} << 20;
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(8, *size));
  *max_records = 0;
}

void CUPTIAPI BufferCompleted(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
  std::lock_guard<std::mutex> lock(g_mu);
  CUpti_Activity* record = nullptr;
  while (cuptiActivityGetNextRecord(buffer, valid, &record) == CUPTI_SUCCESS) {
    if (record->kind == CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) {
      auto* k = reinterpret_cast<KERNEL_RECORD*>(record);
      std::fprintf(g_out, "K,%llu,%llu,%u,%s\n", static_cast<unsigned long long>(k->start),
                   static_cast<unsigned long long>(k->end), k->streamId, k->name);
    } else if (record->kind == CUPTI_ACTIVITY_KIND_MEMCPY) {
      auto* m = reinterpret_cast<MEMCPY_RECORD*>(record);
      std::fprintf(g_out, "M%u,%llu,%llu,%u,%llu\n", static_cast<unsigned>(m->copyKind),
                   static_cast<unsigned long long>(m->start), static_cast<unsigned long long>(m->end), m->streamId,
                   static_cast<unsigned long long>(m->bytes));
    } else if (record->kind == CUPTI_ACTIVITY_KIND_RUNTIME) {
      auto* r = reinterpret_cast<CUpti_ActivityAPI*>(record);
      const char* name = "?";
      cuptiGetCallbackName(CUPTI_CB_DOMAIN_RUNTIME_API, r->cbid, &name);
      std::fprintf(g_out, "R,%llu,%llu,%u,%s\n", static_cast<unsigned long long>(r->start),
                   static_cast<unsigned long long>(r->end), r->threadId, name);
    }
  }
  std::fflush(g_out);
  std::free(buffer);
}

}  // namespace

extern "C" int InitializeInjection(void) {
  const char* path = std::getenv("CUPTI_TRACE_OUT");
  g_out = std::fopen(path != nullptr ? path : "cupti_trace.csv", "w");
  if (g_out == nullptr) return 0;
  cuptiActivityRegisterCallbacks(BufferRequested, BufferCompleted);
  cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL);
  cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMCPY);
  cuptiActivityEnable(CUPTI_ACTIVITY_KIND_RUNTIME);
  cuptiActivityFlushPeriod(500);  // ms: the server may be stopped by a signal, not only exit()
  std::atexit([] { cuptiActivityFlushAll(1); });
  return 1;
}
