// Tests of `fusedctl import-checkpoint` (client/lib/checkpoint_import.h): small synthetic DeepSeek-V4 /
// V4.1 checkpoints, written here in both tensor-name dialects (3 layers, C = 256, hc_mult 4,
// several shards, UE8M0 block scales, F16 / F32 / BF16 norm weights, fresh random values with
// outliers), imported, then loaded through the real manifest loader and built on the CPU backend;
// every tensor must be bitwise what this file wrote (expected values converted here, independently
// of weights/dtype_conversion.cc). Also the errors (missing tensor, unknown layout, wrong
// shape, bad config, --layers) and the fusedctl binary's exit codes and messages.
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "client/lib/checkpoint_import.h"
#include "fusedlayer/backend.h"
#include "fusedlayer/numeric.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/server_test_env.h"
#include "test_util.h"
#include "weights/manifest.h"
#include "weights/safetensors_writer.h"
#include "weights/weight_set.h"

namespace fusedlayer::client {
namespace {

namespace stdfs = std::filesystem;
namespace v1 = ::fusedlayer::v1;
using server::PackedWeightSet;
using server::SafetensorsEntry;
using ::testing::HasSubstr;

class TempDir {
 public:
  TempDir() {
    std::string tmpl = (stdfs::temp_directory_path() / "fusedlayer_import_XXXXXX").string();
    EXPECT_NE(::mkdtemp(tmpl.data()), nullptr);
    path_ = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    stdfs::remove_all(path_, ec);
  }
  std::string Path(const std::string& name) const { return (stdfs::path(path_) / name).string(); }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

void WriteFile(const std::string& path, const std::string& text) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f << text;
  ASSERT_TRUE(f.good()) << path;
}

template <typename T>
std::string Bytes(const std::vector<T>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(T));
}

// ---- the synthetic checkpoint -----------------------------------------------------------------

enum class Names { kDeepSeek, kHuggingFace };

struct CheckpointSpec {
  Names names = Names::kDeepSeek;
  bool hc_head = true;   // V4 (hc_head_* present) or V4.1 (none)
  int layers = 3;
  int shards = 3;
  int64_t n = 4, C = 256, Q = 256, D = 128, N = 256;  // N: wq_b rows
};

// One checkpoint tensor, as written, and what the weight set must hold for it.
struct Written {
  SafetensorsEntry entry;
  std::string expected;  // the weight-set bytes (fp32 or bf16) it must load as
};

struct Checkpoint {
  CheckpointSpec spec;
  std::map<std::string, Written> tensors;  // checkpoint name -> tensor
  std::map<std::string, std::string> shard_of;
  // weight-set name -> weight-set tensor -> expected bytes
  std::map<std::string, std::map<std::string, std::string>> expected;
};

std::string LayerTensor(Names names, int layer, const std::string& deepseek, const std::string& hf) {
  return names == Names::kDeepSeek ? absl::StrCat("layers.", layer, ".", deepseek)
                                   : absl::StrCat("model.layers.", layer, ".", hf);
}

// fp32 values N(0, sigma) with outliers, stored as F32 (expected: the same bytes) or as BF16
// (expected: the bf16 value widened, bits << 16).
Written F32Tensor(std::mt19937_64& rng, std::vector<int64_t> shape, float sigma, bool as_bf16) {
  size_t count = 1;
  for (int64_t d : shape) count *= size_t(d);
  Written w;
  w.entry.shape = shape;
  if (as_bf16) {
    std::vector<uint16_t> v = testing::RandomBf16(rng, count, sigma);
    std::vector<uint32_t> wide(count);
    for (size_t i = 0; i < count; ++i) wide[i] = uint32_t(v[i]) << 16;
    w.entry.dtype = "BF16";
    w.entry.data = Bytes(v);
    w.expected = Bytes(wide);
  } else {
    std::vector<float> v(count);
    for (float& x : v) x = testing::RandomValue(rng, sigma);
    w.entry.dtype = "F32";
    w.entry.data = Bytes(v);
    w.expected = w.entry.data;
  }
  return w;
}

// A norm weight: bf16 values around 1 with outliers, stored as BF16, F16 or F32 (expected: the
// bf16 bits). _Float16 / float hold every such value exactly.
Written NormTensor(std::mt19937_64& rng, int64_t count, const std::string& dtype) {
  std::vector<uint16_t> bf16(static_cast<size_t>(count));
  std::uniform_real_distribution<float> u(0.5f, 1.5f);
  for (size_t i = 0; i < bf16.size(); ++i) {
    float v = u(rng);
    if (i % 37 == 5) v *= -24.0f;  // outliers, still inside fp16's range
    bf16[i] = FloatToBf16(v);
  }
  Written w;
  w.entry.shape = {count};
  w.entry.dtype = dtype;
  w.expected = Bytes(bf16);
  if (dtype == "BF16") {
    w.entry.data = Bytes(bf16);
  } else if (dtype == "F16") {
    std::vector<_Float16> h(bf16.size());
    for (size_t i = 0; i < h.size(); ++i) h[i] = static_cast<_Float16>(Bf16ToFloat(bf16[i]));
    w.entry.data = Bytes(h);
  } else {
    std::vector<float> f(bf16.size());
    for (size_t i = 0; i < f.size(); ++i) f[i] = Bf16ToFloat(bf16[i]);
    w.entry.data = Bytes(f);
  }
  return w;
}

void Put(Checkpoint& ck, std::mt19937_64& rng, const std::string& name, Written w) {
  w.entry.name = name;
  ck.shard_of[name] =
      absl::StrCat("model-", std::uniform_int_distribution<int>(1, ck.spec.shards)(rng), "-of-", ck.spec.shards,
                   ".safetensors");
  ck.tensors[name] = std::move(w);
}

Checkpoint MakeCheckpoint(std::mt19937_64& rng, const CheckpointSpec& spec) {
  Checkpoint ck;
  ck.spec = spec;
  const Names nm = spec.names;
  const int64_t n = spec.n, C = spec.C, M = n * (n + 2), K = n * C, Q = spec.Q, D = spec.D, N = spec.N;
  const float fn_sigma = 1.0f / std::sqrt(float(K));
  for (int l = 0; l < spec.layers; ++l) {
    const std::string attn = absl::StrCat("L", l, "/attn"), ffn = absl::StrCat("L", l, "/ffn");
    struct Item {
      std::string set, set_tensor, deepseek, hf;
      Written w;
    };
    std::vector<Item> items;
    // dtypes vary by layer and tensor so every conversion the manifest path does is exercised.
    items.push_back({attn, "mhc.fn", "hc_attn_fn", "attn_hc.fn", F32Tensor(rng, {M, K}, fn_sigma, l == 1)});
    items.push_back({attn, "mhc.scale", "hc_attn_scale", "attn_hc.scale", F32Tensor(rng, {3}, 1.0f, false)});
    items.push_back({attn, "mhc.base", "hc_attn_base", "attn_hc.base", F32Tensor(rng, {M}, 0.1f, l == 2)});
    items.push_back({attn, "mhc.norm_weight", "attn_norm.weight", "input_layernorm.weight",
                     NormTensor(rng, C, l == 0 ? "F16" : "BF16")});
    items.push_back({attn, "swa.q_norm", "attn.q_norm.weight", "self_attn.q_a_norm.weight",
                     NormTensor(rng, Q, l == 1 ? "F32" : "F16")});
    items.push_back({attn, "swa.kv_norm", "attn.kv_norm.weight", "self_attn.kv_norm.weight", NormTensor(rng, D, "BF16")});
    {
      Written wq;
      wq.entry.dtype = "F8_E4M3";
      wq.entry.shape = {N, Q};
      std::string codes(size_t(N * Q), '\0');
      for (char& b : codes) {
        uint8_t v;
        do v = uint8_t(rng()); while ((v & 0x7f) == 0x7f);  // never the NaN code
        b = char(v);
      }
      wq.entry.data = codes;
      wq.expected = codes;
      items.push_back({attn, "swa.wq_b", "attn.wq_b.weight", "self_attn.q_b_proj.weight", wq});
      // UE8M0 block scales (F8_E8M0): 2^(e-127); the fp32 bits of that power of two are e << 23.
      Written sc;
      sc.entry.dtype = "F8_E8M0";
      sc.entry.shape = {N / 128, Q / 128};
      std::vector<uint32_t> bits;
      for (int64_t i = 0; i < (N / 128) * (Q / 128); ++i) {
        const uint8_t e = uint8_t(std::uniform_int_distribution<int>(110, 135)(rng));
        sc.entry.data.push_back(char(e));
        bits.push_back(uint32_t(e) << 23);
      }
      sc.expected = Bytes(bits);
      items.push_back({attn, "swa.wq_b_scale", "attn.wq_b.scale", "self_attn.q_b_proj.weight_scale_inv", sc});
    }
    items.push_back({ffn, "mhc.fn", "hc_ffn_fn", "ffn_hc.fn", F32Tensor(rng, {M, K}, fn_sigma, l == 0)});
    items.push_back({ffn, "mhc.scale", "hc_ffn_scale", "ffn_hc.scale", F32Tensor(rng, {3}, 1.0f, l == 2)});
    items.push_back({ffn, "mhc.base", "hc_ffn_base", "ffn_hc.base", F32Tensor(rng, {M}, 0.1f, false)});
    items.push_back({ffn, "mhc.norm_weight", "ffn_norm.weight", "post_attention_layernorm.weight",
                     NormTensor(rng, C, l == 2 ? "F16" : "F32")});
    for (Item& it : items) {
      ck.expected[it.set][it.set_tensor] = it.w.expected;
      Put(ck, rng, LayerTensor(nm, l, it.deepseek, it.hf), std::move(it.w));
    }
    // Tensors the seams do not use: present in a real checkpoint, never read by the importer.
    Written other = F32Tensor(rng, {8, 4}, 1.0f, false);
    Put(ck, rng, LayerTensor(nm, l, "ffn.experts.0.w1.weight", "mlp.experts.0.gate_proj.weight"), other);
  }
  Put(ck, rng, nm == Names::kDeepSeek ? "embed.weight" : "model.embed_tokens.weight", F32Tensor(rng, {16, C}, 1, false));
  Written norm = NormTensor(rng, C, "F16");
  ck.expected["head"]["mhc.norm_weight"] = norm.expected;
  Put(ck, rng, nm == Names::kDeepSeek ? "norm.weight" : "model.norm.weight", norm);
  // head's fn / scale / base: hc_head's values in the pre rows and alpha_pre, zeros elsewhere (V4);
  // all zeros without hc_head (V4.1). Written independently of the importer's code.
  std::vector<float> fn(size_t(M * K), 0.0f), scale(3, 0.0f), base(size_t(M), 0.0f);
  if (spec.hc_head) {
    Written hfn = F32Tensor(rng, {n, K}, fn_sigma, true);  // BF16 in the file: converted exactly
    Written hbase = F32Tensor(rng, {n}, 0.1f, false);
    Written hscale = F32Tensor(rng, {1}, 1.0f, false);
    std::memcpy(fn.data(), hfn.expected.data(), hfn.expected.size());
    std::memcpy(base.data(), hbase.expected.data(), hbase.expected.size());
    std::memcpy(scale.data(), hscale.expected.data(), 4);
    Put(ck, rng, nm == Names::kDeepSeek ? "hc_head_fn" : "model.hc_head.hc_fn", hfn);
    Put(ck, rng, nm == Names::kDeepSeek ? "hc_head_base" : "model.hc_head.hc_base", hbase);
    Put(ck, rng, nm == Names::kDeepSeek ? "hc_head_scale" : "model.hc_head.hc_scale", hscale);
  }
  ck.expected["head"]["mhc.fn"] = Bytes(fn);
  ck.expected["head"]["mhc.scale"] = Bytes(scale);
  ck.expected["head"]["mhc.base"] = Bytes(base);
  return ck;
}

std::string ConfigJson(const CheckpointSpec& s, const std::string& extra = "") {
  return absl::StrCat(R"({"architectures": ["DeepseekV4ForCausalLM"], "hidden_size": )", s.C,
                      R"(, "hc_mult": )", s.n, R"(, "num_hidden_layers": )", s.layers, R"(, "q_lora_rank": )", s.Q,
                      R"(, "head_dim": )", s.D, R"(, "rms_norm_eps": 1e-20, "hc_eps": 1e-6, "hc_sinkhorn_iters": 10,
    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                            "weight_block_size": [128, 128]})",
                      extra, "}");
}

