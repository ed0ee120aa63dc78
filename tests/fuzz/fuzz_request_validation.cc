// libFuzzer target: the server's request decoding and validation (op_calls.h / tensor_codec.h) on
// arbitrary MhcSeamRequest / SwaNormQuantRequest messages, against a small CPU weight set; when a
// request passes validation the op runs on every path the backend offers for it, as the service
// would (tiny shapes: --max_tokens is 16 here).
//
// Input: byte 0 selects the op (bit 0: 0 = mHC, 1 = SWA) and the weight set (bit 1: 0 = e4m3fn,
// fp32 row-major scales, with wq_b and norm weight; 1 = e4m3fnuz, ue8m0 column-major TMA scales,
// neither), and bit 2 decodes with a shared-memory transfer (server/transport/shared_memory.h)
// over one real POSIX shared-memory object of 64 KiB registered as regions "r0" (all of it) and
// "r1" (its second half) by the anonymous identity; the outputs placed there are written back
// after the run. The rest is the serialized request (inputs that do not parse are skipped).
//
// Never allowed: a crash, an out-of-bounds access or UB (ASan/UBSan), a leak, an error without a
// message, a run that fails after validation passed (the decoder and the backend disagree on what
// is valid), or a fused path that FusedSupport promised and the backend then refused.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>

#include "absl/status/statusor.h"
#include "fusedlayer/backend.h"
#include "fusedlayer/v1/fusedlayer.pb.h"
#include "google/protobuf/stubs/logging.h"
#include "fuzz_weights_fixture.h"
#include "prometheus/registry.h"
#include "runtime/output_buffers.h"
#include "rpc/proto_convert.h"
#include "transport/cuda_shared_memory.h"
#include "transport/shared_memory.h"
#include "weights/weight_set.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <string>
#include <tuple>

