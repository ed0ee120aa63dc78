// Can a lane overlap a call's copy to the device, its kernels and its copy back on this host? The
// question behind splitting a large mHC call into token chunks: on the H200 an A/B of the server
// with chunked lanes gave no gain (device stage of mHC C = 7168 T = 64: 200 us one copy each
// way, 215-221 us as 2 chunks, 241-261 us as 4), so this measures the pieces with the CUDA runtime
// alone, no server:
//   1. one 4.59 MB copy (an mHC C = 7168 T = 64 call's inputs: x and R, bf16) each way alone, and
//      both at once on two streams: does the link carry both directions at full rate?
//   2. the chunk pipeline with a spin kernel standing in for the op (12 us a chunk, 17 us one
//      launch, as the server's kernel p50 said): 1, 2 and 4 chunks, wall time per call.
//   3. what each runtime call costs the enqueuing thread (cudaMemcpyAsync, cudaEventRecord,
//      cudaStreamWaitEvent, a launch): a chunked call makes ~3x the calls of one launch.
// Page-locked memory from cudaHostAlloc and from cudaHostRegister (how the server pins a request
// buffer or a client's shared memory). Medians of 101 repetitions. Result (H200, PCIe 5 x16): 94 us
// to the device, 91 us back, 103 us both at once (full duplex), 184 us one after the other; the chunk pipeline 202 us as
// one launch, 167 / 153 us as 2 / 4 chunks (one copy each way per chunk). So the link allows the
// overlap; a lane making the server's 7 copies each way for 2 chunks went only 196 -> 190 us
// (a chunked lane, not kept). Not part of the build:
//   nvcc -O2 -std=c++17 -arch=sm_90 bench/experiments/copy_overlap/copy_overlap.cu -o /tmp/copy_overlap
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <vector>

#define CHECK(x)                                                                              \
  do {                                                                                        \
    cudaError_t e_ = (x);                                                                     \
    if (e_ != cudaSuccess) {                                                                  \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                           \
    }                                                                                         \
  } while (0)

namespace {

// Runs for `ns` nanoseconds of the GPU's global timer (not SM cycles: the clock changes under load).
__global__ void Spin(long long ns) {
  unsigned long long start, now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  } while (static_cast<long long>(now - start) < ns);
}

