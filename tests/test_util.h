// Shared helpers for the contract suites: random inputs with outliers (never zeros), NaN poisoning,
// backend enumeration, and tensors that live in a backend's memory.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "fusedlayer/backend.h"
#include "fusedlayer/numeric.h"
#include "gtest/gtest.h"

namespace fusedlayer::testing {

// Backends present in this build and on this machine: "cpu" always, then "cuda"/"hip" if a device
// answers. Suites are INSTANTIATE_TEST_SUITE_P'd over this list.
inline std::vector<std::string> AvailableBackends() {
  std::vector<std::string> kinds = {"cpu"};
  for (const char* k : {"cuda", "hip"}) {
    auto b = CreateBackend(k);
    if (b.ok()) kinds.push_back(k);
  }
  return kinds;
}

// One random stream per test, seeded from the test name plus a run counter so every run of every
// test gets fresh inputs, yet a failure prints the seed to reproduce it.
inline std::mt19937_64 MakeRng(uint64_t salt = 0) {
  static uint64_t counter = 0;
  std::random_device rd;
  const uint64_t seed = (uint64_t(rd()) << 32) ^ rd() ^ (salt * 0x9e3779b97f4a7c15ull) ^ (++counter);
  ::testing::Test::RecordProperty("seed", std::to_string(seed));
  return std::mt19937_64(seed);
}

// Normal(0, sigma) with ~1% outliers scaled by `outlier`; exact zeros are re-drawn.
inline float RandomValue(std::mt19937_64& rng, float sigma = 1.0f, float outlier = 16.0f) {
  std::normal_distribution<float> nd(0.0f, sigma);
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  float v;
  do {
    v = nd(rng);
    if (u(rng) < 0.01f) v *= outlier;
  } while (v == 0.0f);
  return v;
}

inline std::vector<uint16_t> RandomBf16(std::mt19937_64& rng, size_t n, float sigma = 1.0f, float outlier = 16.0f) {
  std::vector<uint16_t> out(n);
  for (auto& b : out) {
    do b = FloatToBf16(RandomValue(rng, sigma, outlier)); while ((b & 0x7fff) == 0);
  }
  return out;
}

inline std::vector<float> RandomFloat(std::mt19937_64& rng, size_t n, float lo, float hi) {
  std::uniform_real_distribution<float> u(lo, hi);
  std::vector<float> out(n);
  for (auto& f : out) {
    do f = u(rng); while (f == 0.0f);
  }
  return out;
}

// A tensor in a backend's memory with a host mirror. Upload() copies host -> device; Download()
// copies device -> host. Poison() fills the device copy with NaN bytes (0xFF: NaN for fp32 and
// bf16, NaN for e4m3fn (0xFF = S.1111.111); for e4m3fnuz 0xFF is -240, so fp8 tests also check
// every code against the reference, which catches unwritten codes).
class DeviceTensor {
 public:
  DeviceTensor(Backend& backend, DType dtype, std::vector<int64_t> dims)
      : backend_(&backend), dtype_(dtype), dims_(std::move(dims)) {
    int64_t n = 1;
    for (int64_t d : dims_) n *= d;
    bytes_ = size_t(n) * DTypeSize(dtype_);
    host_.assign(bytes_, 0);
    auto buf = backend.Allocate(bytes_);
    EXPECT_TRUE(buf.ok()) << buf.status();
    if (buf.ok()) buf_ = std::move(*buf);
  }
  TensorView view() const {
    TensorView t;
    t.data = buf_.data();
    t.dtype = dtype_;
    t.rank = int(dims_.size());
    int64_t s = 1;
    for (int k = t.rank - 1; k >= 0; --k) {
      t.shape[k] = dims_[k];
      t.stride[k] = s;
      s *= dims_[k];
    }
    return t;
  }
  template <typename T>
  void Set(const std::vector<T>& v) {
    ASSERT_EQ(v.size() * sizeof(T), bytes_);
    if (bytes_) std::memcpy(host_.data(), v.data(), bytes_);
    Upload();
  }
  void Upload() { ASSERT_TRUE(backend_->CopyToDevice(buf_.data(), host_.data(), bytes_).ok()); }
  void Poison() {
    std::vector<uint8_t> nan(bytes_, 0xff);
    ASSERT_TRUE(backend_->CopyToDevice(buf_.data(), nan.data(), bytes_).ok());
  }
  template <typename T>
  std::vector<T> Get() {
    std::vector<T> out(bytes_ / sizeof(T));
    EXPECT_TRUE(backend_->CopyToHost(out.data(), buf_.data(), bytes_).ok());
    return out;
  }
  size_t bytes() const { return bytes_; }
  void* data() const { return buf_.data(); }

 private:
  Backend* backend_;
  DType dtype_;
  std::vector<int64_t> dims_;
  size_t bytes_ = 0;
  std::vector<uint8_t> host_;
  DeviceBuffer buf_;
};

// Distance in units in the last place between two bf16 values (monotone key, as in the DeepSeek
// fused-kernel tests): |key(a) - key(b)|.
// The tensor type of FP8 codes in `f`.
inline DType Fp8DType(Fp8Format f) { return f == Fp8Format::kE4M3FN ? DType::kFP8E4M3FN : DType::kFP8E4M3FNUZ; }

// An SWA test problem's hyperparameters and its host weights as views of the test's vectors (the
// contract suite and the GPU suite build their problems alike; Q and D are the norm weights' sizes).
inline SwaHyperParams SwaTestParams(int64_t Q, int64_t D, Fp8Format fmt, ScaleFormat sf, ScaleLayout sl, int64_t N,
                                    float eps = SwaHyperParams{}.eps) {
  SwaHyperParams p;
  p.q_rank = Q;
  p.head_dim = D;
  p.eps = eps;
  p.fp8_format = fmt;
  p.scale_format = sf;
  p.scale_layout = sl;
  p.wq_b_rows = N;
  return p;
}
inline SwaWeightsHost SwaTestWeights(std::vector<uint16_t>& q_norm, std::vector<uint16_t>& kv_norm,
                                     std::vector<uint8_t>& wq_b, std::vector<float>& wq_b_scale, int64_t N,
                                     Fp8Format fmt) {
  const int64_t Q = int64_t(q_norm.size()), D = int64_t(kv_norm.size());
  SwaWeightsHost w;
  w.q_norm = TensorView::Contiguous(q_norm.data(), DType::kBF16, {Q});
  w.kv_norm = TensorView::Contiguous(kv_norm.data(), DType::kBF16, {D});
  if (N > 0) {
    w.wq_b = TensorView::Contiguous(wq_b.data(), Fp8DType(fmt), {N, Q});
    w.wq_b_scale = TensorView::Contiguous(wq_b_scale.data(), DType::kFP32, {N / kSwaGroup, Q / kSwaGroup});
  }
  return w;
}

inline int Bf16UlpDistance(uint16_t a, uint16_t b) {
  auto key = [](uint16_t v) -> int32_t { return (v & 0x8000) ? 0x8000 - int32_t(v & 0x7fff) : 0x8000 + int32_t(v); };
  return std::abs(key(a) - key(b));
}
inline int Fp8CodeDistance(uint8_t a, uint8_t b) {
  auto key = [](uint8_t c) -> int32_t { return (c & 0x80) ? 0x80 - int32_t(c & 0x7f) : 0x80 + int32_t(c); };
  return std::abs(key(a) - key(b));
}

}  // namespace fusedlayer::testing
