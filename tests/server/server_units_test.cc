// Unit tests of the server's pure parts: the dispatcher's precedence and fallback rules, the
// tensor codec's validation, the executor's bound, and flag parsing.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <future>
#include <mutex>
#include <optional>
#include <thread>
#include <tuple>

#include "auth/unix_peers.h"
#include "common/byte_budget.h"
#include "config.h"
#include "exec/dispatcher.h"
#include "runtime/executor.h"
#include "exec/weight_manager.h"
#include "gtest/gtest.h"
#include "rpc/idle_watch.h"
#include "runtime/output_buffers.h"
#include "grpcpp/support/byte_buffer.h"
#include "rpc/proto_convert.h"
#include "rpc/wire_messages.h"
#include "transport/shared_memory.h"
#include "prometheus/registry.h"
#include "forwarding_backend.h"
#include "server_test_env.h"
#include "test_util.h"
#include "weights/weight_set.h"

namespace fusedlayer::server {
namespace {

FusedSupport Yes() { return FusedSupport::Yes(); }
FusedSupport NoHc() { return FusedSupport::No(FallbackReason::kHcMultUnsupported, "n = 2"); }

TEST(Dispatcher, Precedence) {
  auto d = ChoosePath(Op::kMhc, v1::PATH_PREFERENCE_AUTO, false, Yes);
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->path, Path::kFused);
  EXPECT_FALSE(d->reason.has_value());

  d = ChoosePath(Op::kMhc, v1::PATH_PREFERENCE_AUTO, false, NoHc);
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->path, Path::kUnfused);
  EXPECT_EQ(d->reason, FallbackReason::kHcMultUnsupported);
  EXPECT_EQ(d->detail, "n = 2");

  // The kill switch wins over the backend's answer; FORCE_UNFUSED wins over both.
  d = ChoosePath(Op::kSwa, v1::PATH_PREFERENCE_AUTO, true, NoHc);
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->reason, FallbackReason::kDisabledByConfig);
  d = ChoosePath(Op::kSwa, v1::PATH_PREFERENCE_FORCE_UNFUSED, true, NoHc);
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->reason, FallbackReason::kClientForcedUnfused);

  // The backend is not asked when the answer is already known.
  bool asked = false;
  auto probe = [&] {
    asked = true;
    return Yes();
  };
  ASSERT_TRUE(ChoosePath(Op::kMhc, v1::PATH_PREFERENCE_FORCE_UNFUSED, false, probe).ok());
  ASSERT_TRUE(ChoosePath(Op::kMhc, v1::PATH_PREFERENCE_AUTO, true, probe).ok());
  EXPECT_FALSE(asked);
}

TEST(Dispatcher, RequireFusedNamesTheReason) {
  auto d = ChoosePath(Op::kMhc, v1::PATH_PREFERENCE_REQUIRE_FUSED, false, NoHc);
  EXPECT_TRUE(absl::IsFailedPrecondition(d.status()));
  EXPECT_NE(d.status().message().find("hc_mult_unsupported"), std::string::npos);
  d = ChoosePath(Op::kMhc, v1::PATH_PREFERENCE_REQUIRE_FUSED, true, Yes);
  EXPECT_TRUE(absl::IsFailedPrecondition(d.status()));
  EXPECT_NE(d.status().message().find("disabled_by_config"), std::string::npos);
  d = ChoosePath(Op::kMhc, v1::PATH_PREFERENCE_REQUIRE_FUSED, false, Yes);
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->path, Path::kFused);
}

TEST(Dispatcher, FusedFailureReRunsUnfused) {
  PathDecision fused;
  std::vector<Path> runs;
  auto fail_fused = [&](Path p) -> absl::StatusOr<RunStats> {
    runs.push_back(p);
    if (p == Path::kFused) return absl::UnavailableError("launch failed");
    return RunStats{0.5};
  };
  auto out = RunWithFallback(Op::kSwa, fused, false, "t", fail_fused);
  ASSERT_TRUE(out.ok());
  EXPECT_EQ(runs, (std::vector<Path>{Path::kFused, Path::kUnfused}));
  EXPECT_EQ(out->decision.path, Path::kUnfused);
  EXPECT_EQ(out->decision.reason, FallbackReason::kFusedKernelError);
  EXPECT_NE(out->decision.detail.find("launch failed"), std::string::npos);
  EXPECT_EQ(out->stats.kernel_seconds, 0.5);

  // REQUIRE_FUSED: no re-run.
  runs.clear();
  out = RunWithFallback(Op::kSwa, fused, true, "t", fail_fused);
  EXPECT_TRUE(absl::IsFailedPrecondition(out.status()));
  EXPECT_NE(out.status().message().find("fused_kernel_error"), std::string::npos);
  EXPECT_EQ(runs, (std::vector<Path>{Path::kFused}));
}

TEST(Dispatcher, InvalidArgumentIsNotRetriedAndDoubleFailureIsInternal) {
  PathDecision fused;
  int calls = 0;
  auto invalid = [&](Path) -> absl::StatusOr<RunStats> {
    ++calls;
    return absl::InvalidArgumentError("bad x");
  };
  EXPECT_TRUE(absl::IsInvalidArgument(RunWithFallback(Op::kMhc, fused, false, "t", invalid).status()));
  EXPECT_EQ(calls, 1);
  // Out of device memory is back-pressure: returned as is, never re-run as fused_kernel_error.
  calls = 0;
  auto oom = [&](Path) -> absl::StatusOr<RunStats> {
    ++calls;
    return absl::ResourceExhaustedError("device allocation failed");
  };
  EXPECT_TRUE(absl::IsResourceExhausted(RunWithFallback(Op::kMhc, fused, false, "t", oom).status()));
  EXPECT_EQ(calls, 1);
  auto both = [&](Path p) -> absl::StatusOr<RunStats> {
    return absl::UnavailableError(p == Path::kFused ? "fused broke" : "unfused broke");
  };
  absl::Status s = RunWithFallback(Op::kMhc, fused, false, "t", both).status();
  EXPECT_TRUE(absl::IsInternal(s));
  EXPECT_NE(s.message().find("fused broke"), std::string::npos);
  EXPECT_NE(s.message().find("unfused broke"), std::string::npos);
  // An unfused decision that fails is returned as is (nothing to fall back to).
  PathDecision unfused{Path::kUnfused, FallbackReason::kClientForcedUnfused, ""};
  EXPECT_TRUE(absl::IsUnavailable(RunWithFallback(Op::kMhc, unfused, false, "t", both).status()));
}

TEST(Dispatcher, ProtoReasonNamesMatchTheLibrary) {
  for (FallbackReason r : AllFallbackReasons()) {
    std::string name = v1::FallbackReason_Name(ToProto(r));
    for (char& c : name) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    EXPECT_EQ(name, std::string("fallback_reason_") + FallbackReasonName(r));
  }
}

v1::Tensor T(v1::DataType dtype, std::vector<int64_t> shape, size_t bytes) {
  v1::Tensor t;
  t.set_dtype(dtype);
  for (int64_t d : shape) t.add_shape(d);
  t.set_data(std::string(bytes, '\x11'));
  return t;
}

TEST(TensorCodec, ValidatesDtypeShapeAndLength) {
  auto ok = DecodeTensor(T(v1::DATA_TYPE_BF16, {2, 3}, 12), "x", DType::kBF16, {2, 3});
  ASSERT_TRUE(ok.ok());
  EXPECT_EQ(ok->rank, 2);
  EXPECT_EQ(ok->stride[0], 3);
  for (auto [t, needle] : std::vector<std::pair<v1::Tensor, std::string>>{
           {T(v1::DATA_TYPE_FP32, {2, 3}, 24), "dtype fp32"},
           {T(v1::DATA_TYPE_BF16, {3, 2}, 12), "shape [3, 2]"},
           {T(v1::DATA_TYPE_BF16, {2, 3}, 11), "needs 12 bytes, got 11"},
           {T(v1::DATA_TYPE_UNSPECIFIED, {}, 0), "missing"},
       }) {
    auto r = DecodeTensor(t, "x", DType::kBF16, {2, 3});
    EXPECT_TRUE(absl::IsInvalidArgument(r.status()));
    EXPECT_NE(r.status().message().find("'x'"), std::string::npos) << r.status();
    EXPECT_NE(r.status().message().find(needle), std::string::npos) << r.status();
  }
}

