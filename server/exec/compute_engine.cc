// The compute engine (exec/compute_engine.h): admission and decode on the transport's thread, then
// on the executor the launch checks, dynamic batching, path choice and fallback, session commit,
// shared-memory write-back, each request's own report and its completion.
#include "exec/compute_engine.h"

#include <algorithm>
#include <chrono>
#include <random>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/log.h"
#include "exec/batch_assembly.h"
#include "exec/dispatcher.h"
#include "exec/op_traits.h"
#include "runtime/stage_times.h"

namespace fusedlayer::server {

namespace {

absl::Status CheckPreference(v1::PathPreference p) {
  if (!v1::PathPreference_IsValid(p)) {
    return absl::InvalidArgumentError(absl::StrCat("unknown path_preference ", static_cast<int>(p)));
  }
  return absl::OkStatus();
}

// verify = true on a request that ran unfused: there is no fused output to compare. The reason is
// the same label the fallback metric uses.
v1::Verification NotComparedUnfused(const PathDecision& decision) {
  v1::Verification v;
  v.set_compared(false);
  v.set_reason(absl::StrCat("ran unfused (",
                            decision.reason.has_value() ? FallbackReasonName(*decision.reason) : "no reason", ")"));
  return v;
}

bool SameAnswer(const FusedSupport& a, const FusedSupport& b) {
  return a.supported == b.supported && (a.supported || a.reason == b.reason);
}

}  // namespace

// One compute request on the executor. Alone or in a batch, it keeps its own messages and writes
// its own report; a batch shares only the launch.
template <typename Op>
class ComputeEngine::QueuedCall final : public BatchableTask {
 public:
  QueuedCall(ComputeEngine& engine, ServingDevice& device, TransportCall* call, typename Op::Messages* held,
             const typename Op::Request* request, typename Op::Response* response,
             std::shared_ptr<const WeightSet> set, typename Op::Call decoded,
             std::unique_ptr<transport::TensorTransfer> transfer, std::unique_ptr<WireTensorData> wire,
             transport::ResidualSessionStore::Lease session, bool shadow_sampled, double decode_seconds)
      : engine_(engine),
        device_(device),
        call_(call),
        held_(held),
        request_(request),
        response_(response),
        set_(std::move(set)),
        decoded_(std::move(decoded)),
        transfer_(std::move(transfer)),
        wire_(std::move(wire)),
        session_(std::move(session)),
        outputs_(call->outputs()->empty() ? nullptr : call->outputs()),
        shadow_sampled_(shadow_sampled),
        decode_seconds_(decode_seconds) {
    device_.calls_in_flight.fetch_add(1, std::memory_order_relaxed);
  }
  // Refused by a full queue, the call was never answered here: its load drops with it.
  ~QueuedCall() override {
    if (!answered_) device_.calls_in_flight.fetch_sub(1, std::memory_order_relaxed);
  }

  int64_t tokens() const override { return decoded_.args.tokens; }
  bool launchable() const override { return call_->LaunchCheck().ok(); }
  // verify runs the unfused comparison in the same job (per request), and an empty request has
  // nothing to share.
  // Inputs used where they lie in page-locked shared memory are the device's to read only, and a
  // batch is assembled by memcpy (exec/batch_assembly.h).
  // A residual session's state, and tensors in CUDA shared memory, are in device memory, which
  // batch assembly cannot gather.
  bool batchable() const override {
    return !request_->verify() && decoded_.args.tokens > 0 &&
           !(transfer_ != nullptr && (transfer_->inputs_in_place() || transfer_->uses_device_memory())) &&
           !session_.held();
  }
  bool CompatibleWith(const BatchableTask& other) const override {
    const auto* o = dynamic_cast<const QueuedCall*>(&other);
    return o != nullptr && o->set_ == set_ && Op::SameBatch(*request_, *o->request_);
  }

