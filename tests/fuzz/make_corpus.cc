// Writes the seed corpus of the fuzz targets (tests/fuzz/make_corpus.sh runs it):
//   <out>/fuzz_safetensors/         valid files (empty, one tensor, the small weight set, metadata,
//                                   sub-byte dtype, scalar) and a few near misses
//   <out>/fuzz_manifest/            manifests over fuzz_manifest's fixture directory: full set,
//                                   mhc only, swa fnuz with ue8m0 column-major, a bad one
//   <out>/fuzz_request_validation/  valid requests of every mHC stage/mode and of SWA (strided rows,
//                                   both weight sets), plus invalid shapes
//   <out>/fuzz_weight_set_header/   the small set's headers (both variants, with and without
//                                   sha256), plus near misses (offset past the payload, short
//                                   payload_bytes, a hyper-parameter out of range, a bad name)
//   <out>/fuzz_auth_files/          a token file and an identity file with every right, comments
//                                   and CRLF, plus near misses
//   <out>/fuzz_wire_reader/         the fuzz_request_validation seeds (the same selector bit 0), the
//                                   C++ client's shared form (data as one more occurrence of each
//                                   tensor field), a tensor split over occurrences, data twice,
//                                   an unknown field in a tensor, data without a dtype
// Seeds are deterministic (fixed RNG seed), so regenerating them changes nothing.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "fusedlayer/numeric.h"
#include "fusedlayer/v1/fusedlayer.pb.h"
#include "fusedlayer/wire/tensor_patch.h"
#include "fuzz_weights_fixture.h"
#include "weights/safetensors_writer.h"

namespace {

namespace v1 = fusedlayer::v1;
using fusedlayer::server::SafetensorsEntry;
using namespace fusedlayer::fuzz;

std::mt19937_64 rng(20261129);

void WriteFile(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!f) {
    std::fprintf(stderr, "make_corpus: cannot write %s\n", path.c_str());
    std::exit(1);
  }
}

std::string Serialize(const std::vector<SafetensorsEntry>& e, const std::map<std::string, std::string>& meta = {}) {
  absl::StatusOr<std::string> s = fusedlayer::server::SerializeSafetensors(e, meta);
  if (!s.ok()) {
    std::fprintf(stderr, "make_corpus: %s\n", s.status().ToString().c_str());
    std::exit(1);
  }
  return *s;
}

// Inputs with outliers, never zero (bf16 / fp32).
float Value() {
  std::uniform_real_distribution<float> u(0.1f, 1.0f);
  float v = u(rng) * ((rng() & 1) ? 1.0f : -1.0f);
  if (rng() % 16 == 0) v *= 300.0f;
  return v;
}
void SetTensor(v1::Tensor* t, v1::DataType dt, std::vector<int64_t> shape, int64_t row_stride_extra = 0) {
  t->set_dtype(dt);
  int64_t n = 1;
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i + 1 == shape.size()) shape[i] += row_stride_extra;
    t->add_shape(shape[i]);
    n *= shape[i];
  }
  std::string* b = t->mutable_data();
  if (dt == v1::DATA_TYPE_BF16) {
    b->resize(static_cast<size_t>(n) * 2);
    for (int64_t i = 0; i < n; ++i) {
      const uint16_t h = fusedlayer::FloatToBf16(Value());
      std::memcpy(b->data() + i * 2, &h, 2);
    }
  } else {
    b->resize(static_cast<size_t>(n) * 4);
    for (int64_t i = 0; i < n; ++i) {
      const float f = std::abs(Value()) / 4;  // mixing weights: positive, O(1)
      std::memcpy(b->data() + i * 4, &f, 4);
    }
  }
}

void WriteRequest(const std::string& dir, const std::string& name, uint8_t selector, const google::protobuf::Message& m) {
  WriteFile(dir + "/" + name, std::string(1, static_cast<char>(selector)) + m.SerializeAsString());
}