TEST(TensorCodec, HostileShapesDoNotOverflow) {
  const int64_t big = int64_t{1} << 40;
  auto r = DecodeStrided2D(T(v1::DATA_TYPE_BF16, {big, big}, 16), "qr_kv", DType::kBF16, 4);
  EXPECT_TRUE(absl::IsInvalidArgument(r.status()));
  EXPECT_NE(r.status().message().find("overflow"), std::string::npos) << r.status();
  auto n = LeadingDim(T(v1::DATA_TYPE_BF16, {-1, 4}, 0), "x", 2);
  EXPECT_TRUE(absl::IsInvalidArgument(n.status()));
}

TEST(TensorCodec, Strided2DViewsTheLeadingColumns) {
  auto r = DecodeStrided2D(T(v1::DATA_TYPE_BF16, {3, 10}, 60), "qr_kv", DType::kBF16, 7);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->shape[0], 3);
  EXPECT_EQ(r->shape[1], 7);
  EXPECT_EQ(r->stride[0], 10);
  EXPECT_EQ(r->stride[1], 1);
  EXPECT_TRUE(absl::IsInvalidArgument(
      DecodeStrided2D(T(v1::DATA_TYPE_BF16, {3, 6}, 36), "qr_kv", DType::kBF16, 7).status()));
}

// Memory admission sizes the response before Decode*Request allocates it: the two must agree for
// every stage, mode, aux flag, SWA scale layout and wq_b, or admission would count the wrong bytes.
TEST(ResponseSizing, MatchesWhatDecodeAllocates) {
  std::mt19937_64 rng{std::random_device{}()};
  const ServerConfig config = testing::TestConfig();
  std::unique_ptr<Backend> cpu = testing::CpuBackendFor(config);
  int checked = 0;
  for (const auto layout : {v1::SCALE_LAYOUT_ROW_MAJOR, v1::SCALE_LAYOUT_COLUMN_MAJOR_TMA}) {
    for (const int64_t wq_b_rows : {int64_t{0}, int64_t{256}}) {
      const PackedWeightSet packed = testing::MakeWeightSet(
          rng, "s", testing::MhcSetSpec{}, testing::SwaSetSpec{.layout = layout, .wq_b_rows = wq_b_rows});
      absl::StatusOr<std::shared_ptr<const WeightSet>> set = BuildWeightSet(*cpu, packed.first, packed.second, "test");
      ASSERT_TRUE(set.ok()) << set.status();
      for (const int64_t tokens : {int64_t{0}, int64_t{1}, int64_t{7}}) {
        for (const auto stage : {v1::MHC_STAGE_FIRST, v1::MHC_STAGE_SEAM, v1::MHC_STAGE_HEAD}) {
          for (const auto mode : {v1::MHC_MODE_SHIFTED, v1::MHC_MODE_NORMAL}) {
            for (const bool aux : {false, true}) {
              const v1::MhcSeamRequest req = testing::MakeMhcRequest(
                  rng, "s", {.tokens = tokens, .stage = stage, .mode = mode, .pre_mix = true, .capture_aux = aux});
              v1::MhcSeamResponse resp;
              if (!DecodeMhcRequest(req, *(*set)->on(0).mhc, 1 << 20, &resp).ok()) continue;  // combination not defined
              absl::StatusOr<ResponseSize> bytes = MhcResponseBytes(req, *(*set)->on(0).mhc, 1 << 20);
              ASSERT_TRUE(bytes.ok()) << bytes.status();
              const uint64_t want = resp.new_residual().data().size() + resp.new_pre_mix().data().size() +
                                    resp.new_post_mix().data().size() + resp.new_comb_mix().data().size() +
                                    resp.y().data().size() + resp.aux().data().size();
              EXPECT_EQ(bytes->sent, want) << "T " << tokens << " stage " << stage << " mode " << mode << " aux " << aux;
              EXPECT_EQ(bytes->held, want);
              ++checked;
            }
          }
        }
        const v1::SwaNormQuantRequest sreq = testing::MakeSwaRequest(rng, "s", tokens, 256 + 128 + 16);
        v1::SwaNormQuantResponse sresp;
        ASSERT_TRUE(DecodeSwaRequest(sreq, *(*set)->on(0).swa, 1 << 20, &sresp).ok());
        absl::StatusOr<ResponseSize> bytes = SwaResponseBytes(sreq, *(*set)->on(0).swa, 1 << 20);
        ASSERT_TRUE(bytes.ok()) << bytes.status();
        const uint64_t want = sresp.q_fp8().data().size() + sresp.q_scale().data().size() +
                              sresp.kv().data().size() + sresp.q_proj().data().size();
        EXPECT_EQ(bytes->sent, want) << "M " << tokens << " layout " << layout << " wq_b " << wq_b_rows;
        EXPECT_EQ(bytes->held, want);
        ++checked;
      }
    }
  }
  EXPECT_GE(checked, 4 * 3 * (5 + 1));  // FIRST x2, SEAM x4, HEAD x1 minus undefined; SWA once each
  // The token bound is the same error Decode gives, before any size is computed.
  const PackedWeightSet packed = testing::MakeWeightSet(rng, "s", testing::MhcSetSpec{}, std::nullopt);
  absl::StatusOr<std::shared_ptr<const WeightSet>> set = BuildWeightSet(*cpu, packed.first, packed.second, "test");
  ASSERT_TRUE(set.ok());
  const v1::MhcSeamRequest big = testing::MakeMhcRequest(rng, "s", {.tokens = 9});
  EXPECT_TRUE(absl::IsInvalidArgument(MhcResponseBytes(big, *(*set)->on(0).mhc, 8).status()));
}