namespace {

using fusedlayer::Path;

constexpr int64_t kMaxTokens = 16;

struct Fixture {
  std::unique_ptr<fusedlayer::Backend> cpu;
  std::shared_ptr<const fusedlayer::server::WeightSet> sets[2];
  prometheus::Registry metrics;
  std::unique_ptr<fusedlayer::server::transport::SharedMemoryRegistry> shm;
  // On (the flag), but the CPU backend opens no CUDA IPC handle: every CUDA shared-memory reference
  // must come back as a status (FAILED_PRECONDITION), never reach a kernel.
  std::unique_ptr<fusedlayer::server::transport::CudaSharedMemoryRegistry> cuda;
};

constexpr uint64_t kShmBytes = 64 << 10;

// One object per fuzzing process (its pid in the name), kept until exit: the registry checks at
// every use that the key still names it.
void RegisterRegions(Fixture* f) {
  const std::string key = "/fl-fuzz-" + std::to_string(::getpid());
  ::shm_unlink(key.c_str());
  const int fd = ::shm_open(key.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
  if (fd < 0 || ::ftruncate(fd, kShmBytes) != 0) {
    std::fprintf(stderr, "fuzz_request_validation: cannot create %s\n", key.c_str());
    std::abort();
  }
  ::close(fd);
  for (auto [name, offset, bytes] : {std::tuple{"r0", uint64_t{0}, kShmBytes}, {"r1", kShmBytes / 2, kShmBytes / 2}}) {
    fusedlayer::v1::RegisterSystemSharedMemoryRequest r;
    r.set_name(name);
    r.set_key(key);
    r.set_offset(offset);
    r.set_byte_size(bytes);
    if (absl::Status s = f->shm->Register("anonymous", r); !s.ok()) {
      std::fprintf(stderr, "fuzz_request_validation: registering %s failed: %s\n", name, s.ToString().c_str());
      std::abort();
    }
  }
  std::atexit([] { ::shm_unlink(("/fl-fuzz-" + std::to_string(::getpid())).c_str()); });
}

Fixture* MakeFixture() {
  // Invalid UTF-8 in string fields makes ParseFromArray fail (the input is skipped) and log an
  // ERROR line per input; the log would drown libFuzzer's own output.
  google::protobuf::SetLogHandler(nullptr);
  auto* f = new Fixture;
  f->cpu = fusedlayer::CreateCpuBackend({.num_threads = 1});
  for (int v = 0; v < 2; ++v) {
    fusedlayer::server::PackedWeightSet p = fusedlayer::fuzz::SmallPackedSet(v);
    auto set = fusedlayer::server::BuildWeightSet(*f->cpu, p.first, p.second, "fuzz");
    if (!set.ok() || !(*set)->has_mhc() || !(*set)->has_swa()) {
      std::fprintf(stderr, "fuzz_request_validation: building the weight set failed: %s\n",
                   set.status().ToString().c_str());
      std::abort();
    }
    f->sets[v] = *set;
  }
  f->shm = std::make_unique<fusedlayer::server::transport::SharedMemoryRegistry>(
      fusedlayer::server::transport::SharedMemoryLimits{.enabled = true}, f->metrics);
  RegisterRegions(f);
  f->cuda = std::make_unique<fusedlayer::server::transport::CudaSharedMemoryRegistry>(
      fusedlayer::server::transport::CudaSharedMemoryLimits{.enabled = true}, f->metrics, f->cpu.get());
  return f;
}

[[noreturn]] void Fail(const char* op, Path path, const absl::Status& s) {
  std::fprintf(stderr, "fuzz_request_validation: %s request passed validation but the %s run failed: %s\n", op,
               fusedlayer::PathName(path), s.ToString().c_str());
  std::abort();
}

void CheckError(const absl::Status& s) {
  if (s.message().empty()) {
    std::fprintf(stderr, "fuzz_request_validation: error without a message: %s\n", s.ToString().c_str());
    std::abort();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static Fixture* const fx = MakeFixture();
  if (size < 1) return -1;
  const bool swa = data[0] & 1;
  const fusedlayer::server::WeightSet& set = *fx->sets[(data[0] >> 1) & 1];
  std::unique_ptr<fusedlayer::server::transport::TensorTransfer> transfer;
  if (data[0] & 4) {
    transfer =
        std::make_unique<fusedlayer::server::transport::TensorTransfer>(fx->shm.get(), fx->cuda.get(), "anonymous");
  }
  // Outputs in the message, or outside it as the server keeps them (placed outputs included).
  fusedlayer::server::OutputBuffers outside;
  fusedlayer::server::OutputBuffers* const external = (data[0] & 8) ? &outside : nullptr;
  // After a run: the placed outputs go to the object (never fails while the object stands).
  auto write_back = [&] {
    if (transfer == nullptr) return;
    if (absl::Status s = transfer->WriteOutputs(external); !s.ok()) {
      std::fprintf(stderr, "fuzz_request_validation: writing placed outputs failed: %s\n", s.ToString().c_str());
      std::abort();
    }
  };
  const void* msg = data + 1;
  const int len = static_cast<int>(size - 1);

  if (!swa) {
    fusedlayer::v1::MhcSeamRequest req;
    if (!req.ParseFromArray(msg, len)) return -1;
    fusedlayer::v1::MhcSeamResponse resp;
    absl::StatusOr<fusedlayer::server::MhcCall> call =
        fusedlayer::server::DecodeMhcRequest(req, *set.on(0).mhc, kMaxTokens, &resp, transfer.get(), external);
    if (!call.ok()) return CheckError(call.status()), 0;
    for (Path path : {Path::kUnfused, Path::kFused}) {
      if (path == Path::kFused && !fx->cpu->MhcFusedSupport(*set.on(0).mhc, call->query).supported) continue;
      absl::StatusOr<fusedlayer::RunStats> r = fusedlayer::server::RunMhcCall(*fx->cpu, *set.on(0).mhc, call->args, path);
      if (!r.ok()) Fail("mhc", path, r.status());
    }
    write_back();
  } else {
    fusedlayer::v1::SwaNormQuantRequest req;
    if (!req.ParseFromArray(msg, len)) return -1;
    fusedlayer::v1::SwaNormQuantResponse resp;
    absl::StatusOr<fusedlayer::server::SwaCall> call =
        fusedlayer::server::DecodeSwaRequest(req, *set.on(0).swa, kMaxTokens, &resp, transfer.get(), external);
    if (!call.ok()) return CheckError(call.status()), 0;
    for (Path path : {Path::kUnfused, Path::kFused}) {
      if (path == Path::kFused && !fx->cpu->SwaFusedSupport(*set.on(0).swa, call->query).supported) continue;
      absl::StatusOr<fusedlayer::RunStats> r = fusedlayer::server::RunSwaCall(*fx->cpu, *set.on(0).swa, call->args, path);
      if (!r.ok()) Fail("swa", path, r.status());
    }
    write_back();
  }
  return 0;
}
