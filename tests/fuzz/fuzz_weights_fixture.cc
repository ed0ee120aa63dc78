#include "fuzz_weights_fixture.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string_view>

#include "fusedlayer/numeric.h"
#include "fusedlayer/tensor.h"
#include "weights/packing.h"

namespace fusedlayer::fuzz {
namespace {

constexpr int64_t kM = kHcMult * (kHcMult + 2), kK = kHcMult * kHidden;

std::string F32Bytes(std::mt19937_64& rng, int64_t n, float lo, float hi) {
  std::uniform_real_distribution<float> u(lo, hi);
  std::string s(static_cast<size_t>(n) * 4, '\0');
  for (int64_t i = 0; i < n; ++i) {
    const float v = u(rng);
    std::memcpy(&s[static_cast<size_t>(i) * 4], &v, 4);
  }
  return s;
}

// bf16 weights around 1 (RMSNorm gains), never zero.
std::string Bf16Bytes(std::mt19937_64& rng, int64_t n) {
  std::uniform_real_distribution<float> u(0.5f, 1.5f);
  std::string s(static_cast<size_t>(n) * 2, '\0');
  for (int64_t i = 0; i < n; ++i) {
    const bf16_bits b = FloatToBf16(u(rng));
    std::memcpy(&s[static_cast<size_t>(i) * 2], &b, 2);
  }
  return s;
}

// Random fp8 codes, never a NaN code of the format (e4m3fn: S.1111.111; e4m3fnuz: 0x80).
std::string Fp8Bytes(std::mt19937_64& rng, int64_t n, bool fnuz) {
  std::string s(static_cast<size_t>(n), '\0');
  for (auto& c : s) {
    uint8_t b = static_cast<uint8_t>(rng());
    if (fnuz ? b == 0x80 : (b & 0x7f) == 0x7f) b ^= 0x01;
    c = static_cast<char>(b);
  }
  return s;
}

}  // namespace

std::vector<server::SafetensorsEntry> SmallSetEntries(bool fnuz) {
  std::mt19937_64 rng(0x5eedf00dULL);
  std::vector<server::SafetensorsEntry> e;
  e.push_back({"mhc.fn", "F32", {kM, kK}, F32Bytes(rng, kM * kK, -0.03f, 0.03f)});
  e.push_back({"mhc.scale", "F32", {3}, F32Bytes(rng, 3, 0.5f, 2.0f)});
  e.push_back({"mhc.base", "F32", {kM}, F32Bytes(rng, kM, -0.1f, 0.1f)});
  e.push_back({"mhc.norm_weight", "BF16", {kHidden}, Bf16Bytes(rng, kHidden)});
  e.push_back({"swa.q_norm", "BF16", {kQRank}, Bf16Bytes(rng, kQRank)});
  e.push_back({"swa.kv_norm", "BF16", {kHeadDim}, Bf16Bytes(rng, kHeadDim)});
  e.push_back({"swa.wq_b", fnuz ? "F8_E4M3FNUZ" : "F8_E4M3", {kWqbRows, kQRank}, Fp8Bytes(rng, kWqbRows * kQRank, fnuz)});
  e.push_back({"swa.wq_b_scale", "F32", {kWqbRows / 128, kQRank / 128},
               F32Bytes(rng, (kWqbRows / 128) * (kQRank / 128), 1e-4f, 1e-2f)});
  return e;
}

server::PackedWeightSet SmallPackedSet(int variant) {
  const bool alt = variant != 0;
  server::WeightSetPacker p(alt ? "fuzz/alt" : "fuzz/base");
  v1::MhcConfig* m = p.header().mutable_mhc();
  m->set_hc_mult(kHcMult);
  m->set_hidden(kHidden);
  v1::SwaConfig* s = p.header().mutable_swa();
  s->set_q_rank(kQRank);
  s->set_head_dim(kHeadDim);
  if (alt) {
    s->set_fp8_format(v1::FP8_FORMAT_E4M3FNUZ);
    s->set_scale_format(v1::SCALE_FORMAT_UE8M0);
    s->set_scale_layout(v1::SCALE_LAYOUT_COLUMN_MAJOR_TMA);
  }
  for (const server::SafetensorsEntry& t : SmallSetEntries(alt)) {
    if (alt && (t.name == "swa.wq_b" || t.name == "swa.wq_b_scale" || t.name == "mhc.norm_weight")) continue;
    const DType dt = t.dtype == "F32"           ? DType::kFP32
                     : t.dtype == "BF16"        ? DType::kBF16
                     : t.dtype == "F8_E4M3FNUZ" ? DType::kFP8E4M3FNUZ
                                                : DType::kFP8E4M3FN;
    p.Add(t.name, dt, t.shape, t.data);
  }
  absl::StatusOr<server::PackedWeightSet> set = p.Finish();
  if (!set.ok()) {
    std::fprintf(stderr, "fuzz fixture: packing the small set failed: %s\n", set.status().ToString().c_str());
    std::abort();
  }
  return *std::move(set);
}

std::string MakeTempDir(const char* prefix) {
  const char* tmp = std::getenv("TMPDIR");
  std::string templ = std::string(tmp && *tmp ? tmp : "/tmp") + "/" + prefix + "XXXXXX";
  if (mkdtemp(templ.data()) == nullptr) {
    std::perror("fuzz fixture: mkdtemp");
    std::abort();
  }
  return templ;
}

}  // namespace fusedlayer::fuzz
