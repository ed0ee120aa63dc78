// The pipelined data path (server/runtime/op_calls.h, device_lanes.h, host_staging_pool.h) on the
// lane test backend (lane_test_backend.h): a backend whose memory is apart from the host's and
// whose lanes execute their queues asynchronously on their own threads, so a missing wait, an
// early free or a copy from pageable memory shows up as a wrong result or a failed request.
//
// Pipeline.*: gRPC-free (the executor, lanes, staging pool and op calls driven directly), so they
// also run under ThreadSanitizer (scripts/sanitize.sh tsan). PipelineServer.*: the same through
// the gRPC service (ASan/UBSan and plain builds only: Debian's gRPC is not TSan-instrumented).
#include <algorithm>
#include <atomic>
#include <cstring>
#include <future>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "client/lib/fusedlayer_client.h"
#include "client/lib/wire_request.h"
#include "runtime/device_lanes.h"
#include "runtime/device_staging.h"
#include "runtime/executor.h"
#include "runtime/host_staging_pool.h"
#include "runtime/parallel_copy.h"
#include "runtime/streaming_copy.h"
#include "runtime/op_calls.h"
#include "runtime/output_buffers.h"
#include "gtest/gtest.h"
#include "lane_test_backend.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/slice.h"
#include "rpc/proto_convert.h"
#include "rpc/wire_messages.h"
#include "server_test_env.h"
#include "wire_reader_check.h"
#include "test_util.h"
#include "weights/weight_set.h"
#include "exec/weight_store.h"

namespace fusedlayer::testing {
namespace {

using server::DeviceLanes;
using server::Executor;
using server::ExecTarget;
using server::HostStagingPool;

// Fills every output view of a decoded call with a pattern no kernel writes for these inputs.
template <typename Args>
void PoisonOutputs(const Args& a);
template <>
void PoisonOutputs(const MhcArgs& a) {
  for (const TensorView* v : {&a.new_residual, &a.new_pre_mix, &a.new_post_mix, &a.new_comb_mix, &a.y, &a.aux}) {
    if (!v->empty_view()) std::memset(v->data, 0xEE, server::ViewExtentBytes(*v));
  }
}
template <>
void PoisonOutputs(const SwaArgs& a) {
  for (const TensorView* v : {&a.q_fp8, &a.q_scale, &a.kv, &a.q_proj}) {
    if (!v->empty_view()) std::memset(v->data, 0xEE, server::ViewExtentBytes(*v));
  }
}

// One weight set with both parts, built on the lane backend (as the server would) and on the CPU
// for the reference.
struct Fixture {
  explicit Fixture(int lanes, size_t staging_bytes = size_t{64} << 20, int max_lanes = 8, int copy_threads = 0)
      : rng(MakeRng()),
        packed(MakeWeightSet(rng, "p", MhcSetSpec{.hidden = 512}, SwaSetSpec{})),
        reference(packed) {
    auto be = std::make_unique<LaneTestBackend>(max_lanes);
    control = be->control();
    backend = std::move(be);
    auto built = server::BuildWeightSet(*backend, packed.first, packed.second, "test");
    EXPECT_TRUE(built.ok()) << built.status();
    if (built.ok()) set = *built;
    auto made = DeviceLanes::Create(*backend, lanes, staging_bytes, nullptr, copy_threads);
    EXPECT_TRUE(made.ok()) << made.status();
    if (made.ok()) device_lanes = std::move(*made);
  }

  // A fresh request, decoded into `response`, outputs poisoned; `out` keeps the decoded call.
  server::MhcCall Mhc(v1::MhcSeamRequest& request, v1::MhcSeamResponse& response, int64_t tokens) {
    MhcRequestSpec spec{.hidden = 512, .tokens = tokens};
    spec.capture_aux = tokens % 2 == 0;
    request = MakeMhcRequest(rng, "p", spec);
    auto call = server::DecodeMhcRequest(request, *set->on(0).mhc, int64_t{1} << 20, &response);
    EXPECT_TRUE(call.ok()) << call.status();
    PoisonOutputs(call->args);
    return *call;
  }
  server::SwaCall Swa(v1::SwaNormQuantRequest& request, v1::SwaNormQuantResponse& response, int64_t tokens) {
    request = MakeSwaRequest(rng, "p", tokens, /*row_stride=*/256 + 128 + 8 * (tokens % 3));
    auto call = server::DecodeSwaRequest(request, *set->on(0).swa, int64_t{1} << 20, &response);
    EXPECT_TRUE(call.ok()) << call.status();
    PoisonOutputs(call->args);
    return *call;
  }