// Writes config.json, the shards and the index. `skip_in_shard` names a tensor the index lists but
// its shard lacks; `skip_in_index` one that neither has.
void WriteCheckpoint(const Checkpoint& ck, const std::string& dir, const std::string& config,
                     const std::string& skip_in_index = "", const std::string& skip_in_shard = "") {
  WriteFile(dir + "/config.json", config);
  std::map<std::string, std::vector<SafetensorsEntry>> shards;
  std::string index = R"({"metadata": {"total_size": 0}, "weight_map": {)";
  bool first = true;
  for (const auto& [name, w] : ck.tensors) {
    if (name == skip_in_index) continue;
    absl::StrAppend(&index, first ? "" : ", ", "\"", name, "\": \"", ck.shard_of.at(name), "\"");
    first = false;
    if (name != skip_in_shard) shards[ck.shard_of.at(name)].push_back(w.entry);
  }
  absl::StrAppend(&index, "}}");
  WriteFile(dir + "/model.safetensors.index.json", index);
  for (const auto& [file, entries] : shards) {
    ASSERT_TRUE(server::WriteSafetensors(dir + "/" + file, entries).ok()) << file;
  }
}

// Every set of the manifest: names in order, tensors bitwise as expected, hyper-parameters from
// the config, and BuildWeightSet (the server's validation + CPU preparation) accepts it.
void ExpectManifestHolds(const CheckpointImportResult& result, const Checkpoint& ck,
                         const std::vector<std::string>& expected_names) {
  absl::StatusOr<std::vector<PackedWeightSet>> sets = server::LoadManifest(result.manifest_path);
  ASSERT_TRUE(sets.ok()) << sets.status();
  std::vector<std::string> names;
  for (const PackedWeightSet& s : *sets) names.push_back(s.first.name());
  EXPECT_EQ(names, expected_names);
  EXPECT_EQ(result.set_names, expected_names);
  std::unique_ptr<Backend> cpu = CreateCpuBackend(BackendOptions{.num_threads = 1});
  for (const PackedWeightSet& s : *sets) {
    SCOPED_TRACE(s.first.name());
    const std::map<std::string, std::string>& want = ck.expected.at(s.first.name());
    std::set<std::string> seen;
    for (const v1::TensorEntry& t : s.first.tensors()) {
      seen.insert(t.name());
      ASSERT_TRUE(want.count(t.name())) << t.name();
      const std::string& bytes = want.at(t.name());
      ASSERT_LE(t.offset() + bytes.size(), s.second.size()) << t.name();
      EXPECT_TRUE(std::memcmp(s.second.data() + t.offset(), bytes.data(), bytes.size()) == 0)
          << t.name() << " differs from what the checkpoint holds";
    }
    std::set<std::string> want_names;
    for (const auto& [k, v] : want) want_names.insert(k);
    EXPECT_EQ(seen, want_names);
    ASSERT_TRUE(s.first.has_mhc());
    EXPECT_EQ(s.first.mhc().hc_mult(), ck.spec.n);
    EXPECT_EQ(s.first.mhc().hidden(), ck.spec.C);
    EXPECT_EQ(s.first.mhc().hc_norm_eps(), 1e-20f);
    EXPECT_EQ(s.first.mhc().norm_eps(), 1e-20f);
    EXPECT_EQ(s.first.mhc().hc_pre_eps(), 1e-6f);
    EXPECT_EQ(s.first.mhc().sinkhorn_eps(), 1e-6f);
    EXPECT_EQ(s.first.mhc().sinkhorn_iters(), 10);
    const bool attn = s.first.name().find("/attn") != std::string::npos;
    EXPECT_EQ(s.first.has_swa(), attn);
    if (attn) {
      EXPECT_EQ(s.first.swa().q_rank(), ck.spec.Q);
      EXPECT_EQ(s.first.swa().head_dim(), ck.spec.D);
      EXPECT_EQ(s.first.swa().eps(), 1e-20f);
      EXPECT_EQ(s.first.swa().scale_format(), v1::SCALE_FORMAT_UE8M0);  // config's scale_fmt
    }
    absl::StatusOr<std::shared_ptr<const server::WeightSet>> built =
        server::BuildWeightSet(*cpu, s.first, s.second, "manifest:test");
    EXPECT_TRUE(built.ok()) << built.status();
  }
}

