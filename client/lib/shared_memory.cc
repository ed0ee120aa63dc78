#include "client/lib/shared_memory.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <initializer_list>
#include <random>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"

namespace fusedlayer::client {
namespace {

uint64_t AlignUp(uint64_t n) { return (n + kSharedMemoryAlignment - 1) / kSharedMemoryAlignment * kSharedMemoryAlignment; }

uint64_t DTypeBytes(v1::DataType d) {
  switch (d) {
    case v1::DATA_TYPE_BF16: return 2;
    case v1::DATA_TYPE_FP32: return 4;
    default: return 1;
  }
}

uint64_t TensorBytes(const v1::Tensor& t) {
  uint64_t n = DTypeBytes(t.dtype());
  for (int64_t d : t.shape()) n *= static_cast<uint64_t>(d < 0 ? 0 : d);
  return n;
}

int64_t Tokens(const v1::Tensor& t) { return t.shape_size() > 0 ? t.shape(0) : 0; }

uint64_t ShapeBytes(v1::DataType dtype, std::initializer_list<int64_t> shape) {
  uint64_t n = DTypeBytes(dtype);
  for (int64_t d : shape) n *= static_cast<uint64_t>(d < 0 ? 0 : d);
  return n;
}

// An output of `dtype` and `shape` (as the server's response describes it), not placed yet.
PlacedOutput Output(const char* name, v1::DataType dtype, std::initializer_list<int64_t> shape) {
  return PlacedOutput{name, dtype, std::vector<int64_t>(shape), 0, ShapeBytes(dtype, shape)};
}

// Every output the server produces for the request: its name, dtype and shape, and bytes.
std::vector<PlacedOutput> MhcOutputs(const v1::MhcSeamRequest& r, const v1::MhcConfig& mhc) {
  const int64_t T = Tokens(r.x()), n = mhc.hc_mult(), C = mhc.hidden();
  std::vector<PlacedOutput> outs = {Output("new_residual", v1::DATA_TYPE_BF16, {T, n, C}),
                                    Output("y", v1::DATA_TYPE_BF16, {T, C})};
  if (r.stage() != v1::MHC_STAGE_HEAD) {
    outs.push_back(Output("new_pre_mix", v1::DATA_TYPE_FP32, {T, n}));
    outs.push_back(Output("new_post_mix", v1::DATA_TYPE_FP32, {T, n}));
    outs.push_back(Output("new_comb_mix", v1::DATA_TYPE_FP32, {T, n, n}));
  }
  if (r.capture_aux()) outs.push_back(Output("aux", v1::DATA_TYPE_BF16, {T, C}));
  return outs;
}

std::vector<PlacedOutput> SwaOutputs(const v1::SwaNormQuantRequest& r, const v1::SwaConfig& swa, int64_t wq_b_rows) {
  const int64_t M = Tokens(r.qr_kv()), Q = swa.q_rank(), D = swa.head_dim(), G = Q / 128;
  const v1::DataType fp8 =
      swa.fp8_format() == v1::FP8_FORMAT_E4M3FNUZ ? v1::DATA_TYPE_FP8_E4M3FNUZ : v1::DATA_TYPE_FP8_E4M3FN;
  std::vector<PlacedOutput> outs = {Output("q_fp8", fp8, {M, Q})};
  // Column-major scales (the TMA layout) pad the token dimension to a multiple of 4.
  if (swa.scale_layout() == v1::SCALE_LAYOUT_ROW_MAJOR) {
    outs.push_back(Output("q_scale", v1::DATA_TYPE_FP32, {M, G}));
  } else {
    outs.push_back(Output("q_scale", v1::DATA_TYPE_FP32, {G, (M + 3) / 4 * 4}));
  }
  outs.push_back(Output("kv", v1::DATA_TYPE_BF16, {M, D}));
  if (wq_b_rows > 0) outs.push_back(Output("q_proj", v1::DATA_TYPE_BF16, {M, wq_b_rows}));
  return outs;
}

uint64_t Sum(const std::vector<PlacedOutput>& outs, std::initializer_list<const v1::Tensor*> ins) {
  uint64_t total = 0;
  for (const PlacedOutput& o : outs) total += AlignUp(o.bytes);
  for (const v1::Tensor* t : ins) total += AlignUp(TensorBytes(*t));
  return total;
}

std::string RandomHex(int digits) {
  std::random_device rd;
  static constexpr char kHex[] = "0123456789abcdef";
  std::string s;
  for (int i = 0; i < digits; ++i) s.push_back(kHex[rd() % 16]);
  return s;
}

}  // namespace

uint64_t MhcRequestSharedBytes(const v1::MhcSeamRequest& r, const v1::MhcConfig& mhc) {
  return Sum(MhcOutputs(r, mhc), {&r.x(), &r.residual(), &r.post_mix(), &r.comb_mix(), &r.pre_mix()});
}
uint64_t SwaRequestSharedBytes(const v1::SwaNormQuantRequest& r, const v1::SwaConfig& swa, int64_t wq_b_rows) {
  return Sum(SwaOutputs(r, swa, wq_b_rows), {&r.qr_kv()});
}

absl::StatusOr<std::unique_ptr<ClientSharedMemory>> ClientSharedMemory::Create(const FusedLayerClient& client,
                                                                               uint64_t bytes) {
  bytes = AlignUp(bytes == 0 ? 1 : bytes);
  // 128 random bits: knowing the key is what registering the object takes (docs/security.md).
  const std::string suffix = absl::StrCat(::getpid(), "-", RandomHex(32));
  const std::string key = "/fusedlayer-" + suffix, name = "fl-" + suffix;
  const int fd = ::shm_open(key.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
  if (fd < 0) return absl::InternalError(absl::StrCat("shm_open ", key, ": ", std::strerror(errno)));
  if (::ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    const int e = errno;
    ::close(fd);
    ::shm_unlink(key.c_str());
    return absl::ResourceExhaustedError(absl::StrCat("ftruncate ", key, " to ", bytes, " bytes: ", std::strerror(e)));
  }
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ::close(fd);
  if (p == MAP_FAILED) {
    ::shm_unlink(key.c_str());
    return absl::ResourceExhaustedError(absl::StrCat("mmap ", key, ": ", std::strerror(errno)));
  }
  std::unique_ptr<ClientSharedMemory> shm(new ClientSharedMemory(client, name, key, static_cast<char*>(p), bytes));
  if (absl::Status s = client.RegisterSystemSharedMemory(name, key, 0, bytes); !s.ok()) {
    shm->registered_ = false;
    return s;  // the destructor unmaps and unlinks
  }
  return shm;
}

ClientSharedMemory::ClientSharedMemory(const FusedLayerClient& client, std::string name, std::string key, char* data,
                                       uint64_t bytes)
    : ClientRegion(std::move(name), bytes, /*cuda=*/false), client_(client), key_(std::move(key)), data_(data) {}

ClientSharedMemory::~ClientSharedMemory() {
  if (registered_) (void)client_.UnregisterSystemSharedMemory(region_name());
  ::munmap(data_, byte_size());
  ::shm_unlink(key_.c_str());
}

absl::Status ClientSharedMemory::Write(uint64_t at, const char* src, uint64_t n) {
  std::memcpy(data_ + at, src, n);
  return absl::OkStatus();
}

absl::Status ClientSharedMemory::Read(uint64_t at, char* dst, uint64_t n) const {
  std::memcpy(dst, data_ + at, n);
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> ClientRegion::Take(uint64_t bytes) {
  const uint64_t at = used_;
  if (AlignUp(bytes) > bytes_ - used_) {
    return absl::ResourceExhaustedError(
        absl::StrCat("region ", name_, " of ", bytes_, " bytes is too small for this request"));
  }
  used_ += AlignUp(bytes);
  return at;
}

v1::SharedMemoryRef* ClientRegion::MutableRef(v1::Tensor* t) const {
  return cuda_ ? t->mutable_cuda_shared_memory() : t->mutable_shared_memory();  // clears inline data (oneof)
}

absl::Status ClientRegion::PlaceInput(v1::Tensor* t) {
  if (t->storage_case() != v1::Tensor::kData) return absl::OkStatus();
  const uint64_t n = t->data().size();
  absl::StatusOr<uint64_t> at = Take(n);
  if (!at.ok()) return at.status();
  if (absl::Status s = Write(*at, t->data().data(), n); !s.ok()) return s;
  v1::SharedMemoryRef* ref = MutableRef(t);
  ref->set_region(name_);
  ref->set_offset(*at);
  ref->set_byte_size(n);
  return absl::OkStatus();
}

absl::Status ClientRegion::PlaceOutput(PlacedOutput output,
                                       google::protobuf::RepeatedPtrField<v1::OutputPlacement>* out) {
  absl::StatusOr<uint64_t> at = Take(output.bytes);
  if (!at.ok()) return at.status();
  v1::OutputPlacement* p = out->Add();
  p->set_output(output.name);
  v1::SharedMemoryRef* ref = cuda_ ? p->mutable_cuda_shared_memory() : p->mutable_shared_memory();
  ref->set_region(name_);
  ref->set_offset(*at);
  ref->set_byte_size(output.bytes);
  output.offset = *at;
  placed_.push_back(std::move(output));
  return absl::OkStatus();
}

absl::Status ClientRegion::Prepare(v1::MhcSeamRequest& r, const v1::MhcConfig& mhc) {
  used_ = 0;
  placed_.clear();
  r.clear_output_placements();
  for (v1::Tensor* t : {r.mutable_x(), r.mutable_residual(), r.mutable_post_mix(), r.mutable_comb_mix()}) {
    if (absl::Status s = PlaceInput(t); !s.ok()) return s;
  }
  if (r.has_pre_mix()) {
    if (absl::Status s = PlaceInput(r.mutable_pre_mix()); !s.ok()) return s;
  }
  if (r.stage() == v1::MHC_STAGE_FIRST) {  // mutable_* above created empty tensors FIRST must not have
    r.clear_residual();
    r.clear_post_mix();
    r.clear_comb_mix();
  }
  for (PlacedOutput& o : MhcOutputs(r, mhc)) {
    if (absl::Status s = PlaceOutput(std::move(o), r.mutable_output_placements()); !s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::Status ClientRegion::Prepare(v1::SwaNormQuantRequest& r, const v1::SwaConfig& swa, int64_t wq_b_rows) {
  used_ = 0;
  placed_.clear();
  r.clear_output_placements();
  if (absl::Status s = PlaceInput(r.mutable_qr_kv()); !s.ok()) return s;
  for (PlacedOutput& o : SwaOutputs(r, swa, wq_b_rows)) {
    if (absl::Status s = PlaceOutput(std::move(o), r.mutable_output_placements()); !s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::Status ClientRegion::FetchTensor(v1::Tensor* t) const {
  if (cuda_ ? !t->has_cuda_shared_memory() : !t->has_shared_memory()) return absl::OkStatus();
  const v1::SharedMemoryRef ref = cuda_ ? t->cuda_shared_memory() : t->shared_memory();
  if (ref.region() != name_ || ref.offset() > bytes_ || ref.byte_size() > bytes_ - ref.offset()) {
    return absl::InternalError(absl::StrCat("the server placed an output outside region ", name_));
  }
  std::string* data = t->mutable_data();  // clears the reference (oneof)
  data->resize(ref.byte_size());
  return Read(ref.offset(), data->data(), ref.byte_size());
}

absl::Status ClientRegion::Fetch(v1::MhcSeamResponse& r) const {
  for (v1::Tensor* t : {r.mutable_new_residual(), r.mutable_new_pre_mix(), r.mutable_new_post_mix(),
                        r.mutable_new_comb_mix(), r.mutable_y(), r.mutable_aux()}) {
    if (absl::Status s = FetchTensor(t); !s.ok()) return s;
  }
  // mutable_* created the absent ones: drop what the server did not send.
  if (r.new_pre_mix().dtype() == v1::DATA_TYPE_UNSPECIFIED) r.clear_new_pre_mix();
  if (r.new_post_mix().dtype() == v1::DATA_TYPE_UNSPECIFIED) r.clear_new_post_mix();
  if (r.new_comb_mix().dtype() == v1::DATA_TYPE_UNSPECIFIED) r.clear_new_comb_mix();
  if (r.aux().dtype() == v1::DATA_TYPE_UNSPECIFIED) r.clear_aux();
  if (r.new_residual().dtype() == v1::DATA_TYPE_UNSPECIFIED) r.clear_new_residual();
  if (r.y().dtype() == v1::DATA_TYPE_UNSPECIFIED) r.clear_y();
  return absl::OkStatus();
}

absl::Status ClientRegion::Fetch(v1::SwaNormQuantResponse& r) const {
  for (v1::Tensor* t : {r.mutable_q_fp8(), r.mutable_q_scale(), r.mutable_kv(), r.mutable_q_proj()}) {
    if (absl::Status s = FetchTensor(t); !s.ok()) return s;
  }
  if (r.q_proj().dtype() == v1::DATA_TYPE_UNSPECIFIED) r.clear_q_proj();
  return absl::OkStatus();
}

absl::Status ClientRegion::FetchPlaced(google::protobuf::Message& response) const {
  const google::protobuf::Descriptor* type = response.GetDescriptor();
  const google::protobuf::Reflection* reflection = response.GetReflection();
  for (const PlacedOutput& o : placed_) {
    const google::protobuf::FieldDescriptor* field = type->FindFieldByName(o.name);
    if (field == nullptr || field->message_type() != v1::Tensor::descriptor()) {
      return absl::InternalError(absl::StrCat(type->full_name(), " has no tensor ", o.name));
    }
    auto* t = static_cast<v1::Tensor*>(reflection->MutableMessage(&response, field));
    t->Clear();
    t->set_dtype(o.dtype);
    for (int64_t d : o.shape) t->add_shape(d);
    std::string* data = t->mutable_data();
    data->resize(o.bytes);
    if (absl::Status s = Read(o.offset, data->data(), o.bytes); !s.ok()) return s;
  }
  return absl::OkStatus();
}

}  // namespace fusedlayer::client