void SafetensorsSeeds(const std::string& dir) {
  WriteFile(dir + "/empty", Serialize({}));
  WriteFile(dir + "/one_bf16", Serialize({{"w", "BF16", {2, 3}, std::string(12, '\x3f')}}));
  WriteFile(dir + "/scalar_f32_meta", Serialize({{"s", "F32", {}, std::string(4, '\x01')}}, {{"format", "pt"}}));
  WriteFile(dir + "/subbyte_f4", Serialize({{"q", "F4", {4, 2}, std::string(4, '\x12')}}));
  WriteFile(dir + "/fp8_pair", Serialize({{"a", "F8_E4M3", {8}, std::string(8, '\x22')},
                                          {"b", "F8_E4M3FNUZ", {2, 4}, std::string(8, '\x33')}}));
  // The small weight set without its big mhc.fn (keeps the corpus small).
  std::vector<SafetensorsEntry> small;
  for (SafetensorsEntry& e : SmallSetEntries(false)) {
    if (e.name != "mhc.fn" && e.name != "swa.wq_b") small.push_back(std::move(e));
  }
  WriteFile(dir + "/small_set", Serialize(small, {{"model", "fuzz"}}));
  std::string trunc = Serialize({{"w", "F32", {4}, std::string(16, '\x40')}});
  trunc.resize(trunc.size() - 3);
  WriteFile(dir + "/truncated", trunc);
  WriteFile(dir + "/short_header", std::string("\x10\x00\x00\x00\x00\x00\x00\x00{\"a\":", 13));
}

void ManifestSeeds(const std::string& dir) {
  const std::string mhc_tensors =
      R"("mhc.fn": {"file": "mhc.safetensors", "tensor": "mhc.fn"},
        "mhc.scale": {"file": "mhc.safetensors", "tensor": "mhc.scale"},
        "mhc.base": {"file": "mhc.safetensors", "tensor": "mhc.base"})";
  WriteFile(dir + "/full", R"({"weight_sets": [{"name": "v41-flash/L3/ffn",
    "mhc": {"hc_mult": 4, "hidden": 256, "norm_eps": 1e-20, "hc_norm_eps": 1e-20, "hc_pre_eps": 1e-6,
            "sinkhorn_eps": 1e-6, "post_scale": 2.0, "sinkhorn_iters": 20},
    "swa": {"q_rank": 256, "head_dim": 128, "eps": 1e-6, "fp8_format": "e4m3fn", "scale_format": "fp32",
            "scale_layout": "row_major"},
    "tensors": {)" + mhc_tensors + R"(,
      "mhc.norm_weight": {"file": "mhc.safetensors", "tensor": "mhc.norm_weight"},
      "swa.q_norm": {"file": "swa.safetensors", "tensor": "swa.q_norm"},
      "swa.kv_norm": {"file": "swa.safetensors", "tensor": "swa.kv_norm"},
      "swa.wq_b": {"file": "swa.safetensors", "tensor": "swa.wq_b"},
      "swa.wq_b_scale": {"file": "swa.safetensors", "tensor": "swa.wq_b_scale"}}}]}
)");
  WriteFile(dir + "/mhc_only", R"({"weight_sets": [{"name": "m", "mhc": {"hc_mult": 4, "hidden": 256},
    "tensors": {)" + mhc_tensors + "}}]}\n");
  WriteFile(dir + "/swa_fnuz_two_sets", R"({"weight_sets": [
    {"name": "s/a", "swa": {"q_rank": 256, "head_dim": 128, "fp8_format": "e4m3fnuz", "scale_format": "ue8m0",
     "scale_layout": "column_major_tma"},
     "tensors": {"swa.q_norm": {"file": "swa_fnuz.safetensors", "tensor": "swa.q_norm"},
                 "swa.kv_norm": {"file": "swa_fnuz.safetensors", "tensor": "swa.kv_norm"},
                 "swa.wq_b": {"file": "swa_fnuz.safetensors", "tensor": "swa.wq_b"},
                 "swa.wq_b_scale": {"file": "swa_fnuz.safetensors", "tensor": "swa.wq_b_scale"}}},
    {"name": "s/b", "swa": {"q_rank": 256, "head_dim": 128},
     "tensors": {"swa.q_norm": {"file": "swa.safetensors", "tensor": "swa.q_norm"},
                 "swa.kv_norm": {"file": "swa.safetensors", "tensor": "swa.kv_norm"}}}]}
)");
  WriteFile(dir + "/missing_file", R"({"weight_sets": [{"name": "x", "swa": {"q_rank": 256, "head_dim": 128},
    "tensors": {"swa.q_norm": {"file": "nope.safetensors", "tensor": "q"},
                "swa.kv_norm": {"file": "empty.safetensors", "tensor": "kv"}}}]}
)");
}

