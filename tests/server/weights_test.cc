// Tests of weights/: the safetensors reader and writer, manifests, SHA-256, weight-set
// validation and preparation (on the CPU backend), the weight store, the demo sets and the exporter.
// Every weight file is generated here from fresh random values; nothing binary is checked in.
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <functional>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "fusedlayer/backend.h"
#include "fusedlayer/numeric.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "test_util.h"
#include "forwarding_backend.h"
#include "weights/demo_weights.h"
#include "weights/export.h"
#include "weights/manifest.h"
#include "weights/packing.h"
#include "weights/safetensors.h"
#include "weights/safetensors_writer.h"
#include "weights/sha256.h"
#include "weights/weight_set.h"
#include "exec/weight_store.h"

namespace fusedlayer::server {
namespace {

namespace v1 = ::fusedlayer::v1;
namespace stdfs = std::filesystem;
using ::fusedlayer::testing::ForwardingBackend;
using ::fusedlayer::testing::MakeRng;
using ::fusedlayer::testing::RandomValue;
using ::testing::HasSubstr;

// ---- helpers -----------------------------------------------------------------------------------

class TempDir {
 public:
  TempDir() {
    std::string tmpl = (stdfs::temp_directory_path() / "fusedlayer_weights_XXXXXX").string();
    char* p = ::mkdtemp(tmpl.data());
    EXPECT_NE(p, nullptr);
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

std::string ReadFile(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}

void WriteFile(const std::string& path, std::string_view bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(f.good()) << path;
}

std::string Le64(uint64_t v) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[i] = static_cast<char>((v >> (8 * i)) & 0xff);
  return s;
}

// A safetensors file from a hand-written header and data section.
std::string RawFile(const std::string& header, const std::string& data) {
  return Le64(header.size()) + header + data;
}

template <typename T>
std::string AsBytes(const std::vector<T>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(T));
}

std::string RandomF32Bytes(std::mt19937_64& rng, size_t n, float sigma = 1.0f) {
  std::vector<float> v(n);
  for (float& x : v) x = RandomValue(rng, sigma);
  return AsBytes(v);
}

std::string RandomBf16Bytes(std::mt19937_64& rng, size_t n, float lo = 0.5f, float hi = 1.5f) {
  std::vector<uint16_t> v(n);
  std::vector<float> f = fusedlayer::testing::RandomFloat(rng, n, lo, hi);
  for (size_t i = 0; i < n; ++i) v[i] = FloatToBf16(f[i]);
  return AsBytes(v);
}

// Random fp8 codes without NaN codes (fn: 0x7f/0xff; fnuz: 0x80) and without zeros.
std::string RandomFp8Bytes(std::mt19937_64& rng, size_t n, Fp8Format fmt) {
  std::string s(n, '\0');
  std::uniform_int_distribution<int> u(1, 254);
  for (char& c : s) {
    int code;
    do code = u(rng); while (fmt == Fp8Format::kE4M3FN ? (code & 0x7f) == 0x7f : code == 0x80);
    c = static_cast<char>(code);
  }
  return s;
}

// A small but complete weight set: mhc n = 4, C = 256; swa Q = 256, D = 128, wq_b N = 128.
struct SmallSet {
  bool mhc = true;
  bool swa = true;
  bool norm_weight = true;
  bool wq_b = true;
  Fp8Format fmt = Fp8Format::kE4M3FN;
};
constexpr int kN = 4;
constexpr int64_t kC = 256, kM = kN * (kN + 2), kK = kN * kC;
constexpr int64_t kQ = 256, kD = 128, kRows = 128;

PackedWeightSet MakeSmallSet(std::mt19937_64& rng, const std::string& name, const SmallSet& o = {}) {
  WeightSetPacker p(name);
  if (o.mhc) {
    p.header().mutable_mhc()->set_hc_mult(kN);
    p.header().mutable_mhc()->set_hidden(kC);
    p.Add("mhc.fn", DType::kFP32, {kM, kK}, RandomF32Bytes(rng, kM * kK, 0.03f));
    p.Add("mhc.scale", DType::kFP32, {3}, AsBytes(fusedlayer::testing::RandomFloat(rng, 3, 0.5f, 2.0f)));
    p.Add("mhc.base", DType::kFP32, {kM}, RandomF32Bytes(rng, kM, 0.1f));
    if (o.norm_weight) p.Add("mhc.norm_weight", DType::kBF16, {kC}, RandomBf16Bytes(rng, kC));
  }
  if (o.swa) {
    v1::SwaConfig* s = p.header().mutable_swa();
    s->set_q_rank(kQ);
    s->set_head_dim(kD);
    s->set_fp8_format(o.fmt == Fp8Format::kE4M3FN ? v1::FP8_FORMAT_E4M3FN : v1::FP8_FORMAT_E4M3FNUZ);
    p.Add("swa.q_norm", DType::kBF16, {kQ}, RandomBf16Bytes(rng, kQ));
    p.Add("swa.kv_norm", DType::kBF16, {kD}, RandomBf16Bytes(rng, kD));
    if (o.wq_b) {
      const DType dt = o.fmt == Fp8Format::kE4M3FN ? DType::kFP8E4M3FN : DType::kFP8E4M3FNUZ;
      p.Add("swa.wq_b", dt, {kRows, kQ}, RandomFp8Bytes(rng, kRows * kQ, o.fmt));
      p.Add("swa.wq_b_scale", DType::kFP32, {kRows / 128, kQ / 128},
            AsBytes(fusedlayer::testing::RandomFloat(rng, (kRows / 128) * (kQ / 128), 1e-4f, 1e-2f)));
    }
  }
  absl::StatusOr<PackedWeightSet> set = p.Finish();
  EXPECT_TRUE(set.ok()) << set.status();
  return set.ok() ? std::move(*set) : PackedWeightSet{};
}

v1::TensorEntry* FindEntry(v1::WeightSetHeader& h, const std::string& name) {
  for (v1::TensorEntry& e : *h.mutable_tensors()) {
    if (e.name() == name) return &e;
  }
  ADD_FAILURE() << "no entry " << name;
  return nullptr;
}

void RemoveEntry(v1::WeightSetHeader& h, const std::string& name) {
  auto* t = h.mutable_tensors();
  for (int i = 0; i < t->size(); ++i) {
    if (t->Get(i).name() == name) {
      t->erase(t->begin() + i);
      return;
    }
  }
  ADD_FAILURE() << "no entry " << name;
}

std::string ViewBytes(const TensorView& v) {
  if (v.empty_view()) return {};
  return std::string(static_cast<const char*>(v.data), static_cast<size_t>(v.numel()) * DTypeSize(v.dtype));
}

// A CPU backend that records what BuildWeightSet hands to Prepare*: the hyper-parameters and the
// bytes of every weight view.
class RecordingBackend final : public ForwardingBackend {
 public:
  RecordingBackend() : ForwardingBackend(CreateCpuBackend(BackendOptions{.num_threads = 1})) {}

  absl::StatusOr<std::unique_ptr<PreparedMhcWeights>> PrepareMhc(const MhcHyperParams& p,
                                                                 const MhcWeightsHost& w) override {
    mhc_params = p;
    mhc_bytes = {{"mhc.fn", ViewBytes(w.fn)},
                 {"mhc.scale", ViewBytes(w.scale)},
                 {"mhc.base", ViewBytes(w.base)},
                 {"mhc.norm_weight", ViewBytes(w.norm_weight)}};
    for (const TensorView* v : {&w.fn, &w.scale, &w.base, &w.norm_weight}) {
      if (!v->empty_view()) aligned = aligned && reinterpret_cast<uintptr_t>(v->data) % DTypeSize(v->dtype) == 0;
    }
    return ForwardingBackend::PrepareMhc(p, w);
  }
  absl::StatusOr<std::unique_ptr<PreparedSwaWeights>> PrepareSwa(const SwaHyperParams& p,
                                                                 const SwaWeightsHost& w) override {
    swa_params = p;
    swa_bytes = {{"swa.q_norm", ViewBytes(w.q_norm)},
                 {"swa.kv_norm", ViewBytes(w.kv_norm)},
                 {"swa.wq_b", ViewBytes(w.wq_b)},
                 {"swa.wq_b_scale", ViewBytes(w.wq_b_scale)}};
    for (const TensorView* v : {&w.q_norm, &w.kv_norm, &w.wq_b, &w.wq_b_scale}) {
      if (!v->empty_view()) aligned = aligned && reinterpret_cast<uintptr_t>(v->data) % DTypeSize(v->dtype) == 0;
    }
    return ForwardingBackend::PrepareSwa(p, w);
  }

