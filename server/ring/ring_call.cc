#include "ring/ring_call.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <optional>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "exec/op_traits.h"
#include "ring/call_rings.h"
#include "ring/ring.h"

namespace fusedlayer::server::ring {

using wire::RingCallDescriptor;
using wire::RingOp;
using wire::RingRole;
using wire::RingTensorRef;

namespace {

using Clock = std::chrono::steady_clock;

// The request field of an input role, or the placement name of an output role.
v1::Tensor* MhcInput(v1::MhcSeamRequest* r, RingRole role) {
  switch (role) {
    case RingRole::kX: return r->mutable_x();
    case RingRole::kResidual: return r->mutable_residual();
    case RingRole::kPostMix: return r->mutable_post_mix();
    case RingRole::kCombMix: return r->mutable_comb_mix();
    case RingRole::kPreMix: return r->mutable_pre_mix();
    default: return nullptr;
  }
}
v1::Tensor* SwaInput(v1::SwaNormQuantRequest* r, RingRole role) {
  return role == RingRole::kQrKv ? r->mutable_qr_kv() : nullptr;
}

// The fields every op's request has, and its tensors: each reference checked against the ring's
// bindings and turned into the shared-memory reference the RPC would carry. `input` gives the
// request's field for an input role.
template <typename Request, typename InputField>
absl::Status FillCommon(RingOp op, const RingCallDescriptor& call, const std::vector<std::string>& weight_sets,
                        const std::vector<v1::CallRingRegion>& regions, Request* request, InputField input) {
  if (call.weight_set >= weight_sets.size()) {
    return absl::InvalidArgumentError(absl::StrCat("weight_set index ", call.weight_set, ": the ring binds ",
                                                   weight_sets.size(), " weight set(s)"));
  }
  request->set_weight_set(weight_sets[call.weight_set]);
  if (!v1::PathPreference_IsValid(static_cast<int>(call.path_preference))) {
    return absl::InvalidArgumentError(absl::StrCat("path_preference ", call.path_preference, " is not a PathPreference"));
  }
  request->set_path_preference(static_cast<v1::PathPreference>(call.path_preference));
  if (call.num_tensors > wire::kRingMaxTensors) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_tensors ", call.num_tensors, " is over the ring's ", wire::kRingMaxTensors));
  }
  uint64_t seen_roles = 0;
  for (uint32_t i = 0; i < call.num_tensors; ++i) {
    const RingTensorRef& t = call.tensors[i];
    const auto role = static_cast<RingRole>(t.role);
    const bool is_input = wire::RingRoleIsInput(op, role);
    if (!is_input && !wire::RingRoleIsOutput(op, role)) {
      return absl::InvalidArgumentError(absl::StrCat("tensor ", i, ": role ", t.role, " is not a tensor of ",
                                                     op == RingOp::kMhcSeam ? "MhcSeam" : "SwaNormQuant"));
    }
    if (seen_roles & (uint64_t{1} << t.role)) {
      return absl::InvalidArgumentError(absl::StrCat("tensor ", i, ": ", wire::RingRoleName(role), " given twice"));
    }
    seen_roles |= uint64_t{1} << t.role;
    if (t.region >= regions.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor ", i, " (", wire::RingRoleName(role), "): region index ", t.region, ": the ring binds ",
                       regions.size(), " region(s)"));
    }
    const v1::CallRingRegion& region = regions[t.region];
    v1::SharedMemoryRef ref;
    ref.set_region(region.name());
    ref.set_offset(t.offset);
    ref.set_byte_size(t.byte_size);
    if (is_input) {
      if (t.rank > 3) {
        return absl::InvalidArgumentError(
            absl::StrCat("tensor ", i, " (", wire::RingRoleName(role), "): rank ", t.rank, " is over 3"));
      }
      if (!v1::DataType_IsValid(static_cast<int>(t.dtype))) {
        return absl::InvalidArgumentError(
            absl::StrCat("tensor ", i, " (", wire::RingRoleName(role), "): dtype ", t.dtype, " is not a DataType"));
      }
      v1::Tensor* field = input(request, role);
      field->set_dtype(static_cast<v1::DataType>(t.dtype));
      for (uint32_t d = 0; d < t.rank; ++d) field->add_shape(t.shape[d]);
      *(region.cuda() ? field->mutable_cuda_shared_memory() : field->mutable_shared_memory()) = std::move(ref);
    } else {
      v1::OutputPlacement* placement = request->add_output_placements();
      placement->set_output(wire::RingRoleName(role));
      *(region.cuda() ? placement->mutable_cuda_shared_memory() : placement->mutable_shared_memory()) = std::move(ref);
    }
  }
  return absl::OkStatus();
}

void CopyText(char* dst, size_t capacity, absl::string_view text) {
  const size_t n = std::min(text.size(), capacity - 1);
  std::memcpy(dst, text.data(), n);
  dst[n] = '\0';
}