std::vector<std::string> SetNames(int first, int last, bool head) {
  std::vector<std::string> out;
  for (int l = first; l <= last; ++l) {
    out.push_back(absl::StrCat("L", l, "/attn"));
    out.push_back(absl::StrCat("L", l, "/ffn"));
  }
  if (head) out.push_back("head");
  return out;
}

// ---- round trips ------------------------------------------------------------------------------

struct RoundTripCase {
  Names names;
  bool hc_head;
};

void PrintTo(const RoundTripCase& c, std::ostream* os) {
  *os << (c.names == Names::kDeepSeek ? "deepseek names" : "huggingface names") << (c.hc_head ? ", V4" : ", V4.1");
}

class ImportRoundTrip : public ::testing::TestWithParam<RoundTripCase> {};

TEST_P(ImportRoundTrip, EverySetLoadsBitwiseAndBuilds) {
  auto rng = testing::MakeRng(900 + int(GetParam().names) * 2 + int(GetParam().hc_head));
  CheckpointSpec spec;
  spec.names = GetParam().names;
  spec.hc_head = GetParam().hc_head;
  const Checkpoint ck = MakeCheckpoint(rng, spec);
  TempDir ckpt_dir, out_dir;
  WriteCheckpoint(ck, ckpt_dir.path(), ConfigJson(spec));
  CheckpointImportOptions options;
  options.checkpoint_dir = ckpt_dir.path();
  options.output_path = out_dir.Path("model/manifest.json");  // elsewhere: shard paths go relative
  stdfs::create_directory(out_dir.Path("model"));
  absl::StatusOr<CheckpointImportResult> result = ImportCheckpoint(options);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->dialect, spec.names == Names::kDeepSeek ? "deepseek" : "huggingface");
  EXPECT_EQ(result->head_tensors_path, out_dir.Path("model/manifest.head.safetensors"));
  ExpectManifestHolds(*result, ck, SetNames(0, 2, true));
  // The manifest names the shards relative to its own folder, so the two can move together.
  std::ifstream f(result->manifest_path);
  const std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  EXPECT_THAT(text, HasSubstr("\"../../"));
  EXPECT_THAT(text, ::testing::Not(HasSubstr("\"" + ckpt_dir.path())));
}