  std::optional<MhcHyperParams> mhc_params;
  std::optional<SwaHyperParams> swa_params;
  std::map<std::string, std::string> mhc_bytes, swa_bytes;
  bool aligned = true;
};

std::unique_ptr<Backend> Cpu() { return CreateCpuBackend(BackendOptions{.num_threads = 1}); }

// ---- SHA-256 -----------------------------------------------------------------------------------

TEST(Sha256Test, KnownVectors) {
  EXPECT_EQ(*Sha256Hex(""), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(*Sha256Hex("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(*Sha256Hex("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq"),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
}

TEST(Sha256Test, IncrementalEqualsOneShot) {
  auto rng = MakeRng(1);
  const std::string data = RandomF32Bytes(rng, 40000);
  Sha256 h;
  std::uniform_int_distribution<size_t> chunk(0, 5000);
  for (size_t pos = 0; pos < data.size();) {
    const size_t n = std::min(chunk(rng), data.size() - pos);
    h.Update(std::string_view(data).substr(pos, n));
    pos += n;
  }
  EXPECT_EQ(*h.FinishHex(), *Sha256Hex(data));
  EXPECT_EQ(h.FinishHex().status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST(Sha256Test, HexForm) {
  EXPECT_TRUE(IsSha256Hex(*Sha256Hex("x")));
  EXPECT_FALSE(IsSha256Hex(""));
  EXPECT_FALSE(IsSha256Hex(std::string(64, 'A')));
  EXPECT_FALSE(IsSha256Hex(std::string(63, 'a')));
  EXPECT_FALSE(IsSha256Hex(std::string(64, 'g')));
}

// ---- safetensors: round trip ---------------------------------------------------------------------

std::vector<SafetensorsEntry> RandomEntries(std::mt19937_64& rng) {
  std::vector<SafetensorsEntry> e;
  e.push_back({"layers.3.hc_ffn_fn", "F32", {24, 64}, RandomF32Bytes(rng, 24 * 64)});
  e.push_back({"layers.3.ffn_norm.weight", "BF16", {64}, RandomBf16Bytes(rng, 64)});
  e.push_back({"layers.3.attn.wq_b.weight", "F8_E4M3", {128, 256}, RandomFp8Bytes(rng, 128 * 256, Fp8Format::kE4M3FN)});
  e.push_back({"mi300.wq_b", "F8_E4M3FNUZ", {3, 5}, RandomFp8Bytes(rng, 15, Fp8Format::kE4M3FNUZ)});
  // Dtypes fusedlayer does not use still parse (checkpoint shards hold them).
  e.push_back({"other.f16", "F16", {7}, RandomF32Bytes(rng, 7).substr(0, 14)});
  e.push_back({"other.i64", "I64", {2, 2}, RandomF32Bytes(rng, 8)});
  e.push_back({"other.scalar", "F32", {}, RandomF32Bytes(rng, 1)});
  e.push_back({"other.empty", "BF16", {0, 16}, ""});
  e.push_back({"other.f4", "F4", {6}, RandomF32Bytes(rng, 1).substr(0, 3)});
  return e;
}

TEST(SafetensorsTest, WriteThenReadRoundTrip) {
  auto rng = MakeRng(2);
  TempDir dir;
  const std::vector<SafetensorsEntry> entries = RandomEntries(rng);
  const std::string path = dir.Path("a.safetensors");
  ASSERT_TRUE(WriteSafetensors(path, entries, {{"format", "pt"}}).ok());

  // The header is padded so the data section starts 8-byte aligned.
  const std::string bytes = ReadFile(path);
  absl::StatusOr<SafetensorsIndex> mem = ParseSafetensors(bytes, "a");
  ASSERT_TRUE(mem.ok()) << mem.status();
  EXPECT_EQ(mem->data_offset % 8, 0u);
  EXPECT_EQ(mem->metadata.at("format"), "pt");

  absl::StatusOr<std::unique_ptr<SafetensorsFile>> f = SafetensorsFile::Open(path);
  ASSERT_TRUE(f.ok()) << f.status();
  ASSERT_EQ((*f)->index().tensors.size(), entries.size());
  for (const SafetensorsEntry& e : entries) {
    absl::StatusOr<const SafetensorsTensorInfo*> info = (*f)->index().Find(e.name);
    ASSERT_TRUE(info.ok()) << info.status();
    EXPECT_EQ((*info)->dtype, e.dtype);
    EXPECT_EQ((*info)->shape, e.shape);
    std::string out = "prefix";
    ASSERT_TRUE((*f)->AppendTensorBytes(**info, &out).ok());
    EXPECT_EQ(out, "prefix" + e.data) << e.name;
    // The in-memory parse agrees with the file reader.
    const SafetensorsTensorInfo& m = mem->tensors.at(e.name);
    EXPECT_EQ(bytes.substr(mem->data_offset + m.begin, m.bytes()), e.data);
  }
  absl::StatusOr<const SafetensorsTensorInfo*> missing = (*f)->index().Find("nope");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(missing.status().message(), HasSubstr("nope"));
}

TEST(SafetensorsTest, DTypeMapping) {
  EXPECT_EQ(SafetensorsDTypeToDType("BF16"), DType::kBF16);
  EXPECT_EQ(SafetensorsDTypeToDType("F32"), DType::kFP32);
  EXPECT_EQ(SafetensorsDTypeToDType("F8_E4M3"), DType::kFP8E4M3FN);
  EXPECT_EQ(SafetensorsDTypeToDType("F8_E4M3FNUZ"), DType::kFP8E4M3FNUZ);
  EXPECT_EQ(SafetensorsDTypeToDType("F16"), std::nullopt);
  for (DType d : {DType::kBF16, DType::kFP32, DType::kFP8E4M3FN, DType::kFP8E4M3FNUZ}) {
    EXPECT_EQ(SafetensorsDTypeToDType(DTypeToSafetensorsDType(d)), d);
  }
}

TEST(SafetensorsTest, WriterRejectsBadEntries) {
  EXPECT_EQ(SerializeSafetensors({{"a", "F32", {2}, "1234"}}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(SerializeSafetensors({{"a", "F99", {1}, "1234"}}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(SerializeSafetensors({{"a", "U8", {1}, "1"}, {"a", "U8", {1}, "2"}}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(SerializeSafetensors({{"__metadata__", "U8", {1}, "1"}}).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// ---- safetensors: bad files ----------------------------------------------------------------------

absl::StatusCode ParseCode(const std::string& bytes) { return ParseSafetensors(bytes, "bad").status().code(); }

TEST(SafetensorsTest, EveryTruncationIsDataLoss) {
  auto rng = MakeRng(3);
  absl::StatusOr<std::string> file = SerializeSafetensors(
      {{"a", "F32", {3, 5}, RandomF32Bytes(rng, 15)}, {"b", "BF16", {9}, RandomBf16Bytes(rng, 9)}});
  ASSERT_TRUE(file.ok());
  ASSERT_TRUE(ParseSafetensors(*file).ok());
  TempDir dir;
  for (size_t len = 0; len < file->size(); ++len) {
    const std::string cut = file->substr(0, len);
    absl::StatusOr<SafetensorsIndex> r = ParseSafetensors(cut, "cut.safetensors");
    EXPECT_EQ(r.status().code(), absl::StatusCode::kDataLoss) << "length " << len << ": " << r.status();
    EXPECT_THAT(r.status().message(), HasSubstr("cut.safetensors"));
    // The file reader reaches the same verdict from the file size.
    if (len % 7 == 0) {
      WriteFile(dir.Path("cut"), cut);
      EXPECT_EQ(SafetensorsFile::Open(dir.Path("cut")).status().code(), absl::StatusCode::kDataLoss) << len;
    }
  }
}

TEST(SafetensorsTest, HeaderLengthPastEndOfFile) {
  const std::string header = R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}})";
  const std::string good = RawFile(header, "xy");
  ASSERT_TRUE(ParseSafetensors(good).ok());
  std::string bad = good;
  bad.replace(0, 8, Le64(header.size() + 3));  // 1 byte past the end
  absl::StatusOr<SafetensorsIndex> r = ParseSafetensors(bad, "f");
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDataLoss) << r.status();
  EXPECT_THAT(r.status().message(), HasSubstr("header length"));
  // Absurd lengths are refused before anything is allocated.
  bad.replace(0, 8, Le64(~uint64_t{0}));
  EXPECT_EQ(ParseCode(bad), absl::StatusCode::kInvalidArgument);
  bad.replace(0, 8, Le64(kMaxSafetensorsHeaderBytes + 1));
  EXPECT_EQ(ParseCode(bad), absl::StatusCode::kInvalidArgument);
}

struct BadHeaderCase {
  const char* what;
  std::string header;
  std::string data;
  absl::StatusCode code;
  const char* message;  // substring the message must contain
};

TEST(SafetensorsTest, BadHeadersGiveDocumentedStatus) {
  const auto E = absl::StatusCode::kInvalidArgument;
  const auto L = absl::StatusCode::kDataLoss;
  const std::vector<BadHeaderCase> cases = {
      {"empty header", "", "", E, "malformed JSON"},
      {"bad JSON", R"({"a":{"dtype":"U8",)", "", E, "malformed JSON"},
      {"trailing garbage", R"({} x)", "", E, "malformed JSON"},
      {"not an object", R"([1,2])", "", E, "not a JSON object"},
      {"duplicate tensor", R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}})", "xy", E, "duplicate"},
      {"entry not object", R"({"a":5})", "", E, "\"a\""},
      {"unknown key", R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1],"extra":1}})", "x", E, "extra"},
      {"missing shape", R"({"a":{"dtype":"U8","data_offsets":[0,1]}})", "x", E, "shape"},
      {"unknown dtype", R"({"a":{"dtype":"F12","shape":[1],"data_offsets":[0,1]}})", "x", E, "F12"},
      {"dtype not string", R"({"a":{"dtype":3,"shape":[1],"data_offsets":[0,1]}})", "x", E, "dtype"},
      {"negative dim", R"({"a":{"dtype":"U8","shape":[-1],"data_offsets":[0,1]}})", "x", E, "non-negative"},
      {"float dim", R"({"a":{"dtype":"U8","shape":[1.0],"data_offsets":[0,1]}})", "x", E, "non-negative"},
      {"bool dim", R"({"a":{"dtype":"U8","shape":[true],"data_offsets":[0,1]}})", "x", E, "non-negative"},
      {"huge dim", R"({"a":{"dtype":"U8","shape":[18446744073709551615],"data_offsets":[0,1]}})", "x", E, "non-negative"},
      {"numel overflow", R"({"a":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,1]}})", "x", E, "overflow"},
      {"bytes overflow", R"({"a":{"dtype":"F64","shape":[4611686018427387904],"data_offsets":[0,1]}})", "x", E, "overflow"},
      {"overflow hidden by zero", R"({"a":{"dtype":"U8","shape":[4294967296,4294967296,0],"data_offsets":[0,0]}})", "", E, "overflow"},
      {"sub-byte remainder", R"({"a":{"dtype":"F4","shape":[3],"data_offsets":[0,1]}})", "x", E, "whole number of bytes"},
      {"offsets not pair", R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0]}})", "x", E, "data_offsets"},
      {"negative offset", R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[-1,0]}})", "x", E, "non-negative"},
      {"begin > end", R"({"a":{"dtype":"U8","shape":[0],"data_offsets":[1,0]}})", "x", E, "begin > end"},
      {"length mismatch", R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}})", "xxxx", E, "needs 8"},
      {"offsets out of bounds", R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}})", "xy", L, "past the end"},
      {"offsets far out of bounds", R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[1000000,1000002]}})", "xy", L, "\"a\""},
      {"overlap", R"({"a":{"dtype":"U8","shape":[3],"data_offsets":[0,3]},"b":{"dtype":"U8","shape":[2],"data_offsets":[2,4]}})", "wxyz", E, "overlap"},
      {"identical ranges", R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},"b":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}})", "xy", E, "overlap"},
      {"hole", R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"b":{"dtype":"U8","shape":[1],"data_offsets":[2,3]}})", "xyz", E, "belong to no tensor"},
      {"trailing bytes", R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}})", "xyz", E, "trailing"},
      {"metadata not object", R"({"__metadata__":[1]})", "", E, "__metadata__"},
      {"metadata value not string", R"({"__metadata__":{"k":1}})", "", E, "__metadata__"},
      {"too deep", std::string(40, '[') + std::string(40, ']'), "", E, "deeper"},
      // Stops at the limit: 64 KiB of nesting, never closed, is "too deep", not a syntax error
      // found after reading it all.
      {"too deep, unterminated", std::string(1 << 16, '['), "", E, "deeper"},
  };
  for (const BadHeaderCase& c : cases) {
    absl::StatusOr<SafetensorsIndex> r = ParseSafetensors(RawFile(c.header, c.data), "case.safetensors");
    EXPECT_EQ(r.status().code(), c.code) << c.what << ": " << r.status();
    EXPECT_THAT(r.status().message(), HasSubstr(c.message)) << c.what;
    EXPECT_THAT(r.status().message(), HasSubstr("case.safetensors")) << c.what;
  }
  // Valid corner cases: empty header object, null metadata, zero-size tensors, padding spaces.
  EXPECT_TRUE(ParseSafetensors(RawFile("{}", "")).ok());
  EXPECT_TRUE(ParseSafetensors(RawFile(R"({"__metadata__":null})", "")).ok());
  EXPECT_TRUE(ParseSafetensors(RawFile(R"({"z":{"dtype":"F32","shape":[0,5],"data_offsets":[0,0]}})", "")).ok());
  EXPECT_TRUE(ParseSafetensors(RawFile(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}     )", "x")).ok());
}