 private:
  void RunBatch(std::vector<std::unique_ptr<BatchableTask>>& batch, const std::vector<double>& queue_seconds) override;
  // Path choice and run with fallback for `call` (one request's or a batch's); its stage times
  // are added to `times`. `answer_on_device`: the request alone, offered to answer from the device
  // (AnswersOnDevice).
  absl::StatusOr<DispatchOutcome> Execute(const typename Op::Call& call, const std::string& what, StageTimes* times,
                                          OutputBuffers* outputs, HostRange pinned_inputs = {},
                                          HostRange pinned_outputs = {}, bool answer_on_device = false) const;
  // Whether this request, run alone, may have its answer stored by the device after its work
  // (TransportCall::PrepareDeviceAnswer): on a lane, with every output it places in CUDA shared
  // memory (nothing for the server to write after the wait), no session state to copy back, no
  // verify run to compare. Whether the transport takes the offer is its own.
  bool AnswersOnDevice() const {
    return device_.lanes->lanes() > 0 && transfer_ != nullptr && transfer_->outputs_all_on_device() &&
           !session_.held() && !request_->verify();
  }
  // The call's one answer: the device's load drops first, so that a client's next call, sent as
  // soon as this one's response arrives, finds the device as loaded as it now is.
  bool Answer(absl::Status status) {
    answered_ = true;
    device_.calls_in_flight.fetch_sub(1, std::memory_order_relaxed);
    return call_->Complete(std::move(status));
  }
  // Metrics, report, verify or shadow sampling, response: this request's part after the launch.
  void Finish(const absl::StatusOr<DispatchOutcome>& ran, size_t batch_requests, int64_t batch_tokens);
  // Where this request's inputs were read into page-locked memory: its shared-memory inputs'
  // block, else the block its message's tensor data was read into (either may be empty; the lane
  // copies from there only when every input lies in it).
  HostRange PinnedInputs() const {
    if (transfer_ != nullptr && transfer_->pinned_inputs().begin != nullptr) return transfer_->pinned_inputs();
    return HostRange{wire_->begin(), wire_->end()};
  }
  // Where the device writes this request's outputs in place (its page-locked shared memory), or empty.
  HostRange PinnedOutputs() const { return transfer_ != nullptr ? transfer_->pinned_outputs() : HostRange{}; }
  std::string What() const {
    return absl::StrCat("request ", response_->request_id(), " (weight set '", set_->name, "', ",
                        Op::kTokensSymbol, " = ", decoded_.args.tokens, ")");
  }