// Outputs placed in shared memory are not sent; those placed in CUDA shared memory are not held by
// the server either (the kernels write them where they lie). A placement the decode will refuse
// (no reference, or an output the call does not produce) changes nothing.
TEST(ResponseSizing, PlacedOutputsAreNotSentAndCudaPlacedOnesNotHeld) {
  std::mt19937_64 rng{std::random_device{}()};
  const ServerConfig config = testing::TestConfig();
  std::unique_ptr<Backend> cpu = testing::CpuBackendFor(config);
  const PackedWeightSet packed = testing::MakeWeightSet(rng, "s", testing::MhcSetSpec{}, testing::SwaSetSpec{.wq_b_rows = 256});
  absl::StatusOr<std::shared_ptr<const WeightSet>> set = BuildWeightSet(*cpu, packed.first, packed.second, "test");
  ASSERT_TRUE(set.ok()) << set.status();
  const int64_t T = 5;
  v1::MhcSeamRequest req = testing::MakeMhcRequest(rng, "s", {.tokens = T, .capture_aux = true});
  v1::MhcSeamResponse resp;
  ASSERT_TRUE(DecodeMhcRequest(req, *(*set)->on(0).mhc, 1 << 20, &resp).ok());
  const uint64_t all = resp.new_residual().data().size() + resp.new_pre_mix().data().size() +
                       resp.new_post_mix().data().size() + resp.new_comb_mix().data().size() +
                       resp.y().data().size() + resp.aux().data().size();
  const uint64_t y = resp.y().data().size(), residual = resp.new_residual().data().size();
  ASSERT_GT(y, 0u);
  ASSERT_GT(residual, 0u);
  auto place = [&](const char* output) {
    v1::OutputPlacement* p = req.add_output_placements();
    p->set_output(output);
    return p;
  };
  place("y")->mutable_shared_memory()->set_region("r");
  place("new_residual")->mutable_cuda_shared_memory()->set_region("c");
  place("aux");                                                 // no reference: refused by the decode
  place("q_fp8")->mutable_shared_memory()->set_region("r");     // not an mHC output: refused too
  absl::StatusOr<ResponseSize> bytes = MhcResponseBytes(req, *(*set)->on(0).mhc, 1 << 20);
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  EXPECT_EQ(bytes->sent, all - y - residual);
  EXPECT_EQ(bytes->held, all - residual);

  v1::SwaNormQuantRequest sreq = testing::MakeSwaRequest(rng, "s", T, 256 + 128 + 16);
  v1::SwaNormQuantResponse sresp;
  ASSERT_TRUE(DecodeSwaRequest(sreq, *(*set)->on(0).swa, 1 << 20, &sresp).ok());
  v1::OutputPlacement* kv = sreq.add_output_placements();
  kv->set_output("kv");
  kv->mutable_cuda_shared_memory()->set_region("c");
  v1::OutputPlacement* q = sreq.add_output_placements();
  q->set_output("q_fp8");
  q->mutable_shared_memory()->set_region("r");
  absl::StatusOr<ResponseSize> sbytes = SwaResponseBytes(sreq, *(*set)->on(0).swa, 1 << 20);
  ASSERT_TRUE(sbytes.ok()) << sbytes.status();
  EXPECT_EQ(sbytes->sent, sresp.q_scale().data().size() + sresp.q_proj().data().size());
  EXPECT_EQ(sbytes->held, sresp.q_fp8().data().size() + sresp.q_scale().data().size() + sresp.q_proj().data().size());
}

TEST(TensorCodec, OutputsAreSizedInPlace) {
  v1::Tensor out;
  TensorView v = AllocateOutput(&out, DType::kFP32, {4, 5});
  EXPECT_EQ(out.data().size(), 80u);
  EXPECT_EQ(v.data, out.data().data());
  EXPECT_EQ(out.dtype(), v1::DATA_TYPE_FP32);
  EXPECT_EQ(out.shape_size(), 2);
}

TEST(TensorCodec, OutputsOutsideTheMessageGetDtypeAndShapeOnly) {
  v1::Tensor out;
  OutputBuffers external;
  TensorView v = AllocateOutput(&out, DType::kBF16, {3, 7}, &external, v1::MhcSeamResponse::kYFieldNumber);
  EXPECT_FALSE(out.has_data() || out.has_shared_memory());
  EXPECT_EQ(out.dtype(), v1::DATA_TYPE_BF16);
  ASSERT_EQ(out.shape_size(), 2);
  ASSERT_EQ(external.buffers().size(), 1u);
  EXPECT_EQ(external.buffers()[0].field, v1::MhcSeamResponse::kYFieldNumber);
  EXPECT_EQ(external.buffers()[0].bytes, 42u);
  EXPECT_EQ(v.data, external.buffers()[0].data);
}

// An output placed in CUDA shared memory gets no buffer: the kernels write the client's device
// memory (the decode points the view there), so nothing is allocated for it here; the others are.
TEST(TensorCodec, AnOutputWrittenElsewhereGetsNoBuffer) {
  using R = v1::MhcSeamResponse;
  v1::MhcSeamResponse resp;
  OutputBuffers external;
  external.WrittenElsewhere(R::kNewResidualFieldNumber);
  const TensorView residual =
      AllocateOutput(resp.mutable_new_residual(), DType::kBF16, {3, 4, 7}, &external, R::kNewResidualFieldNumber);
  const TensorView y = AllocateOutput(resp.mutable_y(), DType::kBF16, {3, 7}, &external, R::kYFieldNumber);
  EXPECT_EQ(residual.data, nullptr);
  EXPECT_EQ(residual.numel(), 84);  // the shape is there for the placement's size check
  EXPECT_EQ(resp.new_residual().shape_size(), 3);
  EXPECT_FALSE(resp.new_residual().has_data());
  ASSERT_EQ(external.buffers().size(), 1u);
  EXPECT_EQ(external.buffers()[0].field, R::kYFieldNumber);
  EXPECT_EQ(external.buffers()[0].data, y.data);
  EXPECT_EQ(external.Find(R::kNewResidualFieldNumber), nullptr);
}

// An output placed in shared memory lives in the call's OutputBuffers like any other (on a GPU lane
// the lent staging block: no zero-filled message bytes, no copy out of the block): WriteOutputs
// writes it to the object from there, and the response keeps its reference, not its bytes.
TEST(SharedMemoryTransfer, PlacedOutputsAreWrittenFromTheCallsBuffersAndLeaveTheResponse) {
  const std::string key = "/fl-units-" + std::to_string(::getpid());
  const int fd = ::shm_open(key.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::ftruncate(fd, 4096), 0);
  prometheus::Registry metrics;
  transport::SharedMemoryRegistry registry(transport::SharedMemoryLimits{.enabled = true}, metrics);
  v1::RegisterSystemSharedMemoryRequest reg;
  reg.set_name("r");
  reg.set_key(key);
  reg.set_byte_size(4096);
  ASSERT_TRUE(registry.Register("id", reg).ok());

  using R = v1::MhcSeamResponse;
  v1::MhcSeamResponse resp;
  OutputBuffers external;
  TensorView y = AllocateOutput(resp.mutable_y(), DType::kBF16, {3, 7}, &external, R::kYFieldNumber);
  TensorView pre = AllocateOutput(resp.mutable_new_pre_mix(), DType::kFP32, {2, 2}, &external, R::kNewPreMixFieldNumber);
  for (int i = 0; i < 42; ++i) static_cast<char*>(y.data)[i] = static_cast<char>(i * 7 + 1);
  std::memset(pre.data, 0x5a, 16);
  v1::SharedMemoryRef ref;
  ref.set_region("r");
  ref.set_offset(128);
  ref.set_byte_size(42);
  transport::TensorTransfer transfer(&registry, nullptr, "id");
  const absl::Status wrong = transfer.PlaceOutput(ref, resp.mutable_y(), "y", R::kYFieldNumber, 40).status();
  EXPECT_EQ(wrong.code(), absl::StatusCode::kInvalidArgument) << wrong;
  ASSERT_TRUE(transfer.PlaceOutput(ref, resp.mutable_y(), "y", R::kYFieldNumber, 42).ok());
  ASSERT_TRUE(transfer.WriteOutputs(&external).ok());

  std::string written(42, '\0');
  ASSERT_EQ(::pread(fd, written.data(), 42, 128), 42);
  for (int i = 0; i < 42; ++i) EXPECT_EQ(written[i], static_cast<char>(i * 7 + 1)) << i;
  EXPECT_EQ(external.Find(R::kYFieldNumber), nullptr);  // not sent in the response
  ASSERT_NE(external.Find(R::kNewPreMixFieldNumber), nullptr);
  EXPECT_EQ(external.buffers().size(), 1u);
  EXPECT_TRUE(resp.y().has_shared_memory());
  EXPECT_EQ(resp.y().shared_memory().offset(), 128u);
  EXPECT_FALSE(resp.y().has_data());
  ::close(fd);
  ::shm_unlink(key.c_str());
}