// Random byte flips of a valid file never crash and only ever yield the documented codes.
TEST(SafetensorsTest, MutatedFilesFailCleanly) {
  auto rng = MakeRng(4);
  absl::StatusOr<std::string> file = SerializeSafetensors(RandomEntries(rng), {{"k", "v"}});
  ASSERT_TRUE(file.ok());
  std::uniform_int_distribution<size_t> pos_in_header(0, std::min<size_t>(file->size() - 1, 700));
  std::uniform_int_distribution<int> byte(0, 255), flips(1, 4);
  int rejected = 0;
  for (int iter = 0; iter < 3000; ++iter) {
    std::string m = *file;
    for (int k = flips(rng); k > 0; --k) m[pos_in_header(rng)] = static_cast<char>(byte(rng));
    absl::StatusOr<SafetensorsIndex> r = ParseSafetensors(m, "m");
    if (r.ok()) {
      // Whatever parsed must describe ranges inside the data section.
      for (const auto& [n, t] : r->tensors) {
        ASSERT_LE(t.end, r->data_bytes);
        ASSERT_LE(r->data_offset + r->data_bytes, m.size());
      }
    } else {
      ++rejected;
      ASSERT_TRUE(r.status().code() == absl::StatusCode::kInvalidArgument ||
                  r.status().code() == absl::StatusCode::kDataLoss)
          << r.status();
    }
  }
  EXPECT_GT(rejected, 0);
}

TEST(SafetensorsTest, OpenErrors) {
  TempDir dir;
  EXPECT_EQ(SafetensorsFile::Open(dir.Path("missing.safetensors")).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(SafetensorsFile::Open(dir.path()).status().code(), absl::StatusCode::kInvalidArgument);
  WriteFile(dir.Path("bad"), RawFile("{oops", ""));
  absl::StatusOr<std::unique_ptr<SafetensorsFile>> f = SafetensorsFile::Open(dir.Path("bad"));
  EXPECT_EQ(f.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(f.status().message(), HasSubstr(dir.Path("bad")));
}

// A file that shrinks after it was opened gives DATA_LOSS on read, not a crash.
TEST(SafetensorsTest, FileTruncatedAfterOpen) {
  auto rng = MakeRng(5);
  TempDir dir;
  const std::string path = dir.Path("shrink.safetensors");
  ASSERT_TRUE(WriteSafetensors(path, {{"a", "F32", {1000}, RandomF32Bytes(rng, 1000)}}).ok());
  absl::StatusOr<std::unique_ptr<SafetensorsFile>> f = SafetensorsFile::Open(path);
  ASSERT_TRUE(f.ok());
  stdfs::resize_file(path, stdfs::file_size(path) - 100);
  std::string out;
  absl::Status s = (*f)->AppendTensorBytes(*(*f)->index().Find("a").value(), &out);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_TRUE(out.empty());
}

// ---- manifest ------------------------------------------------------------------------------------

// Two safetensors files with DeepSeek-style tensor names (one in a sub-directory) and a manifest
// mapping two weight sets onto them.
struct ManifestFixture {
  TempDir dir;
  std::map<std::string, std::string> bytes;  // weight-set tensor name -> bytes (set "v41/L3/ffn")
  std::string manifest_path;
};

void WriteFixture(std::mt19937_64& rng, ManifestFixture& fx) {
  fx.bytes = {{"mhc.fn", RandomF32Bytes(rng, kM * kK, 0.03f)},
              {"mhc.scale", AsBytes(fusedlayer::testing::RandomFloat(rng, 3, 0.5f, 2.0f))},
              {"mhc.base", RandomF32Bytes(rng, kM, 0.1f)},
              {"mhc.norm_weight", RandomBf16Bytes(rng, kC)},
              {"swa.q_norm", RandomBf16Bytes(rng, kQ)},
              {"swa.kv_norm", RandomBf16Bytes(rng, kD)},
              {"swa.wq_b", RandomFp8Bytes(rng, kRows * kQ, Fp8Format::kE4M3FN)},
              {"swa.wq_b_scale", AsBytes(fusedlayer::testing::RandomFloat(rng, kQ / 128, 1e-4f, 1e-2f))}};
  ASSERT_TRUE(WriteSafetensors(fx.dir.Path("layer3.safetensors"),
                               {{"layers.3.hc_ffn_base", "F32", {kM}, fx.bytes["mhc.base"]},
                                {"layers.3.hc_ffn_fn", "F32", {kM, kK}, fx.bytes["mhc.fn"]},
                                {"layers.3.hc_ffn_scale", "F32", {3}, fx.bytes["mhc.scale"]},
                                {"layers.3.ffn_norm.weight", "BF16", {kC}, fx.bytes["mhc.norm_weight"]},
                                {"layers.3.unrelated", "I16", {4}, "abcdefgh"}})
                  .ok());
  stdfs::create_directory(fx.dir.Path("attn"));
  ASSERT_TRUE(WriteSafetensors(fx.dir.Path("attn/layer3_attn.safetensors"),
                               {{"layers.3.attn.q_norm.weight", "BF16", {kQ}, fx.bytes["swa.q_norm"]},
                                {"layers.3.attn.kv_norm.weight", "BF16", {kD}, fx.bytes["swa.kv_norm"]},
                                {"layers.3.attn.wq_b.weight", "F8_E4M3", {kRows, kQ}, fx.bytes["swa.wq_b"]},
                                {"layers.3.attn.wq_b.scale", "F32", {kRows / 128, kQ / 128}, fx.bytes["swa.wq_b_scale"]}})
                  .ok());
  const std::string attn_abs = fx.dir.Path("attn/layer3_attn.safetensors");
  const std::string manifest = absl::StrCat(R"({"weight_sets": [
    {"name": "v41/L3/ffn",
     "mhc": {"hc_mult": 4, "hidden": 256, "norm_eps": 1e-20, "hc_norm_eps": 1e-20, "sinkhorn_iters": 10},
     "swa": {"q_rank": 256, "head_dim": 128, "eps": 1e-5, "fp8_format": "e4m3fn", "scale_format": "ue8m0",
             "scale_layout": "column_major_tma"},
     "tensors": {
       "swa.wq_b_scale": {"file": ")", attn_abs, R"(", "tensor": "layers.3.attn.wq_b.scale"},
       "mhc.fn": {"file": "layer3.safetensors", "tensor": "layers.3.hc_ffn_fn"},
       "mhc.scale": {"file": "layer3.safetensors", "tensor": "layers.3.hc_ffn_scale"},
       "mhc.base": {"file": "./layer3.safetensors", "tensor": "layers.3.hc_ffn_base"},
       "mhc.norm_weight": {"file": "layer3.safetensors", "tensor": "layers.3.ffn_norm.weight"},
       "swa.q_norm": {"file": "attn/layer3_attn.safetensors", "tensor": "layers.3.attn.q_norm.weight"},
       "swa.kv_norm": {"file": "attn/layer3_attn.safetensors", "tensor": "layers.3.attn.kv_norm.weight"},
       "swa.wq_b": {"file": "attn/layer3_attn.safetensors", "tensor": "layers.3.attn.wq_b.weight"}}},
    {"name": "v41/L3/mhc-only",
     "mhc": {"hc_mult": 4, "hidden": 256},
     "tensors": {
       "mhc.fn": {"file": "layer3.safetensors", "tensor": "layers.3.hc_ffn_fn"},
       "mhc.scale": {"file": "layer3.safetensors", "tensor": "layers.3.hc_ffn_scale"},
       "mhc.base": {"file": "layer3.safetensors", "tensor": "layers.3.hc_ffn_base"}}}
  ]})");
  fx.manifest_path = fx.dir.Path("manifest.json");
  WriteFile(fx.manifest_path, manifest);
}

