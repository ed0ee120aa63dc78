#include "client/lib/call_ring.h"

#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>
#include <thread>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "client/lib/tensor_messages.h"

namespace fusedlayer::client {

namespace {

int64_t DeadlineNanos(absl::Duration deadline) {
  if (deadline == absl::InfiniteDuration()) return 0;
  return wire::MonotonicNanos() + absl::ToInt64Nanoseconds(deadline);
}

inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

}  // namespace

wire::RingTensorRef RingInput(wire::RingRole role, uint32_t region, v1::DataType dtype,
                              std::initializer_list<int64_t> shape, uint64_t offset) {
  wire::RingTensorRef t{};
  t.role = static_cast<uint32_t>(role);
  t.region = region;
  t.dtype = static_cast<uint32_t>(dtype);
  t.rank = static_cast<uint32_t>(std::min<size_t>(shape.size(), 3));
  size_t d = 0;
  for (int64_t n : shape) {
    if (d < 3) t.shape[d] = n;
    ++d;
  }
  t.offset = offset;
  const absl::StatusOr<uint64_t> bytes = TensorByteSize(dtype, std::span<const int64_t>(shape.begin(), shape.size()));
  t.byte_size = bytes.ok() ? *bytes : 0;  // the server answers a wrong size with INVALID_ARGUMENT
  return t;
}

wire::RingTensorRef RingOutput(wire::RingRole role, uint32_t region, uint64_t offset, uint64_t byte_size) {
  wire::RingTensorRef t{};
  t.role = static_cast<uint32_t>(role);
  t.region = region;
  t.offset = offset;
  t.byte_size = byte_size;
  return t;
}

absl::Status AddRingTensor(wire::RingCallDescriptor* call, const wire::RingTensorRef& tensor) {
  if (call->num_tensors >= wire::kRingMaxTensors) {
    return absl::InvalidArgumentError(absl::StrCat("a ring call holds at most ", wire::kRingMaxTensors, " tensors"));
  }
  call->tensors[call->num_tensors++] = tensor;
  return absl::OkStatus();
}

wire::RingCallDescriptor RingMhcCall(uint32_t weight_set, v1::MhcStage stage, v1::MhcMode mode,
                                     std::initializer_list<wire::RingTensorRef> tensors, v1::PathPreference path,
                                     absl::Duration deadline) {
  wire::RingCallDescriptor call{};
  call.op = static_cast<uint32_t>(wire::RingOp::kMhcSeam);
  call.weight_set = weight_set;
  call.stage = static_cast<uint32_t>(stage);
  call.mode = static_cast<uint32_t>(mode);
  call.path_preference = static_cast<uint32_t>(path);
  call.deadline_ns = DeadlineNanos(deadline);
  for (const wire::RingTensorRef& t : tensors) (void)AddRingTensor(&call, t);
  return call;
}

wire::RingCallDescriptor RingSwaCall(uint32_t weight_set, std::initializer_list<wire::RingTensorRef> tensors,
                                     v1::PathPreference path, absl::Duration deadline) {
  wire::RingCallDescriptor call{};
  call.op = static_cast<uint32_t>(wire::RingOp::kSwaNormQuant);
  call.weight_set = weight_set;
  call.path_preference = static_cast<uint32_t>(path);
  call.deadline_ns = DeadlineNanos(deadline);
  for (const wire::RingTensorRef& t : tensors) (void)AddRingTensor(&call, t);
  return call;
}

namespace {

absl::StatusOr<uint32_t> IndexOf(const std::vector<std::string>& weight_sets, const std::string& name) {
  for (size_t i = 0; i < weight_sets.size(); ++i) {
    if (weight_sets[i] == name) return static_cast<uint32_t>(i);
  }
  return absl::NotFoundError(absl::StrCat("weight set '", name, "' is not bound to the ring"));
}

absl::StatusOr<uint32_t> RegionIndex(const std::vector<v1::CallRingRegion>& regions, const std::string& name,
                                     bool cuda) {
  for (size_t i = 0; i < regions.size(); ++i) {
    if (regions[i].name() == name && regions[i].cuda() == cuda) return static_cast<uint32_t>(i);
  }
  return absl::NotFoundError(absl::StrCat(cuda ? "CUDA " : "", "region '", name, "' is not bound to the ring"));
}

// Adds `t` (a request field of role `role`) as an input reference, when present.
absl::Status AddInput(wire::RingCallDescriptor* call, wire::RingRole role, const v1::Tensor& t, bool present,
                      const std::vector<v1::CallRingRegion>& regions) {
  if (!present) return absl::OkStatus();
  const bool cuda = t.has_cuda_shared_memory();
  if (!cuda && !t.has_shared_memory()) {
    return absl::InvalidArgumentError(
        absl::StrCat(wire::RingRoleName(role), " is inline: a ring call's tensors lie in shared-memory regions"));
  }
  if (t.shape_size() > 3) return absl::InvalidArgumentError(absl::StrCat(wire::RingRoleName(role), ": rank over 3"));
  const v1::SharedMemoryRef& ref = cuda ? t.cuda_shared_memory() : t.shared_memory();
  absl::StatusOr<uint32_t> region = RegionIndex(regions, ref.region(), cuda);
  if (!region.ok()) return region.status();
  wire::RingTensorRef r{};
  r.role = static_cast<uint32_t>(role);
  r.region = *region;
  r.dtype = static_cast<uint32_t>(t.dtype());
  r.rank = static_cast<uint32_t>(t.shape_size());
  for (int d = 0; d < t.shape_size(); ++d) r.shape[d] = t.shape(d);
  r.offset = ref.offset();
  r.byte_size = ref.byte_size();
  return AddRingTensor(call, r);
}

absl::Status AddOutputs(wire::RingCallDescriptor* call, wire::RingOp op,
                        const google::protobuf::RepeatedPtrField<v1::OutputPlacement>& placements,
                        const std::vector<v1::CallRingRegion>& regions) {
  for (const v1::OutputPlacement& p : placements) {
    wire::RingRole role = wire::RingRole::kNone;
    for (uint32_t r = 16; r <= 27; ++r) {
      if (wire::RingRoleIsOutput(op, static_cast<wire::RingRole>(r)) &&
          p.output() == wire::RingRoleName(static_cast<wire::RingRole>(r))) {
        role = static_cast<wire::RingRole>(r);
      }
    }
    if (role == wire::RingRole::kNone) {
      return absl::InvalidArgumentError(absl::StrCat("output placement '", p.output(), "' is not an output of the op"));
    }
    const bool cuda = p.has_cuda_shared_memory();
    const v1::SharedMemoryRef& ref = cuda ? p.cuda_shared_memory() : p.shared_memory();
    absl::StatusOr<uint32_t> region = RegionIndex(regions, ref.region(), cuda);
    if (!region.ok()) return region.status();
    if (absl::Status s = AddRingTensor(call, RingOutput(role, *region, ref.offset(), ref.byte_size())); !s.ok()) {
      return s;
    }
  }
  return absl::OkStatus();
}

}  // namespace

v1::ExecutionReport ReportOf(const RingCallResult& r) {
  v1::ExecutionReport report;
  report.set_path(r.path);
  report.set_fallback_reason(r.fallback_reason);
  report.set_fallback_detail(r.fallback_detail);
  report.set_server_seconds(r.server_seconds);
  report.set_queue_seconds(r.queue_seconds);
  report.set_kernel_seconds(r.kernel_seconds);
  report.set_batch_requests(r.batch_requests);
  if (r.status.ok()) *report.mutable_stages() = r.stages;
  return report;
}

CallRing::Options CallRing::Options::ForRegions(const std::string& weight_set,
                                                const std::vector<std::string>& region_names, bool cuda) {
  Options o;
  o.weight_sets = {weight_set};
  for (const std::string& name : region_names) {
    v1::CallRingRegion r;
    r.set_name(name);
    r.set_cuda(cuda);
    o.regions.push_back(std::move(r));
  }
  o.slots = static_cast<uint32_t>(o.regions.size());
  return o;
}

absl::StatusOr<wire::RingCallDescriptor> RingCallOf(const v1::MhcSeamRequest& request,
                                                    const std::vector<std::string>& weight_sets,
                                                    const std::vector<v1::CallRingRegion>& regions,
                                                    absl::Duration deadline) {
  if (!request.session().empty() || request.verify()) {
    return absl::InvalidArgumentError("ring calls carry neither residual sessions nor verify");
  }
  absl::StatusOr<uint32_t> set = IndexOf(weight_sets, request.weight_set());
  if (!set.ok()) return set.status();
  wire::RingCallDescriptor call = RingMhcCall(*set, request.stage(), request.mode(), {}, request.path_preference(),
                                              deadline);
  if (request.capture_aux()) call.flags |= wire::kRingFlagCaptureAux;
  using wire::RingRole;
  for (auto [role, t, present] :
       {std::tuple{RingRole::kX, &request.x(), request.has_x()},
        {RingRole::kResidual, &request.residual(), request.has_residual()},
        {RingRole::kPostMix, &request.post_mix(), request.has_post_mix()},
        {RingRole::kCombMix, &request.comb_mix(), request.has_comb_mix()},
        {RingRole::kPreMix, &request.pre_mix(), request.has_pre_mix()}}) {
    if (absl::Status s = AddInput(&call, role, *t, present, regions); !s.ok()) return s;
  }
  if (absl::Status s = AddOutputs(&call, wire::RingOp::kMhcSeam, request.output_placements(), regions); !s.ok()) {
    return s;
  }
  return call;
}

absl::StatusOr<wire::RingCallDescriptor> RingCallOf(const v1::SwaNormQuantRequest& request,
                                                    const std::vector<std::string>& weight_sets,
                                                    const std::vector<v1::CallRingRegion>& regions,
                                                    absl::Duration deadline) {
  if (request.verify()) return absl::InvalidArgumentError("ring calls do not carry verify");
  absl::StatusOr<uint32_t> set = IndexOf(weight_sets, request.weight_set());
  if (!set.ok()) return set.status();
  wire::RingCallDescriptor call = RingSwaCall(*set, {}, request.path_preference(), deadline);
  if (absl::Status s = AddInput(&call, wire::RingRole::kQrKv, request.qr_kv(), request.has_qr_kv(), regions);
      !s.ok()) {
    return s;
  }
  if (absl::Status s = AddOutputs(&call, wire::RingOp::kSwaNormQuant, request.output_placements(), regions);
      !s.ok()) {
    return s;
  }
  return call;
}

absl::StatusOr<std::unique_ptr<CallRing>> CallRing::Open(const FusedLayerClient& client, const Options& options) {
  v1::OpenCallRingRequest request;
  for (const std::string& w : options.weight_sets) request.add_weight_sets(w);
  for (const v1::CallRingRegion& r : options.regions) *request.add_regions() = r;
  request.set_slots(options.slots);
  if (options.device_id.has_value()) request.set_device_id(*options.device_id);
  absl::StatusOr<v1::OpenCallRingResponse> opened = client.OpenCallRing(request);
  if (!opened.ok()) return opened.status();
  if (opened->layout_version() != wire::kCallRingLayoutVersion) {
    return absl::FailedPreconditionError(absl::StrCat("the server's call rings have layout version ",
                                                      opened->layout_version(), "; this client speaks ",
                                                      wire::kCallRingLayoutVersion));
  }
  std::unique_ptr<CallRing> ring(new CallRing());
  ring->slots_ = opened->slots();
  ring->ring_id_ = opened->ring_id();
  ring->spin_ns_ = absl::ToInt64Nanoseconds(options.spin);
  ring->seq_.assign(ring->slots_, 0);
  const std::string& path = opened->socket_path();
  sockaddr_un sa{};
  if (path.size() >= sizeof(sa.sun_path)) return absl::InternalError("the ring socket's path is too long");
  sa.sun_family = AF_UNIX;
  std::memcpy(sa.sun_path, path.data(), path.size());
  ring->connection_ = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (ring->connection_ < 0 ||
      ::connect(ring->connection_, reinterpret_cast<const sockaddr*>(&sa), sizeof(sa)) != 0) {
    return absl::UnavailableError(
        absl::StrCat("connecting to the call-ring socket ", path, ": ", std::strerror(errno),
                     " (call rings work only on the server's host)"));
  }
  const std::string& token = opened->token();
  if (::send(ring->connection_, token.data(), token.size(), MSG_NOSIGNAL) != static_cast<ssize_t>(token.size())) {
    return absl::UnavailableError(absl::StrCat("sending the ring's token: ", std::strerror(errno)));
  }
  std::string reply;
  int fds[2] = {-1, -1};
  const int got = wire::ReceiveWithDescriptors(ring->connection_, &reply, 256, fds, 2);
  if (got < 0) return absl::UnavailableError(absl::StrCat("receiving the ring: ", std::strerror(errno)));
  ring->memfd_ = got > 0 ? fds[0] : -1;
  ring->doorbell_ = got > 1 ? fds[1] : -1;
  if (reply.rfind("OK ", 0) != 0 || got != 2) {
    return absl::UnavailableError(absl::StrCat("the server did not hand the ring over: ", reply));
  }
  ring->bytes_ = opened->ring_bytes();
  void* base = ::mmap(nullptr, ring->bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, ring->memfd_, 0);
  if (base == MAP_FAILED) return absl::ResourceExhaustedError(absl::StrCat("mapping the ring: ", std::strerror(errno)));
  ring->base_ = base;
  const wire::RingHeader* h = wire::RingHeaderAt(base);
  if (h->magic != wire::kCallRingMagic || h->slots != ring->slots_ || h->slot_bytes != sizeof(wire::RingSlot)) {
    return absl::FailedPreconditionError("the ring's memory does not have this client's layout");
  }
  return ring;
}

CallRing::~CallRing() {
  if (base_ != nullptr) ::munmap(base_, bytes_);
  for (int fd : {memfd_, doorbell_, connection_}) {
    if (fd >= 0) ::close(fd);
  }
}

absl::Status CallRing::Submit(uint32_t slot, const wire::RingCallDescriptor& call) {
  if (slot >= slots_) return absl::InvalidArgumentError(absl::StrCat("slot ", slot, " of a ring of ", slots_));
  wire::RingSlot* s = raw_slot(slot);
  std::memcpy(&s->call, &call, sizeof(call));
  const uint32_t seq = ++seq_[slot];
  s->control.submit_seq.store(seq, std::memory_order_seq_cst);
  // After the store (seq_cst on both sides): either the poller's last scan before it sleeps sees
  // this call, or this load sees its flag and the doorbell wakes it.
  if (wire::RingHeaderAt(base_)->poller_sleeping.load(std::memory_order_seq_cst) != 0) {
    const uint64_t one = 1;
    if (::write(doorbell_, &one, sizeof(one)) < 0 && errno != EAGAIN) {
      return absl::UnavailableError(absl::StrCat("ringing the doorbell: ", std::strerror(errno)));
    }
  }
  return absl::OkStatus();
}

RingCallResult CallRing::Wait(uint32_t slot, absl::Duration timeout) {
  RingCallResult r;
  if (slot >= slots_) {
    r.status = absl::InvalidArgumentError(absl::StrCat("slot ", slot, " of a ring of ", slots_));
    return r;
  }
  wire::RingSlot* s = raw_slot(slot);
  const uint32_t seq = seq_[slot];
  const int64_t start = wire::MonotonicNanos();
  const int64_t end = start + absl::ToInt64Nanoseconds(timeout);
  uint32_t done = s->control.complete_seq.load(std::memory_order_acquire);
  // The spin yields between looks: the server's threads may need this core (a host with few
  // cores), and a yield with nobody else runnable returns within a microsecond.
  for (int i = 0; done != seq && wire::MonotonicNanos() - start < spin_ns_; ++i) {
    if (i % 16 == 15) {
      std::this_thread::yield();
    } else {
      CpuRelax();
    }
    done = s->control.complete_seq.load(std::memory_order_acquire);
  }
  while (done != seq) {
    const int64_t now = wire::MonotonicNanos();
    if (now >= end) {
      r.status = absl::DeadlineExceededError("no completion from the server in time (the call may still run)");
      return r;
    }
    s->control.client_waiting.store(1, std::memory_order_seq_cst);
    done = s->control.complete_seq.load(std::memory_order_seq_cst);
    if (done != seq) wire::FutexWait(&s->control.complete_seq, done, std::min<int64_t>(end - now, 100'000'000));
    s->control.client_waiting.store(0, std::memory_order_relaxed);
    done = s->control.complete_seq.load(std::memory_order_acquire);
  }
  wire::RingCompletion c;
  std::memcpy(&c, &s->completion, sizeof(c));
  c.message[sizeof(c.message) - 1] = '\0';
  c.fallback_detail[sizeof(c.fallback_detail) - 1] = '\0';
  r.status = c.code == 0 ? absl::OkStatus() : absl::Status(static_cast<absl::StatusCode>(c.code), c.message);
  r.path = static_cast<v1::ExecutionPath>(c.path);
  r.fallback_reason = static_cast<v1::FallbackReason>(c.fallback_reason);
  r.fallback_detail = c.fallback_detail;
  r.batch_requests = c.batch_requests;
  r.server_seconds = c.server_seconds;
  r.queue_seconds = c.queue_seconds;
  r.kernel_seconds = c.kernel_seconds;
  r.completed_by_device = (c.flags & wire::kRingCompletedByDevice) != 0;
  if (c.code == 0) {
    r.stages.set_decode(c.decode_seconds);
    r.stages.set_copy_in(c.copy_in_seconds);
    r.stages.set_device(c.device_seconds);
    r.stages.set_copy_out(c.copy_out_seconds);
    r.stages.set_response(c.response_seconds);
  }
  return r;
}

RingCallResult CallRing::Call(uint32_t slot, const wire::RingCallDescriptor& call, absl::Duration timeout) {
  if (absl::Status s = Submit(slot, call); !s.ok()) {
    RingCallResult r;
    r.status = s;
    return r;
  }
  return Wait(slot, timeout);
}

}  // namespace fusedlayer::client
