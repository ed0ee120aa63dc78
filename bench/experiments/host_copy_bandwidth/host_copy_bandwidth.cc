// How fast one host thread (and 2 or 4) gathers a request's data into pinned staging: memcpy
// (what the server did before runtime/streaming_copy.h) against StreamingCopy, the source warm (just
// written by the copying thread, as gRPC's read leaves a request's slices) or cold (evicted), cut
// into pieces of 8 KiB or 1 MiB (gRPC's slices), into page-locked (cudaHostAlloc) or pageable memory.
// Medians of 21 copies, GB/s. Not part of the build:
//   g++ -O2 -std=c++20 -I server -I /usr/local/cuda/include \
//     bench/experiments/host_copy_bandwidth/host_copy_bandwidth.cc server/runtime/streaming_copy.cc \
//     -L /usr/local/cuda/lib64 -lcudart -lpthread -o /tmp/host_copy_bandwidth
#include <cuda_runtime.h>

#include <algorithm>
#include <barrier>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

#include "runtime/streaming_copy.h"

namespace {
using fusedlayer::server::StreamingCopy;
using fusedlayer::server::StreamingCopyFence;

std::vector<char> g_scratch(size_t{512} << 20);

void Evict() {
  for (size_t i = 0; i < g_scratch.size(); i += 64) g_scratch[i] = static_cast<char>(i);
}

struct Setup {
  size_t bytes, piece;
  bool pinned, warm, streaming;
  int threads;
};

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

double Measure(const Setup& s, char* src, char* dst) {
  std::vector<double> gbs;
  for (int rep = 0; rep < 21; ++rep) {
    // The source as gRPC's read leaves it: written by this process just before (warm: by the
    // copying threads themselves, each its share) or long before (cold).
    std::barrier sync(s.threads + 1);
    std::vector<std::thread> ts;
    // Each thread's own start and end (a barrier's wake-up is not the copy's time).
    std::vector<std::chrono::steady_clock::time_point> begin(s.threads), end(s.threads);
    const size_t share = (s.bytes / s.threads + 4095) / 4096 * 4096;
    for (int t = 0; t < s.threads; ++t) {
      ts.emplace_back([&, t] {
        const size_t b = std::min(s.bytes, t * share), e = std::min(s.bytes, b + share);
        if (s.warm) std::memset(src + b, rep + t, e - b);
        sync.arrive_and_wait();  // ready
        sync.arrive_and_wait();  // go
        begin[t] = std::chrono::steady_clock::now();
        for (size_t off = b; off < e; off += s.piece) {
          const size_t n = std::min(s.piece, e - off);
          if (s.streaming) {
            StreamingCopy(dst + off, src + off, n);
          } else {
            std::memcpy(dst + off, src + off, n);
          }
        }
        if (s.streaming) StreamingCopyFence();
        end[t] = std::chrono::steady_clock::now();
        sync.arrive_and_wait();  // done
      });
    }
    if (!s.warm) {
      std::memset(src, rep, s.bytes);
      Evict();
    }
    sync.arrive_and_wait();
    sync.arrive_and_wait();
    sync.arrive_and_wait();
    for (auto& t : ts) t.join();
    const double sec =
        std::chrono::duration<double>(*std::max_element(end.begin(), end.end()) - *std::min_element(begin.begin(), begin.end()))
            .count();
    if (std::memcmp(src, dst, s.bytes) != 0) {
      std::printf("MISMATCH\n");
      std::exit(1);
    }
    gbs.push_back(s.bytes / sec / 1e9);
  }
  return Median(gbs);
}
}  // namespace

int main() {
  const size_t kMax = 4718592;  // an mHC seam C = 7168 T = 64's inputs: 4.5 MiB
  char* pinned = nullptr;
  if (cudaHostAlloc(&pinned, kMax, cudaHostAllocDefault) != cudaSuccess) {
    pinned = nullptr;
    std::printf("cudaHostAlloc failed (no device?): pageable rows only\n");
  }
  std::vector<char> pageable(kMax, 1), src(kMax, 2);
  std::printf("streaming stores supported: %d; hardware threads %u\n",
              fusedlayer::server::StreamingCopySupported(), std::thread::hardware_concurrency());
  std::printf("%-9s %-7s %-9s %-5s %-3s %9s %9s %7s\n", "bytes", "piece", "dest", "src", "thr", "memcpy", "stream",
              "ratio");
  for (size_t bytes : {kMax, size_t{262144}}) {
    for (size_t piece : {size_t{8192}, size_t{1} << 20}) {
      for (bool pin : {true, false}) {
        if (pin && pinned == nullptr) continue;
        for (bool warm : {true, false}) {
          for (int threads : {1, 2, 4}) {
            if (bytes < kMax && threads > 1) continue;
            Setup s{bytes, piece, pin, warm, false, threads};
            char* dst = pin ? pinned : pageable.data();
            const double a = Measure(s, src.data(), dst);
            s.streaming = true;
            const double b = Measure(s, src.data(), dst);
            std::printf("%-9zu %-7zu %-9s %-5s %-3d %9.2f %9.2f %7.2f\n", bytes, piece, pin ? "pinned" : "pageable",
                        warm ? "warm" : "cold", threads, a, b, b / a);
          }
        }
      }
    }
  }
  if (pinned != nullptr) cudaFreeHost(pinned);
  return 0;
}