TEST(ManifestTest, LoadsTensorsByteExactAndBuilds) {
  auto rng = MakeRng(6);
  ManifestFixture fx;
  ASSERT_NO_FATAL_FAILURE(WriteFixture(rng, fx));
  absl::StatusOr<std::vector<PackedWeightSet>> sets = LoadManifest(fx.manifest_path);
  ASSERT_TRUE(sets.ok()) << sets.status();
  ASSERT_EQ(sets->size(), 2u);

  const PackedWeightSet& full = (*sets)[0];
  const v1::WeightSetHeader& h = full.first;
  EXPECT_EQ(h.name(), "v41/L3/ffn");
  EXPECT_EQ(h.payload_bytes(), full.second.size());
  EXPECT_EQ(h.sha256(), *Sha256Hex(full.second));
  EXPECT_EQ(h.mhc().hc_mult(), 4);
  EXPECT_EQ(h.mhc().norm_eps(), 1e-20f);
  EXPECT_EQ(h.mhc().hc_norm_eps(), 1e-20f);
  EXPECT_FALSE(h.mhc().has_post_scale());  // absent in the manifest: left to the default
  EXPECT_EQ(h.mhc().sinkhorn_iters(), 10);
  EXPECT_EQ(h.swa().eps(), 1e-5f);
  EXPECT_EQ(h.swa().scale_format(), v1::SCALE_FORMAT_UE8M0);
  EXPECT_EQ(h.swa().scale_layout(), v1::SCALE_LAYOUT_COLUMN_MAJOR_TMA);
  ASSERT_EQ(h.tensors_size(), 8);
  // Canonical order, 64-byte aligned offsets, exact bytes.
  const char* order[] = {"mhc.fn", "mhc.scale", "mhc.base", "mhc.norm_weight",
                         "swa.q_norm", "swa.kv_norm", "swa.wq_b", "swa.wq_b_scale"};
  for (int i = 0; i < 8; ++i) {
    EXPECT_EQ(h.tensors(i).name(), order[i]);
    EXPECT_EQ(h.tensors(i).offset() % 64, 0u);
    absl::StatusOr<std::string_view> b = PackedTensorBytes(full, order[i]);
    ASSERT_TRUE(b.ok()) << b.status();
    EXPECT_EQ(*b, fx.bytes[order[i]]) << order[i];
  }
  EXPECT_EQ(FindEntry(const_cast<v1::WeightSetHeader&>(h), "swa.wq_b")->dtype(), v1::DATA_TYPE_FP8_E4M3FN);

  EXPECT_FALSE((*sets)[1].first.has_swa());
  EXPECT_EQ((*sets)[1].first.tensors_size(), 3);

  // Both build on the CPU backend, and the backend receives exactly the file's bytes.
  RecordingBackend backend;
  absl::StatusOr<std::shared_ptr<const WeightSet>> built =
      BuildWeightSet(backend, full.first, full.second, "manifest:" + fx.manifest_path);
  ASSERT_TRUE(built.ok()) << built.status();
  for (const auto& [name, b] : backend.mhc_bytes) EXPECT_EQ(b, fx.bytes[name]) << name;
  for (const auto& [name, b] : backend.swa_bytes) EXPECT_EQ(b, fx.bytes[name]) << name;
  ASSERT_TRUE(backend.swa_params.has_value());
  EXPECT_EQ(backend.swa_params->scale_format, ScaleFormat::kUe8m0);
  EXPECT_EQ(backend.swa_params->scale_layout, ScaleLayout::kColumnMajorTma);
  EXPECT_EQ(backend.swa_params->wq_b_rows, kRows);
  EXPECT_EQ(backend.mhc_params->sinkhorn_iters, 10);
  EXPECT_EQ(backend.mhc_params->post_scale, 2.0f);
  EXPECT_EQ((*built)->source, "manifest:" + fx.manifest_path);
  auto cpu = Cpu();
  EXPECT_TRUE(BuildWeightSet(*cpu, (*sets)[1].first, (*sets)[1].second, "manifest").ok());
}

struct ManifestErrorCase {
  const char* what;
  std::string manifest;
  absl::StatusCode code;
  const char* message;
};

TEST(ManifestTest, ErrorsGiveDocumentedStatus) {
  auto rng = MakeRng(7);
  ManifestFixture fx;
  ASSERT_NO_FATAL_FAILURE(WriteFixture(rng, fx));
  const std::string fn = R"("mhc.fn": {"file": "layer3.safetensors", "tensor": "layers.3.hc_ffn_fn"})";
  auto set = [&](const std::string& body) { return absl::StrCat(R"({"weight_sets": [)", body, "]}"); };
  auto one = [&](const std::string& mhc, const std::string& tensors) {
    return set(absl::StrCat(R"({"name": "s", "mhc": )", mhc, R"(, "tensors": {)", tensors, "}}"));
  };
  const std::string mhc = R"({"hc_mult": 4, "hidden": 256})";
  const auto E = absl::StatusCode::kInvalidArgument;
  const std::vector<ManifestErrorCase> cases = {
      {"not JSON", "{", E, "malformed JSON"},
      {"top-level typo", R"({"weight_set": []})", E, "weight_set"},
      {"no weight_sets", R"({})", E, "weight_sets"},
      {"set typo", set(R"({"name": "s", "mhcc": {}, "tensors": {}})"), E, "mhcc"},
      {"set without name", set(R"({"tensors": {}})"), E, "name"},
      {"mhc typo", one(R"({"hc_mult": 4, "hidden": 256, "norm_esp": 1e-6})", fn), E, "norm_esp"},
      {"swa typo", set(R"({"name": "s", "swa": {"q_rank": 256, "head_dim": 128, "scale_fmt": "fp32"}, "tensors": {}})"), E, "scale_fmt"},
      {"missing hidden", one(R"({"hc_mult": 4})", fn), E, "hidden"},
      {"float hc_mult", one(R"({"hc_mult": 4.0, "hidden": 256})", fn), E, "hc_mult"},
      {"string hidden", one(R"({"hc_mult": 4, "hidden": "256"})", fn), E, "hidden"},
      {"eps overflows float", one(R"({"hc_mult": 4, "hidden": 256, "norm_eps": 1e50})", fn), E, "norm_eps"},
      {"eps flushes to zero", one(R"({"hc_mult": 4, "hidden": 256, "norm_eps": 1e-60})", fn), E, "norm_eps"},
      // The serving bound (weight_set.h kMaxSinkhornIters): 2^31 - 1 iterations would stall the executor.
      {"sinkhorn_iters huge", one(R"({"hc_mult": 4, "hidden": 256, "sinkhorn_iters": 2147483647})", fn), E, "sinkhorn_iters"},
      {"bad fp8_format", set(R"({"name": "s", "swa": {"q_rank": 256, "head_dim": 128, "fp8_format": "e5m2"}, "tensors": {}})"), E, "e5m2"},
      {"bad scale_layout", set(R"({"name": "s", "swa": {"q_rank": 256, "head_dim": 128, "scale_layout": "col"}, "tensors": {}})"), E, "col"},
      {"tensor ref typo", one(mhc, R"("mhc.fn": {"fille": "layer3.safetensors", "tensor": "x"})"), E, "fille"},
      {"tensor ref not object", one(mhc, R"("mhc.fn": "layer3.safetensors")"), E, "mhc.fn"},
      {"duplicate key", one(mhc, fn + ", " + fn), E, "duplicate"},
      {"duplicate set", set(absl::StrCat(R"({"name": "s", "mhc": )", mhc, R"(, "tensors": {}}, {"name": "s", "mhc": )", mhc, R"(, "tensors": {}})")), E, "twice"},
      {"missing file", one(mhc, R"("mhc.fn": {"file": "nope.safetensors", "tensor": "x"})"), absl::StatusCode::kNotFound, "nope.safetensors"},
      {"missing tensor", one(mhc, R"("mhc.fn": {"file": "layer3.safetensors", "tensor": "layers.9.x"})"), absl::StatusCode::kNotFound, "layers.9.x"},
      {"unsupported dtype", one(mhc, R"("mhc.fn": {"file": "layer3.safetensors", "tensor": "layers.3.unrelated"})"), E, "I16"},
  };
  for (const ManifestErrorCase& c : cases) {
    absl::StatusOr<std::vector<PackedWeightSet>> r = LoadManifestFromString(c.manifest, fx.dir.path(), "m.json");
    EXPECT_EQ(r.status().code(), c.code) << c.what << ": " << r.status();
    EXPECT_THAT(r.status().message(), HasSubstr(c.message)) << c.what;
    EXPECT_THAT(r.status().message(), HasSubstr("m.json")) << c.what;
  }
  EXPECT_EQ(LoadManifest(fx.dir.Path("absent.json")).status().code(), absl::StatusCode::kNotFound);
  // A manifest pointing at a truncated file reports the file's DATA_LOSS.
  const std::string full = ReadFile(fx.dir.Path("layer3.safetensors"));
  WriteFile(fx.dir.Path("layer3.safetensors"), full.substr(0, full.size() - 10));
  absl::StatusOr<std::vector<PackedWeightSet>> r = LoadManifest(fx.manifest_path);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDataLoss) << r.status();
  EXPECT_THAT(r.status().message(), HasSubstr("layer3.safetensors"));
}

