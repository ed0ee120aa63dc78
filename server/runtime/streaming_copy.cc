#include "runtime/streaming_copy.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define FUSEDLAYER_STREAMING_COPY_X86 1
#endif

namespace fusedlayer::server {

#if FUSEDLAYER_STREAMING_COPY_X86
namespace {
// 32-byte AVX2 loads and streaming stores, four per iteration (two cache lines). The destination
// is aligned first (a streaming store of a whole aligned vector); the source may be anywhere.
__attribute__((target("avx2"))) void StreamAvx2(char* dst, const char* src, size_t n) {
  const size_t head = std::min(n, (32 - (reinterpret_cast<uintptr_t>(dst) & 31)) & size_t{31});
  std::memcpy(dst, src, head);
  dst += head;
  src += head;
  n -= head;
  for (; n >= 128; n -= 128, dst += 128, src += 128) {
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 32));
    const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 64));
    const __m256i d = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 96));
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst), a);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + 32), b);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + 64), c);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + 96), d);
  }
  std::memcpy(dst, src, n);  // the tail, under 128 bytes
}

const bool kHasAvx2 = __builtin_cpu_supports("avx2");
}  // namespace

bool StreamingCopySupported() { return kHasAvx2; }

void StreamingCopy(void* dst, const void* src, size_t n) {
  if (kHasAvx2) {
    StreamAvx2(static_cast<char*>(dst), static_cast<const char*>(src), n);
  } else {
    std::memcpy(dst, src, n);
  }
}

void StreamingCopyFence() { _mm_sfence(); }

#else

bool StreamingCopySupported() { return false; }
void StreamingCopy(void* dst, const void* src, size_t n) { std::memcpy(dst, src, n); }
void StreamingCopyFence() {}

#endif

}  // namespace fusedlayer::server