// The completion record of an OK call with `report` (the engine's, or the part of it known at the
// launch for an answer the device stores).
wire::RingCompletion RecordOf(const v1::ExecutionReport& report) {
  wire::RingCompletion c{};
  c.code = 0;
  c.path = static_cast<uint32_t>(report.path());
  c.fallback_reason = static_cast<uint32_t>(report.fallback_reason());
  c.batch_requests = report.batch_requests();
  c.server_seconds = report.server_seconds();
  c.queue_seconds = report.queue_seconds();
  c.kernel_seconds = report.kernel_seconds();
  const v1::StageSeconds& stages = report.stages();
  c.decode_seconds = stages.decode();
  c.copy_in_seconds = stages.copy_in();
  c.device_seconds = stages.device();
  c.copy_out_seconds = stages.copy_out();
  c.response_seconds = stages.response();
  CopyText(c.fallback_detail, sizeof(c.fallback_detail), report.fallback_detail());
  return c;
}

// The compute engine's transport for a ring call (exec/transport_call.h). Lives from its
// submission to Complete(), which writes the completion record into the slot and deletes it.
template <typename Op>
class RingCall final : public TransportCall {
 public:
  RingCall(RingCallTarget target, int64_t deadline_ns, typename Op::Messages* held)
      : target_(std::move(target)), deadline_ns_(deadline_ns), held_(held), start_(Clock::now()) {
    target_.in_flight->fetch_add(1, std::memory_order_acq_rel);
    target_.metrics->InflightAdd(1);
  }

  absl::Status LaunchCheck() const override {
    if (target_.ring->closed()) return absl::CancelledError("the call ring closed before the op was launched");
    if (deadline_ns_ != 0 && wire::MonotonicNanos() >= deadline_ns_) {
      return absl::DeadlineExceededError(
          absl::StrFormat("deadline passed after %.6f s in the server; the op was not launched", elapsed()));
    }
    return absl::OkStatus();
  }
  double elapsed() const override { return std::chrono::duration<double>(Clock::now() - start_).count(); }
  uint64_t request_bytes() const override { return sizeof(RingCallDescriptor); }
  OutputBuffers* outputs() override { return &outputs_; }
  void HoldBytes(ByteBudget::Lease lease) override { bytes_ = std::move(lease); }
  void HoldVerifySlot(ByteBudget::Lease slot) override { verify_slot_ = std::move(slot); }

  // A CUDA call whose outputs all lie in CUDA shared memory: the record now, complete_seq by the
  // lane's stream after the kernels (wire::kRingCompletedByDevice). Only where the ring's memory is
  // page-locked for the device.
  std::optional<DeviceAnswer> PrepareDeviceAnswer(const v1::ExecutionReport& so_far) override {
    if (!target_.ring->device_visible()) return std::nullopt;
    wire::RingCompletion c = RecordOf(so_far);  // no kernel or device time yet: 0
    c.flags = wire::kRingCompletedByDevice;
    RingSlot* slot = WriteRecord(target_, c);
    std::atomic_thread_fence(std::memory_order_seq_cst);  // all of it before the stream's store of the seq
    answered_on_device_ = true;
    return DeviceAnswer{reinterpret_cast<uint32_t*>(&slot->control.complete_seq), target_.seq};
  }
  void WithdrawDeviceAnswer() override { answered_on_device_ = false; }

  bool Complete(absl::Status status) override {
    if (status.ok() && answered_on_device_) {
      // The stream stored the seq after the kernels (the lane's wait returned OK after it); the
      // client may be on its next call of this slot already, so nothing of the slot is written.
      // Only a client asleep on the futex needs the server: the device cannot wake it.
      RingSlot* slot = target_.ring->slot(target_.slot);
      if (slot->control.client_waiting.load(std::memory_order_seq_cst) != 0) {
        wire::FutexWakeAll(&slot->control.complete_seq);
      }
      return Finish(status);
    }
    wire::RingCompletion c{};
    if (status.ok()) {
      c = RecordOf(held_->response()->report());
    } else {
      c.code = static_cast<int32_t>(status.code());
      c.server_seconds = elapsed();
      CopyText(c.message, sizeof(c.message), status.message());
    }
    Publish(target_, c);
    return Finish(status);
  }

  // Everything of the answer but the seq: the slot is free for the poller again first (a client that
  // sees its completion may submit its next call at once, and the poller, if it looked while the
  // slot was still busy, sleeps without a doorbell: the slot must not be busy any more when the
  // client can see the seq), then the record. Returns the slot.
  static RingSlot* WriteRecord(const RingCallTarget& target, const wire::RingCompletion& c) {
    RingSlot* slot = target.ring->slot(target.slot);
    target.ring->busy(target.slot).store(false, std::memory_order_seq_cst);
    std::memcpy(&slot->completion, &c, sizeof(c));
    return slot;
  }
  // Writes `c` and makes it the answer to the call's seq: WriteRecord, then the seq (release: a
  // client that sees the seq sees the record), then the wake if the client sleeps.
  static void Publish(const RingCallTarget& target, const wire::RingCompletion& c) {
    RingSlot* slot = WriteRecord(target, c);
    slot->control.complete_seq.store(target.seq, std::memory_order_seq_cst);
    if (slot->control.client_waiting.load(std::memory_order_seq_cst) != 0) {
      wire::FutexWakeAll(&slot->control.complete_seq);
    }
  }