  std::mt19937_64 rng;
  server::PackedWeightSet packed;
  Reference reference;
  std::shared_ptr<LaneTestBackend::Control> control;
  std::unique_ptr<Backend> backend;
  std::shared_ptr<const server::WeightSet> set;
  std::unique_ptr<DeviceLanes> device_lanes;  // destroyed before the backend
};

TEST(Pipeline, LaneCallsAreBitwiseTheCpuPathOnBothPaths) {
  Fixture f(/*lanes=*/2);
  ASSERT_NE(f.device_lanes, nullptr);
  ASSERT_EQ(f.device_lanes->lanes(), 2);
  for (Path path : {Path::kFused, Path::kUnfused}) {
    for (int64_t tokens : {0, 1, 7, 64, 300}) {  // 300: x is 1.2 MiB, staged in two chunks
      SCOPED_TRACE(::testing::Message() << "path " << static_cast<int>(path) << " T = " << tokens);
      v1::MhcSeamRequest mreq;
      v1::MhcSeamResponse mresp;
      server::MhcCall m = f.Mhc(mreq, mresp, tokens);
      auto ran = server::RunMhcCall(f.device_lanes->For(static_cast<int>(tokens % 2)), *f.set->on(0).mhc, m.args, path);
      ASSERT_TRUE(ran.ok()) << ran.status();
      EXPECT_GE(ran->kernel_seconds, 0.0);
      ExpectMhcEqual(mresp, f.reference.RunMhc(mreq, path));

      v1::SwaNormQuantRequest sreq;
      v1::SwaNormQuantResponse sresp;
      server::SwaCall s = f.Swa(sreq, sresp, tokens);
      auto sran = server::RunSwaCall(f.device_lanes->For(0), *f.set->on(0).swa, s.args, path);
      ASSERT_TRUE(sran.ok()) << sran.status();
      ExpectSwaEqual(sresp, f.reference.RunSwa(sreq, path));
    }
  }
  EXPECT_GT(f.control->lane_kernels.load(), 0);
  // Everything went through the lanes: the default context ran only the weight set's warm-ups
  // (none here: BuildWeightSet does not warm up).
  EXPECT_EQ(f.control->default_kernels.load(), 0);
  EXPECT_EQ(f.device_lanes->staging()->in_use_bytes(), 0u);
}

// ---- the request reader (rpc/wire_messages.h, ReadWireRequest) ----------------------------------

// `bytes` as gRPC could hand them over: cut into slices at random points (some empty, some 1 byte).
grpc::ByteBuffer SlicedBuffer(std::mt19937_64& rng, const std::string& bytes) {
  std::vector<grpc::Slice> slices;
  size_t at = 0;
  while (at < bytes.size()) {
    const int kind = static_cast<int>(rng() % 8);
    const size_t n = std::min(bytes.size() - at, kind == 0   ? size_t{0}
                                                 : kind == 1 ? size_t{1}
                                                 : kind < 5  ? static_cast<size_t>(rng() % 64)
                                                             : static_cast<size_t>(rng() % 40000));
    slices.emplace_back(bytes.data() + at, n);
    at += n;
  }
  return grpc::ByteBuffer(slices.data(), slices.size());
}

// What ReadWireRequest must agree with: protobuf's own parse of the same bytes. Returns the
// number of tensors whose data the reader moved to the block.
template <typename Request>
size_t ExpectReadAsProtobufParses(std::mt19937_64& rng, const std::string& bytes, HostStagingPool& pool,
                                server::ParallelCopy& copier, bool expect_moved) {
  Request want;
  const bool parses = want.ParseFromString(bytes);
  Request got;
  server::WireTensorData data;
  grpc::ByteBuffer wire = SlicedBuffer(rng, bytes);
  const absl::Status read = server::ReadWireRequest(&wire, &got, &pool, &copier, &data);
  EXPECT_EQ(wire.Length(), 0u);  // emptied either way
  EXPECT_EQ(read.ok(), parses) << read;
  if (!parses || !read.ok()) {
    EXPECT_EQ(read.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(data.tensors(), 0u);
    return 0;
  }
  if (expect_moved) EXPECT_GT(data.tensors(), 0u);
  // Every moved tensor: a dtype, no data left in the message, its bytes aligned in the block.
  EXPECT_EQ(MovedTensorsProblem(got, data), "");
  const size_t found = data.tensors();
  data.MoveIntoMessages();
  EXPECT_EQ(data.tensors(), 0u);
  EXPECT_EQ(got.SerializeAsString(), want.SerializeAsString());
  return found;
}

// On whole requests of every shape the tests make, sliced at random: the same message as protobuf
// parses, with the tensors' data in the block (aligned) instead of the message.
TEST(WireReader, ReadsWhatProtobufParsesWithTheDataInTheBlock) {
  LaneTestBackend backend(1);
  HostStagingPool pool(backend, size_t{64} << 20);
  server::ParallelCopy copier(/*helper_threads=*/2);
  std::mt19937_64 rng = MakeRng();
  for (int i = 0; i < 40; ++i) {
    SCOPED_TRACE(i);
    MhcRequestSpec spec{.hidden = 256, .tokens = static_cast<int64_t>(rng() % 3 == 0 ? 600 : rng() % 9)};
    spec.pre_mix = i % 2 == 0;
    spec.capture_aux = i % 3 == 0;
    v1::MhcSeamRequest m = MakeMhcRequest(rng, "w", spec);
    m.set_request_id("r" + std::to_string(i));
    if (i % 4 == 0) m.add_output_placements()->set_output("y");
    ExpectReadAsProtobufParses<v1::MhcSeamRequest>(rng, m.SerializeAsString(), pool, copier, true);
    v1::SwaNormQuantRequest sw = MakeSwaRequest(rng, "w", static_cast<int64_t>(rng() % 70), 256 + 128 + 8);
    ExpectReadAsProtobufParses<v1::SwaNormQuantRequest>(rng, sw.SerializeAsString(), pool, copier, true);
  }
  EXPECT_EQ(pool.in_use_bytes(), 0u);
  EXPECT_EQ(pool.misses(), 0u);
}

// Requests whose tensors protobuf merges or resolves, malformed and hostile bytes: the reader
// leaves them to protobuf (same message, same error), never reads or writes out of bounds
// (ASan runs this), and gives every block back.
TEST(WireReader, MergedMalformedAndHostileRequestsReadAsProtobufParsesThem) {
  LaneTestBackend backend(1);
  HostStagingPool pool(backend, size_t{64} << 20);
  server::ParallelCopy copier(/*helper_threads=*/0);
  std::mt19937_64 rng = MakeRng();
  v1::MhcSeamRequest base = MakeMhcRequest(rng, "w", MhcRequestSpec{.hidden = 256, .tokens = 2});
  const std::string whole = base.SerializeAsString();
  auto key = [](int field, int type) { return std::string(1, static_cast<char>(field << 3 | type)); };
  auto varint = [](uint64_t v) {
    std::string out;
    for (; v >= 0x80; v >>= 7) out.push_back(static_cast<char>(v | 0x80));
    out.push_back(static_cast<char>(v));
    return out;
  };
  // A length-delimited field.
  auto ld = [&](int field, const std::string& body) { return key(field, 2) + varint(body.size()) + body; };
  const std::string dtype = key(1, 0) + varint(v1::DATA_TYPE_BF16);
  const std::string shm = ld(4, ld(1, "region"));
  const std::vector<std::pair<const char*, std::string>> cases = {
      {"x twice, merged (its data once)", ld(4, dtype) + ld(5, dtype) + ld(4, ld(3, "abcd")) + ld(4, key(2, 0) + varint(2))},
      {"x's data twice", ld(4, dtype + ld(3, "ab") + ld(3, "cdef"))},
      {"x's data twice in two occurrences", ld(4, dtype + ld(3, "ab")) + ld(4, ld(3, "cdef"))},
      {"x whole twice", whole + ld(4, base.x().SerializeAsString())},
      {"data then shared memory in two occurrences", ld(4, dtype + ld(3, "ab")) + ld(4, shm)},
      {"data then shared memory", ld(4, dtype + ld(3, "ab") + shm)},
      {"shared memory then data", ld(4, dtype + shm + ld(3, "ab"))},
      {"data without dtype", ld(4, ld(3, "ab"))},
      {"dtype set back to 0", ld(4, dtype + ld(3, "ab") + key(1, 0) + varint(0))},
      {"unknown field in a tensor", ld(4, dtype + key(9, 0) + varint(1) + ld(3, "ab"))},
      {"unknown top-level fields", whole + key(15, 0) + varint(127) + ld(14, "z")},
      {"tensor as a varint", key(4, 0) + varint(5)},
      {"group", key(4, 3) + key(4, 4)},
      {"empty", ""},
      {"truncated", whole.substr(0, whole.size() / 2)},
      {"length past the end", key(4, 2) + varint(50000)},
      {"data length past the tensor", key(4, 2) + varint(4) + dtype + key(3, 2) + varint(100) + "ab"},
      // The data's length varint itself outside the tensor (found by fuzz_wire_reader).
      {"data's length after the tensor's end", key(4, 2) + varint(3) + dtype + key(3, 2) + varint(2) + "ab"},
      {"data right after the tensor (a field of the request)", key(4, 2) + varint(2) + dtype + key(3, 2) + varint(2) + "ab"},
      // Encodings protobuf refuses that a varint reader would take (found by fuzz_wire_reader): a key
      // in more than 5 bytes, at the top and in a tensor, and a length in more than 5.
      {"a key of 6 bytes", std::string("\x8a\x80\x80\x80\x80\x00", 6) + varint(1) + "w"},
      {"a tensor's key of 6 bytes", ld(4, dtype + std::string("\x9a\x80\x80\x80\x80\x00", 6) + varint(2) + "ab")},
      {"a length of 6 bytes", key(4, 2) + std::string("\x80\x80\x80\x80\x80\x00", 6)},
      {"a key of 5 bytes", std::string("\x8a\x80\x80\x80\x00", 5) + varint(1) + "w"},
      {"varint of 11 bytes", key(2, 0) + std::string(10, static_cast<char>(0xff)) + varint(1)},
      {"field number 0", key(0, 0) + varint(0)},
      {"dtype as a length", ld(4, key(1, 2) + varint(1) + "a" + ld(3, "ab"))},
      {"packed and unpacked shape", ld(4, dtype + ld(2, varint(2) + varint(3)) + key(2, 0) + varint(4) + ld(3, "abcd"))},
  };
  for (const auto& [what, bytes] : cases) {
    SCOPED_TRACE(what);
    ExpectReadAsProtobufParses<v1::MhcSeamRequest>(rng, bytes, pool, copier, false);
  }
  // Random damage to whole requests: flipped bytes, cut ends, inserted noise. Many still parse,
  // and the reader must have moved tensors in many of those (not left everything to protobuf).
  size_t read_with_moved_tensors = 0;
  for (int i = 0; i < 3000; ++i) {
    SCOPED_TRACE(i);
    std::string bytes = whole;
    for (int k = 0; k < 1 + static_cast<int>(rng() % 3); ++k) {
      switch (rng() % 3) {
        case 0: bytes[rng() % bytes.size()] = static_cast<char>(rng()); break;
        case 1: bytes.resize(rng() % bytes.size()); break;
        default: bytes.insert(rng() % bytes.size(), std::string(1 + rng() % 4, static_cast<char>(rng()))); break;
      }
      if (bytes.empty()) bytes = whole;
    }
    read_with_moved_tensors += ExpectReadAsProtobufParses<v1::MhcSeamRequest>(rng, bytes, pool, copier, false) > 0;
  }
  EXPECT_GT(read_with_moved_tensors, 300u);
  EXPECT_EQ(pool.in_use_bytes(), 0u);
}

// The C++ client's shared requests (each tensor's data as one more occurrence of its field after
// the message, client/lib/wire_request.h): read with every tensor's data in the block.
TEST(WireReader, ReadsTheClientsSharedRequestsWithTheDataInTheBlock) {
  LaneTestBackend backend(1);
  HostStagingPool pool(backend, size_t{64} << 20);
  server::ParallelCopy copier(/*helper_threads=*/1);
  std::mt19937_64 rng = MakeRng();
  for (int64_t tokens : {1, 9, 600}) {
    SCOPED_TRACE(tokens);
    auto m = std::make_shared<const v1::MhcSeamRequest>(
        MakeMhcRequest(rng, "w", MhcRequestSpec{.hidden = 256, .tokens = tokens, .capture_aux = true}));
    const grpc::ByteBuffer sent = client::EncodeRequestByReference(m);
    std::vector<grpc::Slice> slices;
    ASSERT_TRUE(sent.Dump(&slices).ok());
    grpc::ByteBuffer wire(slices.data(), slices.size());
    v1::MhcSeamRequest got;
    server::WireTensorData data;
    ASSERT_TRUE(server::ReadWireRequest(&wire, &got, &pool, &copier, &data).ok());
    EXPECT_EQ(data.tensors(), 5u);  // x, residual, post_mix, comb_mix, pre_mix
    data.MoveIntoMessages();
    EXPECT_EQ(got.SerializeAsString(), m->SerializeAsString());

    auto sw = std::make_shared<const v1::SwaNormQuantRequest>(MakeSwaRequest(rng, "w", tokens, 256 + 128 + 8));
    const grpc::ByteBuffer ssent = client::EncodeRequestByReference(sw);
    ASSERT_TRUE(ssent.Dump(&slices).ok());
    grpc::ByteBuffer swire(slices.data(), slices.size());
    v1::SwaNormQuantRequest sgot;
    server::WireTensorData sdata;
    ASSERT_TRUE(server::ReadWireRequest(&swire, &sgot, &pool, &copier, &sdata).ok());
    EXPECT_EQ(sdata.tensors(), 1u);
    sdata.MoveIntoMessages();
    EXPECT_EQ(sgot.SerializeAsString(), sw->SerializeAsString());
  }
  EXPECT_EQ(pool.in_use_bytes(), 0u);
}

// No block free in the pool: the request is parsed as usual (data in the message), never waits.
TEST(WireReader, WithoutAFreeBlockTheRequestIsParsedAsUsual) {
  LaneTestBackend backend(1);
  HostStagingPool pool(backend, size_t{1} << 20);
  server::ParallelCopy copier(0);
  std::mt19937_64 rng = MakeRng();
  absl::StatusOr<HostStagingPool::Lease> taken = pool.Acquire(size_t{1} << 20);
  ASSERT_TRUE(taken.ok());
  const v1::MhcSeamRequest m = MakeMhcRequest(rng, "w", MhcRequestSpec{.hidden = 256, .tokens = 4});
  grpc::ByteBuffer wire = SlicedBuffer(rng, m.SerializeAsString());
  v1::MhcSeamRequest got;
  server::WireTensorData data;
  ASSERT_TRUE(server::ReadWireRequest(&wire, &got, &pool, &copier, &data).ok());
  EXPECT_EQ(data.tensors(), 0u);
  EXPECT_EQ(got.SerializeAsString(), m.SerializeAsString());
  EXPECT_EQ(pool.misses(), 1u);
  EXPECT_EQ(pool.waits(), 0u);
}

// Inputs read into pinned memory (ReadWireRequest) reach the device in one copy from there,
// whatever their size (no staging memcpy, no chunks), and the outputs are bitwise the CPU's.
TEST(Pipeline, InputsReadIntoPinnedMemoryAreCopiedFromThereInOneCopy) {
  Fixture f(/*lanes=*/1);
  ASSERT_NE(f.device_lanes, nullptr);
  HostStagingPool request_pool(*f.backend, size_t{64} << 20);
  auto counts = [&] {
    return std::pair<int64_t, int64_t>(f.control->copies_to_device.exchange(0), f.control->copies_to_host.exchange(0));
  };
  for (int64_t tokens : {1, 64, 1000}) {  // 1000: 5 MB of inputs
    SCOPED_TRACE(::testing::Message() << "T = " << tokens);
    MhcRequestSpec spec{.hidden = 512, .tokens = tokens};
    const v1::MhcSeamRequest sent = MakeMhcRequest(f.rng, "p", spec);
    grpc::ByteBuffer wire = SlicedBuffer(f.rng, sent.SerializeAsString());
    v1::MhcSeamRequest mreq;
    server::WireTensorData data;
    ASSERT_TRUE(server::ReadWireRequest(&wire, &mreq, &request_pool, &f.device_lanes->staging()->copier(), &data).ok());
    ASSERT_EQ(data.tensors(), 5u);
    v1::MhcSeamResponse mresp;
    auto m = server::DecodeMhcRequest(mreq, *f.set->on(0).mhc, int64_t{1} << 20, &mresp, nullptr, nullptr, &data);
    ASSERT_TRUE(m.ok()) << m.status();
    const server::HostRange pinned{data.begin(), data.end()};
    EXPECT_TRUE(pinned.Contains(m->args.x.data, server::ViewExtentBytes(m->args.x)));
    PoisonOutputs(m->args);
    ExecTarget target = f.device_lanes->For(0);
    target.pinned_inputs = pinned;
    counts();
    auto ran = server::RunMhcCall(target, *f.set->on(0).mhc, m->args, Path::kFused);
    ASSERT_TRUE(ran.ok()) << ran.status();
    EXPECT_EQ(counts(), std::make_pair(int64_t{1}, int64_t{1}));
    ExpectMhcEqual(mresp, f.reference.RunMhc(sent, Path::kFused));
  }
  EXPECT_EQ(f.device_lanes->staging()->in_use_bytes(), 0u);
  EXPECT_EQ(request_pool.in_use_bytes(), 0u);
}

// The staging copies split over helper threads (--host_copy_threads): the same bits, from two
// lanes at once sharing the helpers, for tensors below and above the split size (T = 300: x and R
// are 0.3 and 1.2 MiB, staged in 1 MiB chunks, outputs copied back as a whole).
TEST(Pipeline, SplitStagingCopiesAreBitwiseTheCpuPath) {
  Fixture f(/*lanes=*/2, size_t{64} << 20, 8, /*copy_threads=*/3);
  ASSERT_NE(f.device_lanes, nullptr);
  ASSERT_EQ(f.device_lanes->staging()->copier().helper_threads(), 3);
  for (int64_t tokens : {7, 300, 1000}) {
    SCOPED_TRACE(::testing::Message() << "T = " << tokens);
    std::vector<v1::MhcSeamRequest> req(2);
    std::vector<v1::MhcSeamResponse> resp(2);
    std::vector<server::MhcCall> calls;
    for (int i = 0; i < 2; ++i) calls.push_back(f.Mhc(req[i], resp[i], tokens));
    std::vector<absl::Status> st(2);
    std::vector<std::thread> threads;
    for (int i = 0; i < 2; ++i) {
      threads.emplace_back([&, i] {
        auto ran = server::RunMhcCall(f.device_lanes->For(i), *f.set->on(0).mhc, calls[i].args, Path::kFused);
        st[i] = ran.status();
      });
    }
    for (std::thread& t : threads) t.join();
    for (int i = 0; i < 2; ++i) {
      ASSERT_TRUE(st[i].ok()) << st[i];
      ExpectMhcEqual(resp[i], f.reference.RunMhc(req[i], Path::kFused));
    }
  }
  EXPECT_EQ(f.device_lanes->staging()->in_use_bytes(), 0u);
}

// A call's inputs reach the device in one copy (one per ~1 MiB chunk when they are larger) and its
// outputs come back in one copy: LaneStaging lays the inputs out first and the outputs after
// them, so each direction is one contiguous range. The outputs still land bitwise where they belong.
TEST(Pipeline, EachDirectionIsOneCopyPerCallOrPerChunk) {
  Fixture f(/*lanes=*/1);
  ASSERT_NE(f.device_lanes, nullptr);
  auto counts = [&] {
    return std::pair<int64_t, int64_t>(f.control->copies_to_device.exchange(0), f.control->copies_to_host.exchange(0));
  };
  for (int64_t tokens : {1, 7, 64}) {
    SCOPED_TRACE(::testing::Message() << "T = " << tokens);
    v1::MhcSeamRequest mreq;
    v1::MhcSeamResponse mresp;
    server::MhcCall m = f.Mhc(mreq, mresp, tokens);
    counts();
    auto ran = server::RunMhcCall(f.device_lanes->For(0), *f.set->on(0).mhc, m.args, Path::kFused);
    ASSERT_TRUE(ran.ok()) << ran.status();
    EXPECT_EQ(counts(), std::make_pair(int64_t{1}, int64_t{1}));  // 5 inputs, 5 or 6 outputs
    ExpectMhcEqual(mresp, f.reference.RunMhc(mreq, Path::kFused));

    v1::SwaNormQuantRequest sreq;
    v1::SwaNormQuantResponse sresp;
    server::SwaCall sw = f.Swa(sreq, sresp, tokens);
    counts();
    auto sran = server::RunSwaCall(f.device_lanes->For(0), *f.set->on(0).swa, sw.args, Path::kFused);
    ASSERT_TRUE(sran.ok()) << sran.status();
    EXPECT_EQ(counts(), std::make_pair(int64_t{1}, int64_t{1}));
    ExpectSwaEqual(sresp, f.reference.RunSwa(sreq, Path::kFused));
  }
  // T = 1000: x is 1 MB and R 4 MB, so the inputs go in ~1 MiB chunks (the device copies one while
  // the host fills the next), never more chunks than whole MiB plus the remainder.
  v1::MhcSeamRequest mreq;
  v1::MhcSeamResponse mresp;
  server::MhcCall m = f.Mhc(mreq, mresp, 1000);
  uint64_t input_bytes = 0;
  for (const TensorView* v : {&m.args.x, &m.args.residual, &m.args.post_mix, &m.args.comb_mix, &m.args.pre_mix}) {
    input_bytes += server::ViewExtentBytes(*v);
  }
  counts();
  auto ran = server::RunMhcCall(f.device_lanes->For(0), *f.set->on(0).mhc, m.args, Path::kFused);
  ASSERT_TRUE(ran.ok()) << ran.status();
  const auto [to_device, to_host] = counts();
  EXPECT_GE(to_device, 4);
  EXPECT_LE(to_device, static_cast<int64_t>(input_bytes >> 20) + 1);
  EXPECT_EQ(to_host, 1);
  ExpectMhcEqual(mresp, f.reference.RunMhc(mreq, Path::kFused));
  EXPECT_EQ(f.device_lanes->staging()->in_use_bytes(), 0u);
}

TEST(ParallelCopy, CopiesEveryByteOfEverySizeFromConcurrentCallers) {
  server::ParallelCopy copier(3);
  // Below the split size, exactly at it, odd sizes above it (shares end mid-page), and large.
  const std::vector<size_t> sizes = {0, 1, 4095, server::ParallelCopy::kMinSplitBytes - 1,
                                     server::ParallelCopy::kMinSplitBytes, (size_t{1} << 20) + 13,
                                     (size_t{3} << 20) + 4097, size_t{8} << 20};
  std::vector<std::thread> callers;
  std::atomic<int> bad{0};
  for (int c = 0; c < 4; ++c) {
    callers.emplace_back([&, c] {
      std::mt19937_64 r(100 + c);
      for (int rep = 0; rep < 6; ++rep) {
        for (size_t n : sizes) {
          std::vector<unsigned char> src(n + 2), dst(n + 2, 0xAB);
          for (auto& b : src) b = static_cast<unsigned char>(r());
          // Unaligned on both sides; streaming stores (pinned staging) for half the callers.
          copier.Copy(dst.data() + 1, src.data() + 1, n,
                      c % 2 == 0 ? server::ParallelCopy::Destination::kPinnedStaging
                                 : server::ParallelCopy::Destination::kHostMemory);
          if (dst[0] != 0xAB || dst[n + 1] != 0xAB || std::memcmp(dst.data() + 1, src.data() + 1, n) != 0) ++bad;
        }
      }
    });
  }
  for (std::thread& t : callers) t.join();
  EXPECT_EQ(bad.load(), 0);
}

// The streaming copy at every alignment of both sides and every size around its vector and
// loop boundaries: exactly the source's bytes, nothing written before or after.
TEST(StreamingCopy, EveryAlignmentAndSizeCopiesExactlyItsBytes) {
  std::mt19937_64 r(7);
  std::vector<size_t> sizes;
  for (size_t n = 0; n <= 300; ++n) sizes.push_back(n);
  for (size_t n : {size_t{4095}, size_t{4096}, size_t{65537}, (size_t{1} << 20) + 31}) sizes.push_back(n);
  constexpr size_t kGuard = 64;
  int bad = 0;
  for (size_t n : sizes) {
    std::vector<unsigned char> src(n + 2 * kGuard), dst(n + 2 * kGuard);
    for (auto& b : src) b = static_cast<unsigned char>(r());
    for (size_t da = 0; da < 64; da += (n > 4096 ? 7 : 1)) {
      const size_t sa = (da * 13 + n) % 64;
      std::fill(dst.begin(), dst.end(), 0xAB);
      server::StreamingCopy(dst.data() + da, src.data() + sa, n);
      server::StreamingCopyFence();
      bool ok = std::memcmp(dst.data() + da, src.data() + sa, n) == 0;
      for (size_t i = 0; i < da; ++i) ok = ok && dst[i] == 0xAB;
      for (size_t i = da + n; i < dst.size(); ++i) ok = ok && dst[i] == 0xAB;
      if (!ok && ++bad <= 5) ADD_FAILURE() << "n " << n << " dst + " << da << " src + " << sa;
    }
  }
  EXPECT_EQ(bad, 0);
  // The dispatch was initialised from the CPU (before main, a static): on an x86-64 with AVX2, such
  // as CI's machine, the copies above took the streaming path.
#if defined(__x86_64__)
  EXPECT_EQ(server::StreamingCopySupported(), __builtin_cpu_supports("avx2") != 0);
#endif
}

// A call of many small pieces (a request's data in gRPC's slices) that add up to a streamed call:
// every piece lands where it should, with or without helpers.
TEST(ParallelCopy, ManySmallPiecesOfOneLargeCallAreEachCopied) {
  std::mt19937_64 r(11);
  for (int helpers : {0, 2}) {
    SCOPED_TRACE(helpers);
    server::ParallelCopy copier(helpers);
    std::vector<unsigned char> src(size_t{3} << 20), dst(src.size() + 4096, 0xAB);
    for (auto& b : src) b = static_cast<unsigned char>(r());
    std::vector<server::ParallelCopy::Piece> pieces;
    size_t s = 0, d = 0;
    while (s < src.size()) {
      const size_t n = std::min<size_t>(src.size() - s, 1 + r() % 9000);
      pieces.push_back({reinterpret_cast<char*>(dst.data()) + d, reinterpret_cast<const char*>(src.data()) + s, n});
      s += n;
      d += n;
    }
    ASSERT_GE(src.size(), server::kMinStreamingBytes);
    copier.CopyPieces(pieces, server::ParallelCopy::Destination::kPinnedStaging);
    EXPECT_EQ(std::memcmp(dst.data(), src.data(), src.size()), 0) << helpers << " helpers";
    EXPECT_TRUE(std::all_of(dst.begin() + src.size(), dst.end(), [](unsigned char b) { return b == 0xAB; }));
  }
}

TEST(ParallelCopy, HelpersTakeSharesAndNoHelpersMeansPlainMemcpy) {
  std::vector<unsigned char> src(size_t{4} << 20), dst(src.size());
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<unsigned char>(i * 131 + 7);
  server::ParallelCopy none(0);
  none.Copy(dst.data(), src.data(), src.size(), server::ParallelCopy::Destination::kHostMemory);
  EXPECT_EQ(std::memcmp(dst.data(), src.data(), src.size()), 0);
  EXPECT_EQ(none.helper_shares(), 0u);
  server::ParallelCopy three(3);
  // The caller takes back shares no helper has started, so one copy may run alone; over many
  // copies of 4 MiB (3 of 4 shares queued each time) the helpers run some of them.
  for (int i = 0; i < 200 && three.helper_shares() == 0; ++i) {
    std::fill(dst.begin(), dst.end(), 0);
    three.Copy(dst.data(), src.data(), src.size(), server::ParallelCopy::Destination::kHostMemory);
    ASSERT_EQ(std::memcmp(dst.data(), src.data(), src.size()), 0);
  }
  EXPECT_GT(three.helper_shares(), 0u);
  EXPECT_EQ(server::ParallelCopy::AutoHelperThreads(2), 0);
  EXPECT_EQ(server::ParallelCopy::AutoHelperThreads(3), 0);
  EXPECT_EQ(server::ParallelCopy::AutoHelperThreads(4), 2);
  EXPECT_EQ(server::ParallelCopy::AutoHelperThreads(16), 7);
  EXPECT_EQ(server::ParallelCopy::AutoHelperThreads(128), 7);
}

// One split call at a time: while another call is split, a call is copied by its caller alone
// (correctly), and once none is, calls are split again.
TEST(ParallelCopy, ACallIsSplitOnlyWhenNoOtherCallIs) {
  std::vector<unsigned char> src(size_t{2} << 20), dst(src.size());
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<unsigned char>(i * 29 + 3);
  server::ParallelCopy copier(2);
  {
    server::ParallelCopy::SplitInProgressForTest busy(copier);
    for (int i = 0; i < 20; ++i) {
      std::fill(dst.begin(), dst.end(), 0);
      copier.Copy(dst.data(), src.data(), src.size(), server::ParallelCopy::Destination::kPinnedStaging);
      ASSERT_EQ(std::memcmp(dst.data(), src.data(), src.size()), 0);
    }
    EXPECT_EQ(copier.split_calls(), 0u);
    EXPECT_EQ(copier.helper_shares(), 0u);
  }
  copier.Copy(dst.data(), src.data(), src.size(), server::ParallelCopy::Destination::kPinnedStaging);
  EXPECT_EQ(copier.split_calls(), 1u);
  EXPECT_EQ(std::memcmp(dst.data(), src.data(), src.size()), 0);
}

// Many requests of both ops from many threads through an executor with one worker per lane:
// every output is bitwise the CPU path's, and lanes did run kernels at the same time.
TEST(Pipeline, ManyConcurrentRequestsAcrossLanesAndOps) {
  constexpr int kLanes = 4, kRequests = 48;
  Fixture f(kLanes);
  ASSERT_NE(f.device_lanes, nullptr);
  Executor ex(/*capacity=*/kRequests, {}, f.device_lanes->workers());
  ASSERT_EQ(ex.workers(), kLanes);
  struct Job {
    v1::MhcSeamRequest mreq;
    v1::MhcSeamResponse mresp;
    v1::SwaNormQuantRequest sreq;
    v1::SwaNormQuantResponse sresp;
    server::MhcCall m;
    server::SwaCall s;
    absl::Status status;
    int worker = -1;
  };
  std::vector<Job> jobs(kRequests);
  for (int i = 0; i < kRequests; ++i) {
    if (i % 2 == 0) {
      jobs[i].m = f.Mhc(jobs[i].mreq, jobs[i].mresp, 1 + i % 9);
    } else {
      jobs[i].s = f.Swa(jobs[i].sreq, jobs[i].sresp, 1 + i % 9);
    }
  }
  std::atomic<int> done{0};
  std::vector<std::thread> producers;
  for (int p = 0; p < 4; ++p) {
    producers.emplace_back([&, p] {
      for (int i = p; i < kRequests; i += 4) {
        Job& job = jobs[i];
        absl::Status s = ex.Submit([&, i](double) {
          job.worker = ex.worker_index();
          const ExecTarget target = f.device_lanes->For(job.worker);
          job.status = i % 2 == 0 ? server::RunMhcCall(target, *f.set->on(0).mhc, job.m.args, Path::kFused).status()
                                  : server::RunSwaCall(target, *f.set->on(0).swa, job.s.args, Path::kFused).status();
          ++done;
        });
        EXPECT_TRUE(s.ok()) << s;
      }
    });
  }
  for (auto& t : producers) t.join();
  ex.Stop();  // drains and joins the workers: their writes happen-before the reads below
  EXPECT_EQ(done.load(), kRequests);
  std::vector<int> per_worker(kLanes, 0);
  for (int i = 0; i < kRequests; ++i) {
    SCOPED_TRACE(i);
    ASSERT_TRUE(jobs[i].status.ok()) << jobs[i].status;
    ASSERT_GE(jobs[i].worker, 0);
    ++per_worker[jobs[i].worker];
    if (i % 2 == 0) {
      ExpectMhcEqual(jobs[i].mresp, f.reference.RunMhc(jobs[i].mreq, Path::kFused));
    } else {
      ExpectSwaEqual(jobs[i].sresp, f.reference.RunSwa(jobs[i].sreq, Path::kFused));
    }
  }
  EXPECT_EQ(f.control->lane_kernels.load(), kRequests);
  EXPECT_EQ(f.device_lanes->staging()->in_use_bytes(), 0u);
  EXPECT_LE(f.device_lanes->staging()->held_bytes(), f.device_lanes->staging()->limit_bytes());
}

// Lanes overlap deterministically: with the gate held, every lane's first operation is waiting at
// once, i.e. kLanes requests are in flight on the device together.
TEST(Pipeline, EveryLaneHasARequestInFlightAtOnce) {
  constexpr int kLanes = 3;
  Fixture f(kLanes);
  ASSERT_NE(f.device_lanes, nullptr);
  Executor ex(16, {}, f.device_lanes->workers());
  std::vector<v1::MhcSeamRequest> reqs(kLanes);
  std::vector<v1::MhcSeamResponse> resps(kLanes);
  std::vector<server::MhcCall> calls;
  for (int i = 0; i < kLanes; ++i) calls.push_back(f.Mhc(reqs[i], resps[i], 4));
  std::vector<absl::Status> statuses(kLanes);
  f.control->Hold();
  for (int i = 0; i < kLanes; ++i) {
    ASSERT_TRUE(ex.Submit([&, i](double) {
                    statuses[i] =
                        server::RunMhcCall(f.device_lanes->For(ex.worker_index()), *f.set->on(0).mhc, calls[i].args, Path::kFused)
                            .status();
                  }).ok());
  }
  f.control->WaitForHeld(kLanes);  // one operation of each lane waits at the gate: all three in flight
  f.control->Release();
  ex.Stop();
  for (int i = 0; i < kLanes; ++i) {
    ASSERT_TRUE(statuses[i].ok()) << statuses[i];
    ExpectMhcEqual(resps[i], f.reference.RunMhc(reqs[i], Path::kFused));
  }
}

// The bound: a request larger than the whole pool is RESOURCE_EXHAUSTED at once naming the flag;
// requests that fit but together exceed it wait for each other and all complete; pinned memory
// refused by the system is RESOURCE_EXHAUSTED too. Nothing hangs, the lanes stay usable.
TEST(Pipeline, StagingPoolIsBounded) {
  // T = 64 at C = 512, n = 4 is ~1 MiB of tensors: a 1.5 MiB bound holds one such request at a time.
  Fixture f(/*lanes=*/3, /*staging_bytes=*/(size_t{3} << 20) / 2);
  ASSERT_NE(f.device_lanes, nullptr);
  {
    v1::MhcSeamRequest req;
    v1::MhcSeamResponse resp;
    server::MhcCall big = f.Mhc(req, resp, 256);  // ~4 MiB: over the bound
    auto ran = server::RunMhcCall(f.device_lanes->For(0), *f.set->on(0).mhc, big.args, Path::kFused);
    ASSERT_TRUE(absl::IsResourceExhausted(ran.status())) << ran.status();
    EXPECT_NE(ran.status().message().find("--host_staging_bytes"), std::string::npos) << ran.status();
  }
  Executor ex(16, {}, f.device_lanes->workers());
  constexpr int kRequests = 9;
  std::vector<v1::MhcSeamRequest> reqs(kRequests);
  std::vector<v1::MhcSeamResponse> resps(kRequests);
  std::vector<server::MhcCall> calls;
  for (int i = 0; i < kRequests; ++i) calls.push_back(f.Mhc(reqs[i], resps[i], 64));
  std::vector<absl::Status> statuses(kRequests);
  for (int i = 0; i < kRequests; ++i) {
    ASSERT_TRUE(ex.Submit([&, i](double) {
                    statuses[i] =
                        server::RunMhcCall(f.device_lanes->For(ex.worker_index()), *f.set->on(0).mhc, calls[i].args, Path::kFused)
                            .status();
                  }).ok());
  }
  ex.Stop();
  for (int i = 0; i < kRequests; ++i) {
    ASSERT_TRUE(statuses[i].ok()) << statuses[i];
    ExpectMhcEqual(resps[i], f.reference.RunMhc(reqs[i], Path::kFused));
  }
  HostStagingPool& pool = *f.device_lanes->staging();
  EXPECT_LE(pool.held_bytes(), pool.limit_bytes());
  EXPECT_EQ(pool.in_use_bytes(), 0u);

  // Pinned memory refused by the system: a request of a size class the pool keeps is served from
  // a kept block; one that needs a new block is RESOURCE_EXHAUSTED, cleanly.
  f.control->refuse_host_staging = true;
  v1::MhcSeamRequest req;
  v1::MhcSeamResponse resp;
  server::MhcCall same_class = f.Mhc(req, resp, 64);
  auto kept = server::RunMhcCall(f.device_lanes->For(1), *f.set->on(0).mhc, same_class.args, Path::kFused);
  ASSERT_TRUE(kept.ok()) << kept.status();
  ExpectMhcEqual(resp, f.reference.RunMhc(req, Path::kFused));
  server::MhcCall small = f.Mhc(req, resp, 1);
  auto refused = server::RunMhcCall(f.device_lanes->For(1), *f.set->on(0).mhc, small.args, Path::kFused);
  EXPECT_TRUE(absl::IsResourceExhausted(refused.status())) << refused.status();
  f.control->refuse_host_staging = false;
  auto again = server::RunMhcCall(f.device_lanes->For(1), *f.set->on(0).mhc, small.args, Path::kFused);
  ASSERT_TRUE(again.ok()) << again.status();
}

TEST(Pipeline, PoolWaitsForOtherLeasesAndRefusesOversizedAtOnce) {
  LaneTestBackend backend(2);
  HostStagingPool pool(backend, size_t{1} << 20);
  EXPECT_TRUE(absl::IsResourceExhausted(pool.Acquire((size_t{1} << 20) + 1).status()));
  auto a = pool.Acquire(700 << 10);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(pool.in_use_bytes(), pool.ClassBytes(700 << 10));
  std::promise<void> got_b;
  std::thread waiter([&] {
    auto b = pool.Acquire(600 << 10);  // does not fit beside `a`: waits for it
    EXPECT_TRUE(b.ok()) << b.status();
    got_b.set_value();
  });
  // The waiter is blocked until `a` goes back (a wait that cannot end would hang the test).
  while (pool.waits() == 0) std::this_thread::yield();
  a->Release();
  got_b.get_future().wait();
  waiter.join();
  EXPECT_EQ(pool.in_use_bytes(), 0u);
  EXPECT_LE(pool.held_bytes(), pool.limit_bytes());
}

// A device fault surfaces at the request's Wait as INTERNAL; the lane serves the next request.
TEST(Pipeline, DeviceFaultFailsTheRequestAtItsWaitAndTheLaneStaysUsable) {
  Fixture f(/*lanes=*/1);
  ASSERT_NE(f.device_lanes, nullptr);
  v1::MhcSeamRequest req;
  v1::MhcSeamResponse resp;
  server::MhcCall call = f.Mhc(req, resp, 5);
  f.control->fail_next_kernels = 1;
  auto failed = server::RunMhcCall(f.device_lanes->For(0), *f.set->on(0).mhc, call.args, Path::kFused);
  ASSERT_EQ(failed.status().code(), absl::StatusCode::kInternal) << failed.status();
  EXPECT_NE(failed.status().message().find("injected device fault"), std::string::npos);
  // The block the failed request used is discarded, not reused.
  EXPECT_EQ(f.device_lanes->staging()->held_bytes(), 0u);

  server::MhcCall again = f.Mhc(req, resp, 5);
  auto ok = server::RunMhcCall(f.device_lanes->For(0), *f.set->on(0).mhc, again.args, Path::kFused);
  ASSERT_TRUE(ok.ok()) << ok.status();
  ExpectMhcEqual(resp, f.reference.RunMhc(req, Path::kFused));
}

// Invalid arguments are refused at enqueue with INVALID_ARGUMENT (nothing runs), as on the
// default context; the lane serves the next request.
TEST(Pipeline, InvalidArgumentsAreRefusedBeforeAnythingRuns) {
  Fixture f(/*lanes=*/1);
  ASSERT_NE(f.device_lanes, nullptr);
  v1::MhcSeamRequest req;
  v1::MhcSeamResponse resp;
  server::MhcCall call = f.Mhc(req, resp, 3);
  MhcArgs bad = call.args;
  bad.x.shape[1] = 3;  // n = 3 against a set of n = 4
  const int64_t before = f.control->lane_kernels.load();
  auto refused = server::RunMhcCall(f.device_lanes->For(0), *f.set->on(0).mhc, bad, Path::kFused);
  EXPECT_TRUE(absl::IsInvalidArgument(refused.status())) << refused.status();
  EXPECT_EQ(f.control->lane_kernels.load(), before);
  auto ok = server::RunMhcCall(f.device_lanes->For(0), *f.set->on(0).mhc, call.args, Path::kFused);
  ASSERT_TRUE(ok.ok()) << ok.status();
  ExpectMhcEqual(resp, f.reference.RunMhc(req, Path::kFused));
}

// Unloading a weight set while lanes run requests on it: the requests keep the set (and its
// device memory) alive and finish correctly; the memory goes when the last of them is done.
TEST(Pipeline, UnloadWhileLanesHoldTheSet) {
  constexpr int kLanes = 2;
  Fixture f(kLanes);
  ASSERT_NE(f.device_lanes, nullptr);
  server::WeightStore store;
  ASSERT_TRUE(store.Publish(f.set, false).ok());
  const int live_before = f.control->live_weight_sets.load();
  ASSERT_EQ(live_before, 2);  // mHC + SWA parts
  Executor ex(16, {}, f.device_lanes->workers());
  std::vector<v1::MhcSeamRequest> reqs(kLanes);
  std::vector<v1::MhcSeamResponse> resps(kLanes);
  std::vector<absl::Status> statuses(kLanes);
  std::vector<server::MhcCall> calls;
  for (int i = 0; i < kLanes; ++i) calls.push_back(f.Mhc(reqs[i], resps[i], 6));
  f.set.reset();  // from now on only the store and the requests hold the set
  f.control->Hold();
  for (int i = 0; i < kLanes; ++i) {
    std::shared_ptr<const server::WeightSet> set = *store.Get("p");
    ASSERT_TRUE(ex.Submit([&, i, set = std::move(set)](double) mutable {
                    statuses[i] =
                        server::RunMhcCall(f.device_lanes->For(ex.worker_index()), *set->on(0).mhc, calls[i].args, Path::kFused)
                            .status();
                    set.reset();  // as a request drops its set once its response is built
                  }).ok());
  }
  f.control->WaitForHeld(kLanes);  // both requests are on the device
  ASSERT_TRUE(store.Unload("p").ok());
  EXPECT_EQ(f.control->live_weight_sets.load(), live_before);  // still held by the requests
  f.control->Release();
  ex.Stop();
  for (int i = 0; i < kLanes; ++i) {
    ASSERT_TRUE(statuses[i].ok()) << statuses[i];
    ExpectMhcEqual(resps[i], f.reference.RunMhc(reqs[i], Path::kFused));
  }
  EXPECT_EQ(f.control->live_weight_sets.load(), 0);  // freed with the last request
}

// Stop with requests queued and in flight on every lane: all of them run to completion.
TEST(Pipeline, StopDrainsRequestsInFlightOnEveryLane) {
  constexpr int kLanes = 3, kRequests = 12;
  Fixture f(kLanes);
  ASSERT_NE(f.device_lanes, nullptr);
  Executor ex(kRequests, {}, f.device_lanes->workers());
  std::vector<v1::SwaNormQuantRequest> reqs(kRequests);
  std::vector<v1::SwaNormQuantResponse> resps(kRequests);
  std::vector<server::SwaCall> calls;
  for (int i = 0; i < kRequests; ++i) calls.push_back(f.Swa(reqs[i], resps[i], 1 + i));
  std::vector<absl::Status> statuses(kRequests, absl::UnknownError("not run"));
  f.control->Hold();
  for (int i = 0; i < kRequests; ++i) {
    ASSERT_TRUE(ex.Submit([&, i](double) {
                    statuses[i] =
                        server::RunSwaCall(f.device_lanes->For(ex.worker_index()), *f.set->on(0).swa, calls[i].args, Path::kFused)
                            .status();
                  }).ok());
  }
  f.control->WaitForHeld(kLanes);
  std::thread stopper([&] { ex.Stop(); });
  // Stop refuses new work at once, while the accepted requests still run.
  while (ex.Submit([](double) {}).ok()) std::this_thread::yield();
  f.control->Release();
  stopper.join();
  for (int i = 0; i < kRequests; ++i) {
    ASSERT_TRUE(statuses[i].ok()) << i << ": " << statuses[i];
    ExpectSwaEqual(resps[i], f.reference.RunSwa(reqs[i], Path::kFused));
  }
}

// Control and background tasks never run two at once, even with several workers (they drive the
// backend's default context and the weight manager), and background tasks run one at a time.
TEST(Pipeline, ControlAndBackgroundTasksAreSerialisedAcrossWorkers) {
  Executor ex(64, {}, 4);
  std::atomic<int> inside{0}, max_inside{0};
  int64_t plain_counter = 0;  // touched only inside the serialised tasks: TSan checks the claim
  auto body = [&](double) {
    const int now = ++inside;
    int seen = max_inside.load();
    while (now > seen && !max_inside.compare_exchange_weak(seen, now)) {
    }
    ++plain_counter;
    std::this_thread::sleep_for(std::chrono::microseconds(50));
    --inside;
  };
  for (int i = 0; i < 40; ++i) {
    ASSERT_TRUE((i % 2 == 0 ? ex.SubmitControl(body) : ex.SubmitBackground(body)).ok());
  }
  while (ex.queued() > 0 || ex.background_queued() > 0) std::this_thread::yield();
  ex.Stop();
  EXPECT_EQ(max_inside.load(), 1);
  EXPECT_EQ(plain_counter, 40);
}

// Dynamic batching with several workers: while one worker forms a batch (its queue delay), the
// others leave the queue to it, so the batch gets every compatible task a single worker would have
// (without that, two workers would each hold a part of the batch until the delay ran out).
class CountingTask final : public server::BatchableTask {
 public:
  CountingTask(int id, std::vector<std::vector<int>>* launches, std::mutex* mu) : id_(id), launches_(launches), mu_(mu) {}
  int64_t tokens() const override { return 1; }
  bool batchable() const override { return true; }
  bool launchable() const override { return true; }
  bool CompatibleWith(const BatchableTask& other) const override {
    return dynamic_cast<const CountingTask*>(&other) != nullptr;
  }

 private:
  void RunBatch(std::vector<std::unique_ptr<BatchableTask>>& batch, const std::vector<double>&) override {
    std::vector<int> ids;
    for (const auto& t : batch) ids.push_back(static_cast<const CountingTask&>(*t).id_);
    std::lock_guard<std::mutex> lock(*mu_);
    launches_->push_back(ids);
  }
  const int id_;
  std::vector<std::vector<int>>* const launches_;
  std::mutex* const mu_;
};

TEST(Pipeline, BatchFormingWithSeveralWorkersGetsEveryCompatibleTask) {
  std::vector<std::vector<int>> launches;
  std::mutex mu;
  {
    // An hour of delay: the batch launches when its 8-token budget is full, or the test times out.
    Executor ex(64, server::BatchingOptions{8, std::chrono::hours(1)}, /*workers=*/3);
    for (int i = 0; i < 8; ++i) ASSERT_TRUE(ex.SubmitBatchable(std::make_unique<CountingTask>(i, &launches, &mu)).ok());
    for (;;) {
      {
        std::lock_guard<std::mutex> lock(mu);
        if (!launches.empty()) break;
      }
      std::this_thread::yield();
    }
    ex.Stop();
  }
  ASSERT_EQ(launches.size(), 1u);
  EXPECT_EQ(launches[0], (std::vector<int>{0, 1, 2, 3, 4, 5, 6, 7}));
}

// How many lanes a server gets: auto = 4 bounded by the backend; the CPU backend none (one worker,
// host views); flags outside their bounds refused at startup.
TEST(Pipeline, LaneCountsAndFlagBounds) {
  std::unique_ptr<Backend> cpu = CreateCpuBackend(BackendOptions{.num_threads = 1});
  auto on_cpu = DeviceLanes::Create(*cpu, /*requested=*/8, size_t{1} << 20);
  ASSERT_TRUE(on_cpu.ok()) << on_cpu.status();
  EXPECT_EQ((*on_cpu)->lanes(), 0);
  EXPECT_EQ((*on_cpu)->workers(), 1);
  EXPECT_EQ((*on_cpu)->For(0).lane, nullptr);  // zero copy on the backend itself
  EXPECT_EQ((*on_cpu)->staging(), nullptr);

  LaneTestBackend two(/*max_lanes=*/2);
  auto bounded = DeviceLanes::Create(two, 8, size_t{1} << 20);
  ASSERT_TRUE(bounded.ok());
  EXPECT_EQ((*bounded)->lanes(), 2);
  EXPECT_EQ((*bounded)->For(-1).lane, nullptr);  // off the workers: the default context
  EXPECT_NE((*bounded)->For(1).lane, nullptr);
  LaneTestBackend many(/*max_lanes=*/16);
  auto automatic = DeviceLanes::Create(many, 0, size_t{1} << 20);
  ASSERT_TRUE(automatic.ok());
  EXPECT_EQ((*automatic)->lanes(), server::kDefaultDeviceLanes);

  server::ServerConfig cfg = TestConfig();
  EXPECT_TRUE(cfg.Validate().ok());
  cfg.device_lanes = 17;
  EXPECT_TRUE(absl::IsInvalidArgument(cfg.Validate()));
  cfg.device_lanes = -1;
  EXPECT_TRUE(absl::IsInvalidArgument(cfg.Validate()));
  cfg.device_lanes = 16;
  cfg.host_staging_bytes = (uint64_t{1} << 20) - 1;
  EXPECT_TRUE(absl::IsInvalidArgument(cfg.Validate()));
}

// --executor_spin_us=-1 (the default) spins on a device backend with lanes and not on the CPU
// backend, whose kernels want every core; an explicit value is taken as it is on either.
TEST(Pipeline, IdleSpinIsAutoOnLanesAndOffOnTheCpu) {
  struct Case {
    bool lanes;
    int64_t flag;
    int64_t spin_us;
  };
  for (const Case& k : {Case{true, -1, server::kAutoExecutorSpinUs}, Case{false, -1, 0}, Case{true, 0, 0},
                        Case{false, 123, 123}}) {
    SCOPED_TRACE(::testing::Message() << "lanes " << k.lanes << " flag " << k.flag);
    server::ServerConfig cfg = TestConfig();
    EXPECT_EQ(cfg.executor_spin_us, -1);
    cfg.executor_spin_us = k.flag;
    cfg.device_lanes = k.lanes ? 2 : 0;
    auto ts = TestServer::Start(cfg, k.lanes ? std::make_unique<LaneTestBackend>(2) : nullptr);
    ASSERT_NE(ts, nullptr);
    EXPECT_EQ(ts->server().executor().idle_spin(), std::chrono::microseconds(k.spin_us));
  }
}

// A request whose outputs are outside its response message (runtime/output_buffers.h) run alone on
// a lane: the staging block is lent to its outputs instead of being copied into them, the outputs
// are bitwise those of the CPU run, and the block goes back to the pool when the last owner of the
// outputs (a response slice, here the test) lets go. At most half of the bound is ever lent: past
// that the outputs are copied as before.
TEST(Pipeline, LaneLendsItsStagingBlockToOutputsOutsideTheMessage) {
  Fixture f(/*lanes=*/2, /*staging_bytes=*/size_t{8} << 20);
  ASSERT_NE(f.device_lanes, nullptr);
  HostStagingPool& pool = *f.device_lanes->staging();
  // Each request needs a 1 MiB block (~0.7 MiB of tensors): 4 fit in half of the 8 MiB bound.
  std::vector<server::OutputBuffers> kept(6);
  for (size_t i = 0; i < kept.size(); ++i) {
    SCOPED_TRACE(i);
    MhcRequestSpec spec{.hidden = 512, .tokens = 64};
    const v1::MhcSeamRequest req = MakeMhcRequest(f.rng, "p", spec);
    v1::MhcSeamResponse resp;
    auto call = server::DecodeMhcRequest(req, *f.set->on(0).mhc, int64_t{1} << 20, &resp, nullptr, &kept[i]);
    ASSERT_TRUE(call.ok()) << call.status();
    ASSERT_EQ(kept[i].buffers().size(), 5u);
    PoisonOutputs(call->args);
    ExecTarget target = f.device_lanes->For(static_cast<int>(i % 2));
    target.outputs = &kept[i];
    const size_t lent_before = pool.lent_bytes();
    auto ran = server::RunMhcCall(target, *f.set->on(0).mhc, call->args, Path::kFused);
    ASSERT_TRUE(ran.ok()) << ran.status();
    const bool lent = i < 4;
    EXPECT_EQ(pool.lent_bytes(), lent_before + (lent ? size_t{1} << 20 : 0));
    // Lent: every output now lives inside the block (inputs first, so never at its start), owned
    // by it; copied: each output is still its own heap buffer.
    for (const server::OutputBuffers::Buffer& b : kept[i].buffers()) {
      EXPECT_EQ(b.owner.get() != static_cast<const void*>(b.data), lent);
    }
    // The outputs as the response would carry them, against the CPU run.
    for (const server::OutputBuffers::Buffer& b : kept[i].buffers()) {
      auto* t = static_cast<v1::Tensor*>(resp.GetReflection()->MutableMessage(
          &resp, v1::MhcSeamResponse::descriptor()->FindFieldByNumber(b.field)));
      t->set_data(std::string(b.data, b.bytes));
    }
    ExpectMhcEqual(resp, f.reference.RunMhc(req, Path::kFused));
  }
  EXPECT_EQ(pool.lent_bytes(), pool.limit_bytes() / 2);
  kept.clear();  // the last owners let go: every block is back
  EXPECT_EQ(pool.lent_bytes(), 0u);
  EXPECT_EQ(pool.in_use_bytes(), 0u);
}

// A lent block whose owner outlives the pool (gRPC letting go of a response after the server
// stopped) neither crashes nor returns into freed memory, and is freed (ASan's leak check runs
// this test); the pool waits a bounded time for it.
TEST(Pipeline, LentBlockMayOutliveThePool) {
  LaneTestBackend backend(2);
  std::shared_ptr<const void> owner;
  {
    HostStagingPool pool(backend, size_t{8} << 20);
    auto a = pool.Acquire(100 << 10);
    ASSERT_TRUE(a.ok()) << a.status();
    owner = pool.Lend(*a);
    ASSERT_NE(owner, nullptr);
    EXPECT_EQ(a->data(), nullptr);  // the lease gave its block away
    EXPECT_EQ(pool.lent_bytes(), pool.ClassBytes(100 << 10));
    auto big = pool.Acquire(size_t{3} << 20);  // a 4 MiB block: lent beside `owner`, over half the bound
    ASSERT_TRUE(big.ok());
    EXPECT_EQ(pool.Lend(*big), nullptr);  // refused: the lease keeps its block
    EXPECT_NE(big->data(), nullptr);
  }  // waits up to 5 s for `owner`, then lets the block be
  owner.reset();
}

// ---- through the gRPC service -------------------------------------------------------------------

server::ServerConfig LaneConfig(int lanes, int64_t batch_tokens) {
  server::ServerConfig cfg = TestConfig();
  cfg.device_lanes = lanes;
  cfg.max_batch_tokens = batch_tokens;
  cfg.queue_capacity = 256;
  return cfg;
}

// Many concurrent requests of both ops over gRPC on a 3-lane server, batching off and on: every
// response bitwise equals the library run alone, and the report says its own path.
// Each (mreqs[i], sreqs[i]) pair from its own thread over `ts` (60 s deadlines): the responses and
// statuses by index.
struct ConcurrentCalls {
  std::vector<v1::MhcSeamResponse> mresps;
  std::vector<v1::SwaNormQuantResponse> sresps;
  std::vector<grpc::Status> mstat, sstat;
};
ConcurrentCalls CallConcurrently(TestServer& ts, const std::vector<v1::MhcSeamRequest>& mreqs,
                                 const std::vector<v1::SwaNormQuantRequest>& sreqs) {
  const size_t n = mreqs.size();
  ConcurrentCalls r{std::vector<v1::MhcSeamResponse>(n), std::vector<v1::SwaNormQuantResponse>(n),
                    std::vector<grpc::Status>(n), std::vector<grpc::Status>(n)};
  std::vector<std::thread> threads;
  for (size_t i = 0; i < n; ++i) {
    threads.emplace_back([&, i] {
      grpc::ClientContext c1, c2;
      c1.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
      c2.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
      r.mstat[i] = ts.stub().MhcSeam(&c1, mreqs[i], &r.mresps[i]);
      r.sstat[i] = ts.stub().SwaNormQuant(&c2, sreqs[i], &r.sresps[i]);
    });
  }
  for (auto& t : threads) t.join();
  return r;
}

TEST(PipelineServer, ConcurrentRequestsOverGrpcMatchTheLibraryBatchingOffAndOn) {
  for (int64_t batch_tokens : {int64_t{0}, int64_t{64}}) {
    SCOPED_TRACE(::testing::Message() << "max_batch_tokens " << batch_tokens);
    std::mt19937_64 rng = MakeRng(static_cast<uint64_t>(batch_tokens));
    const server::PackedWeightSet set = MakeWeightSet(rng, "g", MhcSetSpec{.hidden = 512}, SwaSetSpec{});
    auto backend = std::make_unique<LaneTestBackend>(8);
    auto control = backend->control();
    auto ts = TestServer::Start(LaneConfig(3, batch_tokens), std::move(backend), {set});
    ASSERT_NE(ts, nullptr);
    Reference ref(set);
    constexpr int kRequests = 24;
    std::vector<v1::MhcSeamRequest> mreqs;
    std::vector<v1::SwaNormQuantRequest> sreqs;
    for (int i = 0; i < kRequests; ++i) {
      MhcRequestSpec spec{.hidden = 512, .tokens = 1 + i % 5};
      mreqs.push_back(MakeMhcRequest(rng, "g", spec));
      if (i % 3 == 0) mreqs.back().set_path_preference(v1::PATH_PREFERENCE_FORCE_UNFUSED);
      sreqs.push_back(MakeSwaRequest(rng, "g", 1 + i % 4, 256 + 128));
    }
    // The lanes held until every mHC request is in the server: the workers each hold one launch at
    // the gate and the rest wait in the queue, so with batching on the compatible ones share launches.
    control->Hold();
    auto pending = std::async(std::launch::async, [&] { return CallConcurrently(*ts, mreqs, sreqs); });
    WaitForInflightRequests(*ts, kRequests);  // each thread calls MhcSeam, then SwaNormQuant
    control->Release();
    const ConcurrentCalls calls = pending.get();
    for (int i = 0; i < kRequests; ++i) {
      SCOPED_TRACE(i);
      ASSERT_TRUE(calls.mstat[i].ok()) << calls.mstat[i].error_message();
      ASSERT_TRUE(calls.sstat[i].ok()) << calls.sstat[i].error_message();
      const Path mpath = i % 3 == 0 ? Path::kUnfused : Path::kFused;
      EXPECT_EQ(calls.mresps[i].report().path(), server::ToProto(mpath));
      ExpectMhcEqual(calls.mresps[i], ref.RunMhc(mreqs[i], mpath));
      ExpectSwaEqual(calls.sresps[i], ref.RunSwa(sreqs[i], Path::kFused));
    }
    EXPECT_EQ(control->lane_kernels.load() > 0, true);
    // Blocks lent to responses come back once gRPC has let go of the responses' slices, which may
    // be just after the calls are done.
    std::string scrape = ScrapeWhenIdle(*ts);
    for (int i = 0; i < 2000 && MetricValue(scrape, "fusedlayer_host_staging_bytes", {{"state", "in_use"}}) != 0; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
      scrape = ts->Scrape();
    }
    EXPECT_EQ(MetricValue(scrape, "fusedlayer_host_staging_bytes", {{"state", "in_use"}}), 0.0);
    EXPECT_EQ(MetricValue(scrape, "fusedlayer_host_staging_bytes", {{"state", "lent"}}), 0.0);
    EXPECT_GT(MetricValue(scrape, "fusedlayer_host_staging_bytes", {{"state", "limit"}}), 0.0);
    // The requests were read into pinned memory (rpc/wire_messages.h), and gave it all back.
    EXPECT_GT(MetricValue(scrape, "fusedlayer_request_staging_bytes", {{"state", "held"}}), 0.0);
    EXPECT_EQ(MetricValue(scrape, "fusedlayer_request_staging_bytes", {{"state", "in_use"}}), 0.0);
    EXPECT_EQ(MetricValue(scrape, "fusedlayer_request_staging_misses_total", {}), 0.0);
    // Requests per launch: more than one in some launch with batching on, exactly one without.
    double launches = 0, requests = 0;
    for (const char* op : {"mhc", "swa"}) {
      launches += MetricValue(scrape, "fusedlayer_batch_requests_count", {{"op", op}});
      requests += MetricValue(scrape, "fusedlayer_batch_requests_sum", {{"op", op}});
    }
    EXPECT_EQ(requests, 2.0 * kRequests);
    if (batch_tokens > 0) {
      EXPECT_LT(launches, requests);
    } else {
      EXPECT_EQ(launches, requests);
    }
  }
}

// The C++ client's shared requests (their tensor data sent by reference after the message,
// client/lib/wire_request.h) read by the server as the same requests: on lanes, where the server reads
// the data straight into pinned memory (rpc/wire_messages.h), and on the CPU. Bitwise the library's
// outputs, and the same as the protobuf-serialized call, for small and large tensors.
TEST(PipelineServer, SharedClientRequestsAreReadAsTheSameRequests) {
  for (const bool lane : {true, false}) {
    SCOPED_TRACE(lane ? "lanes" : "cpu");
    std::mt19937_64 rng = MakeRng(lane ? 11 : 12);
    const server::PackedWeightSet set = MakeWeightSet(rng, "g", MhcSetSpec{.hidden = 512}, SwaSetSpec{});
    std::unique_ptr<Backend> backend;
    if (lane) backend = std::make_unique<LaneTestBackend>(8);
    auto ts = TestServer::Start(LaneConfig(lane ? 2 : 1, 0), std::move(backend), {set});
    ASSERT_NE(ts, nullptr);
    auto client = client::FusedLayerClient::Connect("127.0.0.1:" + std::to_string(ts->server().port()));
    ASSERT_TRUE(client.ok()) << client.status();
    Reference ref(set);
    for (int64_t tokens : {0, 1, 5, 700}) {  // 700: x 0.7 MB and R 2.8 MB
      SCOPED_TRACE(::testing::Message() << "T = " << tokens);
      auto mreq = std::make_shared<const v1::MhcSeamRequest>(
          MakeMhcRequest(rng, "g", MhcRequestSpec{.hidden = 512, .tokens = tokens, .capture_aux = tokens % 2 == 1}));
      absl::StatusOr<v1::MhcSeamResponse> shared = (*client)->MhcSeam(mreq);
      absl::StatusOr<v1::MhcSeamResponse> serialized = (*client)->MhcSeam(*mreq);
      ASSERT_TRUE(shared.ok()) << shared.status();
      ASSERT_TRUE(serialized.ok()) << serialized.status();
      const v1::MhcSeamResponse want = ref.RunMhc(*mreq, Path::kFused);
      ExpectMhcEqual(*shared, want);
      ExpectMhcEqual(*serialized, want);

      auto sreq = std::make_shared<const v1::SwaNormQuantRequest>(MakeSwaRequest(rng, "g", tokens, 256 + 128 + 8));
      absl::StatusOr<v1::SwaNormQuantResponse> sshared = (*client)->SwaNormQuant(sreq);
      ASSERT_TRUE(sshared.ok()) << sshared.status();
      ExpectSwaEqual(*sshared, ref.RunSwa(*sreq, Path::kFused));
    }
  }
}

// Every stage of ExecutionReport.stages, checked against the report's own server time.
void ExpectStagesWithinServerTime(const v1::ExecutionReport& r, bool lane) {
  ASSERT_TRUE(r.has_stages());
  const v1::StageSeconds& st = r.stages();
  for (double v : {st.decode(), r.queue_seconds(), st.copy_in(), st.device(), st.copy_out(), st.response()}) {
    EXPECT_GE(v, 0.0);
  }
  // Disjoint intervals of one request inside [receipt, server_seconds read].
  EXPECT_LE(st.decode() + r.queue_seconds() + st.copy_in() + st.device() + st.copy_out() + st.response(),
            r.server_seconds());
  EXPECT_GT(st.decode(), 0.0);  // validation and decode always run
  EXPECT_GT(st.device(), 0.0);  // so does the op
  if (lane) {
    // The lane path really moves the tensors: a memcpy into staging, and out of it either a
    // memcpy or the lending of the block to the response, each between two clock readings.
    EXPECT_GT(st.copy_in(), 0.0);
    EXPECT_GT(st.copy_out(), 0.0);
  }
}

// The per-stage server timing (ExecutionReport.stages, fusedlayer_request_stage_seconds) on a
// lane server (batching off and on) and on the CPU backend: present on every OK response,
// non-negative, adding up to no more than server_seconds, and one histogram observation per
// stage per request. A failed request records none.
TEST(PipelineServer, StageTimesArePresentAndAddUpToAtMostTheServerTime) {
  for (const bool lane : {true, false}) {
    for (int64_t batch_tokens : {int64_t{0}, int64_t{64}}) {
      SCOPED_TRACE(::testing::Message() << (lane ? "lanes" : "cpu") << " max_batch_tokens " << batch_tokens);
      std::mt19937_64 rng = MakeRng(static_cast<uint64_t>(batch_tokens) + (lane ? 0 : 7));
      const server::PackedWeightSet set = MakeWeightSet(rng, "g", MhcSetSpec{.hidden = 512}, SwaSetSpec{});
      std::unique_ptr<Backend> backend;
      if (lane) backend = std::make_unique<LaneTestBackend>(8);
      auto ts = TestServer::Start(LaneConfig(lane ? 2 : 1, batch_tokens), std::move(backend), {set});
      ASSERT_NE(ts, nullptr);
      Reference ref(set);
      constexpr int kRequests = 8;
      std::vector<v1::MhcSeamRequest> mreqs;
      std::vector<v1::SwaNormQuantRequest> sreqs;
      for (int i = 0; i < kRequests; ++i) {
        mreqs.push_back(MakeMhcRequest(rng, "g", MhcRequestSpec{.hidden = 512, .tokens = 1 + i % 5}));
        sreqs.push_back(MakeSwaRequest(rng, "g", 1 + i % 4, 256 + 128));
      }
      const ConcurrentCalls calls = CallConcurrently(*ts, mreqs, sreqs);
      for (int i = 0; i < kRequests; ++i) {
        SCOPED_TRACE(i);
        ASSERT_TRUE(calls.mstat[i].ok()) << calls.mstat[i].error_message();
        ASSERT_TRUE(calls.sstat[i].ok()) << calls.sstat[i].error_message();
        ExpectMhcEqual(calls.mresps[i], ref.RunMhc(mreqs[i], Path::kFused));
        ExpectSwaEqual(calls.sresps[i], ref.RunSwa(sreqs[i], Path::kFused));
        ExpectStagesWithinServerTime(calls.mresps[i].report(), lane);
        ExpectStagesWithinServerTime(calls.sresps[i].report(), lane);
      }
      {
        // Refused at decode (unknown weight set): no stage is recorded for it.
        grpc::ClientContext ctx;
        v1::MhcSeamRequest bad = mreqs[0];
        bad.set_weight_set("no-such-set");
        v1::MhcSeamResponse resp;
        EXPECT_EQ(ts->stub().MhcSeam(&ctx, bad, &resp).error_code(), grpc::StatusCode::NOT_FOUND);
        EXPECT_FALSE(resp.report().has_stages());
      }
      const std::string scrape = ScrapeWhenIdle(*ts);
      for (const char* op : {"mhc", "swa"}) {
        for (const char* stage : {"decode", "queue", "copy_in", "device", "copy_out", "response"}) {
          SCOPED_TRACE(::testing::Message() << op << " " << stage);
          EXPECT_EQ(MetricValue(scrape, "fusedlayer_request_stage_seconds_count", {{"op", op}, {"stage", stage}}),
                    kRequests);
          EXPECT_GE(MetricValue(scrape, "fusedlayer_request_stage_seconds_sum", {{"op", op}, {"stage", stage}}), 0.0);
        }
      }
    }
  }
}

// A request whose tensors exceed --host_staging_bytes gets RESOURCE_EXHAUSTED naming the flag;
// the server keeps serving.
TEST(PipelineServer, RequestLargerThanTheStagingBoundIsResourceExhausted) {
  std::mt19937_64 rng = MakeRng();
  const server::PackedWeightSet set = MakeWeightSet(rng, "g", MhcSetSpec{.hidden = 512}, std::nullopt);
  server::ServerConfig cfg = LaneConfig(2, 0);
  cfg.host_staging_bytes = uint64_t{1} << 20;
  auto ts = TestServer::Start(cfg, std::make_unique<LaneTestBackend>(8), {set});
  ASSERT_NE(ts, nullptr);
  Reference ref(set);
  v1::MhcSeamResponse resp;
  {
    grpc::ClientContext ctx;
    const v1::MhcSeamRequest big = MakeMhcRequest(rng, "g", MhcRequestSpec{.hidden = 512, .tokens = 256});
    const grpc::Status s = ts->stub().MhcSeam(&ctx, big, &resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
    EXPECT_NE(s.error_message().find("--host_staging_bytes"), std::string::npos) << s.error_message();
  }
  grpc::ClientContext ctx;
  const v1::MhcSeamRequest small = MakeMhcRequest(rng, "g", MhcRequestSpec{.hidden = 512, .tokens = 4});
  const grpc::Status s = ts->stub().MhcSeam(&ctx, small, &resp);
  ASSERT_TRUE(s.ok()) << s.error_message();
  ExpectMhcEqual(resp, ref.RunMhc(small, Path::kFused));
}

// Cancellation and drain with requests on every lane: cancelled queued requests are CANCELLED,
// the ones already on the device complete correctly, and Shutdown drains them.
TEST(PipelineServer, CancellationAndDrainWithRequestsInFlight) {
  std::mt19937_64 rng = MakeRng();
  const server::PackedWeightSet set = MakeWeightSet(rng, "g", MhcSetSpec{.hidden = 512}, std::nullopt);
  auto backend = std::make_unique<LaneTestBackend>(8);
  auto control = backend->control();
  constexpr int kLanes = 2;
  auto ts = TestServer::Start(LaneConfig(kLanes, 0), std::move(backend), {set});
  ASSERT_NE(ts, nullptr);
  Reference ref(set);
  control->Hold();
  // kLanes requests reach the device (held at the gate); the next ones queue behind them.
  constexpr int kRunning = kLanes, kQueued = 3;
  std::vector<v1::MhcSeamRequest> reqs;
  for (int i = 0; i < kRunning + kQueued; ++i) {
    reqs.push_back(MakeMhcRequest(rng, "g", MhcRequestSpec{.hidden = 512, .tokens = 2 + i}));
  }
  std::vector<v1::MhcSeamResponse> resps(reqs.size());
  std::vector<grpc::Status> stats(reqs.size());
  std::vector<std::unique_ptr<grpc::ClientContext>> ctxs;
  for (size_t i = 0; i < reqs.size(); ++i) ctxs.push_back(std::make_unique<grpc::ClientContext>());
  std::vector<std::thread> threads;
  for (int i = 0; i < kRunning; ++i) {
    threads.emplace_back([&, i] { stats[i] = ts->stub().MhcSeam(ctxs[i].get(), reqs[i], &resps[i]); });
  }
  control->WaitForHeld(kRunning);
  for (int i = kRunning; i < kRunning + kQueued; ++i) {
    threads.emplace_back([&, i] { stats[i] = ts->stub().MhcSeam(ctxs[i].get(), reqs[i], &resps[i]); });
  }
  while (ts->server().queued_tasks() < static_cast<size_t>(kQueued)) std::this_thread::yield();
  ctxs[kRunning]->TryCancel();  // the first queued one: cancelled before it launches
  std::thread shutdown([&] { ts->server().Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(30)); });
  control->Release();
  for (auto& t : threads) t.join();
  shutdown.join();
  for (int i = 0; i < kRunning; ++i) {
    ASSERT_TRUE(stats[i].ok()) << i << ": " << stats[i].error_message();
    ExpectMhcEqual(resps[i], ref.RunMhc(reqs[i], Path::kFused));
  }
  EXPECT_EQ(stats[kRunning].error_code(), grpc::StatusCode::CANCELLED) << stats[kRunning].error_message();
  for (int i = kRunning + 1; i < kRunning + kQueued; ++i) {
    // Queued when the drain began: they run (drain completes accepted work) and are correct.
    ASSERT_TRUE(stats[i].ok()) << i << ": " << stats[i].error_message();
    ExpectMhcEqual(resps[i], ref.RunMhc(reqs[i], Path::kFused));
  }
}

}  // namespace
}  // namespace fusedlayer::testing