// ManifestReader reads one set at a time: a set whose file is gone does not stop the sets before
// it, and reading set i gives the bytes LoadManifest gives for set i.
TEST(ManifestTest, ReaderLoadsOneSetAtATime) {
  auto rng = MakeRng(61);
  ManifestFixture fx;
  WriteFixture(rng, fx);
  absl::StatusOr<std::vector<PackedWeightSet>> all = LoadManifest(fx.manifest_path);
  ASSERT_TRUE(all.ok()) << all.status();
  // Set 0 reads attn/layer3_attn.safetensors, set 1 does not: without that file only set 0 fails.
  stdfs::remove(fx.dir.Path("attn/layer3_attn.safetensors"));
  absl::StatusOr<ManifestReader> reader = ManifestReader::Open(fx.manifest_path);
  ASSERT_TRUE(reader.ok()) << reader.status();
  ASSERT_EQ(reader->size(), 2u);
  EXPECT_EQ(reader->name(0), "v41/L3/ffn");
  EXPECT_EQ(reader->name(1), "v41/L3/mhc-only");
  absl::StatusOr<PackedWeightSet> second = reader->Load(1);
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(second->second, (*all)[1].second);
  EXPECT_EQ(second->first.SerializeAsString(), (*all)[1].first.SerializeAsString());
  absl::StatusOr<PackedWeightSet> first = reader->Load(0);
  EXPECT_EQ(first.status().code(), absl::StatusCode::kNotFound) << first.status();
  EXPECT_THAT(first.status().message(), HasSubstr("layer3_attn.safetensors"));
  EXPECT_THAT(first.status().message(), HasSubstr("v41/L3/ffn"));
  // The outline is checked at Open: a duplicate name fails before any tensor is read.
  absl::StatusOr<ManifestReader> dup = ManifestReader::FromString(
      R"({"weight_sets": [{"name": "a", "tensors": {}}, {"name": "a", "tensors": {}}]})", fx.dir.path(), "d.json");
  EXPECT_EQ(dup.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(dup.status().message(), HasSubstr("\"a\" is defined twice"));
}

// Checkpoint dtypes that convert exactly (dtype_conversion.h): F16 / BF16 / F8_E8M0 to the F32
// tensors, F32 / F16 holding bf16 values to the BF16 tensors. Expected values come from the
// compiler's _Float16 and from ldexp, not from the converter.
TEST(ManifestTest, ConvertsCheckpointDTypesExactly) {
  auto rng = MakeRng(61);
  TempDir dir;
  std::vector<_Float16> fn16(kM * kK);
  std::vector<float> fn32(fn16.size());
  for (size_t i = 0; i < fn16.size(); ++i) {
    float v = RandomValue(rng, 0.05f);
    if (i % 97 == 0) v = (i % 2 ? 60000.0f : -3.0e-6f);  // outliers: near F16 max, and F16 subnormals
    fn16[i] = static_cast<_Float16>(v);
    fn32[i] = static_cast<float>(fn16[i]);
  }
  std::vector<uint16_t> scale_bf16(3);
  std::vector<float> scale32(3);
  for (int i = 0; i < 3; ++i) {
    scale_bf16[i] = FloatToBf16(fusedlayer::testing::RandomFloat(rng, 1, 0.5f, 2.0f)[0]);
    uint32_t bits = uint32_t(scale_bf16[i]) << 16;
    std::memcpy(&scale32[i], &bits, 4);
  }
  // UE8M0 block scales, the whole exponent range but NaN (0xFF), both ends included.
  std::vector<uint8_t> e8(kRows / 128 * kQ / 128);
  std::vector<float> e8_32(e8.size());
  std::uniform_int_distribution<int> ue(0, 254);
  for (size_t i = 0; i < e8.size(); ++i) {
    e8[i] = static_cast<uint8_t>(i == 0 ? 0 : i == 1 ? 254 : ue(rng));
    e8_32[i] = static_cast<float>(std::ldexp(1.0, int(e8[i]) - 127));
  }
  // Norm weights: F32 and F16 tensors whose values are bf16 values.
  std::vector<float> qn32(kQ);
  std::vector<uint16_t> qn_bf16(kQ);
  for (int64_t i = 0; i < kQ; ++i) {
    qn_bf16[i] = FloatToBf16(fusedlayer::testing::RandomFloat(rng, 1, 0.5f, 1.5f)[0]);
    uint32_t bits = uint32_t(qn_bf16[i]) << 16;
    std::memcpy(&qn32[i], &bits, 4);
  }
  std::vector<_Float16> kn16(kD);
  std::vector<uint16_t> kn_bf16(kD);
  std::uniform_int_distribution<int> small(-255, 255);
  for (int64_t i = 0; i < kD; ++i) {
    int k;
    do k = small(rng); while (k == 0);
    const float v = std::ldexp(static_cast<float>(k), -int(i % 20));  // 8 significant bits at most
    kn16[i] = static_cast<_Float16>(v);
    kn_bf16[i] = FloatToBf16(v);
  }
  const std::string base = RandomF32Bytes(rng, kM, 0.1f);
  const std::string wq_b = RandomFp8Bytes(rng, kRows * kQ, Fp8Format::kE4M3FN);
  ASSERT_TRUE(WriteSafetensors(dir.Path("ckpt.safetensors"),
                               {{"fn", "F16", {kM, kK}, AsBytes(fn16)},
                                {"scale", "BF16", {3}, AsBytes(scale_bf16)},
                                {"base", "F32", {kM}, base},
                                {"q_norm", "F32", {kQ}, AsBytes(qn32)},
                                {"kv_norm", "F16", {kD}, AsBytes(kn16)},
                                {"wq_b", "F8_E4M3", {kRows, kQ}, wq_b},
                                {"wq_b_scale", "F8_E8M0", {kRows / 128, kQ / 128}, AsBytes(e8)},
                                {"bad_norm", "F32", {kQ}, AsBytes(std::vector<float>(kQ, 1.0f + 0x1p-10f))},
                                {"nan_scale", "F8_E8M0", {kRows / 128, kQ / 128}, std::string(e8.size(), '\xff')}})
                  .ok());
  auto manifest = [&](const std::string& q_norm, const std::string& wq_b_scale) {
    return absl::StrCat(R"({"weight_sets": [{"name": "ckpt",
      "mhc": {"hc_mult": 4, "hidden": 256},
      "swa": {"q_rank": 256, "head_dim": 128, "scale_format": "ue8m0"},
      "tensors": {
        "mhc.fn": {"file": "ckpt.safetensors", "tensor": "fn"},
        "mhc.scale": {"file": "ckpt.safetensors", "tensor": "scale"},
        "mhc.base": {"file": "ckpt.safetensors", "tensor": "base"},
        "swa.q_norm": {"file": "ckpt.safetensors", "tensor": ")", q_norm, R"("},
        "swa.kv_norm": {"file": "ckpt.safetensors", "tensor": "kv_norm"},
        "swa.wq_b": {"file": "ckpt.safetensors", "tensor": "wq_b"},
        "swa.wq_b_scale": {"file": "ckpt.safetensors", "tensor": ")", wq_b_scale, R"("}}}]})");
  };
  absl::StatusOr<std::vector<PackedWeightSet>> sets =
      LoadManifestFromString(manifest("q_norm", "wq_b_scale"), dir.path(), "m.json");
  ASSERT_TRUE(sets.ok()) << sets.status();
  const PackedWeightSet& set = (*sets)[0];
  const std::map<std::string, std::string> expect = {
      {"mhc.fn", AsBytes(fn32)},       {"mhc.scale", AsBytes(scale32)}, {"mhc.base", base},
      {"swa.q_norm", AsBytes(qn_bf16)}, {"swa.kv_norm", AsBytes(kn_bf16)}, {"swa.wq_b", wq_b},
      {"swa.wq_b_scale", AsBytes(e8_32)}};
  for (const auto& [name, bytes] : expect) {
    absl::StatusOr<std::string_view> b = PackedTensorBytes(set, name);
    ASSERT_TRUE(b.ok()) << name << ": " << b.status();
    EXPECT_EQ(*b, bytes) << name;
  }
  const v1::WeightSetHeader& h = set.first;
  EXPECT_EQ(FindEntry(const_cast<v1::WeightSetHeader&>(h), "mhc.fn")->dtype(), v1::DATA_TYPE_FP32);
  EXPECT_EQ(FindEntry(const_cast<v1::WeightSetHeader&>(h), "swa.wq_b_scale")->dtype(), v1::DATA_TYPE_FP32);
  EXPECT_EQ(FindEntry(const_cast<v1::WeightSetHeader&>(h), "swa.kv_norm")->dtype(), v1::DATA_TYPE_BF16);
  EXPECT_EQ(h.sha256(), *Sha256Hex(set.second));
  RecordingBackend backend;
  EXPECT_TRUE(BuildWeightSet(backend, set.first, set.second, "manifest:m.json").ok());

  // What does not convert exactly is INVALID_ARGUMENT naming the tensor and the element.
  struct Case {
    const char* what;
    std::string q_norm, wq_b_scale, message;
  } cases[] = {
      {"F32 value that bf16 cannot hold", "bad_norm", "wq_b_scale", "element 0"},
      {"UE8M0 NaN", "q_norm", "nan_scale", "NaN"},
      {"UE8M0 into a bf16 tensor", "wq_b_scale", "wq_b_scale", "cannot be converted to bf16"},
      {"fp8 into a bf16 tensor", "wq_b", "wq_b_scale", "cannot be converted to bf16"},
  };
  for (const Case& c : cases) {
    absl::StatusOr<std::vector<PackedWeightSet>> r =
        LoadManifestFromString(manifest(c.q_norm, c.wq_b_scale), dir.path(), "m.json");
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << c.what << ": " << r.status();
    EXPECT_THAT(r.status().message(), HasSubstr(c.message)) << c.what;
    EXPECT_THAT(r.status().message(), HasSubstr("m.json")) << c.what;
  }
}

// A manifest with wrong shapes for its hyper-parameters loads (it only packs) and is rejected by
// BuildWeightSet naming the tensor.
TEST(ManifestTest, WrongShapeForHyperParamsRejectedAtBuild) {
  auto rng = MakeRng(8);
  ManifestFixture fx;
  ASSERT_NO_FATAL_FAILURE(WriteFixture(rng, fx));
  const std::string manifest = R"({"weight_sets": [{"name": "s", "mhc": {"hc_mult": 4, "hidden": 512}, "tensors": {
      "mhc.fn": {"file": "layer3.safetensors", "tensor": "layers.3.hc_ffn_fn"},
      "mhc.scale": {"file": "layer3.safetensors", "tensor": "layers.3.hc_ffn_scale"},
      "mhc.base": {"file": "layer3.safetensors", "tensor": "layers.3.hc_ffn_base"}}}]})";
  absl::StatusOr<std::vector<PackedWeightSet>> sets = LoadManifestFromString(manifest, fx.dir.path(), "m");
  ASSERT_TRUE(sets.ok()) << sets.status();
  auto cpu = Cpu();
  absl::StatusOr<std::shared_ptr<const WeightSet>> b = BuildWeightSet(*cpu, (*sets)[0].first, (*sets)[0].second, "m");
  EXPECT_EQ(b.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(b.status().message(), HasSubstr("mhc.fn"));
  EXPECT_THAT(b.status().message(), HasSubstr("fp32[24, 2048]"));
}

// ---- weight sets ---------------------------------------------------------------------------------

