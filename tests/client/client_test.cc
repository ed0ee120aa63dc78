// Unit tests of the client library and fusedctl helpers that need no server: tensor messages, the
// random input generators, argument validation, percentile math, safetensors I/O, fp8 dequantized
// summaries, bench aggregation (the echo floor too, with its in-process echo server) and the client's
// local checks. The wire is covered end to end by the service's e2e suites.
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "client/fusedctl/bench_stats.h"
#include "client/fusedctl/cli_options.h"
#include "client/fusedctl/echo_floor.h"
#include "client/fusedctl/commands.h"
#include "client/lib/fusedlayer_client.h"
#include "client/lib/latency_stats.h"
#include "client/lib/random_inputs.h"
#include "client/lib/safetensors_io.h"
#include "client/lib/tensor_messages.h"
#include "client/lib/tensor_summary.h"
#include "client/lib/wire_request.h"
#include "grpcpp/support/slice.h"
#include "gtest/gtest.h"

namespace fusedlayer::client {
namespace {

// Fresh seed per test run (recorded so a failure can be reproduced).
std::mt19937_64 FreshRng() {
  const uint64_t seed = FreshSeed();
  ::testing::Test::RecordProperty("seed", std::to_string(seed));
  SCOPED_TRACE(seed);
  return std::mt19937_64(seed);
}

// Independent bf16 decode (no shared code with the client): the upper half of an fp32.
double Bf16BitsToDouble(uint16_t b) {
  uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

std::vector<uint16_t> Bf16Of(const v1::Tensor& t) {
  std::vector<uint16_t> v(t.data().size() / 2);
  if (!v.empty()) std::memcpy(v.data(), t.data().data(), t.data().size());  // memcpy(nullptr, .., 0) is UB
  return v;
}
std::vector<float> Fp32Of(const v1::Tensor& t) {
  std::vector<float> v(t.data().size() / 4);
  if (!v.empty()) std::memcpy(v.data(), t.data().data(), t.data().size());
  return v;
}
std::vector<int64_t> Shape(const v1::Tensor& t) { return {t.shape().begin(), t.shape().end()}; }

// ---- shared requests sent by reference (client/lib/wire_request.h) ------------------------------------

std::string RandomBytes(std::mt19937_64& rng, size_t n) {
  std::string s(n, '\0');
  for (char& c : s) c = static_cast<char>(rng());
  return s;
}

// The bytes parse as the request itself (protobuf merges the data patches into their tensors), a
// large tensor's data goes as a slice over the request's own memory, and the slices' references to
// the request are gone with the buffer.
TEST(WireRequest, ParsesAsTheRequestAndSendsLargeTensorsFromItsMemory) {
  std::mt19937_64 rng = FreshRng();
  auto request = std::make_shared<v1::MhcSeamRequest>();
  request->set_weight_set("w");
  request->set_mode(v1::MHC_MODE_SHIFTED);
  request->set_request_id("id");
  request->set_capture_aux(true);
  request->mutable_x()->set_dtype(v1::DATA_TYPE_BF16);
  request->mutable_x()->add_shape(5);
  request->mutable_x()->add_shape(4000);
  request->mutable_x()->set_data(RandomBytes(rng, 40000));  // a slice of its own
  request->mutable_residual()->set_dtype(v1::DATA_TYPE_BF16);
  request->mutable_residual()->set_data(RandomBytes(rng, 100));  // copied beside the headers
  request->mutable_post_mix()->set_data(RandomBytes(rng, 6000));  // data only (no dtype or shape)
  request->mutable_comb_mix()->set_dtype(v1::DATA_TYPE_FP32);
  request->mutable_comb_mix()->mutable_shared_memory()->set_region("r");  // no data at all
  request->mutable_pre_mix()->set_dtype(v1::DATA_TYPE_FP32);  // empty data
  request->mutable_pre_mix()->set_data("");
  request->add_output_placements()->set_output("y");
  std::shared_ptr<const v1::MhcSeamRequest> shared = request;
  {
    const grpc::ByteBuffer wire = EncodeRequestByReference(shared);
    std::vector<grpc::Slice> slices;
    ASSERT_TRUE(wire.Dump(&slices).ok());
    std::string bytes;
    bool x_by_reference = false;
    for (const grpc::Slice& s : slices) {
      bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
      x_by_reference = x_by_reference || (reinterpret_cast<const char*>(s.begin()) == shared->x().data().data() &&
                                          s.size() == shared->x().data().size());
    }
    EXPECT_TRUE(x_by_reference);
    EXPECT_EQ(wire.Length(), bytes.size());
    v1::MhcSeamRequest parsed;
    ASSERT_TRUE(parsed.ParseFromString(bytes));
    EXPECT_EQ(parsed.SerializeAsString(), shared->SerializeAsString());
    EXPECT_GT(shared.use_count(), 2);  // `request`, `shared` and the large tensors' slices
  }
  EXPECT_EQ(shared.use_count(), 2);  // `request` and `shared`: the buffer's slices let go
}

// ---- tensor messages -----------------------------------------------------------------------------

TEST(TensorMessages, ByteSizes) {
  const std::vector<int64_t> s = {3, 5};
  EXPECT_EQ(*TensorByteSize(v1::DATA_TYPE_BF16, s), 30u);
  EXPECT_EQ(*TensorByteSize(v1::DATA_TYPE_FP32, s), 60u);
  EXPECT_EQ(*TensorByteSize(v1::DATA_TYPE_FP8_E4M3FN, s), 15u);
  EXPECT_EQ(*TensorByteSize(v1::DATA_TYPE_FP8_E4M3FNUZ, s), 15u);
  const std::vector<int64_t> empty = {0, 7168};
  EXPECT_EQ(*TensorByteSize(v1::DATA_TYPE_BF16, empty), 0u);
  const std::vector<int64_t> scalar = {};
  EXPECT_EQ(*TensorByteSize(v1::DATA_TYPE_FP32, scalar), 4u);  // rank 0: one element
  EXPECT_EQ(TensorByteSize(v1::DATA_TYPE_UNSPECIFIED, s).status().code(), absl::StatusCode::kInvalidArgument);
  const std::vector<int64_t> neg = {4, -1};
  EXPECT_EQ(TensorByteSize(v1::DATA_TYPE_BF16, neg).status().code(), absl::StatusCode::kInvalidArgument);
  const std::vector<int64_t> huge = {int64_t{1} << 40, int64_t{1} << 40};
  EXPECT_EQ(NumElements(huge).status().code(), absl::StatusCode::kInvalidArgument);
  const std::vector<int64_t> big_bytes = {int64_t{1} << 62, 2};  // elements fit, bytes overflow
  EXPECT_EQ(TensorByteSize(v1::DATA_TYPE_FP32, big_bytes).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(TensorMessages, MakeTensorsCarryTheBytes) {
  std::mt19937_64 rng = FreshRng();
  const std::vector<uint16_t> bits = RandomActivationsBf16(rng, 4 * 6);
  absl::StatusOr<v1::Tensor> t = MakeBf16Tensor({4, 6}, bits);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->dtype(), v1::DATA_TYPE_BF16);
  EXPECT_EQ(Shape(*t), (std::vector<int64_t>{4, 6}));
  EXPECT_EQ(t->data().size(), 48u);
  EXPECT_EQ(Bf16Of(*t), bits);

  const std::vector<float> f = RandomUniform(rng, 10, 0.5f, 3.0f);
  absl::StatusOr<v1::Tensor> u = MakeFp32Tensor({2, 5}, f);
  ASSERT_TRUE(u.ok()) << u.status();
  EXPECT_EQ(u->data().size(), 40u);
  EXPECT_EQ(Fp32Of(*u), f);

  EXPECT_EQ(MakeBf16Tensor({4, 5}, bits).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(MakeFp32Tensor({11}, f).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(MakeTensor(v1::DATA_TYPE_FP8_E4M3FN, {3, 3}, std::string(8, '\x01')).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(TensorMessages, ValidateNamesTheTensor) {
  v1::Tensor t;
  t.set_dtype(v1::DATA_TYPE_BF16);
  t.add_shape(2);
  t.add_shape(3);
  t.set_data(std::string(11, 'a'));
  absl::Status s = ValidateTensor(t, "residual");
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(s.message(), "residual")) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "12")) << s;
  t.set_data(std::string(12, 'a'));
  EXPECT_TRUE(ValidateTensor(t, "residual").ok());
}

TEST(TensorMessages, DecodeKnownCodes) {
  // Hand-computed values (independent of numeric.h): e4m3fn bias 7, e4m3fnuz bias 8.
  auto decode = [](v1::DataType dt, std::vector<uint8_t> codes) {
    absl::StatusOr<v1::Tensor> t =
        MakeTensor(dt, {int64_t(codes.size())}, std::string(codes.begin(), codes.end()));
    EXPECT_TRUE(t.ok());
    return *DecodeToFloat(*t);
  };
  std::vector<float> fn = decode(v1::DATA_TYPE_FP8_E4M3FN, {0x38, 0x7e, 0xfe, 0x01, 0x40, 0x7f, 0x00});
  EXPECT_EQ(fn[0], 1.0f);
  EXPECT_EQ(fn[1], 448.0f);
  EXPECT_EQ(fn[2], -448.0f);
  EXPECT_EQ(fn[3], std::ldexp(1.0f, -9));
  EXPECT_EQ(fn[4], 2.0f);
  EXPECT_TRUE(std::isnan(fn[5]));
  EXPECT_EQ(fn[6], 0.0f);
  std::vector<float> fnuz = decode(v1::DATA_TYPE_FP8_E4M3FNUZ, {0x40, 0x7f, 0xff, 0x01, 0x80});
  EXPECT_EQ(fnuz[0], 1.0f);
  EXPECT_EQ(fnuz[1], 240.0f);
  EXPECT_EQ(fnuz[2], -240.0f);
  EXPECT_EQ(fnuz[3], std::ldexp(1.0f, -10));
  EXPECT_TRUE(std::isnan(fnuz[4]));

  std::mt19937_64 rng = FreshRng();
  const std::vector<uint16_t> bits = RandomActivationsBf16(rng, 257);
  std::vector<float> dec = *DecodeToFloat(*MakeBf16Tensor({257}, bits));
  for (size_t i = 0; i < bits.size(); ++i) ASSERT_EQ(double(dec[i]), Bf16BitsToDouble(bits[i])) << i;
}

// ---- random inputs -------------------------------------------------------------------------------

void ExpectNoZeroBf16(const v1::Tensor& t, const char* what) {
  ASSERT_EQ(t.dtype(), v1::DATA_TYPE_BF16) << what;
  for (uint16_t b : Bf16Of(t)) {
    ASSERT_NE(b & 0x7fff, 0) << what << " has a zero";
    ASSERT_FALSE((b & 0x7f80) == 0x7f80) << what << " has inf/NaN";
  }
}

void ExpectFp32In(const v1::Tensor& t, float lo, float hi, const char* what) {
  ASSERT_EQ(t.dtype(), v1::DATA_TYPE_FP32) << what;
  for (float v : Fp32Of(t)) {
    ASSERT_GT(v, lo) << what;
    ASSERT_LT(v, hi) << what;
  }
}

struct MhcCase {
  int n;
  int64_t hidden;
};
void PrintTo(const MhcCase& c, std::ostream* os) { *os << "n=" << c.n << " C=" << c.hidden; }

class RandomMhcTest : public ::testing::TestWithParam<MhcCase> {};

TEST_P(RandomMhcTest, ShapesAndValuesPerStageAndMode) {
  const MhcCase c = GetParam();
  v1::MhcConfig cfg;
  cfg.set_hc_mult(c.n);
  cfg.set_hidden(c.hidden);
  std::mt19937_64 rng = FreshRng();
  const int64_t t = 7;
  const int64_t n = c.n, h = c.hidden;
  for (v1::MhcStage stage : {v1::MHC_STAGE_SEAM, v1::MHC_STAGE_FIRST, v1::MHC_STAGE_HEAD}) {
    for (v1::MhcMode mode : {v1::MHC_MODE_SHIFTED, v1::MHC_MODE_NORMAL}) {
      for (bool pre : {true, false}) {
        if (stage == v1::MHC_STAGE_HEAD && mode == v1::MHC_MODE_NORMAL) continue;
        SCOPED_TRACE(MhcStageName(stage) + "/" + MhcModeName(mode) + (pre ? "/pre" : "/nopre"));
        MhcRequestSpec spec{.weight_set = "ws/a", .stage = stage, .mode = mode, .tokens = t,
                            .include_pre_mix = pre, .path = v1::PATH_PREFERENCE_REQUIRE_FUSED};
        absl::StatusOr<v1::MhcSeamRequest> r = RandomMhcRequest(cfg, spec, rng);
        ASSERT_TRUE(r.ok()) << r.status();
        EXPECT_EQ(r->weight_set(), "ws/a");
        EXPECT_EQ(r->stage(), stage);
        EXPECT_EQ(r->mode(), mode);
        EXPECT_EQ(r->path_preference(), v1::PATH_PREFERENCE_REQUIRE_FUSED);
        EXPECT_EQ(Shape(r->x()), (std::vector<int64_t>{t, h}));
        ExpectNoZeroBf16(r->x(), "x");
        if (stage == v1::MHC_STAGE_FIRST) {
          EXPECT_FALSE(r->has_residual() || r->has_post_mix() || r->has_comb_mix() || r->has_pre_mix());
          continue;
        }
        EXPECT_EQ(Shape(r->residual()), (std::vector<int64_t>{t, n, h}));
        ExpectNoZeroBf16(r->residual(), "residual");
        EXPECT_EQ(Shape(r->post_mix()), (std::vector<int64_t>{t, n}));
        ExpectFp32In(r->post_mix(), 0.2f, 2.0f, "post_mix");
        EXPECT_EQ(Shape(r->comb_mix()), (std::vector<int64_t>{t, n, n}));
        ExpectFp32In(r->comb_mix(), 0.0f, 1.0f + 1e-6f, "comb_mix");
        // Near doubly stochastic: every row and column of every token sums to ~1.
        const std::vector<float> comb = Fp32Of(r->comb_mix());
        for (int64_t k = 0; k < t; ++k) {
          for (int64_t i = 0; i < n; ++i) {
            double row = 0, col = 0;
            for (int64_t j = 0; j < n; ++j) {
              row += comb[size_t((k * n + i) * n + j)];
              col += comb[size_t((k * n + j) * n + i)];
            }
            EXPECT_NEAR(col, 1.0, 1e-5);
            EXPECT_NEAR(row, 1.0, 1e-2);
          }
        }
        const bool want_pre = mode == v1::MHC_MODE_SHIFTED && pre;
        EXPECT_EQ(r->has_pre_mix(), want_pre);
        if (want_pre) {
          EXPECT_EQ(Shape(r->pre_mix()), (std::vector<int64_t>{t, n}));
          ExpectFp32In(r->pre_mix(), 0.0f, 1.0f, "pre_mix");
        }
        for (const v1::Tensor* tensor : {&r->x(), &r->residual(), &r->post_mix(), &r->comb_mix()}) {
          EXPECT_TRUE(ValidateTensor(*tensor, "t").ok());
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Configs, RandomMhcTest,
                         ::testing::Values(MhcCase{4, 5120}, MhcCase{4, 7168}, MhcCase{1, 128}, MhcCase{2, 384},
                                           MhcCase{8, 256}),
                         [](const auto& info) {
                           return "n" + std::to_string(info.param.n) + "_C" + std::to_string(info.param.hidden);
                         });

TEST(RandomInputs, ZeroTokensGivesEmptyTensors) {
  v1::MhcConfig cfg;
  cfg.set_hc_mult(4);
  cfg.set_hidden(5120);
  std::mt19937_64 rng = FreshRng();
  absl::StatusOr<v1::MhcSeamRequest> r = RandomMhcRequest(cfg, {.weight_set = "w", .tokens = 0}, rng);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(Shape(r->residual()), (std::vector<int64_t>{0, 4, 5120}));
  EXPECT_TRUE(r->residual().data().empty());
  EXPECT_TRUE(r->has_residual());  // present but empty: T = 0 is a valid request
}

TEST(RandomInputs, ActivationsHaveOutliersAndNoZerosAndAreFresh) {
  std::mt19937_64 rng = FreshRng();
  const size_t n = 200000;
  const std::vector<uint16_t> a = RandomActivationsBf16(rng, n);
  size_t big = 0;
  for (uint16_t b : a) {
    ASSERT_NE(b & 0x7fff, 0);
    if (std::fabs(Bf16BitsToDouble(b)) > 5.0) ++big;
  }
  // |N(0,1)| > 5 essentially never happens; with 1% of draws scaled x16, |v| > 5 happens for about
  // 0.75% of all values. Bounds are wide (the count is binomial with sd ~ 39 around 1500).
  EXPECT_GT(big, n * 3 / 1000);
  EXPECT_LT(big, n * 15 / 1000);
  const std::vector<uint16_t> b = RandomActivationsBf16(rng, n);
  EXPECT_NE(a, b);
}

TEST(RandomInputs, MhcSpecValidation) {
  v1::MhcConfig cfg;
  cfg.set_hc_mult(4);
  cfg.set_hidden(7168);
  EXPECT_TRUE(ValidateMhcSpec(cfg, {.tokens = 64}).ok());
  EXPECT_EQ(ValidateMhcSpec(cfg, {.tokens = -1}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ValidateMhcSpec(cfg, {.stage = v1::MHC_STAGE_HEAD, .mode = v1::MHC_MODE_NORMAL}).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ValidateMhcSpec(cfg, {.stage = v1::MHC_STAGE_FIRST, .capture_aux = true}).code(),
            absl::StatusCode::kInvalidArgument);
  // 40 bytes per token-channel: 2^31 / (7168 * 4 * 2) ~ 37449 tokens reach 2 GiB.
  absl::Status too_big = ValidateMhcSpec(cfg, {.tokens = 40000});
  EXPECT_EQ(too_big.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(too_big.message(), "2 GiB")) << too_big;
  v1::MhcConfig bad = cfg;
  bad.set_hc_mult(9);
  EXPECT_EQ(ValidateMhcSpec(bad, {}).code(), absl::StatusCode::kInvalidArgument);
  bad = cfg;
  bad.set_hidden(0);
  EXPECT_EQ(ValidateMhcSpec(bad, {}).code(), absl::StatusCode::kInvalidArgument);
}

TEST(RandomInputs, SwaShapesAndStride) {
  v1::SwaConfig cfg;
  cfg.set_q_rank(1536);
  cfg.set_head_dim(512);
  std::mt19937_64 rng = FreshRng();
  for (int64_t m : {0, 1, 3, 64}) {
    for (int64_t stride : {int64_t{0}, int64_t{2048}, int64_t{2112}}) {
      absl::StatusOr<v1::SwaNormQuantRequest> r =
          RandomSwaRequest(cfg, {.weight_set = "s", .tokens = m, .row_stride = stride}, rng);
      ASSERT_TRUE(r.ok()) << r.status();
      const int64_t w = stride ? stride : 2048;
      EXPECT_EQ(Shape(r->qr_kv()), (std::vector<int64_t>{m, w}));
      EXPECT_EQ(r->qr_kv().data().size(), size_t(m * w * 2));
      ExpectNoZeroBf16(r->qr_kv(), "qr_kv");
    }
  }
  EXPECT_EQ(ValidateSwaSpec(cfg, {.tokens = 4, .row_stride = 2047}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ValidateSwaSpec(cfg, {.tokens = -2}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ValidateSwaSpec(cfg, {.tokens = 1 << 20}).code(), absl::StatusCode::kInvalidArgument);  // 4 GiB
  v1::SwaConfig bad = cfg;
  bad.set_q_rank(1000);
  EXPECT_EQ(ValidateSwaSpec(bad, {.tokens = 1}).code(), absl::StatusCode::kInvalidArgument);
}

// ---- CLI helpers ---------------------------------------------------------------------------------

TEST(CliOptions, ParseChoices) {
  EXPECT_EQ(*ParsePathPreference("auto"), v1::PATH_PREFERENCE_AUTO);
  EXPECT_EQ(*ParsePathPreference("require_fused"), v1::PATH_PREFERENCE_REQUIRE_FUSED);
  EXPECT_EQ(*ParsePathPreference("force_unfused"), v1::PATH_PREFERENCE_FORCE_UNFUSED);
  absl::StatusOr<v1::PathPreference> bad = ParsePathPreference("fused");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(bad.status().message(), "auto|require_fused|force_unfused")) << bad.status();
  EXPECT_EQ(*ParseMhcMode("normal"), v1::MHC_MODE_NORMAL);
  EXPECT_FALSE(ParseMhcMode("Shifted").ok());  // exact spelling
  EXPECT_EQ(*ParseMhcStage("head"), v1::MHC_STAGE_HEAD);
  EXPECT_EQ(*ParseMhcStage("first"), v1::MHC_STAGE_FIRST);
  EXPECT_FALSE(ParseMhcStage("").ok());
  EXPECT_EQ(*ParseBenchOp("swa"), BenchOp::kSwa);
  EXPECT_FALSE(ParseBenchOp("mhc_pre").ok());
}

TEST(CliOptions, NamesMatchTheMetricLabels) {
  // The metric label values of docs/conventions.md, spelled out independently.
  const std::vector<std::pair<v1::FallbackReason, std::string>> reasons = {
      {v1::FALLBACK_REASON_NONE, "none"},
      {v1::FALLBACK_REASON_DISABLED_BY_CONFIG, "disabled_by_config"},
      {v1::FALLBACK_REASON_CLIENT_FORCED_UNFUSED, "client_forced_unfused"},
      {v1::FALLBACK_REASON_BACKEND_HAS_NO_FUSED_KERNEL, "backend_has_no_fused_kernel"},
      {v1::FALLBACK_REASON_DEVICE_ARCH_UNSUPPORTED, "device_arch_unsupported"},
      {v1::FALLBACK_REASON_HC_MULT_UNSUPPORTED, "hc_mult_unsupported"},
      {v1::FALLBACK_REASON_HIDDEN_SIZE_UNSUPPORTED, "hidden_size_unsupported"},
      {v1::FALLBACK_REASON_TOO_MANY_TOKENS, "too_many_tokens"},
      {v1::FALLBACK_REASON_AUX_CAPTURE_REQUESTED, "aux_capture_requested"},
      {v1::FALLBACK_REASON_WORKSPACE_UNAVAILABLE, "workspace_unavailable"},
      {v1::FALLBACK_REASON_FUSED_KERNEL_ERROR, "fused_kernel_error"},
  };
  for (const auto& [r, name] : reasons) EXPECT_EQ(ReasonName(r), name);
  EXPECT_EQ(PathName(v1::EXECUTION_PATH_FUSED), "fused");
  EXPECT_EQ(PathName(v1::EXECUTION_PATH_UNFUSED), "unfused");
  EXPECT_EQ(ScaleLayoutName(v1::SCALE_LAYOUT_COLUMN_MAJOR_TMA), "column_major_tma");
  EXPECT_EQ(ScaleFormatName(v1::SCALE_FORMAT_UE8M0), "ue8m0");
  EXPECT_EQ(Fp8FormatName(v1::FP8_FORMAT_E4M3FNUZ), "e4m3fnuz");
}

TEST(CliOptions, CommandLineChecks) {
  const CommandInfo* swa = FindCommand("swa");
  const CommandInfo* seam = FindCommand("seam");
  const CommandInfo* unload = FindCommand("unload");
  const CommandInfo* health = FindCommand("health");
  ASSERT_TRUE(swa && seam && unload && health);
  EXPECT_EQ(FindCommand("serve"), nullptr);
  EXPECT_TRUE(CheckCommandLine(*seam, {"weight_set", "stage", "mode", "tokens"}, 0).ok());
  absl::Status s = CheckCommandLine(*swa, {"weight_set", "stage"}, 0);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(s.message(), "--stage does not apply to 'swa'")) << s;
  // Global flags are not command flags and are always accepted.
  EXPECT_TRUE(CheckCommandLine(*health, {"target", "deadline", "service"}, 0).ok());
  EXPECT_FALSE(CheckCommandLine(*health, {"weight_set"}, 0).ok());
  EXPECT_TRUE(CheckCommandLine(*unload, {}, 1).ok());
  EXPECT_EQ(CheckCommandLine(*unload, {}, 0).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CheckCommandLine(*unload, {}, 2).code(), absl::StatusCode::kInvalidArgument);
  // Every command's flags are known and every command has a usage line starting with its name.
  for (const CommandInfo& c : Commands()) {
    EXPECT_EQ(c.usage.rfind(c.name, 0), 0u) << c.name;
    std::set<std::string> own(c.flags.begin(), c.flags.end());
    EXPECT_TRUE(CheckCommandLine(c, own, size_t(c.positional_args)).ok()) << c.name;
  }
}

TEST(CliOptions, DurationFlag) {
  EXPECT_EQ(*ParseDurationFlag("10"), absl::Seconds(10));
  EXPECT_EQ(*ParseDurationFlag("2.5"), absl::Milliseconds(2500));
  EXPECT_EQ(*ParseDurationFlag("1m30s"), absl::Seconds(90));
  EXPECT_EQ(*ParseDurationFlag("250ms"), absl::Milliseconds(250));
  for (const char* bad : {"0", "-3", "0s", "ten", "", "inf", "nan"}) {
    EXPECT_EQ(ParseDurationFlag(bad).status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
}

TEST(CliOptions, FlagsOnCommandLine) {
  const std::set<std::string> known = {"tokens", "stage", "no_pre_mix", "capture_aux", "weight_set"};
  EXPECT_EQ(FlagsOnCommandLine({"fusedctl", "--target=x:1", "seam", "--tokens=16", "-stage", "head",
                                "--nocapture_aux", "--no_pre_mix", "--", "--weight_set=w"},
                               known),
            (std::set<std::string>{"tokens", "stage", "capture_aux", "no_pre_mix"}));
  EXPECT_TRUE(FlagsOnCommandLine({"fusedctl", "info"}, known).empty());
}

TEST(CliOptions, ErrorLineIsOneLineWithTheCodeName) {
  const std::string line = ErrorLine(absl::UnavailableError("failed to connect\nto all addresses"));
  EXPECT_EQ(line, "fusedctl: error: UNAVAILABLE: failed to connect; to all addresses");
  EXPECT_EQ(ErrorLine(absl::FailedPreconditionError("fused path unavailable")),
            "fusedctl: error: FAILED_PRECONDITION: fused path unavailable");
}

TEST(CliOptions, Formatting) {
  EXPECT_EQ(FormatSeconds(12.5e-6), "12.5 us");
  EXPECT_EQ(FormatSeconds(0.0045), "4.500 ms");
  EXPECT_EQ(FormatSeconds(2.0), "2.000 s");
  EXPECT_EQ(FormatBytes(512), "512 B");
  EXPECT_EQ(FormatBytes(4 << 20), "4.0 MiB");
  EXPECT_EQ(FormatBytes(1536), "1.5 KiB");
}

// ---- percentiles ---------------------------------------------------------------------------------

// Brute force of the nearest-rank definition: the smallest sample v such that at least p% of the
// samples are <= v.
double BruteForcePercentile(const std::vector<double>& samples, double p) {
  std::vector<double> s = samples;
  std::sort(s.begin(), s.end());
  for (double v : s) {
    const size_t at_most = size_t(std::count_if(s.begin(), s.end(), [&](double x) { return x <= v; }));
    if (100.0 * double(at_most) >= p * double(s.size()) - 1e-9) return v;
  }
  return s.back();
}

TEST(Percentiles, NearestRankKnownValues) {
  std::vector<double> v;
  for (int i = 1; i <= 100; ++i) v.push_back(i);
  EXPECT_EQ(NearestRankPercentile(v, 50), 50);
  EXPECT_EQ(NearestRankPercentile(v, 90), 90);
  EXPECT_EQ(NearestRankPercentile(v, 99), 99);
  EXPECT_EQ(NearestRankPercentile(v, 100), 100);
  EXPECT_EQ(NearestRankPercentile(v, 0), 1);
  EXPECT_EQ(NearestRankPercentile(v, 99.5), 100);
  const std::vector<double> ten = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10};
  EXPECT_EQ(NearestRankPercentile(ten, 50), 5);
  EXPECT_EQ(NearestRankPercentile(ten, 90), 9);
  EXPECT_EQ(NearestRankPercentile(ten, 99), 10);
  EXPECT_EQ(NearestRankPercentile({7.0}, 1), 7.0);
  EXPECT_EQ(NearestRankPercentile({}, 50), 0.0);
}

TEST(Percentiles, MatchBruteForceOnRandomSamples) {
  std::mt19937_64 rng = FreshRng();
  std::exponential_distribution<double> lat(1000.0);
  for (int trial = 0; trial < 50; ++trial) {
    const size_t n = 1 + rng() % 500;
    std::vector<double> samples(n);
    for (double& x : samples) x = lat(rng);
    const LatencySummary s = SummarizeLatencies(samples);
    EXPECT_EQ(s.count, int64_t(n));
    EXPECT_EQ(s.p50, BruteForcePercentile(samples, 50));
    EXPECT_EQ(s.p90, BruteForcePercentile(samples, 90));
    EXPECT_EQ(s.p99, BruteForcePercentile(samples, 99));
    EXPECT_EQ(s.max, *std::max_element(samples.begin(), samples.end()));
    EXPECT_EQ(s.min, *std::min_element(samples.begin(), samples.end()));
    EXPECT_LE(s.p50, s.p90);
    EXPECT_LE(s.p90, s.p99);
    EXPECT_LE(s.p99, s.max);
  }
  EXPECT_EQ(SummarizeLatencies({}).count, 0);
}

// ---- summaries and fp8 dequantization ------------------------------------------------------------

TEST(Summary, CountsNanAndInfAndIgnoresThemInStats) {
  const std::vector<float> v = {1.0f, -3.0f, NAN, 2.0f, INFINITY, NAN};
  TensorSummary s = SummarizeValues({6}, "fp32", v);
  EXPECT_EQ(s.count, 6);
  EXPECT_EQ(s.finite, 3);
  EXPECT_EQ(s.nan_count, 2);
  EXPECT_EQ(s.inf_count, 1);
  EXPECT_EQ(s.min, -3.0);
  EXPECT_EQ(s.max, 2.0);
  EXPECT_EQ(s.absmax, 3.0);
  EXPECT_DOUBLE_EQ(s.mean, 0.0);
  EXPECT_TRUE(absl::StrContains(FormatSummary("y", s), "nan=2")) << FormatSummary("y", s);
  EXPECT_TRUE(absl::StrContains(FormatSummary("y", SummarizeValues({0, 5}, "bf16", {})), "(empty)"));
}

void CheckDequant(v1::ScaleLayout layout, int64_t m, int64_t q, v1::DataType fp8, std::mt19937_64& rng) {
  const int64_t g = q / 128, m4 = (m + 3) / 4 * 4;
  std::string codes(size_t(m * q), '\0');
  for (char& c : codes) {
    do c = char(rng() & 0xff); while ((uint8_t(c) & 0x7f) == 0x7f || uint8_t(c) == 0x80);  // no NaN codes
  }
  const bool rm = layout == v1::SCALE_LAYOUT_ROW_MAJOR;
  std::vector<float> scales = RandomUniform(rng, size_t(rm ? m * g : g * m4), 1e-3f, 4.0f);
  absl::StatusOr<v1::Tensor> qt = MakeTensor(fp8, {m, q}, codes);
  absl::StatusOr<v1::Tensor> st = MakeFp32Tensor(rm ? std::vector<int64_t>{m, g} : std::vector<int64_t>{g, m4}, scales);
  ASSERT_TRUE(qt.ok() && st.ok());
  absl::StatusOr<std::vector<float>> dq = DequantizeFp8Groups(*qt, *st, layout);
  ASSERT_TRUE(dq.ok()) << dq.status();
  // Reference: decode each code by its fields (independent of numeric.h), times the group's scale.
  const int bias = fp8 == v1::DATA_TYPE_FP8_E4M3FN ? 7 : 8;
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t k = 0; k < q; ++k) {
      const uint8_t c = uint8_t(codes[size_t(r * q + k)]);
      const int e = (c >> 3) & 15, mant = c & 7;
      double mag = e == 0 ? std::ldexp(double(mant), 1 - bias - 3) : std::ldexp(1.0 + mant / 8.0, e - bias);
      if (c & 0x80) mag = -mag;
      const double s = rm ? scales[size_t(r * g + k / 128)] : scales[size_t((k / 128) * m4 + r)];
      ASSERT_EQ(double((*dq)[size_t(r * q + k)]), double(float(mag) * float(s))) << r << "," << k;
    }
  }
}

TEST(Summary, DequantizeBothLayoutsAndFormats) {
  std::mt19937_64 rng = FreshRng();
  for (int64_t m : {1, 3, 5, 8}) {
    CheckDequant(v1::SCALE_LAYOUT_ROW_MAJOR, m, 384, v1::DATA_TYPE_FP8_E4M3FN, rng);
    CheckDequant(v1::SCALE_LAYOUT_COLUMN_MAJOR_TMA, m, 384, v1::DATA_TYPE_FP8_E4M3FN, rng);
    CheckDequant(v1::SCALE_LAYOUT_COLUMN_MAJOR_TMA, m, 256, v1::DATA_TYPE_FP8_E4M3FNUZ, rng);
  }
}

TEST(Summary, DequantizeRejectsMismatchedScales) {
  absl::StatusOr<v1::Tensor> q = MakeTensor(v1::DATA_TYPE_FP8_E4M3FN, {3, 256}, std::string(768, '\x38'));
  std::vector<float> s(6, 1.0f);
  absl::StatusOr<v1::Tensor> rm = MakeFp32Tensor({3, 2}, s);
  ASSERT_TRUE(q.ok() && rm.ok());
  EXPECT_TRUE(DequantizeFp8Groups(*q, *rm, v1::SCALE_LAYOUT_ROW_MAJOR).ok());
  // Row-major scales handed in as column-major TMA ([G, align(M,4)] = [2, 4]) are rejected.
  EXPECT_EQ(DequantizeFp8Groups(*q, *rm, v1::SCALE_LAYOUT_COLUMN_MAJOR_TMA).status().code(),
            absl::StatusCode::kInvalidArgument);
  absl::StatusOr<v1::Tensor> bf = MakeBf16Tensor({3, 256}, std::vector<uint16_t>(768, 0x3f80));
  EXPECT_EQ(DequantizeFp8Groups(*bf, *rm, v1::SCALE_LAYOUT_ROW_MAJOR).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// ---- safetensors ---------------------------------------------------------------------------------

TEST(Safetensors, RoundTripAllDtypes) {
  std::mt19937_64 rng = FreshRng();
  std::vector<std::pair<std::string, v1::Tensor>> in;
  in.emplace_back("x", *MakeBf16Tensor({3, 5}, RandomActivationsBf16(rng, 15)));
  in.emplace_back("post_mix", *MakeFp32Tensor({3, 4}, RandomUniform(rng, 12, 0.2f, 2.0f)));
  std::string codes(256, '\0');
  for (char& c : codes) c = char(rng() & 0xff);
  in.emplace_back("q_fp8", *MakeTensor(v1::DATA_TYPE_FP8_E4M3FN, {2, 128}, codes));
  in.emplace_back("q_fnuz", *MakeTensor(v1::DATA_TYPE_FP8_E4M3FNUZ, {1, 256}, codes));
  in.emplace_back("empty", *MakeBf16Tensor({0, 7}, {}));
  absl::StatusOr<std::string> image = SerializeSafetensors(in, {{"note", "hello"}});
  ASSERT_TRUE(image.ok()) << image.status();
  uint64_t header_len;
  std::memcpy(&header_len, image->data(), 8);
  EXPECT_EQ(header_len % 8, 0u);
  absl::StatusOr<SafetensorsFile> out = ParseSafetensors(*image);
  ASSERT_TRUE(out.ok()) << out.status();
  ASSERT_EQ(out->tensors.size(), in.size());
  for (const auto& [name, t] : in) {
    ASSERT_TRUE(out->tensors.count(name)) << name;
    const v1::Tensor& u = out->tensors.at(name);
    EXPECT_EQ(u.dtype(), t.dtype()) << name;
    EXPECT_EQ(Shape(u), Shape(t)) << name;
    EXPECT_EQ(u.data(), t.data()) << name;
  }
  EXPECT_EQ(out->metadata, (std::map<std::string, std::string>{{"note", "hello"}}));
  // The OCP fp8 tensor uses safetensors' own dtype name; fnuz the manifests' spelling.
  EXPECT_TRUE(absl::StrContains(*image, "\"F8_E4M3\""));
  EXPECT_TRUE(absl::StrContains(*image, "\"F8_E4M3FNUZ\""));
}

TEST(Safetensors, RejectsMalformedFiles) {
  auto file = [](const std::string& header, size_t data_bytes) {
    std::string s(8, '\0');
    const uint64_t n = header.size();
    std::memcpy(s.data(), &n, 8);
    return s + header + std::string(data_bytes, '\x11');
  };
  auto code = [](const std::string& image) { return ParseSafetensors(image).status().code(); };
  const auto kInvalid = absl::StatusCode::kInvalidArgument;
  EXPECT_EQ(code("abc"), kInvalid);
  EXPECT_EQ(code(file("{not json", 0)), kInvalid);
  EXPECT_EQ(code(file(R"({"x":{"dtype":"BF16","shape":[2],"data_offsets":[0,4]}})", 3)), kInvalid);  // short data
  EXPECT_EQ(code(file(R"({"x":{"dtype":"BF16","shape":[3],"data_offsets":[0,4]}})", 4)), kInvalid);  // shape/bytes
  EXPECT_EQ(code(file(R"({"x":{"dtype":"F16","shape":[2],"data_offsets":[0,4]}})", 4)), kInvalid);   // dtype
  EXPECT_EQ(code(file(R"({"x":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}})", 4)), kInvalid);
  EXPECT_EQ(code(file(R"({"x":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})", 4)), kInvalid);
  EXPECT_EQ(code(file(R"({"x":{"dtype":"F32","shape":[1],"data_offsets":[4,0]}})", 4)), kInvalid);
  EXPECT_EQ(code(file(R"({"x":{"dtype":"F32","shape":[1]}})", 4)), kInvalid);
  std::string lying(8, '\0');
  const uint64_t huge = uint64_t{1} << 40;
  std::memcpy(lying.data(), &huge, 8);
  EXPECT_EQ(code(lying + "{}"), kInvalid);
  EXPECT_TRUE(ParseSafetensors(file(R"({"x":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", 4)).ok());
  // Duplicate names are refused on write.
  std::vector<std::pair<std::string, v1::Tensor>> dup = {{"a", *MakeFp32Tensor({1}, std::vector<float>{1.0f})},
                                                         {"a", *MakeFp32Tensor({1}, std::vector<float>{2.0f})}};
  EXPECT_EQ(SerializeSafetensors(dup).status().code(), kInvalid);
}

// ---- bench aggregation ---------------------------------------------------------------------------

TEST(BenchStatsTest, HitRateFallbacksErrorsAndMerge) {
  auto ok = [](double sec, v1::ExecutionPath p, v1::FallbackReason r) {
    CallOutcome o;
    o.round_trip_seconds = sec;
    o.report.set_path(p);
    o.report.set_fallback_reason(r);
    return o;
  };
  auto err = [](absl::Status s) {
    CallOutcome o;
    o.status = std::move(s);
    return o;
  };
  BenchStats a, b;
  a.Add(ok(0.001, v1::EXECUTION_PATH_FUSED, v1::FALLBACK_REASON_NONE));
  a.Add(ok(0.003, v1::EXECUTION_PATH_UNFUSED, v1::FALLBACK_REASON_TOO_MANY_TOKENS));
  a.Add(err(absl::ResourceExhaustedError("queue full")));
  b.Add(ok(0.002, v1::EXECUTION_PATH_FUSED, v1::FALLBACK_REASON_NONE));
  b.Add(ok(0.004, v1::EXECUTION_PATH_UNFUSED, v1::FALLBACK_REASON_TOO_MANY_TOKENS));
  b.Add(err(absl::ResourceExhaustedError("queue full again")));
  b.Add(err(absl::DeadlineExceededError("late")));
  a.Merge(b);
  EXPECT_EQ(a.ok(), 4);
  EXPECT_EQ(a.failed(), 3);
  EXPECT_EQ(a.fused(), 2);
  EXPECT_DOUBLE_EQ(a.FusedHitRate(), 0.5);
  EXPECT_EQ(a.fallbacks(), (std::map<std::string, int64_t>{{"too_many_tokens", 2}}));
  EXPECT_EQ(a.errors(), (std::map<std::string, int64_t>{{"RESOURCE_EXHAUSTED", 2}, {"DEADLINE_EXCEEDED", 1}}));
  EXPECT_EQ(a.MostFrequentError(), absl::StatusCode::kResourceExhausted);
  const std::string text = a.Format({.op = "mhc", .tokens_per_request = 64, .request_bytes = 1000,
                                     .response_bytes = 2000, .elapsed_seconds = 2.0});
  EXPECT_TRUE(absl::StrContains(text, "4 ok, 3 failed")) << text;
  EXPECT_TRUE(absl::StrContains(text, "2.0 req/s, 128.0 tokens/s")) << text;
  EXPECT_TRUE(absl::StrContains(text, "50.00%")) << text;
  EXPECT_TRUE(absl::StrContains(text, "too_many_tokens: 2")) << text;
  EXPECT_TRUE(absl::StrContains(text, "RESOURCE_EXHAUSTED: 2 (first: queue full)")) << text;
  EXPECT_TRUE(absl::StrContains(text, "p50 2.000 ms")) << text;  // nearest rank of {1,2,3,4} ms
  EXPECT_FALSE(absl::StrContains(text, "connections")) << text;  // not given: not shown
  const std::string pooled = a.Format({.op = "mhc", .elapsed_seconds = 2.0, .connections = 4});
  EXPECT_TRUE(absl::StrContains(pooled, "\nconnections  4 (calls spread round robin)\n")) << pooled;
  EXPECT_EQ(BenchStats().FusedHitRate(), 0.0);
  EXPECT_EQ(BenchStats().MostFrequentError(), absl::StatusCode::kOk);
}

// The "stages p50" line: each stage's own p50 over the merged OK calls, beside the server p50;
// absent when no response carried stages (an older server), and failed calls count in none.
TEST(BenchStatsTest, StagesLineHasEachStagesP50) {
  auto ok = [](double k) {  // stage i of call k is k * (i + 1) us; server time 100k us
    CallOutcome o;
    o.round_trip_seconds = 1e-3 * k;
    o.report.set_path(v1::EXECUTION_PATH_FUSED);
    o.report.set_server_seconds(1e-4 * k);
    o.report.set_queue_seconds(2e-6 * k);
    v1::StageSeconds* st = o.report.mutable_stages();
    st->set_decode(1e-6 * k);
    st->set_copy_in(3e-6 * k);
    st->set_device(4e-6 * k);
    st->set_copy_out(5e-6 * k);
    st->set_response(6e-6 * k);
    return o;
  };
  BenchStats a, b;
  a.Add(ok(1));
  a.Add(ok(3));
  b.Add(ok(2));
  b.Add(ok(4));
  CallOutcome failed;
  failed.status = absl::UnavailableError("down");
  b.Add(failed);
  a.Merge(b);
  const BenchStats::RunInfo info{.op = "mhc", .tokens_per_request = 1, .elapsed_seconds = 1.0};
  const std::string text = a.Format(info);
  // Nearest rank of {1, 2, 3, 4}: k = 2.
  EXPECT_TRUE(absl::StrContains(text, "stages p50   decode 2.0 us  queue 4.0 us  copy_in 6.0 us  device 8.0 us  "
                                      "copy_out 10.0 us  response 12.0 us  (server p50 200.0 us)"))
      << text;
  BenchStats old;
  CallOutcome no_stages = ok(1);
  no_stages.report.clear_stages();
  old.Add(no_stages);
  EXPECT_FALSE(absl::StrContains(old.Format(info), "stages p50")) << old.Format(info);
}

// `fusedctl seam` / `swa` print the stages of the report when the server sent them.
TEST(FusedctlReportTest, PrintsTheStagesWhenPresent) {
  v1::ExecutionReport r;
  r.set_path(v1::EXECUTION_PATH_FUSED);
  r.set_server_seconds(2e-3);
  EXPECT_FALSE(absl::StrContains(FormatReport(r, 3e-3), "stages")) << FormatReport(r, 3e-3);
  v1::StageSeconds* st = r.mutable_stages();
  st->set_decode(11e-6);
  st->set_copy_in(22e-6);
  st->set_device(1.5e-3);
  st->set_copy_out(33e-6);
  st->set_response(44e-6);
  const std::string text = FormatReport(r, 3e-3);
  EXPECT_TRUE(absl::StrContains(text, "  stages      decode 11.0 us  copy_in 22.0 us  device 1.500 ms  "
                                      "copy_out 33.0 us  response 44.0 us\n"))
      << text;
}

TEST(BenchStatsTest, EchoFloorBlockHasTheFieldsAndRatios) {
  auto at = [](double sec) {
    CallOutcome o;
    o.round_trip_seconds = sec;
    o.report.set_path(v1::EXECUTION_PATH_FUSED);
    return o;
  };
  BenchStats call, echo;
  for (double ms : {3.0, 4.0, 5.0, 6.0}) call.Add(at(ms * 1e-3));  // p50 4 ms (nearest rank)
  for (double ms : {1.0, 2.0, 2.0, 8.0}) echo.Add(at(ms * 1e-3));  // p50 2 ms
  echo.Add(CallOutcome{.status = absl::DeadlineExceededError("slow echo")});
  BenchStats::EchoFloorInfo info{.transport = "127.0.0.1 (plaintext)",
                                 .call_request_bytes = 1234,
                                 .call_response_bytes = 5678,
                                 .echo_request_bytes_min = 1234,
                                 .echo_request_bytes_max = 1234,
                                 .echo_response_bytes_min = 5678,
                                 .echo_response_bytes_max = 5679,
                                 .call_elapsed_seconds = 2.0,
                                 .echo_elapsed_seconds = 1.0};
  const std::string text = BenchStats::FormatEchoFloor(call, echo, info);
  EXPECT_TRUE(absl::StrContains(text, "echo floor   bare gRPC echo over 127.0.0.1 (plaintext), same channel")) << text;
  // With the connection count, the title names it.
  for (const auto& [n, words] : {std::pair{1, "1 connection,"}, std::pair{4, "4 connections,"}}) {
    BenchStats::EchoFloorInfo pooled = info;
    pooled.connections = n;
    const std::string title = BenchStats::FormatEchoFloor(call, echo, pooled);
    EXPECT_TRUE(absl::StrContains(title, absl::StrCat("over 127.0.0.1 (plaintext), ", words, " same channel options")))
        << title;
  }
  EXPECT_TRUE(absl::StrContains(text, "echo bytes   request 1234 B (server received), response 5678..5679 B "
                                      "(client received); call request 1234 B, response 5678 B")) << text;
  EXPECT_TRUE(absl::StrContains(text, "echo         4 ok, 1 failed in 1.000 s, 4.0 req/s")) << text;
  EXPECT_TRUE(absl::StrContains(text, "echo error   DEADLINE_EXCEEDED: 1 (first: slow echo)")) << text;
  EXPECT_TRUE(absl::StrContains(text, "echo latency p50 2.000 ms  p90 8.000 ms  p99 8.000 ms  max 8.000 ms")) << text;
  // p50 4/2, p90 6/8, p99 6/8; req/s (4 / 2 s) / (4 / 1 s).
  EXPECT_TRUE(absl::StrContains(text, "vs floor     round trip / echo: p50 2.00x  p90 0.75x  p99 0.75x; req/s call / "
                                      "echo 0.50x")) << text;
  // No echo call succeeded: no latency or ratio line, the error still shown.
  BenchStats none;
  none.Add(CallOutcome{.status = absl::UnavailableError("down")});
  const std::string empty = BenchStats::FormatEchoFloor(call, none, info);
  EXPECT_FALSE(absl::StrContains(empty, "echo latency")) << empty;
  EXPECT_FALSE(absl::StrContains(empty, "vs floor")) << empty;
  EXPECT_TRUE(absl::StrContains(empty, "UNAVAILABLE: 1 (first: down)")) << empty;
}

// ---- bench --echo_floor: the echo server and client (in-process, loopback and unix socket) --------

TEST(EchoFloor, AnswersWithTheResponseSizeAndCountsTheRequestBytes) {
  char tmpl[] = "/tmp/fusedctl-echo-test-XXXXXX";
  const char* dir = mkdtemp(tmpl);
  ASSERT_NE(dir, nullptr);
  for (const std::string& listen : {std::string("127.0.0.1:0"), std::string("unix:") + dir + "/echo.sock"}) {
    SCOPED_TRACE(listen);
    std::mt19937_64 rng = FreshRng();
    const uint64_t response_bytes = (4 << 20) + rng() % 1000;  // past gRPC's 4 MiB receive default
    absl::StatusOr<std::unique_ptr<EchoFloorServer>> server =
        EchoFloorServer::Start(listen, response_bytes, int64_t{64} << 20);
    ASSERT_TRUE(server.ok()) << server.status();
    EXPECT_EQ((*server)->calls(), 0);
    EXPECT_GT((*server)->min_request_bytes(), (*server)->max_request_bytes());  // none yet
    ClientOptions options;
    options.max_message_bytes = int64_t{64} << 20;
    absl::StatusOr<std::unique_ptr<FusedLayerClient>> channel = FusedLayerClient::Connect((*server)->target(), options);
    ASSERT_TRUE(channel.ok()) << channel.status();
    const uint64_t big = (5 << 20) + rng() % 1000, small = rng() % 100;  // 5 MiB: past gRPC's 4 MiB default
    for (uint64_t request_bytes : {big, small, big}) {
      const EchoFloorClient echo((*channel)->channel(), request_bytes, options);
      absl::StatusOr<uint64_t> got = echo.Call();
      ASSERT_TRUE(got.ok()) << got.status();
      EXPECT_EQ(*got, response_bytes);
    }
    EXPECT_EQ((*server)->calls(), 3);
    EXPECT_EQ((*server)->min_request_bytes(), small);
    EXPECT_EQ((*server)->max_request_bytes(), big);

    // The client's own message limit applies to the echo as to the real call.
    ClientOptions tight;
    tight.max_message_bytes = 4096;
    absl::StatusOr<std::unique_ptr<FusedLayerClient>> tight_channel =
        FusedLayerClient::Connect((*server)->target(), tight);
    ASSERT_TRUE(tight_channel.ok());
    EXPECT_EQ(EchoFloorClient((*tight_channel)->channel(), 5000, tight).Call().status().code(),
              absl::StatusCode::kResourceExhausted);
  }
  rmdir(dir);
}

TEST(EchoFloor, ListensLikeTheTarget) {
  EXPECT_EQ(EchoListenAddressFor("localhost:50051", "/tmp/d"), "127.0.0.1:0");
  EXPECT_EQ(EchoListenAddressFor("dns:///fl.internal:443", "/tmp/d"), "127.0.0.1:0");
  EXPECT_EQ(EchoListenAddressFor("unix:/run/fusedlayer.sock", "/tmp/d"), "unix:/tmp/d/echo-floor.sock");
  const std::string a = EchoListenAddressFor("unix-abstract:fusedlayer", "/tmp/d");
  EXPECT_TRUE(absl::StartsWith(a, "unix-abstract:fusedctl-echo-floor-")) << a;
  EXPECT_NE(a, EchoListenAddressFor("unix-abstract:fusedlayer", "/tmp/d"));  // fresh per run
}

TEST(EchoFloor, FlagBelongsToBenchOnly) {
  const CommandInfo* bench = FindCommand("bench");
  const CommandInfo* seam = FindCommand("seam");
  ASSERT_NE(bench, nullptr);
  ASSERT_NE(seam, nullptr);
  EXPECT_TRUE(CheckCommandLine(*bench, {"op", "weight_set", "tokens", "echo_floor"}, 0).ok());
  const absl::Status s = CheckCommandLine(*seam, {"weight_set", "echo_floor"}, 0);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(s.message(), "--echo_floor does not apply to 'seam'")) << s;
}

// ---- client library (local behaviour only) -------------------------------------------------------

TEST(Client, StatusMappingKeepsCodeAndMessage) {
  for (int c = 1; c <= 16; ++c) {
    const grpc::Status g(static_cast<grpc::StatusCode>(c), "msg " + std::to_string(c));
    const absl::Status a = ToAbslStatus(g);
    EXPECT_EQ(int(a.code()), c);
    EXPECT_EQ(a.message(), "msg " + std::to_string(c));
  }
  EXPECT_TRUE(ToAbslStatus(grpc::Status::OK).ok());
  EXPECT_EQ(absl::StatusCodeToString(ToAbslStatus(grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, "x")).code()),
            "FAILED_PRECONDITION");
}

TEST(Client, OptionsValidation) {
  EXPECT_TRUE(ValidateClientOptions({}).ok());
  ClientOptions o;
  o.max_message_bytes = int64_t{1} << 31;  // protobuf cannot go there
  EXPECT_EQ(ValidateClientOptions(o).code(), absl::StatusCode::kInvalidArgument);
  o = {};
  o.max_message_bytes = 100;
  EXPECT_EQ(ValidateClientOptions(o).code(), absl::StatusCode::kInvalidArgument);
  o = {};
  o.deadline = absl::ZeroDuration();
  EXPECT_EQ(ValidateClientOptions(o).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(FusedLayerClient::Connect("").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(FusedLayerClient::Connect("localhost:1", o).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(Client, Sha256KnownVectors) {
  EXPECT_EQ(Sha256Hex("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(Sha256Hex(""), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
}

TEST(Client, LoadWeightsRejectsInconsistentHeadersLocally) {
  // 127.0.0.1:1 is never contacted: these fail before the stream opens.
  absl::StatusOr<std::unique_ptr<FusedLayerClient>> c = FusedLayerClient::Connect("127.0.0.1:1");
  ASSERT_TRUE(c.ok()) << c.status();
  v1::WeightSetHeader h;
  h.set_name("w");
  h.set_payload_bytes(5);
  EXPECT_EQ((*c)->LoadWeights(h, "abcd").status().code(), absl::StatusCode::kInvalidArgument);
  h.set_payload_bytes(0);
  h.set_sha256(std::string(64, '0'));
  absl::Status s = (*c)->LoadWeights(h, "abcd").status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(s.message(), "sha256")) << s;
  h.clear_sha256();
  EXPECT_EQ((*c)->LoadWeights(h, "abcd", 0).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*c)->LoadWeights(h, "abcd", size_t{1} << 30).status().code(), absl::StatusCode::kInvalidArgument);
}

// A bearer token never crosses the network in clear text: without TLS credentials the client sends
// it only to loopback and unix: targets (Connect contacts nobody, so these need no server).
TEST(Client, RefusesABearerTokenOverPlaintextToANetworkTarget) {
  ClientOptions o;
  o.bearer_token = "0123456789abcdef0123456789abcdef";
  for (const char* target : {"10.0.0.7:50051", "fusedlayer.internal:50051", "dns:///fusedlayer.internal:50051",
                             "0.0.0.0:50051", "[2001:db8::1]:50051", "ipv4:127.0.0.1:1,10.0.0.7:1", "128.0.0.1:1"}) {
    absl::StatusOr<std::unique_ptr<FusedLayerClient>> c = FusedLayerClient::Connect(target, o);
    EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument) << target;
    EXPECT_TRUE(absl::StrContains(c.status().message(), "plaintext")) << target << ": " << c.status();
    EXPECT_FALSE(absl::StrContains(c.status().message(), o.bearer_token)) << "the token was echoed";
  }
  for (const char* target : {"127.0.0.1:1", "127.1.2.3:1", "localhost:1", "[::1]:1", "unix:/tmp/fusedlayer.sock",
                             "unix-abstract:fusedlayer", "dns:///localhost:1", "ipv4:127.0.0.1:1", "ipv6:[::1]:1"}) {
    EXPECT_TRUE(FusedLayerClient::Connect(target, o).ok()) << target;
  }
  // With TLS credentials any target is fine; without a token too.
  ClientOptions tls = o;
  tls.credentials = grpc::SslCredentials(grpc::SslCredentialsOptions());
  EXPECT_TRUE(FusedLayerClient::Connect("10.0.0.7:50051", tls).ok());
  EXPECT_TRUE(FusedLayerClient::Connect("10.0.0.7:50051", ClientOptions{}).ok());
}

TEST(Client, UnreachableServerIsUnavailable) {
  // Nothing listens on port 1 of the loopback: the call fails fast with UNAVAILABLE (a refused
  // connection), mapped through to absl with its message.
  ClientOptions o;
  o.deadline = absl::Seconds(20);
  absl::StatusOr<std::unique_ptr<FusedLayerClient>> c = FusedLayerClient::Connect("127.0.0.1:1", o);
  ASSERT_TRUE(c.ok()) << c.status();
  absl::StatusOr<v1::GetServerInfoResponse> info = (*c)->GetServerInfo();
  EXPECT_EQ(info.status().code(), absl::StatusCode::kUnavailable) << info.status();
  EXPECT_FALSE(info.status().message().empty());
  EXPECT_EQ((*c)->CheckHealth("").status().code(), absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace fusedlayer::client