INSTANTIATE_TEST_SUITE_P(Dialects, ImportRoundTrip,
                         ::testing::Values(RoundTripCase{Names::kDeepSeek, true}, RoundTripCase{Names::kDeepSeek, false},
                                           RoundTripCase{Names::kHuggingFace, true},
                                           RoundTripCase{Names::kHuggingFace, false}),
                         [](const auto& info) {
                           return absl::StrCat(info.param.names == Names::kDeepSeek ? "DeepSeek" : "HuggingFace",
                                               info.param.hc_head ? "V4" : "V41");
                         });

TEST(ImportCheckpoint, LayerSubsets) {
  auto rng = testing::MakeRng(910);
  CheckpointSpec spec;
  spec.names = Names::kHuggingFace;
  const Checkpoint ck = MakeCheckpoint(rng, spec);
  TempDir dir;
  WriteCheckpoint(ck, dir.path(), ConfigJson(spec));
  CheckpointImportOptions options;
  options.checkpoint_dir = dir.path();
  options.output_path = dir.Path("m1.json");
  options.layers = LayerRange{1, 1};  // not the last layer: no head
  absl::StatusOr<CheckpointImportResult> r = ImportCheckpoint(options);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->head_tensors_path.empty());
  EXPECT_FALSE(stdfs::exists(dir.Path("m1.head.safetensors")));
  EXPECT_THAT(r->notes, ::testing::Contains(HasSubstr("no head set")));
  ExpectManifestHolds(*r, ck, SetNames(1, 1, false));

  options.output_path = dir.Path("m2.json");
  options.layers = LayerRange{1, 2};
  r = ImportCheckpoint(options);
  ASSERT_TRUE(r.ok()) << r.status();
  ExpectManifestHolds(*r, ck, SetNames(1, 2, true));

  options.layers = LayerRange{2, 3};  // past the model
  r = ImportCheckpoint(options);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(), HasSubstr("the model has 3 layers"));
}