  ComputeEngine& engine_;
  ServingDevice& device_;  // where it runs: its executor's queue, its lanes, its prepared weights
  TransportCall* const call_;
  typename Op::Messages* const held_;
  const typename Op::Request* const request_;
  typename Op::Response* const response_;
  const std::shared_ptr<const WeightSet> set_;
  const typename Op::Call decoded_;
  // Shared-memory tensors of this request (null when it has none): the staged inputs the call
  // views, and the outputs written to their regions after the run (server/transport/).
  const std::unique_ptr<transport::TensorTransfer> transfer_;
  // The request's tensor data when it was read into a pinned block instead of the message
  // (codec/wire_tensor_data.h): the decoded views point into it. Never null.
  const std::unique_ptr<WireTensorData> wire_;
  // The residual session this call holds (transport/residual_sessions.h), or none. Released before
  // the response is sent, so that the client's next call of the session finds it free.
  transport::ResidualSessionStore::Lease session_;
  // Where the request's output views point when not into the response message (runtime/output_buffers.h):
  // run alone on a lane, they may take over its staging block instead of a copy. Null otherwise.
  OutputBuffers* const outputs_;
  // Drawn before decoding (ShadowVerifier::Sample): a sampled request keeps its outputs in the
  // response message, where its shadow job reads them after the response is sent.
  const bool shadow_sampled_;
  double queue_seconds_ = 0;
  const double decode_seconds_;  // on the transport's thread, receipt to hand-off (AdmitAndQueue)
  StageTimes stages_;            // of this request's launch (the batch's when it shared one)
  bool answered_ = false;        // Answer ran (the device's load already dropped)
};

template <typename Op>
absl::StatusOr<DispatchOutcome> ComputeEngine::QueuedCall<Op>::Execute(const typename Op::Call& call,
                                                                     const std::string& what,
                                                                     StageTimes* times,
                                                                     OutputBuffers* outputs,
                                                                     HostRange pinned_inputs,
                                                                     HostRange pinned_outputs,
                                                                     bool answer_on_device) const {
  const typename Op::Prepared& part = *Op::Part(*set_, device_.ordinal);
  Backend& backend = *device_.backend;
  const v1::PathPreference preference = request_->path_preference();
  absl::StatusOr<PathDecision> decision = ChoosePath(Op::kOp, preference, engine_.config_.fused_disabled(Op::kOp),
                                                     [&] { return Op::Support(backend, part, call); });
  if (!decision.ok()) return decision.status();
  // This worker's lane (or the backend itself on a host-accessible backend).
  ExecTarget target = device_.lanes->For(device_.executor->worker_index());
  target.times = times;
  target.outputs = outputs;
  target.pinned_inputs = pinned_inputs;
  target.pinned_outputs = pinned_outputs;
  if (session_.held()) target.resident = session_.memory();
  if (transfer_ != nullptr && transfer_->uses_device_memory()) target.resident = transfer_->device_ranges();
  if (!answer_on_device || target.lane == nullptr) {
    return RunWithFallback(Op::kOp, *decision, preference == v1::PATH_PREFERENCE_REQUIRE_FUSED, what,
                           [&](Path path) { return Op::Run(target, part, call, path); });
  }
  // Offered on the chosen path's run only: a re-run after a failed fused run is answered after its
  // wait (its report names the failure, which is known only then).
  return RunWithFallback(Op::kOp, *decision, preference == v1::PATH_PREFERENCE_REQUIRE_FUSED, what, [&](Path path) {
    if (path != decision->path) return Op::Run(target, part, call, path);
    bool prepared = false;
    ExecTarget answering = target;
    answering.answer_on_device = [&](Lane& lane) {
      v1::ExecutionReport so_far;
      so_far.set_path(ToProto(path));
      so_far.set_fallback_reason(decision->reason.has_value() ? ToProto(*decision->reason) : v1::FALLBACK_REASON_NONE);
      so_far.set_fallback_detail(decision->detail);
      so_far.set_queue_seconds(queue_seconds_);
      so_far.set_batch_requests(1);
      so_far.set_batch_tokens(call.args.tokens);
      so_far.mutable_stages()->set_decode(decode_seconds_);
      so_far.mutable_stages()->set_copy_in(times->copy_in);
      so_far.set_server_seconds(call_->elapsed());
      std::optional<TransportCall::DeviceAnswer> answer = call_->PrepareDeviceAnswer(so_far);
      if (!answer.has_value()) return;
      if (lane.EnqueueHostWrite(answer->word, answer->value).ok()) {
        prepared = true;
      } else {
        call_->WithdrawDeviceAnswer();
      }
    };
    absl::StatusOr<RunStats> ran = Op::Run(answering, part, call, path);
    // A failed wait means the stream stopped before the store: the answer is Complete()'s again.
    if (prepared && !ran.ok()) call_->WithdrawDeviceAnswer();
    return ran;
  });
}

template <typename Op>
void ComputeEngine::QueuedCall<Op>::RunBatch(std::vector<std::unique_ptr<BatchableTask>>& batch,
                                             const std::vector<double>& queue_seconds) {
  Metrics& metrics = engine_.metrics_;
  std::vector<QueuedCall*> live;
  for (size_t i = 0; i < batch.size(); ++i) {
    auto* task = static_cast<QueuedCall*>(batch[i].get());
    task->queue_seconds_ = queue_seconds[i];
    metrics.ObserveQueue(device_.ordinal, queue_seconds[i]);
    if (absl::Status s = task->call_->LaunchCheck(); !s.ok()) {
      task->session_ = {};
      task->Answer(std::move(s));  // expired or cancelled while queued: not launched
      continue;
    }
    live.push_back(task);
  }
  if (live.size() > 1) {
    const typename Op::Prepared& part = *Op::Part(*set_, device_.ordinal);
    BatchAssembly assembly;
    std::vector<const typename Op::Call*> calls;
    for (const QueuedCall* task : live) calls.push_back(&task->decoded_);
    const typename Op::Call batched = Op::Gather(assembly, calls, part);
    // A batch must not change any request's path: the batched shape has to get the same
    // fused-support answer as every request alone (e.g. --fused_max_tokens, workspace limits).
    const FusedSupport batched_support = Op::Support(*device_.backend, part, batched);
    bool same_path = true;
    std::vector<FusedSupport> alone;  // each request's own answer
    for (const QueuedCall* task : live) {
      alone.push_back(Op::Support(*device_.backend, part, task->decoded_));
      same_path = same_path && SameAnswer(batched_support, alone.back());
    }
    if (same_path) {
      const std::string what = absl::StrCat("a batch of ", live.size(), " requests from ", live.front()->What(),
                                            ", ", Op::kTokensSymbol, " = ", batched.args.tokens, " in all");
      StageTimes times;
      // Launched through a live request, never through `this`: batch[0] may have been answered
      // above (expired or cancelled), and its transport may already have freed its call's messages.
      // (The batch's outputs are scattered into each request's buffers: none takes over staging.)
      absl::StatusOr<DispatchOutcome> ran = live.front()->Execute(batched, what, &times, /*outputs=*/nullptr);
      if (ran.ok()) {
        // (Scattering the batch's outputs into the responses falls between stages: it is in
        // server_seconds but in no stage.)
        for (QueuedCall* task : live) task->stages_ = times;
        assembly.Scatter();
        metrics.RecordBatch(device_.ordinal, Op::kOp, live.size(), batched.args.tokens);
        for (size_t i = 0; i < live.size(); ++i) {
          absl::StatusOr<DispatchOutcome> mine = ran;
          // A fallback that the batched shape's answer decided is each request's own (same_path), but
          // its detail names the batch's shape: each report says its own request's.
          if (!batched_support.supported && mine->decision.reason == batched_support.reason &&
              mine->decision.detail == batched_support.detail) {
            mine->decision.detail = alone[i].detail;
          }
          live[i]->Finish(mine, live.size(), batched.args.tokens);
        }
        return;
      }
      // The batch failed (e.g. out of device memory for its staging): each request alone may not.
      LogWarning(what, " failed (", ran.status().ToString(), "); running its requests one by one");
    }
  }
  for (QueuedCall* task : live) {
    // Alone, its inputs are copied to the device from where they were read (when pinned).
    absl::StatusOr<DispatchOutcome> ran =
        task->Execute(task->decoded_, task->What(), &task->stages_, task->outputs_, task->PinnedInputs(),
                      task->PinnedOutputs(), task->AnswersOnDevice());
    metrics.RecordBatch(device_.ordinal, Op::kOp, 1, task->decoded_.args.tokens);
    task->Finish(ran, 1, task->decoded_.args.tokens);
  }
}

template <typename Op>
void ComputeEngine::QueuedCall<Op>::Finish(const absl::StatusOr<DispatchOutcome>& ran, size_t batch_requests,
                                           int64_t batch_tokens) {
  const auto response_start = std::chrono::steady_clock::now();
  Metrics& metrics = engine_.metrics_;
  shadow::ShadowVerifier& shadow = engine_.shadow_;
  std::unique_ptr<shadow::ShadowVerifier::Job> shadow_job;
  if (ran.ok() && session_.held()) {
    // The new state is in the session's other copy: copies for the response (return_state), then
    // it becomes the session's state. A failed call leaves the session as it was.
    for (const MhcCall::CopyBack& c : Op::CopiesAfterRun(decoded_)) {
      if (absl::Status s = device_.backend->CopyToHost(c.host, c.device, c.bytes); !s.ok()) {
        session_ = {};
        Answer(std::move(s));
        return;
      }
    }
    session_.Commit(Op::LeavesMixes(decoded_));
  }
  session_ = {};  // before the response: the client's next call of the session may come at once
  if (ran.ok() && transfer_ != nullptr) {
    // Outputs to their regions before the report: a region that shrank or vanished meanwhile
    // fails this request alone (FAILED_PRECONDITION), the batch it shared a launch with is not affected.
    if (absl::Status s = transfer_->WriteOutputs(outputs_); !s.ok()) {
      Answer(std::move(s));
      return;
    }
  }
  if (ran.ok()) {
    const PathDecision& d = ran->decision;
    metrics.RecordExecution(device_.ordinal, Op::kOp, d.path, ran->stats.kernel_seconds);
    if (d.reason.has_value()) metrics.RecordFallback(device_.ordinal, Op::kOp, *d.reason);
    v1::ExecutionReport* report = response_->mutable_report();
    report->set_path(ToProto(d.path));
    report->set_fallback_reason(d.reason.has_value() ? ToProto(*d.reason) : v1::FALLBACK_REASON_NONE);
    report->set_fallback_detail(d.detail);
    report->set_kernel_seconds(ran->stats.kernel_seconds);
    report->set_queue_seconds(queue_seconds_);
    report->set_batch_requests(static_cast<uint32_t>(batch_requests));
    report->set_batch_tokens(batch_tokens);
    if (request_->verify()) {
      // Synchronous: the unfused run and the comparison happen in this job, before the response.
      *response_->mutable_verification() =
          d.path == Path::kFused ? Op::Verify(shadow, *set_, *request_, *response_, device_.ordinal)
                                 : NotComparedUnfused(d);
    } else if (d.path == Path::kFused && decoded_.args.tokens > 0 && shadow_sampled_) {
      // No copy: the job takes a reference to this call's messages (shadow/shared_messages.h).
      // Only the report is written after this, before the response is sent; the job never reads it.
      shadow_job = Op::Capture(shadow, set_, held_, device_.ordinal);
    }
    engine_.FillReport(report, set_->name, device_);
    v1::StageSeconds* stages = report->mutable_stages();
    stages->set_decode(decode_seconds_);
    stages->set_copy_in(stages_.copy_in);
    stages->set_device(stages_.device);
    stages->set_copy_out(stages_.copy_out);
    // Last: every stage ends before server_seconds is read, so they add up to at most it.
    stages->set_response(SecondsBetween(response_start, std::chrono::steady_clock::now()));
    report->set_server_seconds(call_->elapsed());
    metrics.RecordStages(device_.ordinal, Op::kOp, RequestStages{decode_seconds_, queue_seconds_, stages_.copy_in, stages_.device,
                                                 stages_.copy_out, stages->response()});
  }
  // A response over the send limit is cleared and not sent: nothing to shadow-verify.
  if (!Answer(ran.status())) shadow_job.reset();
  // After the response: the shadow run waits in the executor's background lane.
  shadow.Submit(std::move(shadow_job));
}

ComputeEngine::ComputeEngine(const ServerConfig& config, ServingDevices& devices, WeightManager& weights,
                             Metrics& metrics, shadow::ShadowVerifier& shadow,
                             transport::SharedMemoryRegistry& shared_memory,
                             transport::CudaSharedMemoryRegistry& cuda_shared_memory,
                             transport::ResidualSessionStore& sessions)
    : config_(config),
      devices_(devices),
      primary_lanes_(*devices.primary().lanes),
      weights_(weights),
      metrics_(metrics),
      shadow_(shadow),
      shared_memory_(shared_memory),
      cuda_shared_memory_(cuda_shared_memory),
      sessions_(sessions),
      inflight_bytes_(config.EffectiveMaxInflightBytes(), metrics.inflight_bytes()),
      verify_slots_(static_cast<uint64_t>(config.max_inflight_verify)),
      request_id_salt_(std::random_device{}() & 0xffffff) {}

std::string ComputeEngine::RequestId(const std::string& given) {
  // Echoed in the response and written into log lines and error messages: escaped and bounded.
  if (!given.empty()) return ClientString(given);
  return absl::StrFormat("srv-%06x-%d", request_id_salt_, next_request_id_.fetch_add(1, std::memory_order_relaxed));
}

void ComputeEngine::FillReport(v1::ExecutionReport* report, const std::string& weight_set,
                               const ServingDevice& device) const {
  report->set_backend(device.kind);
  report->set_device(device.name);
  report->set_device_id(device.device_id);
  report->set_weight_set(weight_set);
}

absl::StatusOr<ServingDevice*> ComputeEngine::ChooseDevice(std::optional<int> named,
                                                           const transport::TensorTransfer* transfer,
                                                           const transport::ResidualSessionStore::Lease& session) {
  // Where the call's data already is decides; a name must agree with it.
  ServingDevice* bound = nullptr;
  const char* bound_by = "";
  if (transfer != nullptr && transfer->uses_device_memory()) {
    bound = devices_.FindById(transfer->device_id());
    bound_by = "its CUDA shared-memory tensors";
    if (bound == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("its CUDA shared-memory tensors are on GPU ", transfer->device_id(),
                                                     ", which this server does not serve on (", devices_.Describe(),
                                                     ")"));
    }
  } else if (session.held()) {
    bound = &devices_[session.session().device()];
    bound_by = "its residual session";
  }
  if (named.has_value()) {
    absl::StatusOr<ServingDevice*> d = devices_.Named(*named);
    if (!d.ok()) return d.status();
    if (bound != nullptr && *d != bound) {
      return absl::InvalidArgumentError(absl::StrCat("device_id ", *named, ": ", bound_by, " are on device_id ",
                                                     bound->device_id, " (", bound->label,
                                                     "); a call runs where its device data is"));
    }
    return *d;
  }
  return bound != nullptr ? bound : &devices_.LeastLoaded();
}