TEST(WeightSetTest, SmallSetBuildsWithExactBytesAndDefaults) {
  auto rng = MakeRng(9);
  PackedWeightSet set = MakeSmallSet(rng, "small/a");
  RecordingBackend backend;
  absl::StatusOr<std::shared_ptr<const WeightSet>> b = BuildWeightSet(backend, set.first, set.second, "rpc");
  ASSERT_TRUE(b.ok()) << b.status();
  const WeightSet& ws = **b;
  EXPECT_EQ(ws.name, "small/a");
  EXPECT_EQ(ws.source, "rpc");
  EXPECT_EQ(ws.sha256, *Sha256Hex(set.second));
  ASSERT_NE(ws.on(0).mhc, nullptr);
  ASSERT_NE(ws.on(0).swa, nullptr);
  EXPECT_EQ(ws.resident_bytes, ws.on(0).mhc->resident_bytes() + ws.on(0).swa->resident_bytes());
  EXPECT_GE(ws.resident_bytes, size_t(kM * kK * 4));
  for (const auto& [name, bytes] : backend.mhc_bytes) EXPECT_EQ(bytes, *PackedTensorBytes(set, name)) << name;
  for (const auto& [name, bytes] : backend.swa_bytes) EXPECT_EQ(bytes, *PackedTensorBytes(set, name)) << name;
  // Absent optional fields take the defaults of MhcHyperParams / SwaHyperParams.
  const MhcHyperParams def;
  EXPECT_EQ(backend.mhc_params->hc_norm_eps, def.hc_norm_eps);
  EXPECT_EQ(backend.mhc_params->norm_eps, def.norm_eps);
  EXPECT_EQ(backend.mhc_params->post_scale, def.post_scale);
  EXPECT_EQ(backend.mhc_params->sinkhorn_iters, def.sinkhorn_iters);
  EXPECT_EQ(backend.swa_params->eps, SwaHyperParams{}.eps);
  EXPECT_EQ(backend.swa_params->wq_b_rows, kRows);
  // The stored header carries the effective values.
  EXPECT_TRUE(ws.header.mhc().has_norm_eps());
  EXPECT_EQ(ws.header.mhc().sinkhorn_iters(), def.sinkhorn_iters);
  EXPECT_EQ(ws.header.swa().eps(), SwaHyperParams{}.eps);
  EXPECT_EQ(ws.header.sha256(), ws.sha256);

  v1::WeightSetInfo info = ToInfo(ws, backend);
  EXPECT_EQ(info.name(), "small/a");
  EXPECT_TRUE(info.has_mhc());
  EXPECT_TRUE(info.has_swa());
  EXPECT_TRUE(info.has_norm_weight());
  EXPECT_EQ(info.wq_b_rows(), kRows);
  EXPECT_EQ(info.resident_bytes(), ws.resident_bytes);
  EXPECT_EQ(info.sha256(), ws.sha256);
  EXPECT_EQ(info.source(), "rpc");
  ASSERT_EQ(info.capabilities_size(), 2);
  EXPECT_EQ(info.capabilities(0).op(), "mhc");
  EXPECT_EQ(info.capabilities(1).op(), "swa");
}

TEST(WeightSetTest, OptionalPartsAndTensors) {
  auto rng = MakeRng(10);
  auto cpu = Cpu();
  {  // mhc only, no norm weight
    PackedWeightSet s = MakeSmallSet(rng, "m", {.swa = false, .norm_weight = false});
    absl::StatusOr<std::shared_ptr<const WeightSet>> b = BuildWeightSet(*cpu, s.first, s.second, "rpc");
    ASSERT_TRUE(b.ok()) << b.status();
    EXPECT_EQ((*b)->on(0).swa, nullptr);
    EXPECT_FALSE((*b)->on(0).mhc->has_norm_weight());
    v1::WeightSetInfo info = ToInfo(**b, *cpu);
    EXPECT_FALSE(info.has_swa());
    EXPECT_FALSE(info.has_norm_weight());
    ASSERT_EQ(info.capabilities_size(), 1);
  }
  {  // swa only, no wq_b, fnuz
    PackedWeightSet s = MakeSmallSet(rng, "s", {.mhc = false, .wq_b = false, .fmt = Fp8Format::kE4M3FNUZ});
    absl::StatusOr<std::shared_ptr<const WeightSet>> b = BuildWeightSet(*cpu, s.first, s.second, "rpc");
    ASSERT_TRUE(b.ok()) << b.status();
    EXPECT_EQ((*b)->on(0).mhc, nullptr);
    EXPECT_EQ((*b)->on(0).swa->params().wq_b_rows, 0);
    EXPECT_EQ((*b)->on(0).swa->params().fp8_format, Fp8Format::kE4M3FNUZ);
    EXPECT_EQ(ToInfo(**b, *cpu).wq_b_rows(), 0);
  }
  {  // swa with fnuz wq_b
    PackedWeightSet s = MakeSmallSet(rng, "s2", {.mhc = false, .fmt = Fp8Format::kE4M3FNUZ});
    EXPECT_TRUE(BuildWeightSet(*cpu, s.first, s.second, "rpc").ok());
  }
}

// Tensors at offsets that are not multiples of their element size reach the backend aligned and
// byte-exact.
TEST(WeightSetTest, MisalignedOffsetsAreStaged) {
  auto rng = MakeRng(11);
  PackedWeightSet s = MakeSmallSet(rng, "mis");
  // Shift every tensor by 1..3 bytes: rebuild the payload with odd gaps.
  std::string payload;
  v1::WeightSetHeader h = s.first;
  for (v1::TensorEntry& e : *h.mutable_tensors()) {
    const std::string bytes(*PackedTensorBytes(s, e.name()));
    payload.append(1 + payload.size() % 3, '\x5a');
    if ((payload.size() % 2) == 0) payload.push_back('\x5a');  // odd offset: misaligned for every dtype > 1 byte
    e.set_offset(payload.size());
    payload += bytes;
  }
  h.set_payload_bytes(payload.size());
  h.set_sha256(*Sha256Hex(payload));
  RecordingBackend backend;
  absl::StatusOr<std::shared_ptr<const WeightSet>> b = BuildWeightSet(backend, h, payload, "rpc");
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_TRUE(backend.aligned);
  for (const auto& [name, bytes] : backend.mhc_bytes) EXPECT_EQ(bytes, *PackedTensorBytes(s, name)) << name;
  for (const auto& [name, bytes] : backend.swa_bytes) EXPECT_EQ(bytes, *PackedTensorBytes(s, name)) << name;
}

struct BuildErrorCase {
  const char* what;
  std::function<void(PackedWeightSet&)> mutate;
  absl::StatusCode code;
  const char* message;
};