TEST(ImportCheckpoint, ParsesLayerRanges) {
  ASSERT_TRUE(ParseLayerRange("0-3").ok());
  EXPECT_EQ(ParseLayerRange("0-3")->first, 0);
  EXPECT_EQ(ParseLayerRange("0-3")->last, 3);
  EXPECT_EQ(ParseLayerRange("7")->first, 7);
  EXPECT_EQ(ParseLayerRange("7")->last, 7);
  for (const char* bad : {"", "-", "3-1", "-1", "a-b", "1-", "+1", "1-+2", " 1", "1.5", "1-2-3", "99999999999"}) {
    EXPECT_EQ(ParseLayerRange(bad).status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
}

// A checkpoint without wq_b (or with another FP8 block layout) imports without it, and says so.
TEST(ImportCheckpoint, LeavesOutWqBItCannotServe) {
  auto rng = testing::MakeRng(911);
  CheckpointSpec spec;
  Checkpoint ck = MakeCheckpoint(rng, spec);
  TempDir dir;
  WriteCheckpoint(ck, dir.path(), absl::StrReplaceAll(ConfigJson(spec), {{"[128, 128]", "[32, 32]"}}));
  CheckpointImportOptions options;
  options.checkpoint_dir = dir.path();
  options.output_path = dir.Path("m.json");
  absl::StatusOr<CheckpointImportResult> r = ImportCheckpoint(options);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_THAT(r->notes, ::testing::Contains(HasSubstr("weight_block_size [32, 32]")));
  for (int l = 0; l < spec.layers; ++l) {
    ck.expected[absl::StrCat("L", l, "/attn")].erase("swa.wq_b");
    ck.expected[absl::StrCat("L", l, "/attn")].erase("swa.wq_b_scale");
  }
  ExpectManifestHolds(*r, ck, SetNames(0, 2, true));
}

// ---- errors -----------------------------------------------------------------------------------

absl::Status ImportInto(const std::string& dir) {
  CheckpointImportOptions options;
  options.checkpoint_dir = dir;
  options.output_path = dir + "/out.json";
  return ImportCheckpoint(options).status();
}

TEST(ImportCheckpoint, MissingTensorIsNamed) {
  auto rng = testing::MakeRng(912);
  for (Names names : {Names::kDeepSeek, Names::kHuggingFace}) {
    CheckpointSpec spec;
    spec.names = names;
    const Checkpoint ck = MakeCheckpoint(rng, spec);
    const std::string gone = LayerTensor(names, 1, "hc_ffn_base", "ffn_hc.base");
    {
      TempDir dir;  // absent from the index and the shards
      WriteCheckpoint(ck, dir.path(), ConfigJson(spec), gone);
      const absl::Status s = ImportInto(dir.path());
      EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
      EXPECT_THAT(s.message(), HasSubstr("\"" + gone + "\" (layer 1 FFN seam) is not in model.safetensors.index.json"));
      EXPECT_FALSE(stdfs::exists(dir.Path("out.json")));
    }
    {
      TempDir dir;  // the index places it in a shard that does not hold it
      WriteCheckpoint(ck, dir.path(), ConfigJson(spec), "", gone);
      const absl::Status s = ImportInto(dir.path());
      EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
      EXPECT_THAT(s.message(), HasSubstr(gone));
      EXPECT_THAT(s.message(), HasSubstr(ck.shard_of.at(gone)));
    }
  }
}

TEST(ImportCheckpoint, UnknownLayoutNamesTheFirstTensorItCannotPlace) {
  TempDir dir;
  CheckpointSpec spec;
  WriteFile(dir.Path("config.json"), ConfigJson(spec));
  WriteFile(dir.Path("model.safetensors.index.json"),
            R"({"weight_map": {"blk.0.hc_attn_fn.weight": "a.safetensors", "layers.0.attn_norm.weight": "a.safetensors",
                               "token_embd.weight": "a.safetensors"}})");
  absl::Status s = ImportInto(dir.path());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(), HasSubstr("cannot place tensor \"blk.0.hc_attn_fn.weight\""));

  // Known prefixes but no mHC tensor in either spelling: the message names both.
  WriteFile(dir.Path("model.safetensors.index.json"), R"({"weight_map": {"layers.0.attn_norm.weight": "a.safetensors"}})");
  s = ImportInto(dir.path());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(), HasSubstr("neither \"layers.0.hc_attn_fn\" nor \"model.layers.0.attn_hc.fn\""));

  // Both spellings at once is ambiguous.
  WriteFile(dir.Path("model.safetensors.index.json"),
            R"({"weight_map": {"layers.0.hc_attn_fn": "a.safetensors", "model.layers.0.attn_hc.fn": "b.safetensors"}})");
  s = ImportInto(dir.path());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(), HasSubstr("mixes both dialects"));
}