// ExpireIdle (the reaper's step of --shared_memory_idle_seconds) at chosen times: a region is
// unregistered once no request has looked it up for the idle time, registration counting as a use,
// whatever identity holds it; one looked up since stays; a name freed this way can be registered
// again. (The idle time here is an hour, so the reaper thread itself never fires during the test.)
TEST(SharedMemoryRegistry, ExpireIdleUnregistersWhatNoRequestUsedForTheIdleTime) {
  const std::string key = "/fl-units-idle-" + std::to_string(::getpid());
  const int fd = ::shm_open(key.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::ftruncate(fd, 3 * 4096), 0);
  prometheus::Registry metrics;
  transport::SharedMemoryRegistry registry(transport::SharedMemoryLimits{.enabled = true, .idle_seconds = 3600},
                                           metrics);
  auto reg = [&](const std::string& identity, const std::string& name, uint64_t offset) {
    v1::RegisterSystemSharedMemoryRequest r;
    r.set_name(name);
    r.set_key(key);
    r.set_offset(offset);
    r.set_byte_size(4096);
    return registry.Register(identity, r);
  };
  // The registrations happen between these two readings of the clock (and take their own), so
  // the test chooses its times from the bounds, never from how long registering took.
  const auto before_registering = std::chrono::steady_clock::now();
  ASSERT_TRUE(reg("id", "a", 0).ok());
  ASSERT_TRUE(reg("id", "b", 4096).ok());
  ASSERT_TRUE(reg("id", "c", 8192).ok());
  const auto registered = std::chrono::steady_clock::now();
  while (std::chrono::steady_clock::now() == registered) {
  }
  ASSERT_TRUE(registry.Lookup("id", "b", "x").ok());  // a use, after `registered`
  const auto hour = std::chrono::seconds(3600);

  // Earlier than an hour after the first registration: nothing has been idle for an hour yet.
  registry.ExpireIdle(before_registering + hour - std::chrono::nanoseconds(1));
  absl::StatusOr<v1::SystemSharedMemoryStatusResponse> st = registry.Status("id", "");
  ASSERT_TRUE(st.ok());
  EXPECT_EQ(st->regions_size(), 3);
  registry.ExpireIdle(registered + hour);  // a and c: an hour since registration; b used since
  st = registry.Status("id", "");
  ASSERT_TRUE(st.ok());
  ASSERT_EQ(st->regions_size(), 1);
  EXPECT_EQ(st->regions(0).name(), "b");
  const absl::Status gone = registry.Lookup("id", "a", "x").status();
  EXPECT_EQ(gone.code(), absl::StatusCode::kNotFound) << gone;
  EXPECT_NE(gone.message().find("--shared_memory_idle_seconds"), std::string::npos) << gone;
  EXPECT_TRUE(reg("id", "a", 0).ok());  // the name and its bytes are free again
  registry.ExpireIdle(std::chrono::steady_clock::now() + 2 * hour);
  st = registry.Status("id", "");
  ASSERT_TRUE(st.ok());
  EXPECT_EQ(st->regions_size(), 0);
  ::close(fd);
  ::shm_unlink(key.c_str());
}

// The unix-socket peers' table (auth/unix_peers.h): a connection's credentials are found by the
// name gRPC gives its calls' peer ("fd:N") while N is still the socket that was recorded; any other
// name, or N reused by anything else, finds nothing.
TEST(UnixPeerTable, FindsTheRecordedConnectionByItsGrpcPeerNameAndNothingElse) {
  int pair[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, pair), 0);
  server::auth::UnixPeerTable table;
  ASSERT_TRUE(table.Add(pair[0]));
  const std::string name = "fd:" + std::to_string(pair[0]);
  std::optional<server::auth::UnixPeer> peer = table.Find(name);
  ASSERT_TRUE(peer.has_value());
  EXPECT_EQ(peer->uid, ::getuid());  // the other end is this process
  EXPECT_EQ(peer->gid, ::getgid());
  EXPECT_EQ(peer->pid, ::getpid());
  EXPECT_EQ(server::auth::UnixPeerIdentity(*peer), "uid:" + std::to_string(::getuid()));
  EXPECT_TRUE(server::auth::UnixPeerTable::IsFdPeer(name));
  EXPECT_FALSE(table.Find("fd:" + std::to_string(pair[1])).has_value());  // never recorded
  for (const char* other : {"fd:", "fd:x", "fd:-1", "ipv4:127.0.0.1:5000", "unix:/tmp/s", ""}) {
    EXPECT_FALSE(table.Find(other).has_value()) << other;
  }
  EXPECT_FALSE(table.Find(name + "0").has_value());
  EXPECT_FALSE(server::auth::UnixPeerTable::IsFdPeer("ipv6:[::1]:1"));
  // The number reused: by a file, then by another socket. Neither lends the recorded credentials.
  const int file = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  ASSERT_GE(file, 0);
  ASSERT_EQ(::dup2(file, pair[0]), pair[0]);
  EXPECT_FALSE(table.Find(name).has_value());
  int other[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, other), 0);
  ASSERT_EQ(::dup2(other[0], pair[0]), pair[0]);
  EXPECT_FALSE(table.Find(name).has_value());
  // Recorded again (a new connection accepted on that number): found again.
  ASSERT_TRUE(table.Add(pair[0]));
  EXPECT_TRUE(table.Find(name).has_value());
  // A descriptor that is not a socket has no peer credentials: not recorded.
  EXPECT_FALSE(table.Add(file));
  for (int fd : {pair[0], pair[1], other[0], other[1], file}) ::close(fd);
}

// Whether a unix-socket caller could open an object read-write itself, from its mode bits.
TEST(UnixPeerTable, MayReadWriteFollowsTheModeBitsForOwnerGroupAndOthers) {
  using server::auth::UnixPeer;
  using server::auth::UnixPeerMayReadWrite;
  struct stat st {};
  st.st_uid = 1000;
  st.st_gid = 2000;
  const UnixPeer owner{1000, 3000, 1}, group{1001, 2000, 1}, other{1002, 3000, 1}, root{0, 0, 1};
  st.st_mode = S_IFREG | 0600;
  EXPECT_TRUE(UnixPeerMayReadWrite(owner, st));
  EXPECT_FALSE(UnixPeerMayReadWrite(group, st));
  EXPECT_FALSE(UnixPeerMayReadWrite(other, st));
  EXPECT_TRUE(UnixPeerMayReadWrite(root, st));
  st.st_mode = S_IFREG | 0400;  // the owner may read only
  EXPECT_FALSE(UnixPeerMayReadWrite(owner, st));
  st.st_mode = S_IFREG | 0660;
  EXPECT_TRUE(UnixPeerMayReadWrite(group, st));
  EXPECT_FALSE(UnixPeerMayReadWrite(other, st));
  st.st_mode = S_IFREG | 0066;  // others and group, not the owner: the owner's bits decide for it
  EXPECT_FALSE(UnixPeerMayReadWrite(owner, st));
  EXPECT_TRUE(UnixPeerMayReadWrite(other, st));
  st.st_mode = S_IFREG | 0664;
  EXPECT_FALSE(UnixPeerMayReadWrite(other, st));
}