TEST(WeightSetTest, ValidationErrorsGiveDocumentedStatus) {
  const auto E = absl::StatusCode::kInvalidArgument;
  const auto L = absl::StatusCode::kDataLoss;
  auto reshape = [](const char* name, std::vector<int64_t> shape) {
    return [=](PackedWeightSet& s) {
      v1::TensorEntry* e = FindEntry(s.first, name);
      e->clear_shape();
      for (int64_t d : shape) e->add_shape(d);
    };
  };
  auto retype = [](const char* name, v1::DataType t) {
    return [=](PackedWeightSet& s) { FindEntry(s.first, name)->set_dtype(t); };
  };
  auto remove = [](const char* name) { return [=](PackedWeightSet& s) { RemoveEntry(s.first, name); }; };
  const std::vector<BuildErrorCase> cases = {
      {"empty name", [](PackedWeightSet& s) { s.first.set_name(""); }, E, "name"},
      {"name with space", [](PackedWeightSet& s) { s.first.set_name("a b"); }, E, "[A-Za-z0-9._/-]"},
      {"name too long", [](PackedWeightSet& s) { s.first.set_name(std::string(129, 'a')); }, E, "name"},
      {"no parts", [](PackedWeightSet& s) { s.first.clear_mhc(); s.first.clear_swa(); }, E, "neither"},
      {"hc_mult 9", [](PackedWeightSet& s) { s.first.mutable_mhc()->set_hc_mult(9); }, E, "hc_mult"},
      {"hidden 0", [](PackedWeightSet& s) { s.first.mutable_mhc()->set_hidden(0); }, E, "hidden"},
      {"hidden huge", [](PackedWeightSet& s) { s.first.mutable_mhc()->set_hidden(int64_t{1} << 60); }, E, "hidden"},
      {"negative eps", [](PackedWeightSet& s) { s.first.mutable_mhc()->set_norm_eps(-1); }, E, "eps"},
      {"sinkhorn_iters 0", [](PackedWeightSet& s) { s.first.mutable_mhc()->set_sinkhorn_iters(0); }, E, "sinkhorn_iters"},
      // Serving bounds (weight_set.h): every loop count bounded, every float finite and in range,
      // and the message names the field.
      {"sinkhorn_iters 2^31-1", [](PackedWeightSet& s) { s.first.mutable_mhc()->set_sinkhorn_iters(INT32_MAX); }, E, "sinkhorn_iters = 2147483647"},
      {"sinkhorn_iters 1001", [](PackedWeightSet& s) { s.first.mutable_mhc()->set_sinkhorn_iters(1001); }, E, "sinkhorn_iters = 1001"},
      {"hc_norm_eps nan", [](PackedWeightSet& s) { s.first.mutable_mhc()->set_hc_norm_eps(std::nanf("")); }, E, "hc_norm_eps"},
      {"norm_eps inf", [](PackedWeightSet& s) { s.first.mutable_mhc()->set_norm_eps(INFINITY); }, E, "norm_eps"},
      {"hc_pre_eps 2", [](PackedWeightSet& s) { s.first.mutable_mhc()->set_hc_pre_eps(2.0f); }, E, "hc_pre_eps"},
      {"sinkhorn_eps -inf", [](PackedWeightSet& s) { s.first.mutable_mhc()->set_sinkhorn_eps(-INFINITY); }, E, "sinkhorn_eps"},
      {"post_scale nan", [](PackedWeightSet& s) { s.first.mutable_mhc()->set_post_scale(std::nanf("")); }, E, "post_scale"},
      {"post_scale inf", [](PackedWeightSet& s) { s.first.mutable_mhc()->set_post_scale(INFINITY); }, E, "post_scale"},
      {"post_scale 0", [](PackedWeightSet& s) { s.first.mutable_mhc()->set_post_scale(0.0f); }, E, "post_scale"},
      {"post_scale 1e4", [](PackedWeightSet& s) { s.first.mutable_mhc()->set_post_scale(1e4f); }, E, "post_scale"},
      {"swa eps nan", [](PackedWeightSet& s) { s.first.mutable_swa()->set_eps(std::nanf("")); }, E, "swa: eps"},
      {"swa eps 10", [](PackedWeightSet& s) { s.first.mutable_swa()->set_eps(10.0f); }, E, "swa: eps"},
      {"q_rank not /128", [](PackedWeightSet& s) { s.first.mutable_swa()->set_q_rank(200); }, E, "q_rank"},
      {"head_dim 0", [](PackedWeightSet& s) { s.first.mutable_swa()->set_head_dim(0); }, E, "head_dim"},
      {"unknown fp8 enum", [](PackedWeightSet& s) { s.first.mutable_swa()->set_fp8_format(static_cast<v1::Fp8Format>(7)); }, E, "fp8_format"},
      {"fn wrong dtype", retype("mhc.fn", v1::DATA_TYPE_BF16), E, "mhc.fn"},
      {"fn wrong shape", reshape("mhc.fn", {kM, kK / 2}), E, "mhc.fn"},
      {"fn transposed", reshape("mhc.fn", {kK, kM}), E, "fp32[24, 1024]"},
      {"scale wrong shape", reshape("mhc.scale", {2}), E, "mhc.scale"},
      {"base wrong shape", reshape("mhc.base", {kM - 1}), E, "mhc.base"},
      {"norm weight fp32", retype("mhc.norm_weight", v1::DATA_TYPE_FP32), E, "mhc.norm_weight"},
      {"q_norm wrong shape", reshape("swa.q_norm", {kQ / 2}), E, "swa.q_norm"},
      {"kv_norm wrong dtype", retype("swa.kv_norm", v1::DATA_TYPE_FP32), E, "swa.kv_norm"},
      {"wq_b other fp8 format", retype("swa.wq_b", v1::DATA_TYPE_FP8_E4M3FNUZ), E, "swa.wq_b"},
      {"wq_b N not /128", reshape("swa.wq_b", {100, kQ}), E, "wq_b"},
      {"wq_b 1-D", reshape("swa.wq_b", {kRows * kQ}), E, "swa.wq_b"},
      {"wq_b_scale wrong shape", reshape("swa.wq_b_scale", {kQ / 128, kRows / 128 + 1}), E, "swa.wq_b_scale"},
      {"unspecified dtype", retype("mhc.base", v1::DATA_TYPE_UNSPECIFIED), E, "mhc.base"},
      {"rank 5", reshape("mhc.base", {1, 1, 1, 1, kM}), E, "rank"},
      {"negative dim", reshape("mhc.base", {-kM}), E, "negative"},
      {"missing fn", remove("mhc.fn"), E, "missing tensor mhc.fn"},
      {"missing scale", remove("mhc.scale"), E, "missing tensor mhc.scale"},
      {"missing base", remove("mhc.base"), E, "missing tensor mhc.base"},
      {"missing q_norm", remove("swa.q_norm"), E, "missing tensor swa.q_norm"},
      {"missing kv_norm", remove("swa.kv_norm"), E, "missing tensor swa.kv_norm"},
      {"missing wq_b_scale", remove("swa.wq_b_scale"), E, "missing tensor swa.wq_b_scale"},
      {"wq_b_scale without wq_b", remove("swa.wq_b"), E, "without swa.wq_b"},
      {"unknown tensor", [](PackedWeightSet& s) { FindEntry(s.first, "mhc.base")->set_name("mhc.bias"); }, E, "unknown tensor \"mhc.bias\""},
      {"duplicate tensor", [](PackedWeightSet& s) { *s.first.add_tensors() = *FindEntry(s.first, "mhc.scale"); }, E, "twice"},
      {"swa tensor without swa part", [](PackedWeightSet& s) { s.first.clear_swa(); }, E, "no swa part"},
      {"mhc tensor without mhc part", [](PackedWeightSet& s) { s.first.clear_mhc(); }, E, "no mhc part"},
      {"offset past payload", [](PackedWeightSet& s) { FindEntry(s.first, "swa.kv_norm")->set_offset(s.second.size()); }, E, "outside"},
      {"offset overflow", [](PackedWeightSet& s) { FindEntry(s.first, "swa.kv_norm")->set_offset(~uint64_t{0} - 8); }, E, "outside"},
      {"overlap", [](PackedWeightSet& s) { FindEntry(s.first, "mhc.scale")->set_offset(FindEntry(s.first, "mhc.fn")->offset() + 4); }, E, "overlap"},
      {"payload short", [](PackedWeightSet& s) { s.second.pop_back(); s.first.set_sha256(""); }, L, "payload"},
      {"payload long", [](PackedWeightSet& s) { s.second.push_back('x'); s.first.set_sha256(""); }, L, "payload"},
      {"bad checksum", [](PackedWeightSet& s) { s.second[s.second.size() / 2] ^= 1; }, L, "SHA-256"},
      {"malformed checksum", [](PackedWeightSet& s) { s.first.set_sha256("xyz"); }, E, "sha256"},
  };
  auto rng = MakeRng(12);
  auto cpu = Cpu();
  const PackedWeightSet base = MakeSmallSet(rng, "base");
  ASSERT_TRUE(BuildWeightSet(*cpu, base.first, base.second, "rpc").ok());
  for (const BuildErrorCase& c : cases) {
    PackedWeightSet s = base;
    c.mutate(s);
    absl::StatusOr<std::shared_ptr<const WeightSet>> b = BuildWeightSet(*cpu, s.first, s.second, "rpc");
    EXPECT_EQ(b.status().code(), c.code) << c.what << ": " << b.status();
    EXPECT_THAT(b.status().message(), HasSubstr(c.message)) << c.what;
  }
  // The bounds themselves are accepted.
  PackedWeightSet edge = base;
  edge.first.mutable_mhc()->set_sinkhorn_iters(kMaxSinkhornIters);
  edge.first.mutable_mhc()->set_post_scale(kMaxPostScale);
  edge.first.mutable_mhc()->set_norm_eps(kMaxEps);
  edge.first.mutable_mhc()->set_sinkhorn_eps(0.0f);
  edge.first.mutable_swa()->set_eps(kMaxEps);
  EXPECT_TRUE(BuildWeightSet(*cpu, edge.first, edge.second, "rpc").ok());
  // An upper-case checksum is the same digest.
  PackedWeightSet s = base;
  s.first.set_sha256(absl::AsciiStrToUpper(s.first.sha256()));
  EXPECT_TRUE(BuildWeightSet(*cpu, s.first, s.second, "rpc").ok());
  // No checksum: accepted, and the set reports the computed one.
  s.first.clear_sha256();
  absl::StatusOr<std::shared_ptr<const WeightSet>> b = BuildWeightSet(*cpu, s.first, s.second, "rpc");
  ASSERT_TRUE(b.ok());
  EXPECT_EQ((*b)->sha256, base.first.sha256());
}

TEST(WeightSetTest, NameRule) {
  EXPECT_TRUE(IsValidWeightSetName("v41-flash/L3/ffn"));
  EXPECT_TRUE(IsValidWeightSetName("a"));
  EXPECT_TRUE(IsValidWeightSetName(std::string(128, 'z')));
  EXPECT_TRUE(IsValidWeightSetName("A.b_c-9/x"));
  EXPECT_FALSE(IsValidWeightSetName(""));
  EXPECT_FALSE(IsValidWeightSetName(std::string(129, 'z')));
  for (const char* bad : {"a b", "a:b", "a\\b", "ä", "a\nb", "a*"}) EXPECT_FALSE(IsValidWeightSetName(bad)) << bad;
  EXPECT_FALSE(IsValidWeightSetName(std::string("a\0b", 3)));
}

// ---- demo sets -----------------------------------------------------------------------------------

TEST(DemoWeightsTest, BuildOnCpuWithFusedAvailable) {
  absl::StatusOr<std::vector<PackedWeightSet>> demo = MakeDemoWeightSets(kDefaultDemoSeed);
  ASSERT_TRUE(demo.ok()) << demo.status();
  ASSERT_EQ(demo->size(), 2u);
  auto cpu = Cpu();
  std::map<std::string, v1::WeightSetInfo> infos;
  for (const PackedWeightSet& s : *demo) {
    absl::StatusOr<std::shared_ptr<const WeightSet>> b = BuildWeightSet(*cpu, s.first, s.second, "demo");
    ASSERT_TRUE(b.ok()) << s.first.name() << ": " << b.status();
    infos[s.first.name()] = ToInfo(**b, *cpu);
  }
  const v1::WeightSetInfo& flash = infos.at(kDemoFlashSetName);
  EXPECT_EQ(flash.mhc().hc_mult(), 4);
  EXPECT_EQ(flash.mhc().hidden(), 5120);
  EXPECT_EQ(flash.mhc().norm_eps(), 1e-20f);
  EXPECT_EQ(flash.swa().q_rank(), 1280);
  EXPECT_EQ(flash.swa().head_dim(), 512);
  EXPECT_EQ(flash.swa().scale_format(), v1::SCALE_FORMAT_FP32);
  EXPECT_EQ(flash.swa().scale_layout(), v1::SCALE_LAYOUT_ROW_MAJOR);
  EXPECT_EQ(flash.wq_b_rows(), 1024);
  EXPECT_FALSE(flash.wq_b_implementation().empty());
  EXPECT_TRUE(flash.has_norm_weight());
  const v1::WeightSetInfo& pro = infos.at(kDemoProSetName);
  EXPECT_EQ(pro.mhc().hidden(), 7168);
  EXPECT_EQ(pro.mhc().norm_eps(), 1e-6f);
  EXPECT_EQ(pro.swa().q_rank(), 1536);
  EXPECT_EQ(pro.swa().scale_format(), v1::SCALE_FORMAT_UE8M0);
  EXPECT_EQ(pro.swa().scale_layout(), v1::SCALE_LAYOUT_COLUMN_MAJOR_TMA);
  EXPECT_EQ(pro.wq_b_rows(), 0);
  EXPECT_EQ(pro.wq_b_implementation(), "");  // no wq_b, nothing to report
  for (const auto& [name, info] : infos) {
    EXPECT_EQ(info.source(), "demo");
    EXPECT_GT(info.resident_bytes(), 0u);
    ASSERT_EQ(info.capabilities_size(), 2) << name;
    for (const v1::OpCapability& c : info.capabilities()) {
      EXPECT_TRUE(c.fused_available()) << name << " " << c.op() << ": " << c.detail();
      EXPECT_EQ(c.reason(), v1::FALLBACK_REASON_NONE);
    }
  }
}

TEST(DemoWeightsTest, DeterministicAndSensible) {
  absl::StatusOr<std::vector<PackedWeightSet>> a = MakeDemoWeightSets(42), b = MakeDemoWeightSets(42),
                                               c = MakeDemoWeightSets(43);
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  for (size_t i = 0; i < a->size(); ++i) {
    EXPECT_EQ((*a)[i].second, (*b)[i].second);
    EXPECT_EQ((*a)[i].first.sha256(), *Sha256Hex((*a)[i].second));
    EXPECT_NE((*a)[i].first.sha256(), (*c)[i].first.sha256());
  }
  const PackedWeightSet& flash = (*a)[0];
  auto floats = [&](const PackedWeightSet& s, const char* name) {
    std::string_view b = *PackedTensorBytes(s, name);
    std::vector<float> v(b.size() / 4);
    std::memcpy(v.data(), b.data(), b.size());
    return v;
  };
  for (float x : floats(flash, "mhc.scale")) EXPECT_TRUE(x >= 0.5f && x <= 2.0f) << x;
  double ss = 0;
  const std::vector<float> fn = floats(flash, "mhc.fn");
  for (float x : fn) ss += double(x) * x;
  EXPECT_NEAR(std::sqrt(ss / fn.size()), 1.0 / std::sqrt(4.0 * 5120), 0.1 / std::sqrt(4.0 * 5120));
  for (const char* name : {"mhc.norm_weight", "swa.q_norm", "swa.kv_norm"}) {
    std::string_view b = *PackedTensorBytes(flash, name);
    for (size_t i = 0; i < b.size(); i += 2) {
      uint16_t v;
      std::memcpy(&v, b.data() + i, 2);
      const float f = Bf16ToFloat(v);
      ASSERT_TRUE(f >= 0.5f && f <= 1.5f) << name << " " << f;
    }
  }
  std::string_view wq_b = *PackedTensorBytes(flash, "swa.wq_b");
  int nonzero = 0;
  for (char ch : wq_b) {
    const uint8_t code = static_cast<uint8_t>(ch);
    ASSERT_NE(code & 0x7f, 0x7f) << "NaN code";
    nonzero += code != 0;
  }
  EXPECT_GT(nonzero, int(wq_b.size() * 9 / 10));
  for (float s : floats(flash, "swa.wq_b_scale")) {
    int e;
    EXPECT_EQ(std::frexp(s, &e), 0.5f) << s;  // a power of two
    EXPECT_GT(s, 0.0f);
  }
}