// Tensors that look like mHC / SWA parameters in a spelling the dialect does not have: an error
// naming them, never a zero head or a set without them.
TEST(ImportCheckpoint, UnrecognisedSeamTensorsAreAnErrorNamingThem) {
  auto rng = testing::MakeRng(915);
  struct Case {
    Names names;
    std::vector<std::string> extra;  // written besides the dialect's own tensors
    std::string named;               // what the message must name
  };
  const std::vector<Case> cases = {
      // V4's head in an unknown spelling, next to DeepSeek names (was: "no hc_head tensors", zeros, exit 0).
      {Names::kDeepSeek, {"hc_head.fn", "hc_head.base", "hc_head.scale"}, "\"hc_head.fn\""},
      // transformers' head spelled the way DeepSeek's own code spells it.
      {Names::kHuggingFace, {"model.hc_head_fn"}, "\"model.hc_head_fn\""},
      // a layer's mHC tensors under another module name.
      {Names::kDeepSeek, {"layers.1.hc_attn.fn"}, "\"layers.1.hc_attn.fn\""},
      // an SWA norm spelled in the other dialect.
      {Names::kHuggingFace, {"model.layers.0.self_attn.q_norm.weight"}, "\"model.layers.0.self_attn.q_norm.weight\""},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.named);
    CheckpointSpec spec;
    spec.names = c.names;
    spec.hc_head = false;
    Checkpoint ck = MakeCheckpoint(rng, spec);
    for (const std::string& name : c.extra) Put(ck, rng, name, F32Tensor(rng, {4}, 1.0f, false));
    TempDir dir;
    WriteCheckpoint(ck, dir.path(), ConfigJson(spec));
    const absl::Status s = ImportInto(dir.path());
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_THAT(s.message(), HasSubstr("look like mHC / SWA parameters"));
    EXPECT_THAT(s.message(), HasSubstr(c.named));
    EXPECT_FALSE(stdfs::exists(dir.Path("out.json")));
    EXPECT_FALSE(stdfs::exists(dir.Path("out.head.safetensors")));
  }
  // The multi-token-prediction layers' own mHC tensors are not imported and not an error.
  CheckpointSpec spec;
  Checkpoint ck = MakeCheckpoint(rng, spec);
  Put(ck, rng, "mtp.0.hc_attn_fn", F32Tensor(rng, {4}, 1.0f, false));
  TempDir dir;
  WriteCheckpoint(ck, dir.path(), ConfigJson(spec));
  EXPECT_TRUE(ImportInto(dir.path()).ok());
}

TEST(ImportCheckpoint, PrefixNamesEverySet) {
  auto rng = testing::MakeRng(916);
  CheckpointSpec spec;
  const Checkpoint ck = MakeCheckpoint(rng, spec);
  TempDir dir;
  WriteCheckpoint(ck, dir.path(), ConfigJson(spec));
  CheckpointImportOptions options;
  options.checkpoint_dir = dir.path();
  options.output_path = dir.Path("a.json");
  options.prefix = "v4-flash/a";
  options.layers = LayerRange{1, 2};
  absl::StatusOr<CheckpointImportResult> r = ImportCheckpoint(options);
  ASSERT_TRUE(r.ok()) << r.status();
  const std::vector<std::string> want = {"v4-flash/a/L1/attn", "v4-flash/a/L1/ffn", "v4-flash/a/L2/attn",
                                         "v4-flash/a/L2/ffn", "v4-flash/a/head"};
  EXPECT_EQ(r->set_names, want);
  absl::StatusOr<std::vector<PackedWeightSet>> sets = server::LoadManifest(r->manifest_path);
  ASSERT_TRUE(sets.ok()) << sets.status();
  std::vector<std::string> names;
  for (const PackedWeightSet& s : *sets) names.push_back(s.first.name());
  EXPECT_EQ(names, want);
  for (const char* bad : {"/a", "a/", "a b", "a!"}) {
    options.prefix = bad;
    r = ImportCheckpoint(options);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(r.status().message(), HasSubstr("--prefix=")) << bad;
  }
}

TEST(ImportCheckpoint, ShapeThatDisagreesWithTheConfigIsNamed) {
  auto rng = testing::MakeRng(913);
  CheckpointSpec spec;
  const Checkpoint ck = MakeCheckpoint(rng, spec);
  TempDir dir;
  CheckpointSpec wrong = spec;
  wrong.C = 512;  // config says hidden 512, the tensors are 256 wide
  WriteCheckpoint(ck, dir.path(), ConfigJson(wrong));
  const absl::Status s = ImportInto(dir.path());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(), HasSubstr("\"layers.0.hc_attn_fn\" (layer 0 attention seam) has shape [24, 1024]; "
                                     "config.json implies [24, 2048]"));
}

TEST(ImportCheckpoint, ConfigAndFolderErrors) {
  TempDir dir;
  absl::Status s = ImportInto(dir.Path("absent"));
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
  EXPECT_THAT(s.message(), HasSubstr("absent"));

  s = ImportInto(dir.path());  // no config.json
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
  EXPECT_THAT(s.message(), HasSubstr("config.json"));

  CheckpointSpec spec;
  std::string config = ConfigJson(spec);
  const std::string without_hc_eps = absl::StrReplaceAll(config, {{"\"hc_eps\": 1e-6, ", ""}});
  ASSERT_NE(without_hc_eps, config);
  WriteFile(dir.Path("config.json"), without_hc_eps);
  s = ImportInto(dir.path());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(), HasSubstr("missing \"hc_eps\""));

  WriteFile(dir.Path("config.json"), absl::StrReplaceAll(config, {{"\"hc_mult\": 4", "\"hc_mult\": \"4\""}}));
  s = ImportInto(dir.path());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(), HasSubstr("\"hc_mult\" must be a positive integer"));

  WriteFile(dir.Path("config.json"), config);  // no index
  s = ImportInto(dir.path());
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
  EXPECT_THAT(s.message(), HasSubstr("model.safetensors.index.json"));

  WriteFile(dir.Path("model.safetensors.index.json"), R"({"weight_map": {"a": "x", "a": "y"}})");
  s = ImportInto(dir.path());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;

  // --output in a folder that does not exist: nothing is written.
  {
    auto rng = testing::MakeRng(916);
    CheckpointSpec ok_spec;
    TempDir ok;
    WriteCheckpoint(MakeCheckpoint(rng, ok_spec), ok.path(), ConfigJson(ok_spec));
    CheckpointImportOptions options;
    options.checkpoint_dir = ok.path();
    options.output_path = ok.Path("no/such/dir/m.json");
    s = ImportCheckpoint(options).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
    EXPECT_THAT(s.message(), HasSubstr(ok.Path("no/such/dir") + " does not exist"));
  }

  // A shard the index names but the folder lacks.
  WriteFile(dir.Path("model.safetensors.index.json"), R"({"weight_map": {"layers.0.hc_attn_fn": "gone.safetensors"}})");
  s = ImportInto(dir.path());
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
  EXPECT_THAT(s.message(), HasSubstr("gone.safetensors"));
}