double Now() {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Median wall time in us of `call` (enqueue + wait for `sync` streams), after 10 warm-up calls.
double MedianUs(const std::function<void()>& call, const std::vector<cudaStream_t>& sync) {
  std::vector<double> t;
  for (int i = 0; i < 111; ++i) {
    const double t0 = Now();
    call();
    for (cudaStream_t s : sync) CHECK(cudaStreamSynchronize(s));
    if (i >= 10) t.push_back(Now() - t0);
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

struct Buffers {
  char* host_in;
  char* host_out;
};

Buffers MakeHost(size_t bytes, bool registered) {
  Buffers b{nullptr, nullptr};
  for (char** p : {&b.host_in, &b.host_out}) {
    if (registered) {
      *p = static_cast<char*>(std::aligned_alloc(4096, bytes));
      CHECK(cudaHostRegister(*p, bytes, cudaHostRegisterDefault));
    } else {
      CHECK(cudaHostAlloc(reinterpret_cast<void**>(p), bytes, cudaHostAllocDefault));
    }
    for (size_t i = 0; i < bytes; i += 4096) (*p)[i] = static_cast<char>(i);
  }
  return b;
}

}  // namespace

int main() {
  const size_t bytes = size_t{64} * 7168 * 2 * 5;  // x [64, 7168] + R [64, 4, 7168], bf16: 4.59 MB
  cudaDeviceProp prop{};
  CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device %s, asyncEngineCount %d, copy %zu B each way\n", prop.name, prop.asyncEngineCount, bytes);
  char *dev_in, *dev_out;
  CHECK(cudaMalloc(&dev_in, bytes));
  CHECK(cudaMalloc(&dev_out, bytes));
  cudaStream_t compute, to_device, to_host;
  for (cudaStream_t* s : {&compute, &to_device, &to_host}) CHECK(cudaStreamCreateWithFlags(s, cudaStreamNonBlocking));
  const int kChunkEvents = 16;
  std::vector<cudaEvent_t> ev(kChunkEvents);
  for (auto& e : ev) CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  auto ns_for = [](double us) { return static_cast<long long>(us * 1000.0); };  // ns of the spin
  std::printf("spin 0 / 12 / 17 us: %.1f / %.1f / %.1f us launch to sync\n",
              MedianUs([&] { Spin<<<1, 32, 0, compute>>>(0); }, {compute}),
              MedianUs([&] { Spin<<<1, 32, 0, compute>>>(ns_for(12)); }, {compute}),
              MedianUs([&] { Spin<<<1, 32, 0, compute>>>(ns_for(17)); }, {compute}));

  for (bool registered : {false, true}) {
    Buffers h = MakeHost(bytes, registered);
    const char* kind = registered ? "cudaHostRegister" : "cudaHostAlloc";
    const double h2d = MedianUs([&] { CHECK(cudaMemcpyAsync(dev_in, h.host_in, bytes, cudaMemcpyHostToDevice, to_device)); },
                                {to_device});
    const double d2h = MedianUs([&] { CHECK(cudaMemcpyAsync(h.host_out, dev_out, bytes, cudaMemcpyDeviceToHost, to_host)); },
                                {to_host});
    const double both = MedianUs(
        [&] {
          CHECK(cudaMemcpyAsync(dev_in, h.host_in, bytes, cudaMemcpyHostToDevice, to_device));
          CHECK(cudaMemcpyAsync(h.host_out, dev_out, bytes, cudaMemcpyDeviceToHost, to_host));
        },
        {to_device, to_host});
    const double serial = MedianUs(
        [&] {
          CHECK(cudaMemcpyAsync(dev_in, h.host_in, bytes, cudaMemcpyHostToDevice, to_device));
          CHECK(cudaMemcpyAsync(h.host_out, dev_out, bytes, cudaMemcpyDeviceToHost, to_device));
        },
        {to_device});
    std::printf("[%s] to device %.1f us (%.1f GB/s), to host %.1f us (%.1f GB/s), both at once %.1f us, "
                "one after the other %.1f us\n",
                kind, h2d, bytes / h2d / 1e3, d2h, bytes / d2h / 1e3, both, serial);

    // The chunk pipeline: chunk c's copy in on to_device; compute waits for it and runs the op; to_host
    // waits for the op and copies chunk c back. A one-launch call is chunks = 1 on the compute stream.
    for (double op_us : {17.0, 12.0}) {
      for (int chunks : {1, 2, 4}) {
        const double chunk_op_us = chunks == 1 ? op_us : (op_us == 17.0 ? 12.0 : op_us);
        const long long spin_ns = ns_for(chunk_op_us);
        const size_t step = bytes / chunks;
        auto one_stream = [&] {
          CHECK(cudaMemcpyAsync(dev_in, h.host_in, bytes, cudaMemcpyHostToDevice, compute));
          Spin<<<1, 32, 0, compute>>>(spin_ns);
          CHECK(cudaMemcpyAsync(h.host_out, dev_out, bytes, cudaMemcpyDeviceToHost, compute));
        };
        auto pipelined = [&] {
          for (int c = 0; c < chunks; ++c) {
            const size_t off = c * step, n = c + 1 == chunks ? bytes - off : step;
            CHECK(cudaMemcpyAsync(dev_in + off, h.host_in + off, n, cudaMemcpyHostToDevice, to_device));
            CHECK(cudaEventRecord(ev[2 * c], to_device));
            CHECK(cudaStreamWaitEvent(compute, ev[2 * c], 0));
            Spin<<<1, 32, 0, compute>>>(spin_ns);
            CHECK(cudaEventRecord(ev[2 * c + 1], compute));
            CHECK(cudaStreamWaitEvent(to_host, ev[2 * c + 1], 0));
            CHECK(cudaMemcpyAsync(h.host_out + off, dev_out + off, n, cudaMemcpyDeviceToHost, to_host));
          }
        };
        if (chunks == 1) {
          std::printf("[%s] op %.0f us: one stream, one copy each way: %.1f us\n", kind, op_us,
                      MedianUs(one_stream, {compute}));
        } else {
          std::printf("[%s] op %.0f us: %d chunks (op %.0f us each), three streams: %.1f us\n", kind, op_us, chunks,
                      chunk_op_us, MedianUs(pipelined, {compute, to_device, to_host}));
        }
      }
    }
    if (registered) {
      CHECK(cudaHostUnregister(h.host_in));
      CHECK(cudaHostUnregister(h.host_out));
      std::free(h.host_in);
      std::free(h.host_out);
    } else {
      CHECK(cudaFreeHost(h.host_in));
      CHECK(cudaFreeHost(h.host_out));
    }
  }

  // What the enqueuing thread pays per runtime call (the GPU is kept busy by a long spin first, so
  // the calls queue and none waits for the device).
  {
    Buffers h = MakeHost(4096, false);
    const int n = 200;
    auto per_call = [&](const char* what, const std::function<void()>& call) {
      std::vector<double> t;
      for (int rep = 0; rep < 9; ++rep) {
        Spin<<<1, 32, 0, compute>>>(ns_for(3000.0));
        const double t0 = Now();
        for (int i = 0; i < n; ++i) call();
        t.push_back((Now() - t0) / n);
        CHECK(cudaDeviceSynchronize());
      }
      std::sort(t.begin(), t.end());
      std::printf("host cost per call: %-40s %.2f us\n", what, t[t.size() / 2]);
    };
    per_call("cudaMemcpyAsync 4 KiB to device", [&] {
      CHECK(cudaMemcpyAsync(dev_in, h.host_in, 4096, cudaMemcpyHostToDevice, compute));
    });
    per_call("cudaMemcpyAsync 4 KiB to host", [&] {
      CHECK(cudaMemcpyAsync(h.host_out, dev_out, 4096, cudaMemcpyDeviceToHost, compute));
    });
    per_call("cudaEventRecord", [&] { CHECK(cudaEventRecord(ev[0], compute)); });
    per_call("cudaEventRecord + cudaStreamWaitEvent", [&] {
      CHECK(cudaEventRecord(ev[0], compute));
      CHECK(cudaStreamWaitEvent(to_host, ev[0], 0));
    });
    per_call("kernel launch", [&] { Spin<<<1, 32, 0, compute>>>(0); });
  }
  return 0;
}