void RequestSeeds(const std::string& dir) {
  const int64_t n = kHcMult, C = kHidden;
  int idx = 0;
  for (uint8_t set : {0, 2}) {
    for (auto [stage, mode] : {std::pair{v1::MHC_STAGE_SEAM, v1::MHC_MODE_SHIFTED}, {v1::MHC_STAGE_SEAM, v1::MHC_MODE_NORMAL},
                               {v1::MHC_STAGE_FIRST, v1::MHC_MODE_SHIFTED}, {v1::MHC_STAGE_HEAD, v1::MHC_MODE_SHIFTED}}) {
      const int64_t T = 1 + idx % 3;
      v1::MhcSeamRequest r;
      r.set_weight_set("fuzz/base");
      r.set_stage(stage);
      r.set_mode(mode);
      SetTensor(r.mutable_x(), v1::DATA_TYPE_BF16, {T, C});
      if (stage != v1::MHC_STAGE_FIRST) {
        SetTensor(r.mutable_residual(), v1::DATA_TYPE_BF16, {T, n, C});
        SetTensor(r.mutable_post_mix(), v1::DATA_TYPE_FP32, {T, n});
        SetTensor(r.mutable_comb_mix(), v1::DATA_TYPE_FP32, {T, n, n});
        if (mode == v1::MHC_MODE_SHIFTED && idx % 2 == 0) SetTensor(r.mutable_pre_mix(), v1::DATA_TYPE_FP32, {T, n});
      }
      if (stage == v1::MHC_STAGE_SEAM && idx % 2 == 1) r.set_capture_aux(true);
      r.set_path_preference(static_cast<v1::PathPreference>(idx % 3));
      WriteRequest(dir, "mhc_" + std::to_string(idx++), set, r);
    }
  }
  for (uint8_t set : {1, 3}) {
    for (int64_t extra : {0, 3}) {
      v1::SwaNormQuantRequest r;
      r.set_weight_set("fuzz/base");
      SetTensor(r.mutable_qr_kv(), v1::DATA_TYPE_BF16, {2 + extra, kQRank + kHeadDim}, extra);
      WriteRequest(dir, "swa_" + std::to_string(idx++), set, r);
    }
  }
  // Near misses: wrong rank, wrong dtype, byte length off by one.
  v1::SwaNormQuantRequest bad;
  SetTensor(bad.mutable_qr_kv(), v1::DATA_TYPE_FP32, {2, kQRank + kHeadDim});
  WriteRequest(dir, "swa_bad_dtype", 1, bad);
  v1::MhcSeamRequest badm;
  SetTensor(badm.mutable_x(), v1::DATA_TYPE_BF16, {1, C});
  badm.mutable_x()->mutable_data()->pop_back();
  badm.set_stage(v1::MHC_STAGE_FIRST);
  WriteRequest(dir, "mhc_bad_bytes", 0, badm);
  // Shared memory (selector bit 2: the target's regions "r0" = the whole 64 KiB object, "r1" = its
  // second half): an mHC FIRST request with x in r0 and y placed in r1, and an SWA request with
  // qr_kv in r0 and a kv placement of the wrong size.
  v1::MhcSeamRequest shm_mhc;
  shm_mhc.set_weight_set("fuzz/base");
  shm_mhc.set_stage(v1::MHC_STAGE_FIRST);
  SetTensor(shm_mhc.mutable_x(), v1::DATA_TYPE_BF16, {1, C});
  const uint64_t x_bytes = shm_mhc.x().data().size();
  auto* x_ref = shm_mhc.mutable_x()->mutable_shared_memory();
  x_ref->set_region("r0");
  x_ref->set_byte_size(x_bytes);
  auto* y_out = shm_mhc.add_output_placements();
  y_out->set_output("y");
  y_out->mutable_shared_memory()->set_region("r1");
  y_out->mutable_shared_memory()->set_byte_size(x_bytes);
  WriteRequest(dir, "mhc_shm", 4, shm_mhc);
  v1::SwaNormQuantRequest shm_swa;
  shm_swa.set_weight_set("fuzz/base");
  SetTensor(shm_swa.mutable_qr_kv(), v1::DATA_TYPE_BF16, {2, kQRank + kHeadDim});
  const uint64_t qr_bytes = shm_swa.qr_kv().data().size();
  auto* qr_ref = shm_swa.mutable_qr_kv()->mutable_shared_memory();
  qr_ref->set_region("r0");
  qr_ref->set_byte_size(qr_bytes);
  auto* kv_out = shm_swa.add_output_placements();
  kv_out->set_output("kv");
  kv_out->mutable_shared_memory()->set_region("r1");
  WriteRequest(dir, "swa_shm", 5, shm_swa);
}