// ---- into a real server -------------------------------------------------------------------------

// The imported sets load into an in-process server (BuildWeightSet on its CPU backend, published in
// its store), and V4's head works as the header promises: a normal-mode seam with `head` gives
// new_pre_mix = σ(α·r·(R'·hc_head_fn) + b) + hc_eps, checked against an fp64 reference computed
// from the hc_head tensors this test wrote (not from the importer's head file), within the
// contract's mixes tolerance (spec/mhc.md: 1e-5 + 1e-4·|ref|); new_residual bitwise per Post.
TEST(ImportCheckpoint, ImportedSetsServeAndV4HeadMatchesHcHead) {
  auto rng = testing::MakeRng(915);
  CheckpointSpec spec;
  spec.names = Names::kDeepSeek;
  const Checkpoint ck = MakeCheckpoint(rng, spec);
  TempDir dir;
  WriteCheckpoint(ck, dir.path(), ConfigJson(spec));
  CheckpointImportOptions options;
  options.checkpoint_dir = dir.path();
  options.output_path = dir.Path("m.json");
  absl::StatusOr<CheckpointImportResult> result = ImportCheckpoint(options);
  ASSERT_TRUE(result.ok()) << result.status();
  absl::StatusOr<std::vector<PackedWeightSet>> sets = server::LoadManifest(result->manifest_path);
  ASSERT_TRUE(sets.ok()) << sets.status();
  std::map<std::string, std::string> sha;
  for (const PackedWeightSet& s : *sets) sha[s.first.name()] = s.first.sha256();
  auto ts = testing::TestServer::Start(testing::TestConfig(), nullptr, *std::move(sets));
  ASSERT_NE(ts, nullptr);
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    v1::ListWeightSetsResponse list;
    ASSERT_TRUE(ts->stub().ListWeightSets(&ctx, {}, &list).ok());
    std::set<std::string> listed;
    for (const v1::WeightSetInfo& info : list.weight_sets()) {
      listed.insert(info.name());
      EXPECT_EQ(info.sha256(), sha[info.name()]) << info.name();
      EXPECT_TRUE(info.has_norm_weight()) << info.name();
      EXPECT_EQ(info.wq_b_rows(), info.name().find("/attn") != std::string::npos ? spec.N : 0) << info.name();
    }
    EXPECT_EQ(listed, std::set<std::string>(result->set_names.begin(), result->set_names.end()));
  }

  const int64_t T = 5, n = spec.n, C = spec.C, K = n * C;
  const std::vector<uint16_t> x = testing::RandomBf16(rng, size_t(T * C));
  const std::vector<uint16_t> residual = testing::RandomBf16(rng, size_t(T * K));
  const std::vector<float> post = testing::RandomFloat(rng, size_t(T * n), 0.1f, 2.0f);
  const std::vector<float> comb = testing::RandomFloat(rng, size_t(T * n * n), 0.05f, 1.0f);
  v1::MhcSeamRequest req;
  req.set_weight_set("head");
  req.set_stage(v1::MHC_STAGE_SEAM);
  req.set_mode(v1::MHC_MODE_NORMAL);
  *req.mutable_x() = testing::MakeTensorOf(DType::kBF16, {T, C}, x);
  *req.mutable_residual() = testing::MakeTensorOf(DType::kBF16, {T, n, C}, residual);
  *req.mutable_post_mix() = testing::MakeTensorOf(DType::kFP32, {T, n}, post);
  *req.mutable_comb_mix() = testing::MakeTensorOf(DType::kFP32, {T, n, n}, comb);
  v1::MhcSeamResponse resp;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  const grpc::Status st = ts->stub().MhcSeam(&ctx, req, &resp);
  ASSERT_TRUE(st.ok()) << st.error_message();

  auto f32 = [&](const std::string& name) {
    const std::string& b = ck.tensors.at(name).expected;
    std::vector<float> v(b.size() / 4);
    std::memcpy(v.data(), b.data(), b.size());
    return v;
  };
  const std::vector<float> head_fn = f32("hc_head_fn"), head_base = f32("hc_head_base"), head_scale = f32("hc_head_scale");
  ASSERT_EQ(resp.new_residual().data().size(), size_t(T * K) * 2);
  ASSERT_EQ(resp.new_pre_mix().data().size(), size_t(T * n) * 4);
  std::vector<uint16_t> got_r(static_cast<size_t>(T * K));
  std::memcpy(got_r.data(), resp.new_residual().data().data(), got_r.size() * 2);
  std::vector<float> got_pre(static_cast<size_t>(T * n));
  std::memcpy(got_pre.data(), resp.new_pre_mix().data().data(), got_pre.size() * 4);
  for (int64_t t = 0; t < T; ++t) {
    // Post, in the contract's order: v = x·post[j], then fma over the source streams, one rounding.
    std::vector<float> r_new(static_cast<size_t>(K));
    for (int64_t j = 0; j < n; ++j) {
      for (int64_t c = 0; c < C; ++c) {
        float v = Bf16ToFloat(x[size_t(t * C + c)]) * post[size_t(t * n + j)];
        for (int64_t i = 0; i < n; ++i) {
          v = std::fma(Bf16ToFloat(residual[size_t((t * n + i) * C + c)]), comb[size_t((t * n + i) * n + j)], v);
        }
        const uint16_t b = FloatToBf16(v);
        ASSERT_EQ(got_r[size_t((t * n + j) * C + c)], b) << "new_residual t " << t << " j " << j << " c " << c;
        r_new[size_t(j * C + c)] = Bf16ToFloat(b);
      }
    }
    double sum_sq = 0;
    for (float v : r_new) sum_sq += double(v) * v;
    const double r = 1.0 / std::sqrt(sum_sq / double(K) + 1e-20);  // rms_norm_eps of ConfigJson
    for (int64_t j = 0; j < n; ++j) {
      double dot = 0;
      for (int64_t k = 0; k < K; ++k) dot += double(r_new[size_t(k)]) * head_fn[size_t(j * K + k)];
      const double a = double(head_scale[0]) * r * dot + head_base[size_t(j)];
      const double ref = 1.0 / (1.0 + std::exp(-a)) + double(float(1e-6));  // + hc_eps
      EXPECT_LE(std::abs(double(got_pre[size_t(t * n + j)]) - ref), 1e-5 + 1e-4 * std::abs(ref))
          << "new_pre_mix t " << t << " j " << j;
    }
  }
}