// Registration for a unix-socket caller: an object it could not open read-write itself is
// PERMISSION_DENIED (the server, which could, does not act for it), one it could is registered;
// without a caller's credentials (TCP) nothing is checked beyond the server's own open.
TEST(SharedMemoryRegistry, AUnixSocketCallerRegistersOnlyObjectsItCouldOpenItself) {
  const std::string key = "/fl-units-peer-" + std::to_string(::getpid());
  const int fd = ::shm_open(key.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::ftruncate(fd, 4096), 0);
  struct stat st {};
  ASSERT_EQ(::fstat(fd, &st), 0);
  prometheus::Registry metrics;
  transport::SharedMemoryRegistry registry(transport::SharedMemoryLimits{.enabled = true}, metrics);
  v1::RegisterSystemSharedMemoryRequest r;
  r.set_key(key);
  r.set_byte_size(4096);
  const uid_t someone = st.st_uid + 4242;  // neither the owner nor root
  const server::auth::UnixPeer stranger{someone, st.st_gid + 4242, 1}, owner{st.st_uid, st.st_gid + 4242, 1};
  r.set_name("stranger");
  const absl::Status denied = registry.Register("uid:" + std::to_string(someone), r, &stranger);
  EXPECT_EQ(denied.code(), absl::StatusCode::kPermissionDenied) << denied;
  EXPECT_NE(denied.message().find("(uid " + std::to_string(someone) + ")"), std::string::npos) << denied;
  r.set_name("owner");
  EXPECT_TRUE(registry.Register("uid:" + std::to_string(st.st_uid), r, &owner).ok());
  ASSERT_TRUE(registry.Unregister("uid:" + std::to_string(st.st_uid), "owner").ok());
  ASSERT_EQ(::fchmod(fd, 0666), 0);  // now anyone could open it read-write
  r.set_name("stranger");
  EXPECT_TRUE(registry.Register("uid:" + std::to_string(someone), r, &stranger).ok());
  ASSERT_TRUE(registry.Unregister("uid:" + std::to_string(someone), "stranger").ok());
  ASSERT_EQ(::fchmod(fd, 0600), 0);
  r.set_name("tcp");
  EXPECT_TRUE(registry.Register("anonymous", r).ok());
  ::close(fd);
  ::shm_unlink(key.c_str());
}

std::string WireBytes(const grpc::ByteBuffer& wire) {
  std::vector<grpc::Slice> slices;
  EXPECT_TRUE(wire.Dump(&slices).ok());
  std::string bytes;
  for (const grpc::Slice& s : slices) bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  return bytes;
}

// The raw response (rpc/wire_messages.h): what a client parses is the message with each output's
// data in its tensor, for every size class (copied below a few KiB, referenced above, empty), and
// the referenced outputs really are sent from their own memory.
TEST(WireMessages, ResponseParsesAsTheWholeMessageAndLargeOutputsAreNotCopied) {
  std::mt19937_64 rng = fusedlayer::testing::MakeRng();
  v1::MhcSeamResponse message;
  message.set_request_id("wire-1");
  message.mutable_report()->set_path(v1::EXECUTION_PATH_FUSED);
  message.mutable_report()->set_server_seconds(1.5e-4);
  OutputBuffers outputs;
  v1::MhcSeamResponse whole = message;  // the same response with the data inside, as protobuf would send it
  using R = v1::MhcSeamResponse;
  const std::vector<std::pair<int, size_t>> sizes = {
      {R::kNewResidualFieldNumber, 3 * 4096 + 18}, {R::kNewPreMixFieldNumber, 16}, {R::kNewPostMixFieldNumber, 4094},
      {R::kNewCombMixFieldNumber, 4096}, {R::kYFieldNumber, 0}, {R::kAuxFieldNumber, 100000}};
  for (const auto& [field, bytes] : sizes) {
    auto* tensor = static_cast<v1::Tensor*>(
        message.GetReflection()->MutableMessage(&message, R::descriptor()->FindFieldByNumber(field)));
    TensorView view = AllocateOutput(tensor, DType::kBF16, {static_cast<int64_t>(bytes / 2), 1}, &outputs, field);
    char* data = static_cast<char*>(view.data);
    for (size_t i = 0; i < bytes; ++i) data[i] = static_cast<char>(rng());
    auto* whole_tensor = static_cast<v1::Tensor*>(
        whole.GetReflection()->MutableMessage(&whole, R::descriptor()->FindFieldByNumber(field)));
    *whole_tensor = *tensor;
    whole_tensor->set_data(std::string(data, bytes));
  }
  grpc::ByteBuffer wire;
  EncodeWireResponse(message, outputs, &wire);
  EXPECT_EQ(wire.Length(), WireResponseBytes(message, outputs));
  R parsed;
  ASSERT_TRUE(parsed.ParseFromString(WireBytes(wire)));
  EXPECT_EQ(parsed.SerializeAsString(), whole.SerializeAsString());
  EXPECT_TRUE(parsed.y().has_data());  // an empty output is still present as data

  // Written after encoding, seen in the wire bytes: the large outputs are referenced, not copied.
  // Their memory outlives the OutputBuffers (each slice holds its owner).
  const OutputBuffers::Buffer aux = outputs.buffers().back();
  outputs.Clear();
  aux.data[0] = static_cast<char>(~whole.aux().data()[0]);
  ASSERT_TRUE(parsed.ParseFromString(WireBytes(wire)));
  EXPECT_EQ(parsed.aux().data()[0], aux.data[0]);
  EXPECT_EQ(parsed.new_pre_mix().data(), whole.new_pre_mix().data());
}

TEST(WireMessages, RequestParseRefusesGarbageAndFreesTheBytes) {
  std::mt19937_64 rng = fusedlayer::testing::MakeRng();
  const v1::MhcSeamRequest request = testing::MakeMhcRequest(rng, "s", {.tokens = 3});
  const std::string bytes = request.SerializeAsString();
  // Over several slices, as gRPC delivers a large message.
  std::vector<grpc::Slice> slices;
  for (size_t at = 0; at < bytes.size(); at += 1000) {
    slices.emplace_back(bytes.data() + at, std::min<size_t>(1000, bytes.size() - at));
  }
  grpc::ByteBuffer wire(slices.data(), slices.size());
  v1::MhcSeamRequest parsed;
  ASSERT_TRUE(ParseWireRequest(&wire, &parsed).ok());
  EXPECT_EQ(parsed.SerializeAsString(), bytes);
  EXPECT_EQ(wire.Length(), 0u);

  for (const std::string& garbage : {std::string("\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01", 11),
                                     std::string("\x22\x7f", 2) /* x: a length past the end */,
                                     bytes.substr(0, bytes.size() / 2)}) {
    grpc::Slice slice(garbage.data(), garbage.size());
    grpc::ByteBuffer bad(&slice, 1);
    absl::Status s = ParseWireRequest(&bad, &parsed);
    EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
    EXPECT_NE(s.message().find("fusedlayer.v1.MhcSeamRequest"), std::string::npos) << s;
  }
}

TEST(Executor, BoundedQueueRejectsButControlTasksPass) {
  Executor ex(1);
  std::mutex mu;
  std::condition_variable cv;
  bool release = false, started = false;
  std::atomic<int> ran{0};
  ASSERT_TRUE(ex.Submit([&](double) {
                  std::unique_lock<std::mutex> l(mu);
                  started = true;
                  cv.notify_all();
                  cv.wait(l, [&] { return release; });
                  ++ran;
                }).ok());
  {
    std::unique_lock<std::mutex> l(mu);
    cv.wait(l, [&] { return started; });
  }
  ASSERT_TRUE(ex.Submit([&](double) { ++ran; }).ok());  // waits in the queue
  EXPECT_TRUE(absl::IsResourceExhausted(ex.Submit([&](double) { ++ran; })));
  EXPECT_TRUE(ex.SubmitControl([&](double) { ++ran; }).ok());
  EXPECT_EQ(ex.queued(), 2u);
  {
    std::lock_guard<std::mutex> l(mu);
    release = true;
  }
  cv.notify_all();
  ex.Stop();  // drains
  EXPECT_EQ(ran, 3);
  EXPECT_TRUE(absl::IsUnavailable(ex.Submit([](double) {})));
}