// The request reader's seeds (fuzz_wire_reader: byte 0 bit 0 the message, bits 1-7 the slicing
// seed). Besides RequestSeeds' requests, the shapes the reader treats apart: the C++ client's
// shared form (client/lib/wire_request.h), tensors in several occurrences, and what it leaves to protobuf.
// Field `field` of the wire type LEN holding `body`.
std::string LengthDelimited(int field, const std::string& body) {
  std::string out;
  auto varint = [&](uint64_t v) {
    for (; v >= 0x80; v >>= 7) out.push_back(static_cast<char>(v | 0x80));
    out.push_back(static_cast<char>(v));
  };
  varint(static_cast<uint64_t>(field) << 3 | 2);
  varint(body.size());
  return out + body;
}

void WireReaderSeeds(const std::string& dir) {
  RequestSeeds(dir);
  const auto number = [](const google::protobuf::Message& m, const char* field) {
    return m.GetDescriptor()->FindFieldByName(field)->number();
  };
  // mHC seam, T = 2, in the client's shared form: the message without x's and residual's data, then
  // one patch per tensor (header, then the data), each seed with another slicing.
  v1::MhcSeamRequest m;
  m.set_weight_set("fuzz/base");
  SetTensor(m.mutable_x(), v1::DATA_TYPE_BF16, {2, kHidden});
  SetTensor(m.mutable_residual(), v1::DATA_TYPE_BF16, {2, kHcMult, kHidden});
  SetTensor(m.mutable_post_mix(), v1::DATA_TYPE_FP32, {2, kHcMult});
  SetTensor(m.mutable_comb_mix(), v1::DATA_TYPE_FP32, {2, kHcMult, kHcMult});
  v1::MhcSeamRequest head = m;
  head.mutable_x()->clear_data();
  head.mutable_residual()->clear_data();
  std::string shared = head.SerializeAsString();
  for (const char* f : {"x", "residual"}) {
    const std::string& data = f[0] == 'x' ? m.x().data() : m.residual().data();
    fusedlayer::wire::AppendTensorPatchHeader(&shared, number(m, f), data.size());
    shared += data;
  }
  for (uint8_t seed : {0, 1, 2, 3}) {
    WriteFile(dir + "/mhc_shared_form_" + std::to_string(seed), std::string(1, static_cast<char>(seed << 1)) + shared);
  }
  // SWA: qr_kv's dtype, shape and data in three occurrences, with request_id between them.
  v1::SwaNormQuantRequest w;
  w.set_weight_set("fuzz/base");
  SetTensor(w.mutable_qr_kv(), v1::DATA_TYPE_BF16, {3, kQRank + kHeadDim});
  const int qr = number(w, "qr_kv");
  v1::Tensor dtype_only, shape_only, data_only;
  dtype_only.set_dtype(w.qr_kv().dtype());
  *shape_only.mutable_shape() = w.qr_kv().shape();
  data_only.set_data(w.qr_kv().data());
  v1::SwaNormQuantRequest rest;
  rest.set_weight_set("fuzz/base");
  rest.set_request_id("split");
  const std::string split = LengthDelimited(qr, dtype_only.SerializeAsString()) + rest.SerializeAsString() +
                            LengthDelimited(qr, shape_only.SerializeAsString()) +
                            LengthDelimited(qr, data_only.SerializeAsString());
  WriteFile(dir + "/swa_split_occurrences", std::string(1, '\x03') + split);
  // Left to protobuf: x's data twice (protobuf keeps the last), an unknown field inside a tensor,
  // and data without a dtype.
  v1::Tensor again;
  again.set_data(std::string(m.x().data().size(), '\x11'));
  WriteFile(dir + "/mhc_data_twice", std::string(1, '\x04') + m.SerializeAsString() +
                                         LengthDelimited(number(m, "x"), again.SerializeAsString()));
  v1::SwaNormQuantRequest unknown = w;
  unknown.mutable_qr_kv()->GetReflection()->MutableUnknownFields(unknown.mutable_qr_kv())->AddVarint(99, 7);
  WriteFile(dir + "/swa_unknown_in_tensor", std::string(1, '\x05') + unknown.SerializeAsString());
  v1::SwaNormQuantRequest no_dtype = w;
  no_dtype.mutable_qr_kv()->clear_dtype();
  WriteFile(dir + "/swa_data_without_dtype", std::string(1, '\x07') + no_dtype.SerializeAsString());
}