// ---- the fusedctl binary ----------------------------------------------------------------------

struct RunResult {
  int exit_code = -1;
  std::string output;  // stdout + stderr
};

RunResult RunFusedctl(const std::string& args) {
  RunResult r;
  const std::string cmd = absl::StrCat(FUSEDCTL_BINARY, " ", args, " 2>&1");
  FILE* p = ::popen(cmd.c_str(), "r");
  if (p == nullptr) return r;
  std::array<char, 4096> buf;
  size_t got;
  while ((got = std::fread(buf.data(), 1, buf.size(), p)) > 0) r.output.append(buf.data(), got);
  const int status = ::pclose(p);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

TEST(FusedctlImportCheckpoint, ExitCodesAndMessages) {
  TempDir dir;
  RunResult r = RunFusedctl(absl::StrCat("import-checkpoint ", dir.Path("absent")));
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_THAT(r.output, HasSubstr("fusedctl: error: NOT_FOUND: checkpoint folder " + dir.Path("absent")));

  r = RunFusedctl(absl::StrCat("import-checkpoint ", dir.path(), " --layers=3-1"));
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_THAT(r.output, HasSubstr("fusedctl: usage error: --layers=3-1"));

  r = RunFusedctl("import-checkpoint");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_THAT(r.output, HasSubstr("'import-checkpoint' takes 1 argument(s)"));

  r = RunFusedctl(absl::StrCat("import-checkpoint ", dir.path(), " --replace"));
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_THAT(r.output, HasSubstr("--replace does not apply to 'import-checkpoint'"));

  auto rng = testing::MakeRng(914);
  CheckpointSpec spec;
  spec.names = Names::kHuggingFace;
  const Checkpoint ck = MakeCheckpoint(rng, spec);
  WriteCheckpoint(ck, dir.path(), ConfigJson(spec));
  r = RunFusedctl(absl::StrCat("import-checkpoint ", dir.path(), " --output=", dir.Path("m.json"), " --layers=2"));
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr(absl::StrCat("wrote ", dir.Path("m.json"),
                                               ": 3 weight sets (huggingface tensor names), L2/attn .. head")));
  absl::StatusOr<std::vector<PackedWeightSet>> sets = server::LoadManifest(dir.Path("m.json"));
  ASSERT_TRUE(sets.ok()) << sets.status();
  EXPECT_EQ(sets->size(), 3u);

  r = RunFusedctl(absl::StrCat("import-checkpoint ", dir.path(), " --output=", dir.Path("p.json"),
                               " --layers=2 --prefix=model-b"));
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("3 weight sets (huggingface tensor names), model-b/L2/attn .. model-b/head"));

  // A head spelled in no known dialect: exit 1 naming it (no zero head written).
  Checkpoint odd = ck;
  Put(odd, rng, "model.hc_head.fn", F32Tensor(rng, {4}, 1.0f, false));
  TempDir odd_dir;
  WriteCheckpoint(odd, odd_dir.path(), ConfigJson(spec));
  r = RunFusedctl(absl::StrCat("import-checkpoint ", odd_dir.path(), " --output=", odd_dir.Path("m.json")));
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_THAT(r.output, HasSubstr("fusedctl: error: INVALID_ARGUMENT: "));
  EXPECT_THAT(r.output, HasSubstr("\"model.hc_head.fn\""));
  EXPECT_FALSE(stdfs::exists(odd_dir.Path("m.json")));
}

}  // namespace
}  // namespace fusedlayer::client