 private:
  // The call's bookkeeping once it is answered; deletes the call.
  bool Finish(const absl::Status& status) {
    target_.metrics->RecordRequest(Op::kMethod, static_cast<grpc::StatusCode>(status.code()), elapsed(),
                                   request_bytes(), 0);
    bytes_ = {};
    verify_slot_ = {};
    held_->Release();
    target_.metrics->InflightAdd(-1);
    target_.in_flight->fetch_sub(1, std::memory_order_acq_rel);
    delete this;  // the ring may be unmapped from here on (the last call of a closed ring)
    return status.ok();
  }

  const RingCallTarget target_;
  const int64_t deadline_ns_;
  typename Op::Messages* const held_;
  const Clock::time_point start_;
  OutputBuffers outputs_;
  ByteBudget::Lease bytes_;
  ByteBudget::Lease verify_slot_;
  bool answered_on_device_ = false;  // PrepareDeviceAnswer took the offer, not withdrawn since
};

template <typename Op, typename Fill>
void Submit(ComputeEngine& engine, const RingCallTarget& target, const RingCallDescriptor& call, Fill fill) {
  auto* held = new typename Op::Messages();
  auto* transport = new RingCall<Op>(target, call.deadline_ns, held);
  absl::Status s = engine.AdmitDuringDrain();
  if (s.ok()) s = fill(held->request());
  if (!s.ok()) {
    transport->Complete(std::move(s));
    return;
  }
  OpCallSubmission<Op> submission;
  submission.transport = transport;
  submission.messages = held;
  submission.caller_identity = [ring = target.ring] { return ring->identity(); };
  submission.tensor_data = std::make_unique<WireTensorData>();
  engine.Submit(std::move(submission));
}

}  // namespace

absl::Status RingMhcRequest(const RingCallDescriptor& call, const std::vector<std::string>& weight_sets,
                            const std::vector<v1::CallRingRegion>& regions, v1::MhcSeamRequest* request) {
  if (!v1::MhcStage_IsValid(static_cast<int>(call.stage))) {
    return absl::InvalidArgumentError(absl::StrCat("stage ", call.stage, " is not an MhcStage"));
  }
  if (!v1::MhcMode_IsValid(static_cast<int>(call.mode))) {
    return absl::InvalidArgumentError(absl::StrCat("mode ", call.mode, " is not an MhcMode"));
  }
  if ((call.flags & ~wire::kRingFlagCaptureAux) != 0) {
    return absl::InvalidArgumentError(absl::StrFormat("flags 0x%x: unknown bits", call.flags));
  }
  request->set_stage(static_cast<v1::MhcStage>(call.stage));
  request->set_mode(static_cast<v1::MhcMode>(call.mode));
  request->set_capture_aux((call.flags & wire::kRingFlagCaptureAux) != 0);
  return FillCommon(RingOp::kMhcSeam, call, weight_sets, regions, request, MhcInput);
}

absl::Status RingSwaRequest(const RingCallDescriptor& call, const std::vector<std::string>& weight_sets,
                            const std::vector<v1::CallRingRegion>& regions, v1::SwaNormQuantRequest* request) {
  if (call.flags != 0) return absl::InvalidArgumentError(absl::StrFormat("flags 0x%x: unknown bits", call.flags));
  return FillCommon(RingOp::kSwaNormQuant, call, weight_sets, regions, request, SwaInput);
}

void SubmitRingCall(ComputeEngine& engine, const RingCallTarget& target, const RingCallDescriptor& call) {
  const Ring& ring = *target.ring;
  switch (static_cast<RingOp>(call.op)) {
    case RingOp::kMhcSeam:
      target.ring_metrics->calls[0]->Increment();
      Submit<MhcOp>(engine, target, call, [&](v1::MhcSeamRequest* r) {
        if (ring.device_id().has_value()) r->set_device_id(*ring.device_id());
        return RingMhcRequest(call, ring.weight_sets(), ring.regions(), r);
      });
      return;
    case RingOp::kSwaNormQuant:
      target.ring_metrics->calls[1]->Increment();
      Submit<SwaOp>(engine, target, call, [&](v1::SwaNormQuantRequest* r) {
        if (ring.device_id().has_value()) r->set_device_id(*ring.device_id());
        return RingSwaRequest(call, ring.weight_sets(), ring.regions(), r);
      });
      return;
  }
  // Not an op: answered here, in the slot, without a request behind it.
  wire::RingCompletion c{};
  c.code = static_cast<int32_t>(absl::StatusCode::kInvalidArgument);
  CopyText(c.message, sizeof(c.message), absl::StrCat("op ", call.op, " is not an op of the call ring (1: MhcSeam, 2: SwaNormQuant)"));
  RingCall<MhcOp>::Publish(target, c);
}

}  // namespace fusedlayer::server::ring