void HeaderSeeds(const std::string& dir) {
  for (uint8_t variant : {0, 1}) {
    const v1::WeightSetHeader header = SmallPackedSet(variant).first;
    const std::string v = std::to_string(variant);
    WriteFile(dir + "/set_" + v, std::string(1, static_cast<char>(variant)) + header.SerializeAsString());
    WriteFile(dir + "/set_" + v + "_nosha", std::string(1, static_cast<char>(variant | 2)) + header.SerializeAsString());
    v1::WeightSetHeader past = header;
    if (past.tensors_size() > 0) past.mutable_tensors(0)->set_offset(header.payload_bytes());
    WriteFile(dir + "/offset_past_" + v, std::string(1, static_cast<char>(variant | 2)) + past.SerializeAsString());
    v1::WeightSetHeader short_payload = header;
    short_payload.set_payload_bytes(header.payload_bytes() - 1);
    WriteFile(dir + "/short_payload_" + v, std::string(1, static_cast<char>(variant | 2)) + short_payload.SerializeAsString());
  }
  v1::WeightSetHeader iters = SmallPackedSet(0).first;
  iters.mutable_mhc()->set_sinkhorn_iters(1001);
  WriteFile(dir + "/sinkhorn_iters_over", std::string(1, '\x02') + iters.SerializeAsString());
  v1::WeightSetHeader name = SmallPackedSet(1).first;
  name.set_name("bad name\n");
  WriteFile(dir + "/bad_name", std::string(1, '\x03') + name.SerializeAsString());
}

void AuthFileSeeds(const std::string& dir) {
  WriteFile(dir + "/tokens", "# tokens\n0123456789abcdef0123456789abcdef compute\n\nABCDEFGHIJKLMNOP+/== admin\r\n"
                             "tok-en.with_all~chars0 admin,compute\n");
  WriteFile(dir + "/identities", "# identities\nspiffe://td.example/ns/a/sa/loader admin\r\n"
                                 "subject:CN=orchestrator,O=Acme Inc compute\n\tsubject:CN=x compute,admin\n");
  WriteFile(dir + "/token_near_misses", "short compute\n0123456789abcdef0123456789abcdef root\n"
                                        "0123456789abcdef0123456789abcdef compute,compute\n");
  WriteFile(dir + "/identity_near_misses", "CN=x compute\nspiffe:// admin\nsubject:CN=x compute\nsubject:CN=x admin\n");
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s OUT_DIR (holding fuzz_safetensors/, fuzz_manifest/, fuzz_request_validation/, "
                 "fuzz_weight_set_header/, fuzz_auth_files/, fuzz_wire_reader/)\n", argv[0]);
    return 2;
  }
  const std::string out = argv[1];
  SafetensorsSeeds(out + "/fuzz_safetensors");
  ManifestSeeds(out + "/fuzz_manifest");
  RequestSeeds(out + "/fuzz_request_validation");
  HeaderSeeds(out + "/fuzz_weight_set_header");
  AuthFileSeeds(out + "/fuzz_auth_files");
  WireReaderSeeds(out + "/fuzz_wire_reader");
  return 0;
}