// ---- export --------------------------------------------------------------------------------------

TEST(ExportTest, DemoSetsRoundTripThroughManifest) {
  absl::StatusOr<std::vector<PackedWeightSet>> demo = MakeDemoWeightSets(7);
  ASSERT_TRUE(demo.ok());
  TempDir dir;
  absl::StatusOr<std::string> manifest = ExportWeightSets(dir.path(), *demo);
  ASSERT_TRUE(manifest.ok()) << manifest.status();
  absl::StatusOr<std::vector<PackedWeightSet>> loaded = LoadManifest(*manifest);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  ASSERT_EQ(loaded->size(), demo->size());
  for (size_t i = 0; i < demo->size(); ++i) {
    const PackedWeightSet& want = (*demo)[i];
    const PackedWeightSet& got = (*loaded)[i];
    EXPECT_EQ(got.first.name(), want.first.name());
    EXPECT_EQ(got.first.mhc().SerializeAsString(), want.first.mhc().SerializeAsString());
    EXPECT_EQ(got.first.swa().SerializeAsString(), want.first.swa().SerializeAsString());
    ASSERT_EQ(got.first.tensors_size(), want.first.tensors_size());
    for (const v1::TensorEntry& e : want.first.tensors()) {
      EXPECT_EQ(*PackedTensorBytes(got, e.name()), *PackedTensorBytes(want, e.name())) << e.name();
    }
    auto cpu = Cpu();
    EXPECT_TRUE(BuildWeightSet(*cpu, got.first, got.second, "manifest:" + *manifest).ok());
  }
}

// ---- store ---------------------------------------------------------------------------------------

class WeightStoreTest : public ::testing::Test {
 protected:
  std::shared_ptr<const WeightSet> Build(const std::string& name, SmallSet o = {}) {
    PackedWeightSet s = MakeSmallSet(rng_, name, o);
    absl::StatusOr<std::shared_ptr<const WeightSet>> b = BuildWeightSet(*cpu_, s.first, s.second, "rpc");
    EXPECT_TRUE(b.ok()) << b.status();
    return b.ok() ? *b : nullptr;
  }
  std::mt19937_64 rng_ = MakeRng(13);
  std::unique_ptr<Backend> cpu_ = Cpu();
};

TEST_F(WeightStoreTest, PublishGetListUnload) {
  WeightStore store;
  EXPECT_EQ(store.resident_bytes(), 0u);
  absl::StatusOr<std::shared_ptr<const WeightSet>> missing = store.Get("x");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(missing.status().message(), HasSubstr("none"));

  auto a = Build("b/a"), b = Build("a/b", {.swa = false});
  ASSERT_TRUE(a && b);
  absl::StatusOr<std::shared_ptr<const WeightSet>> prev = store.Publish(a, false);
  ASSERT_TRUE(prev.ok());
  EXPECT_EQ(*prev, nullptr);
  ASSERT_TRUE(store.Publish(b, false).ok());
  EXPECT_EQ(store.size(), 2u);
  EXPECT_EQ(store.resident_bytes(), a->resident_bytes + b->resident_bytes);
  EXPECT_EQ(store.Get("b/a").value(), a);
  std::vector<std::shared_ptr<const WeightSet>> list = store.List();
  ASSERT_EQ(list.size(), 2u);
  EXPECT_EQ(list[0]->name, "a/b");  // sorted by name
  EXPECT_EQ(list[1]->name, "b/a");

  missing = store.Get("nope");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(missing.status().message(), HasSubstr("a/b, b/a"));

  absl::StatusOr<uint64_t> freed = store.Unload("b/a");
  ASSERT_TRUE(freed.ok());
  EXPECT_EQ(*freed, a->resident_bytes);
  EXPECT_EQ(store.Get("b/a").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(store.Unload("b/a").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(store.resident_bytes(), b->resident_bytes);
  EXPECT_EQ(store.Publish(nullptr, true).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(WeightStoreTest, DuplicatePublishIsAlreadyExists) {
  WeightStore store;
  auto first = Build("dup"), second = Build("dup");
  ASSERT_TRUE(store.Publish(first, false).ok());
  absl::StatusOr<std::shared_ptr<const WeightSet>> r = store.Publish(second, false);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_THAT(r.status().message(), HasSubstr("dup"));
  EXPECT_EQ(store.Get("dup").value(), first);  // unchanged
  EXPECT_EQ(store.resident_bytes(), first->resident_bytes);
}

// A group publishes all its sets or none: one refused member (a loaded name without replace, a name
// twice, a null set) leaves every loaded set as it was, the members before it included.
TEST_F(WeightStoreTest, PublishGroupIsAllOrNothing) {
  WeightStore store;
  auto a1 = Build("g/a"), b1 = Build("g/b");
  ASSERT_TRUE(a1 && b1);
  ASSERT_TRUE(store.Publish(a1, false).ok());
  ASSERT_TRUE(store.Publish(b1, false).ok());
  const uint64_t resident = store.resident_bytes();
  auto a2 = Build("g/a", {.swa = false}), b2 = Build("g/b", {.swa = false}), c2 = Build("g/c");
  ASSERT_TRUE(a2 && b2 && c2);
  auto unchanged = [&] {
    EXPECT_EQ(store.Get("g/a").value(), a1);
    EXPECT_EQ(store.Get("g/b").value(), b1);
    EXPECT_EQ(store.Get("g/c").status().code(), absl::StatusCode::kNotFound);
    EXPECT_EQ(store.resident_bytes(), resident);
  };
  // g/b is loaded and its member does not replace: nothing of the group is published.
  auto r = store.PublishGroup({{a2, true}, {c2, false}, {b2, false}});
  EXPECT_EQ(r.status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_THAT(r.status().message(), HasSubstr("g/b"));
  unchanged();
  r = store.PublishGroup({{a2, true}, {a2, true}});
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  unchanged();
  r = store.PublishGroup({{c2, false}, {nullptr, true}});
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  unchanged();
  // All accepted: every member visible, the replaced sets handed back.
  r = store.PublishGroup({{a2, true}, {b2, true}, {c2, false}});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_THAT(*r, ::testing::UnorderedElementsAre(a1, b1));
  EXPECT_EQ(store.Get("g/a").value(), a2);
  EXPECT_EQ(store.Get("g/b").value(), b2);
  EXPECT_EQ(store.Get("g/c").value(), c2);
  EXPECT_EQ(store.resident_bytes(), a2->resident_bytes + b2->resident_bytes + c2->resident_bytes);
}

TEST_F(WeightStoreTest, ReplaceSwapsWhileOldReaderKeepsItsSet) {
  WeightStore store;
  auto old_set = Build("swap");
  auto new_set = Build("swap", {.swa = false});
  ASSERT_NE(old_set->sha256, new_set->sha256);
  ASSERT_TRUE(store.Publish(old_set, false).ok());

  // A request in flight holds the old set.
  std::shared_ptr<const WeightSet> reader = store.Get("swap").value();
  std::weak_ptr<const PreparedSwaWeights> old_swa = old_set->on(0).swa;
  old_set.reset();

  absl::StatusOr<std::shared_ptr<const WeightSet>> replaced = store.Publish(new_set, true);
  ASSERT_TRUE(replaced.ok());
  EXPECT_EQ(*replaced, reader);
  replaced->reset();
  EXPECT_EQ(store.Get("swap").value(), new_set);
  EXPECT_EQ(store.resident_bytes(), new_set->resident_bytes);
  // The reader still sees the complete old set, and its weights are alive...
  EXPECT_NE(reader->sha256, new_set->sha256);
  ASSERT_NE(reader->on(0).swa, nullptr);
  EXPECT_FALSE(old_swa.expired());
  // ...until the request lets go.
  reader.reset();
  EXPECT_TRUE(old_swa.expired());
}

TEST_F(WeightStoreTest, ConcurrentReadersSeeWholeSets) {
  WeightStore store;
  std::vector<std::shared_ptr<const WeightSet>> versions;
  for (int i = 0; i < 4; ++i) versions.push_back(Build("hot", {.mhc = i % 2 == 0, .swa = true}));
  std::set<std::string> digests;
  for (const auto& v : versions) digests.insert(v->sha256);
  ASSERT_TRUE(store.Publish(versions[0], false).ok());
  std::atomic<bool> stop{false};
  std::atomic<int> bad{0}, reads{0};
  std::vector<std::thread> readers;
  for (int t = 0; t < 3; ++t) {
    readers.emplace_back([&] {
      while (!stop.load()) {
        absl::StatusOr<std::shared_ptr<const WeightSet>> s = store.Get("hot");
        if (!s.ok() || (*s)->name != "hot" || !digests.count((*s)->sha256) || (*s)->on(0).swa == nullptr) ++bad;
        ++reads;
      }
    });
  }
  for (int round = 0; round < 400; ++round) ASSERT_TRUE(store.Publish(versions[round % 4], true).ok());
  // Let the readers overlap with the publishes at least a little before stopping (no timing
  // assertion: only that every read was whole).
  while (reads.load() < 100) std::this_thread::yield();
  stop = true;
  for (auto& th : readers) th.join();
  EXPECT_EQ(bad.load(), 0);
  EXPECT_EQ(store.size(), 1u);
  EXPECT_EQ(store.resident_bytes(), versions[399 % 4]->resident_bytes);
}

}  // namespace
}  // namespace fusedlayer::server