// --executor_spin_us: an idle worker polls the queue, so a task submitted meanwhile is taken
// without a wake-up; Stop() ends a spin at once (this one would last 100 s), and spinning changes
// nothing about what runs: every task of several workers runs once.
TEST(Executor, IdleWorkerSpinsAndTakesWorkWithoutAWakeUp) {
  Executor ex(8, {}, /*workers=*/1, SpinOptions{std::chrono::seconds(100)});
  // Bounded, so a worker that never spins fails the test instead of hanging it.
  const auto wait_until = [](auto done) {
    const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (!done() && std::chrono::steady_clock::now() < give_up) std::this_thread::sleep_for(std::chrono::microseconds(200));
    return done();
  };
  std::atomic<int> ran{0};
  for (int i = 1; i <= 3; ++i) {
    ASSERT_TRUE(wait_until([&] { return ex.spinning(); }));
    ASSERT_TRUE(ex.Submit([&](double) { ++ran; }).ok());
    ASSERT_TRUE(wait_until([&] { return ran.load() == i; }));
    EXPECT_EQ(ex.taken_while_spinning(), static_cast<uint64_t>(i));
  }
  ASSERT_TRUE(wait_until([&] { return ex.spinning(); }));
  ex.Stop();
  EXPECT_FALSE(ex.spinning());
  EXPECT_TRUE(absl::IsUnavailable(ex.Submit([](double) {})));

  Executor many(64, {}, /*workers=*/4, SpinOptions{std::chrono::microseconds(500)});
  std::atomic<int> count{0};
  for (int i = 0; i < 200; ++i) {
    while (absl::IsResourceExhausted(many.Submit([&](double) { ++count; }))) std::this_thread::yield();
  }
  ASSERT_TRUE(many.SubmitControl([&](double) { ++count; }).ok());
  many.Stop();
  EXPECT_EQ(count.load(), 201);
}

// A task queued while a worker spins wakes no one (that worker takes it), but a second task queued
// behind it must wake a sleeping worker: here the first task waits for the second to start, which
// only the other worker can do. Many rounds, so the second task lands both before and after the
// spinner has taken the first.
TEST(Executor, ATaskQueuedBehindTheSpinnersWakesASleepingWorker) {
  Executor ex(8, {}, /*workers=*/2, SpinOptions{std::chrono::seconds(100)});
  const auto wait_until = [](auto done) {
    const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (!done() && std::chrono::steady_clock::now() < give_up) std::this_thread::yield();
    return done();
  };
  for (int round = 0; round < 200; ++round) {
    SCOPED_TRACE(round);
    ASSERT_TRUE(wait_until([&] { return ex.spinning(); }));
    std::atomic<bool> second_started{false}, first_saw_second{false};
    std::atomic<int> finished{0};
    ASSERT_TRUE(ex.Submit([&](double) {
                    first_saw_second = wait_until([&] { return second_started.load(); });
                    ++finished;
                  }).ok());
    if (round % 2 == 1) std::this_thread::sleep_for(std::chrono::microseconds(50));  // the spinner has taken it
    ASSERT_TRUE(ex.Submit([&](double) {
                    second_started = true;
                    ++finished;
                  }).ok());
    ASSERT_TRUE(wait_until([&] { return finished.load() == 2; }));
    ASSERT_TRUE(first_saw_second.load());
  }
  EXPECT_GT(ex.taken_while_spinning(), 0u);
  ex.Stop();
}