absl::Status ComputeEngine::AdmitDuringDrain() const {
  if (!draining_.load(std::memory_order_acquire)) return absl::OkStatus();
  return absl::UnavailableError("the server is draining (shutting down); retry on another replica");
}

absl::Status ComputeEngine::AdmitComputeBytes(TransportCall* call, const ResponseSize& response,
                                                  uint64_t staged_bytes) {
  const uint64_t send_limit = static_cast<uint64_t>(config_.max_message_bytes);
  if (response.sent > send_limit) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the response would hold ", response.sent, " bytes of tensors, over the server's send limit of ", send_limit,
        " bytes (--max_message_bytes); refused before running; send fewer tokens per call, or place the outputs "
        "in shared memory"));
  }
  // What the call holds in server memory: its request, its outputs (those the kernels write in the
  // client's CUDA buffers excepted) and its shared-memory inputs read into staging.
  uint64_t need = call->request_bytes() + response.held;
  if (__builtin_add_overflow(need, staged_bytes, &need)) need = UINT64_MAX;
  if (need > inflight_bytes_.limit()) {
    return absl::ResourceExhaustedError(absl::StrCat("this call needs ", need, " bytes (request ",
                                                     call->request_bytes(), " + outputs ", response.held,
                                                     staged_bytes > 0 ? absl::StrCat(" + shared-memory inputs ", staged_bytes) : "",
                                                     "), more than the server admits at once (--max_inflight_bytes = ",
                                                     inflight_bytes_.limit(), "); send fewer tokens per call"));
  }
  std::optional<ByteBudget::Lease> lease = inflight_bytes_.TryAcquire(need);
  if (!lease.has_value()) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "server busy: this call needs ", need, " bytes and the compute calls in flight already hold ",
        inflight_bytes_.in_use(), " of ", inflight_bytes_.limit(), " (--max_inflight_bytes); retry with backoff"));
  }
  call->HoldBytes(std::move(*lease));
  return absl::OkStatus();
}

