// libFuzzer target: the server's own reader of compute requests (server/rpc/wire_messages.h,
// ReadWireRequest). Every server with a device backend reads each MhcSeam / SwaNormQuant request
// with it: a hand-written protobuf wire parser over gRPC's slices that moves the tensors' data into
// a pinned block and leaves the rest to protobuf. It is differential: protobuf's own parse of the
// same bytes is the oracle.
//
// Input: byte 0: bit 0 the message (0 MhcSeamRequest, 1 SwaNormQuantRequest), bits 1-7 the seed of
// where the bytes are cut into slices (as gRPC may hand them over: empty, 1-byte, short and long
// slices, so every varint, key and length may straddle a boundary); the rest is the wire bytes.
//
// Never allowed: a crash, an out-of-bounds access or UB, a leak (ASan/UBSan); gRPC's buffer left
// unread; a verdict other than protobuf's (OK exactly when protobuf parses the bytes, else
// INVALID_ARGUMENT with a message and nothing moved); a moved tensor's data outside the block, off
// WireTensorData::kAlign, or still in the message; a read message that, with the moved data put
// back (MoveIntoMessages), serializes differently from protobuf's; a block not given back.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "runtime/host_staging_pool.h"
#include "runtime/parallel_copy.h"
#include "fusedlayer/v1/fusedlayer.pb.h"
#include "google/protobuf/stubs/logging.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/slice.h"
#include "lane_test_backend.h"  // tests/server: a non-host-accessible backend with host staging
#include "rpc/wire_messages.h"
#include "wire_reader_check.h"  // tests/server

namespace {

namespace v1 = fusedlayer::v1;
using fusedlayer::server::HostStagingPool;
using fusedlayer::server::ParallelCopy;
using fusedlayer::server::WireTensorData;

[[noreturn]] void Fail(const char* what) {
  std::fprintf(stderr, "fuzz_wire_reader: %s\n", what);
  std::abort();
}

struct Fixture {
  fusedlayer::testing::LaneTestBackend backend{1};
  HostStagingPool pool{backend, size_t{64} << 20};
  ParallelCopy copier{/*helper_threads=*/0};
};

Fixture& F() {
  static Fixture* f = [] {
    google::protobuf::SetLogHandler(nullptr);  // protobuf's parse errors are expected here
    return new Fixture();
  }();
  return *f;
}

// `bytes` cut into slices at points drawn from `seed` (a fixed LCG: the same input, the same cuts).
grpc::ByteBuffer Sliced(const std::string& bytes, uint32_t seed) {
  std::vector<grpc::Slice> slices;
  uint32_t s = seed * 2654435761u + 1;
  for (size_t at = 0; at < bytes.size();) {
    s = s * 1103515245u + 12345u;
    const uint32_t kind = (s >> 16) % 8;
    const size_t want = kind == 0 ? 0 : kind == 1 ? 1 : kind < 5 ? (s >> 8) % 64 : (s >> 4) % 8192;
    const size_t n = std::min(want, bytes.size() - at);
    slices.emplace_back(bytes.data() + at, n);
    at += n;
  }
  return grpc::ByteBuffer(slices.data(), slices.size());
}

template <typename Request>
void Check(const std::string& bytes, uint32_t seed) {
  Fixture& f = F();
  Request want;
  const bool parses = want.ParseFromString(bytes);
  {
    Request got;
    WireTensorData data;
    grpc::ByteBuffer wire = Sliced(bytes, seed);
    const absl::Status read = fusedlayer::server::ReadWireRequest(&wire, &got, &f.pool, &f.copier, &data);
    if (wire.Length() != 0) Fail("gRPC's buffer was not emptied");
    if (read.ok() != parses) {
      Fail(parses ? "protobuf parses the bytes, the reader refused them"
                  : "the reader accepted bytes protobuf refuses");
    }
    if (!read.ok()) {
      if (read.code() != absl::StatusCode::kInvalidArgument || read.message().empty()) {
        Fail("refused without INVALID_ARGUMENT and a message");
      }
      if (data.tensors() != 0) Fail("a refused request kept tensors in the block");
      return;
    }
    if (const std::string problem = fusedlayer::testing::MovedTensorsProblem(got, data); !problem.empty()) {
      Fail(problem.c_str());
    }
    data.MoveIntoMessages();
    if (data.tensors() != 0 || data.begin() != nullptr) Fail("MoveIntoMessages kept the block");
    if (got.SerializeAsString() != want.SerializeAsString()) Fail("the read message differs from protobuf's parse");
  }
  if (f.pool.in_use_bytes() != 0) Fail("a block was not given back to the pool");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const std::string bytes(reinterpret_cast<const char*>(data + 1), size - 1);
  const uint32_t seed = data[0] >> 1;
  if ((data[0] & 1) == 0) {
    Check<v1::MhcSeamRequest>(bytes, seed);
  } else {
    Check<v1::SwaNormQuantRequest>(bytes, seed);
  }
  return 0;
}