TEST(Config, DisableFusedAndLimits) {
  ServerConfig c;
  ASSERT_TRUE(ParseDisableFused(" mhc , swa", c).ok());
  EXPECT_TRUE(c.fused_disabled(Op::kMhc));
  EXPECT_TRUE(c.fused_disabled(Op::kSwa));
  ASSERT_TRUE(ParseDisableFused("", c).ok());
  EXPECT_FALSE(c.fused_disabled(Op::kMhc));
  EXPECT_TRUE(absl::IsInvalidArgument(ParseDisableFused("mhc,attn", c)));
  EXPECT_TRUE(c.Validate().ok());
  c.max_message_bytes = int64_t{1} << 31;
  EXPECT_TRUE(absl::IsInvalidArgument(c.Validate()));
  c.max_message_bytes = 1 << 20;
  c.queue_capacity = 0;
  EXPECT_TRUE(absl::IsInvalidArgument(c.Validate()));
  c.queue_capacity = 64;
  c.max_connection_age_seconds = 300;
  EXPECT_TRUE(c.Validate().ok());
  c.max_connection_age_seconds = -1;
  EXPECT_TRUE(absl::IsInvalidArgument(c.Validate()));
  c.max_connection_age_seconds = 0;
  // drain_seconds becomes an int of milliseconds: bounded, NaN refused.
  for (const double bad : {3600.5, 1e12, -1.0, std::nan("")}) {
    c.drain_seconds = bad;
    EXPECT_TRUE(absl::IsInvalidArgument(c.Validate())) << bad;
  }
  c.drain_seconds = 3600;
  EXPECT_TRUE(c.Validate().ok());
  // Dynamic batching: token budget in [0, 2^20], queue delay in [0, 60 s].
  for (const int64_t bad : {int64_t{-1}, (int64_t{1} << 20) + 1}) {
    c.max_batch_tokens = bad;
    EXPECT_TRUE(absl::IsInvalidArgument(c.Validate())) << bad;
  }
  c.max_batch_tokens = int64_t{1} << 20;
  EXPECT_TRUE(c.Validate().ok());
  c.max_batch_tokens = 64;
  for (const int64_t bad : {int64_t{-1}, int64_t{60'000'001}}) {
    c.max_queue_delay_us = bad;
    EXPECT_TRUE(absl::IsInvalidArgument(c.Validate())) << bad;
  }
  c.max_queue_delay_us = 60'000'000;
  EXPECT_TRUE(c.Validate().ok());
  c.max_queue_delay_us = 0;
  // Idle spinning: [0, 10 ms], or -1 (auto, the default).
  EXPECT_EQ(c.executor_spin_us, -1);
  for (const int64_t bad : {int64_t{-2}, int64_t{10'001}}) {
    c.executor_spin_us = bad;
    EXPECT_TRUE(absl::IsInvalidArgument(c.Validate())) << bad;
  }
  c.executor_spin_us = 10'000;
  EXPECT_TRUE(c.Validate().ok());
  c.executor_spin_us = -1;
  // The new admission limits.
  c.max_concurrent_streams = 0;
  EXPECT_TRUE(absl::IsInvalidArgument(c.Validate()));
  c.max_concurrent_streams = 128;
  c.max_concurrent_uploads = 0;
  EXPECT_TRUE(absl::IsInvalidArgument(c.Validate()));
  c.max_concurrent_uploads = 4;
  c.grpc_memory_quota_bytes = static_cast<uint64_t>(c.max_message_bytes);  // below twice the message limit
  EXPECT_TRUE(absl::IsInvalidArgument(c.Validate()));
  c.grpc_memory_quota_bytes = 0;
  EXPECT_TRUE(c.Validate().ok());
  EXPECT_GT(c.EffectiveMaxInflightBytes(), 0u);
  EXPECT_GT(c.EffectiveGrpcMemoryQuotaBytes(), c.EffectiveMaxInflightBytes());
  c.max_inflight_bytes = 12345;
  EXPECT_EQ(c.EffectiveMaxInflightBytes(), 12345u);
  // Residual sessions: count [0 (off), 65536], bytes >= 1, idle [1, 86400] s; total 0 = a quarter
  // of memory.
  for (const int64_t bad : {int64_t{-1}, int64_t{65'537}}) {
    c.residual_session_max_sessions = bad;
    EXPECT_TRUE(absl::IsInvalidArgument(c.Validate())) << bad;
  }
  c.residual_session_max_sessions = 0;
  EXPECT_TRUE(c.Validate().ok());
  c.residual_session_max_sessions = 64;
  c.residual_session_max_bytes = 0;
  EXPECT_TRUE(absl::IsInvalidArgument(c.Validate()));
  c.residual_session_max_bytes = 1;
  for (const double bad : {0.5, 86'401.0, std::nan("")}) {
    c.residual_session_idle_seconds = bad;
    EXPECT_TRUE(absl::IsInvalidArgument(c.Validate())) << bad;
  }
  c.residual_session_idle_seconds = 1;
  EXPECT_TRUE(c.Validate().ok());
  // Call rings: rings [1, 4096] in all and per identity, slots [1, 1024], spin [0, 100000] us,
  // pollers [0, 64] (0: one per 8 cores, 1 to 4).
  for (auto [field, lo, hi] : {std::tuple{&server::ServerConfig::call_ring_max_rings, int64_t{1}, int64_t{4096}},
                               {&server::ServerConfig::call_ring_max_per_identity, int64_t{1}, int64_t{4096}},
                               {&server::ServerConfig::call_ring_max_slots, int64_t{1}, int64_t{1024}},
                               {&server::ServerConfig::call_ring_spin_us, int64_t{0}, int64_t{100000}},
                               {&server::ServerConfig::call_ring_pollers, int64_t{0}, int64_t{64}}}) {
    const int64_t kept = c.*field;
    for (const int64_t bad : {lo - 1, hi + 1}) {
      c.*field = bad;
      const absl::Status s = c.Validate();
      EXPECT_TRUE(absl::IsInvalidArgument(s)) << bad;
      EXPECT_NE(s.message().find("--call_ring_"), std::string::npos) << s;
    }
    for (const int64_t good : {lo, hi}) {
      c.*field = good;
      EXPECT_TRUE(c.Validate().ok()) << good;
    }
    c.*field = kept;
  }
  // Shared-memory regions: idle [0 (never), 604800] s, each kind.
  for (double* idle : {&c.shared_memory_idle_seconds, &c.cuda_shared_memory_idle_seconds}) {
    for (const double bad : {-1.0, 604'801.0, std::nan("")}) {
      *idle = bad;
      EXPECT_TRUE(absl::IsInvalidArgument(c.Validate())) << bad;
    }
    *idle = 0.25;
    EXPECT_TRUE(c.Validate().ok());
    *idle = 0;
  }
  const decltype(c) defaults;  // both a quarter of memory
  EXPECT_EQ(defaults.EffectiveResidualSessionTotalBytes(), defaults.EffectiveMaxInflightBytes());
  c.residual_session_total_bytes = 777;
  EXPECT_EQ(c.EffectiveResidualSessionTotalBytes(), 777u);
}

// The admission counter never over-commits and gives bytes back exactly once.
TEST(ByteBudget, AdmitsUpToTheLimitAndReleasesOnDestruction) {
  ByteBudget budget(100);
  std::optional<ByteBudget::Lease> a = budget.TryAcquire(60);
  ASSERT_TRUE(a.has_value());
  EXPECT_FALSE(budget.TryAcquire(41).has_value());
  std::optional<ByteBudget::Lease> b = budget.TryAcquire(40);
  ASSERT_TRUE(b.has_value());
  EXPECT_EQ(budget.in_use(), 100u);
  EXPECT_FALSE(budget.TryAcquire(1).has_value());
  EXPECT_FALSE(budget.TryAcquire(~uint64_t{0}).has_value());  // no wrap-around
  b->Release();
  b->Release();  // idempotent
  EXPECT_EQ(budget.in_use(), 60u);
  EXPECT_TRUE(budget.TryExtend(*a, 40));
  EXPECT_EQ(a->bytes(), 100u);
  EXPECT_FALSE(budget.TryExtend(*a, 1));
  EXPECT_EQ(a->bytes(), 100u);
  ByteBudget::Lease moved = std::move(*a);
  a.reset();
  EXPECT_EQ(budget.in_use(), 100u);
  { ByteBudget::Lease gone = std::move(moved); }
  EXPECT_EQ(budget.in_use(), 0u);
  ByteBudget::Lease empty;
  EXPECT_TRUE(budget.TryExtend(empty, 10));
  EXPECT_EQ(budget.in_use(), 10u);
}

// ---- the last reference to a weight set is freed on the executor -----------------------------

// Which thread destroyed prepared weights: the CPU backend's, wrapped so their destructor records it.
struct FreedOn {
  std::mutex mu;
  std::condition_variable cv;
  std::optional<std::thread::id> thread;
  void Record() {
    {
      std::lock_guard<std::mutex> lock(mu);
      thread = std::this_thread::get_id();
    }
    cv.notify_all();
  }
  std::optional<std::thread::id> WaitFor(std::chrono::seconds limit) {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait_for(lock, limit, [&] { return thread.has_value(); });
    return thread;
  }
};

class TrackedMhc final : public PreparedMhcWeights {
 public:
  TrackedMhc(std::unique_ptr<PreparedMhcWeights> inner, std::shared_ptr<FreedOn> freed)
      : inner_(std::move(inner)), freed_(std::move(freed)) {}
  ~TrackedMhc() override { freed_->Record(); }
  const MhcHyperParams& params() const override { return inner_->params(); }
  bool has_norm_weight() const override { return inner_->has_norm_weight(); }
  size_t resident_bytes() const override { return inner_->resident_bytes(); }
  const PreparedMhcWeights& inner() const { return *inner_; }

 private:
  std::unique_ptr<PreparedMhcWeights> inner_;
  std::shared_ptr<FreedOn> freed_;
};

// The CPU backend, with mHC prepared weights that say where they were freed.
class FreeTrackingBackend final : public fusedlayer::testing::ForwardingBackend {
 public:
  FreeTrackingBackend(std::unique_ptr<Backend> inner, std::shared_ptr<FreedOn> freed)
      : ForwardingBackend(std::move(inner)), freed_(std::move(freed)) {}
  absl::StatusOr<std::unique_ptr<PreparedMhcWeights>> PrepareMhc(const MhcHyperParams& p,
                                                                 const MhcWeightsHost& w) override {
    absl::StatusOr<std::unique_ptr<PreparedMhcWeights>> prepared = inner().PrepareMhc(p, w);
    if (!prepared.ok()) return prepared.status();
    return std::make_unique<TrackedMhc>(*std::move(prepared), freed_);
  }
  FusedSupport MhcFusedSupport(const PreparedMhcWeights& w, const MhcShapeQuery& q) const override {
    return inner().MhcFusedSupport(static_cast<const TrackedMhc&>(w).inner(), q);
  }
  absl::StatusOr<RunStats> RunMhc(const PreparedMhcWeights& w, const MhcArgs& a, Path path) override {
    return inner().RunMhc(static_cast<const TrackedMhc&>(w).inner(), a, path);
  }

 private:
  std::shared_ptr<FreedOn> freed_;
};

// A caller off the executor (a gRPC thread refusing a compute call, LoadWeights asking Contains)
// holds the last reference to a set that was unloaded or replaced meanwhile: dropping it there
// must not free the backend memory there, but on the executor, soon after.
class LastReference : public ::testing::TestWithParam<bool /*replace instead of unload*/> {};

TEST_P(LastReference, IsFreedOnTheExecutorNotWhereItDropped) {
  const bool replace = GetParam();
  std::mt19937_64 rng{std::random_device{}()};
  const ServerConfig config = fusedlayer::testing::TestConfig();
  auto freed = std::make_shared<FreedOn>();
  std::unique_ptr<ServingDevices> devices = fusedlayer::testing::SingleDevice(
      std::make_unique<FreeTrackingBackend>(fusedlayer::testing::CpuBackendFor(config), freed));
  Executor& executor = *devices->primary().executor;
  Metrics metrics("test", "cpu", "x86_64", "cpu");
  Health health;
  WeightManager weights(config, *devices, metrics, health);
  PackedWeightSet set = fusedlayer::testing::MakeWeightSet(rng, "held", fusedlayer::testing::MhcSetSpec{}, std::nullopt);
  PackedWeightSet again = set;
  ASSERT_TRUE(weights.InstallAndWait(set.first, std::move(set.second), "test").ok());

  std::promise<std::thread::id> worker_id;
  ASSERT_TRUE(executor.SubmitControl([&](double) { worker_id.set_value(std::this_thread::get_id()); }).ok());
  const std::thread::id worker = worker_id.get_future().get();

  absl::StatusOr<std::shared_ptr<const WeightSet>> held = weights.Get("held");  // this thread: "gRPC"
  ASSERT_TRUE(held.ok()) << held.status();
  if (replace) {
    // The replacement's prepared weights are tracked too; only the first free is recorded.
    again.first.set_replace(true);
    ASSERT_TRUE(weights.InstallAndWait(again.first, std::move(again.second), "test").ok());
  } else {
    std::promise<absl::StatusOr<uint64_t>> unloaded;
    ASSERT_TRUE(executor.SubmitControl([&](double) { unloaded.set_value(weights.UnloadOnWorker("held")); }).ok());
    ASSERT_TRUE(unloaded.get_future().get().ok());
  }
  EXPECT_FALSE(freed->WaitFor(std::chrono::seconds(0)).has_value()) << "freed while a reference was held";

  held->reset();  // the last reference, dropped off the executor
  const std::optional<std::thread::id> on = freed->WaitFor(std::chrono::seconds(30));
  ASSERT_TRUE(on.has_value()) << "the set was never freed";
  EXPECT_EQ(*on, worker) << "freed on the thread that dropped the last reference, not on the executor";
  EXPECT_NE(*on, std::this_thread::get_id());
  executor.Stop();
}

INSTANTIATE_TEST_SUITE_P(WeightManager, LastReference, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& p) { return p.param ? "Replaced" : "Unloaded"; });

// Once the executor has stopped nothing can run there any more: the last reference frees the set
// where it drops (shutdown), rather than never.
TEST(WeightManager, AfterTheExecutorStoppedTheLastReferenceFreesInPlace) {
  std::mt19937_64 rng{std::random_device{}()};
  const ServerConfig config = fusedlayer::testing::TestConfig();
  auto freed = std::make_shared<FreedOn>();
  std::unique_ptr<ServingDevices> devices = fusedlayer::testing::SingleDevice(
      std::make_unique<FreeTrackingBackend>(fusedlayer::testing::CpuBackendFor(config), freed));
  Executor& executor = *devices->primary().executor;
  Metrics metrics("test", "cpu", "x86_64", "cpu");
  Health health;
  std::shared_ptr<const WeightSet> held;
  {
    WeightManager weights(config, *devices, metrics, health);
    PackedWeightSet set =
        fusedlayer::testing::MakeWeightSet(rng, "held", fusedlayer::testing::MhcSetSpec{}, std::nullopt);
    ASSERT_TRUE(weights.InstallAndWait(set.first, std::move(set.second), "test").ok());
    absl::StatusOr<std::shared_ptr<const WeightSet>> got = weights.Get("held");
    ASSERT_TRUE(got.ok());
    held = *std::move(got);
    executor.Stop();
  }
  EXPECT_FALSE(freed->WaitFor(std::chrono::seconds(0)).has_value());
  held.reset();
  const std::optional<std::thread::id> on = freed->WaitFor(std::chrono::seconds(0));
  ASSERT_TRUE(on.has_value());
  EXPECT_EQ(*on, std::this_thread::get_id());
}

// ---- IdleWatch (LoadWeights upload idle timeout) ------------------------------------------------

// An entry left idle expires exactly once; a disarmed one never; after Remove nothing runs. No
// timing assertion: the test waits for events, never for a duration.
TEST(IdleWatch, ExpiresIdleEntriesOnceAndNeverDisarmedOnes) {
  IdleWatch watch(std::chrono::milliseconds(50));
  std::mutex mu;
  std::condition_variable cv;
  int idle_expired = 0, disarmed_expired = 0;
  auto count = [&](int* n) {
    return [&, n] {
      std::lock_guard<std::mutex> lock(mu);
      ++*n;
      cv.notify_all();
    };
  };
  IdleWatch::Entry idle(count(&idle_expired));
  IdleWatch::Entry disarmed(count(&disarmed_expired));
  disarmed.Disarm();
  watch.Add(&idle);
  watch.Add(&disarmed);
  {
    std::unique_lock<std::mutex> lock(mu);
    ASSERT_TRUE(cv.wait_for(lock, std::chrono::seconds(60), [&] { return idle_expired > 0; }));
  }
  // A second idle entry added later expires too; by then the watch has looked at the first one
  // again several times without calling it again.
  IdleWatch::Entry later(count(&idle_expired));
  later.Touch();
  watch.Add(&later);
  {
    std::unique_lock<std::mutex> lock(mu);
    ASSERT_TRUE(cv.wait_for(lock, std::chrono::seconds(60), [&] { return idle_expired > 1; }));
  }
  watch.Remove(&idle);
  watch.Remove(&disarmed);
  watch.Remove(&later);
  std::lock_guard<std::mutex> lock(mu);
  EXPECT_EQ(idle_expired, 2);
  EXPECT_EQ(disarmed_expired, 0);
}

TEST(Config, UploadIdleTimeoutAndVerifyBounds) {
  ServerConfig c = fusedlayer::testing::TestConfig();
  ASSERT_TRUE(c.Validate().ok()) << c.Validate();
  for (int bad : {0, -1, 3601}) {
    c.upload_idle_timeout_seconds = bad;
    EXPECT_TRUE(absl::IsInvalidArgument(c.Validate())) << bad;
  }
  for (int good : {1, 3600}) {
    c.upload_idle_timeout_seconds = good;
    EXPECT_TRUE(c.Validate().ok()) << good;
  }
  for (int bad : {-1, 1025}) {
    c.max_inflight_verify = bad;
    EXPECT_TRUE(absl::IsInvalidArgument(c.Validate())) << bad;
  }
  for (int good : {0, 1024}) {
    c.max_inflight_verify = good;
    EXPECT_TRUE(c.Validate().ok()) << good;
  }
  c.verify_dump_max_files = -1;
  EXPECT_TRUE(absl::IsInvalidArgument(c.Validate()));
  c.verify_dump_max_files = 0;
  c.verify_dump_max_bytes = -1;
  EXPECT_TRUE(absl::IsInvalidArgument(c.Validate()));
  c.verify_dump_max_bytes = 0;
  EXPECT_TRUE(c.Validate().ok());
  for (int bad : {-2, 65}) {
    c.host_copy_threads = bad;
    EXPECT_TRUE(absl::IsInvalidArgument(c.Validate())) << bad;
  }
  for (int good : {-1, 0, 3, 64}) {
    c.host_copy_threads = good;
    EXPECT_TRUE(c.Validate().ok()) << good;
  }
  for (int bad : {-1, 1025}) {
    c.malloc_arena_max = bad;
    EXPECT_TRUE(absl::IsInvalidArgument(c.Validate())) << bad;
  }
  for (int good : {0, 1, 1024}) {
    c.malloc_arena_max = good;
    EXPECT_TRUE(c.Validate().ok()) << good;
  }
  for (int64_t bad : {int64_t{-1}, (int64_t{32} << 20) + 1}) {
    c.malloc_mmap_threshold_bytes = bad;
    EXPECT_TRUE(absl::IsInvalidArgument(c.Validate())) << bad;
  }
  for (int64_t good : {int64_t{0}, int64_t{4096}, int64_t{32} << 20}) {
    c.malloc_mmap_threshold_bytes = good;
    EXPECT_TRUE(c.Validate().ok()) << good;
  }
  for (int64_t bad : {int64_t{-1}, int64_t{INT32_MAX} + 1}) {
    c.malloc_trim_threshold_bytes = bad;
    EXPECT_TRUE(absl::IsInvalidArgument(c.Validate())) << bad;
  }
  for (int64_t good : {int64_t{0}, int64_t{64} << 20, int64_t{INT32_MAX}}) {
    c.malloc_trim_threshold_bytes = good;
    EXPECT_TRUE(c.Validate().ok()) << good;
  }
}

}  // namespace
}  // namespace fusedlayer::server