absl::Status ComputeEngine::AdmitVerify(TransportCall* call) {
  if (verify_slots_.limit() == 0) {
    return absl::FailedPreconditionError(
        "verify is switched off on this server (--max_inflight_verify=0); send the call without verify");
  }
  std::optional<ByteBudget::Lease> slot = verify_slots_.TryAcquire(1);
  if (!slot.has_value()) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "server busy: ", verify_slots_.limit(), " verify = true calls are already in flight (--max_inflight_verify; "
        "each runs the op twice); retry with backoff or send the call without verify"));
  }
  call->HoldVerifySlot(std::move(*slot));
  return absl::OkStatus();
}

// On the transport's thread: admit and decode, then queue the request on the device executor.
template <typename Op>
absl::Status ComputeEngine::AdmitAndQueue(OpCallSubmission<Op>& submission) {
  TransportCall* const call = submission.transport;
  typename Op::Messages* const held = submission.messages;
  const typename Op::Request* const request = held->request();
  typename Op::Response* const response = held->response();
  std::unique_ptr<WireTensorData>& wire = submission.tensor_data;
  if (absl::Status s = CheckPreference(request->path_preference()); !s.ok()) return s;
  if (request->verify()) {
    if (absl::Status s = AdmitVerify(call); !s.ok()) return s;
  }
  absl::StatusOr<std::shared_ptr<const WeightSet>> set = weights_.Get(request->weight_set());
  if (!set.ok()) return set.status();
  // Sizes and decoding read the part's hyper-parameters, the same on every device: the primary's.
  if (Op::Part(**set, 0) == nullptr) {
    return absl::NotFoundError(
        absl::StrCat("weight set '", request->weight_set(), "' has no ", Op::kPartName, " part"));
  }
  // Memory admission: the response is sized from the request and admitted by bytes before any of
  // it is allocated (docs/operations.md, "Memory admission").
  absl::StatusOr<ResponseSize> response_bytes = Op::ResponseBytes(*request, *Op::Part(**set, 0), config_.max_tokens);
  if (!response_bytes.ok()) return response_bytes.status();
  // Shared-memory inputs are staged in server memory: admitted with the response, before reading.
  std::unique_ptr<transport::TensorTransfer> transfer;
  uint64_t staged_bytes = 0;
  if (transport::UsesSharedMemory(*request)) {
    transfer = std::make_unique<transport::TensorTransfer>(&shared_memory_, &cuda_shared_memory_,
                                                           submission.caller_identity());
    // What its references claim, up to what a valid request of this size has (a larger claim is
    // refused by decode as INVALID_ARGUMENT, never read): a wrong shape is not RESOURCE_EXHAUSTED.
    staged_bytes = std::min(transport::SharedMemoryInputBytes(*request), response_bytes->inputs_at_most);
  }
  if (absl::Status s = AdmitComputeBytes(call, *response_bytes, staged_bytes); !s.ok()) return s;
  // On a device backend, inputs in a page-locked region are used where they lie; others are read
  // into page-locked memory (when a block is free).
  if (transfer != nullptr && !transfer->UseInputsInPlace(transport::InputTensors(*request))) {
    transfer->ReadInputsIntoPinned(primary_lanes_.request_staging(), staged_bytes);
  }
  // A residual session call holds its session from here to its response (one call at a time).
  transport::ResidualSessionStore::Lease session;
  if (const std::string& name = Op::SessionName(*request); !name.empty()) {
    absl::StatusOr<transport::ResidualSessionStore::Lease> held =
        sessions_.Acquire(submission.caller_identity(), name, (*set)->name);
    if (!held.ok()) return held.status();
    session = std::move(*held);
    // An unload between weights_.Get above and Acquire found no session using the set (its
    // CloseUsing ran first); the set is gone or replaced by then, so the session closes here. This
    // call still runs on the set it holds, like every call in flight at an unload; its state is
    // dropped with the session.
    absl::StatusOr<std::shared_ptr<const WeightSet>> now = weights_.Get(request->weight_set());
    if (!now.ok() || now->get() != set->get()) (void)sessions_.Close(submission.caller_identity(), name);
  }
  // A request the shadow verifier samples (fused runs only; a shared-memory or session request is
  // not sampled: the shadow job re-reads the inline messages) keeps its outputs in the response
  // message for the job to read; every other one has them outside it, sent without copies.
  const bool shadow_sampled = transfer == nullptr && !session.held() && !request->verify() && shadow_.Sample();
  // Both read the request's tensors from its message.
  if (request->verify() || shadow_sampled) wire->MoveIntoMessages();
  absl::StatusOr<typename Op::Call> decoded =
      Op::Decode(*request, *Op::Part(**set, 0), config_.max_tokens, response, transfer.get(),
                  shadow_sampled ? nullptr : call->outputs(), wire.get(), session.held() ? &session : nullptr);
  if (!decoded.ok()) return decoded.status();
  absl::StatusOr<ServingDevice*> device = ChooseDevice(
      request->has_device_id() ? std::optional<int>(request->device_id()) : std::nullopt, transfer.get(), session);
  if (!device.ok()) return device.status();
  response->set_request_id(RequestId(request->request_id()));
  // The decode stage ends here: the queue wait starts inside SubmitBatchable.
  const double decode_seconds = call->elapsed();
  return (*device)->executor->SubmitBatchable(std::make_unique<QueuedCall<Op>>(
      *this, **device, call, held, request, response, std::move(*set), std::move(*decoded), std::move(transfer), std::move(wire),
      std::move(session), shadow_sampled, decode_seconds));
}


template <typename Op>
void ComputeEngine::Submit(OpCallSubmission<Op> submission) {
  if (absl::Status s = AdmitAndQueue(submission); !s.ok()) submission.transport->Complete(std::move(s));
}

template void ComputeEngine::Submit<MhcOp>(OpCallSubmission<MhcOp> submission);
template void ComputeEngine::Submit<SwaOp>(OpCallSubmission<SwaOp> submission);

}  // namespace fusedlayer::server
