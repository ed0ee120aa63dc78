// The compute RPCs (MhcSeam, SwaNormQuant). Inline on the gRPC thread: validate and decode the
// request (rpc/proto_convert.h) and queue it as a ComputeTask. On the executor: the launch checks,
// dynamic batching with compatible queued requests (exec/executor.h, exec/batch_assembly.h), the
// path choice and run with fallback (exec/dispatcher.h), verify or shadow sampling, each request's
// own report, the response. What differs between the two ops is in rpc/op_traits.h.
#include <chrono>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "auth/caller_identity.h"
#include "common/log.h"
#include "exec/batch_assembly.h"
#include "exec/dispatcher.h"
#include "exec/stage_times.h"
#include "rpc/op_traits.h"
#include "rpc/proto_convert.h"
#include "rpc/service.h"
#include "rpc/unary_call.h"
#include "rpc/wire_messages.h"

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
template <typename Rpc>
class FusedLayerService::ComputeTask final : public BatchableTask {
 public:
  ComputeTask(FusedLayerService& service, ComputeCall* call, typename Rpc::Messages* held,
              const typename Rpc::Request* request, typename Rpc::Response* response,
              std::shared_ptr<const WeightSet> set, typename Rpc::Call decoded,
              std::unique_ptr<transport::TensorTransfer> transfer, std::unique_ptr<WireTensorData> wire,
              transport::ResidualSessionStore::Lease session, bool shadow_sampled, double decode_seconds)
      : service_(service),
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
        decode_seconds_(decode_seconds) {}

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
    const auto* o = dynamic_cast<const ComputeTask*>(&other);
    return o != nullptr && o->set_ == set_ && Rpc::SameBatch(*request_, *o->request_);
  }

 private:
  void RunBatch(std::vector<std::unique_ptr<BatchableTask>>& batch, const std::vector<double>& queue_seconds) override;
  // Path choice and run with fallback for `call` (one request's or a batch's); its stage times
  // are added to `times`.
  absl::StatusOr<DispatchOutcome> Execute(const typename Rpc::Call& call, const std::string& what, StageTimes* times,
                                          OutputBuffers* outputs, HostRange pinned_inputs = {},
                                          HostRange pinned_outputs = {}) const;
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
                        Rpc::kTokensSymbol, " = ", decoded_.args.tokens, ")");
  }

  FusedLayerService& service_;
  ComputeCall* const call_;
  typename Rpc::Messages* const held_;
  const typename Rpc::Request* const request_;
  typename Rpc::Response* const response_;
  const std::shared_ptr<const WeightSet> set_;
  const typename Rpc::Call decoded_;
  // Shared-memory tensors of this request (null when it has none): the staged inputs the call
  // views, and the outputs written to their regions after the run (server/transport/).
  const std::unique_ptr<transport::TensorTransfer> transfer_;
  // The request's tensor data when it was read into a pinned block instead of the message
  // (rpc/wire_messages.h): the decoded views point into it. Never null.
  const std::unique_ptr<WireTensorData> wire_;
  // The residual session this call holds (transport/residual_sessions.h), or none. Released before
  // the response is sent, so that the client's next call of the session finds it free.
  transport::ResidualSessionStore::Lease session_;
  // Where the request's output views point when not into the response message (exec/output_buffers.h):
  // run alone on a lane, they may take over its staging block instead of a copy. Null otherwise.
  OutputBuffers* const outputs_;
  // Drawn before decoding (ShadowVerifier::Sample): a sampled request keeps its outputs in the
  // response message, where its shadow job reads them after the response is sent.
  const bool shadow_sampled_;
  double queue_seconds_ = 0;
  const double decode_seconds_;  // on the gRPC thread, receipt to hand-off (StartCompute)
  StageTimes stages_;            // of this request's launch (the batch's when it shared one)
};

template <typename Rpc>
absl::StatusOr<DispatchOutcome> FusedLayerService::ComputeTask<Rpc>::Execute(const typename Rpc::Call& call,
                                                                             const std::string& what,
                                                                             StageTimes* times,
                                                                             OutputBuffers* outputs,
                                                                             HostRange pinned_inputs,
                                                                             HostRange pinned_outputs) const {
  const typename Rpc::Prepared& part = *Rpc::Part(*set_);
  Backend& backend = service_.backend_;
  const v1::PathPreference preference = request_->path_preference();
  absl::StatusOr<PathDecision> decision = ChoosePath(Rpc::kOp, preference, service_.config_.fused_disabled(Rpc::kOp),
                                                     [&] { return Rpc::Support(backend, part, call); });
  if (!decision.ok()) return decision.status();
  // This worker's lane (or the backend itself on a host-accessible backend).
  ExecTarget target = service_.lanes_.For(service_.executor_.worker_index());
  target.times = times;
  target.outputs = outputs;
  target.pinned_inputs = pinned_inputs;
  target.pinned_outputs = pinned_outputs;
  if (session_.held()) target.resident = session_.memory();
  if (transfer_ != nullptr && transfer_->uses_device_memory()) target.resident = transfer_->device_ranges();
  return RunWithFallback(Rpc::kOp, *decision, preference == v1::PATH_PREFERENCE_REQUIRE_FUSED, what,
                         [&](Path path) { return Rpc::Run(target, part, call, path); });
}

template <typename Rpc>
void FusedLayerService::ComputeTask<Rpc>::RunBatch(std::vector<std::unique_ptr<BatchableTask>>& batch,
                                                   const std::vector<double>& queue_seconds) {
  Metrics& metrics = service_.metrics_;
  std::vector<ComputeTask*> live;
  for (size_t i = 0; i < batch.size(); ++i) {
    auto* task = static_cast<ComputeTask*>(batch[i].get());
    task->queue_seconds_ = queue_seconds[i];
    metrics.ObserveQueue(queue_seconds[i]);
    if (absl::Status s = task->call_->LaunchCheck(); !s.ok()) {
      task->session_ = {};
      task->call_->Complete(std::move(s));  // expired or cancelled while queued: not launched
      continue;
    }
    live.push_back(task);
  }
  if (live.size() > 1) {
    const typename Rpc::Prepared& part = *Rpc::Part(*set_);
    BatchAssembly assembly;
    std::vector<const typename Rpc::Call*> calls;
    for (const ComputeTask* task : live) calls.push_back(&task->decoded_);
    const typename Rpc::Call batched = Rpc::Gather(assembly, calls, part);
    // A batch must not change any request's path: the batched shape has to get the same
    // fused-support answer as every request alone (e.g. --fused_max_tokens, workspace limits).
    const FusedSupport batched_support = Rpc::Support(service_.backend_, part, batched);
    bool same_path = true;
    std::vector<FusedSupport> alone;  // each request's own answer
    for (const ComputeTask* task : live) {
      alone.push_back(Rpc::Support(service_.backend_, part, task->decoded_));
      same_path = same_path && SameAnswer(batched_support, alone.back());
    }
    if (same_path) {
      const std::string what = absl::StrCat("a batch of ", live.size(), " requests from ", live.front()->What(),
                                            ", ", Rpc::kTokensSymbol, " = ", batched.args.tokens, " in all");
      StageTimes times;
      // Launched through a live request, never through `this`: batch[0] may have been answered
      // above (expired or cancelled), and gRPC may already have freed its call's messages.
      // (The batch's outputs are scattered into each request's buffers: none takes over staging.)
      absl::StatusOr<DispatchOutcome> ran = live.front()->Execute(batched, what, &times, /*outputs=*/nullptr);
      if (ran.ok()) {
        // (Scattering the batch's outputs into the responses falls between stages: it is in
        // server_seconds but in no stage.)
        for (ComputeTask* task : live) task->stages_ = times;
        assembly.Scatter();
        metrics.RecordBatch(Rpc::kOp, live.size(), batched.args.tokens);
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
  for (ComputeTask* task : live) {
    // Alone, its inputs are copied to the device from where they were read (when pinned).
    absl::StatusOr<DispatchOutcome> ran =
        task->Execute(task->decoded_, task->What(), &task->stages_, task->outputs_, task->PinnedInputs(),
                      task->PinnedOutputs());
    metrics.RecordBatch(Rpc::kOp, 1, task->decoded_.args.tokens);
    task->Finish(ran, 1, task->decoded_.args.tokens);
  }
}

template <typename Rpc>
void FusedLayerService::ComputeTask<Rpc>::Finish(const absl::StatusOr<DispatchOutcome>& ran, size_t batch_requests,
                                                 int64_t batch_tokens) {
  const auto response_start = std::chrono::steady_clock::now();
  Metrics& metrics = service_.metrics_;
  shadow::ShadowVerifier& shadow = service_.shadow_;
  std::unique_ptr<shadow::ShadowVerifier::Job> shadow_job;
  if (ran.ok() && session_.held()) {
    // The new state is in the session's other copy: copies for the response (return_state), then
    // it becomes the session's state. A failed call leaves the session as it was.
    for (const MhcCall::CopyBack& c : Rpc::CopiesAfterRun(decoded_)) {
      if (absl::Status s = service_.backend_.CopyToHost(c.host, c.device, c.bytes); !s.ok()) {
        session_ = {};
        call_->Complete(std::move(s));
        return;
      }
    }
    session_.Commit(Rpc::LeavesMixes(decoded_));
  }
  session_ = {};  // before the response: the client's next call of the session may come at once
  if (ran.ok() && transfer_ != nullptr) {
    // Outputs to their regions before the report: a region that shrank or vanished meanwhile
    // fails this request alone (FAILED_PRECONDITION), the batch it shared a launch with is not affected.
    if (absl::Status s = transfer_->WriteOutputs(outputs_); !s.ok()) {
      call_->Complete(std::move(s));
      return;
    }
  }
  if (ran.ok()) {
    const PathDecision& d = ran->decision;
    metrics.RecordExecution(Rpc::kOp, d.path, ran->stats.kernel_seconds);
    if (d.reason.has_value()) metrics.RecordFallback(Rpc::kOp, *d.reason);
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
          d.path == Path::kFused ? Rpc::Verify(shadow, *set_, *request_, *response_) : NotComparedUnfused(d);
    } else if (d.path == Path::kFused && decoded_.args.tokens > 0 && shadow_sampled_) {
      // No copy: the job takes a reference to this call's messages (shadow/shared_messages.h).
      // Only the report is written after this, before the response is sent; the job never reads it.
      shadow_job = Rpc::Capture(shadow, set_, held_);
    }
    service_.FillReport(report, set_->name);
    v1::StageSeconds* stages = report->mutable_stages();
    stages->set_decode(decode_seconds_);
    stages->set_copy_in(stages_.copy_in);
    stages->set_device(stages_.device);
    stages->set_copy_out(stages_.copy_out);
    // Last: every stage ends before server_seconds is read, so they add up to at most it.
    stages->set_response(SecondsBetween(response_start, std::chrono::steady_clock::now()));
    report->set_server_seconds(call_->elapsed());
    metrics.RecordStages(Rpc::kOp, RequestStages{decode_seconds_, queue_seconds_, stages_.copy_in, stages_.device,
                                                 stages_.copy_out, stages->response()});
  }
  // A response over the send limit is cleared and not sent: nothing to shadow-verify.
  if (!call_->Complete(ran.status())) shadow_job.reset();
  // After the response: the shadow run waits in the executor's background lane.
  shadow.Submit(std::move(shadow_job));
}

grpc::ServerUnaryReactor* FusedLayerService::MhcSeam(grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* request,
                                                     grpc::ByteBuffer* response) {
  return ServeCompute<MhcRpc>(ctx, request, response);
}

grpc::ServerUnaryReactor* FusedLayerService::SwaNormQuant(grpc::CallbackServerContext* ctx,
                                                          const grpc::ByteBuffer* request, grpc::ByteBuffer* response) {
  return ServeCompute<SwaRpc>(ctx, request, response);
}

template <typename Rpc>
grpc::ServerUnaryReactor* FusedLayerService::ServeCompute(grpc::CallbackServerContext* ctx,
                                                          const grpc::ByteBuffer* wire_request,
                                                          grpc::ByteBuffer* wire_response) {
  auto* held = new typename Rpc::Messages();  // the call's reference, dropped in ComputeCall::ReleaseWhenDone
  auto* call = new ComputeCall(metrics_, Rpc::kMethod, config_.max_message_bytes, ctx, wire_request->Length(),
                               held->response(), wire_response, held);
  auto wire = std::make_unique<WireTensorData>();
  absl::Status s = AdmitDuringDrain();
  // gRPC hands the request over and never reads it again: reading frees its slices at once.
  if (s.ok()) {
    HostStagingPool* pinned = lanes_.request_staging();
    s = ReadWireRequest(const_cast<grpc::ByteBuffer*>(wire_request), held->request(), pinned,
                        pinned == nullptr ? nullptr : &lanes_.staging()->copier(), wire.get());
  }
  if (s.ok()) s = StartCompute<Rpc>(call, held, held->request(), held->response(), std::move(wire));
  if (!s.ok()) call->Complete(std::move(s));
  return call;
}

// Inline (on the gRPC thread): validate and decode, then queue the request on the device executor.
template <typename Rpc>
absl::Status FusedLayerService::StartCompute(ComputeCall* call, typename Rpc::Messages* held,
                                             const typename Rpc::Request* request, typename Rpc::Response* response,
                                             std::unique_ptr<WireTensorData> wire) {
  if (absl::Status s = CheckPreference(request->path_preference()); !s.ok()) return s;
  if (request->verify()) {
    if (absl::Status s = AdmitVerify(call); !s.ok()) return s;
  }
  absl::StatusOr<std::shared_ptr<const WeightSet>> set = weights_.Get(request->weight_set());
  if (!set.ok()) return set.status();
  if (Rpc::Part(**set) == nullptr) {
    return absl::NotFoundError(
        absl::StrCat("weight set '", request->weight_set(), "' has no ", Rpc::kPartName, " part"));
  }
  // Memory admission: the response is sized from the request and admitted by bytes before any of
  // it is allocated (docs/operations.md, "Memory admission").
  absl::StatusOr<ResponseSize> response_bytes = Rpc::ResponseBytes(*request, *Rpc::Part(**set), config_.max_tokens);
  if (!response_bytes.ok()) return response_bytes.status();
  // Shared-memory inputs are staged in server memory: admitted with the response, before reading.
  std::unique_ptr<transport::TensorTransfer> transfer;
  uint64_t staged_bytes = 0;
  if (transport::UsesSharedMemory(*request)) {
    transfer = std::make_unique<transport::TensorTransfer>(
        &shared_memory_, &cuda_shared_memory_,
        CallerIdentity(*call->context()));
    // What its references claim, up to what a valid request of this size has (a larger claim is
    // refused by decode as INVALID_ARGUMENT, never read): a wrong shape is not RESOURCE_EXHAUSTED.
    staged_bytes = std::min(transport::SharedMemoryInputBytes(*request), response_bytes->inputs_at_most);
  }
  if (absl::Status s = AdmitComputeBytes(call, *response_bytes, staged_bytes); !s.ok()) return s;
  // On a device backend, inputs in a page-locked region are used where they lie; others are read
  // into page-locked memory (when a block is free).
  if (transfer != nullptr && !transfer->UseInputsInPlace(transport::InputTensors(*request))) {
    transfer->ReadInputsIntoPinned(lanes_.request_staging(), staged_bytes);
  }
  // A residual session call holds its session from here to its response (one call at a time).
  transport::ResidualSessionStore::Lease session;
  if (const std::string& name = Rpc::SessionName(*request); !name.empty()) {
    absl::StatusOr<transport::ResidualSessionStore::Lease> held =
        sessions_.Acquire(CallerIdentity(*call->context()), name, (*set)->name);
    if (!held.ok()) return held.status();
    session = std::move(*held);
    // An unload between weights_.Get above and Acquire found no session using the set (its
    // CloseUsing ran first); the set is gone or replaced by then, so the session closes here. This
    // call still runs on the set it holds, like every call in flight at an unload; its state is
    // dropped with the session.
    absl::StatusOr<std::shared_ptr<const WeightSet>> now = weights_.Get(request->weight_set());
    if (!now.ok() || now->get() != set->get()) (void)sessions_.Close(CallerIdentity(*call->context()), name);
  }
  // A request the shadow verifier samples (fused runs only; a shared-memory or session request is
  // not sampled: the shadow job re-reads the inline messages) keeps its outputs in the response
  // message for the job to read; every other one has them outside it, sent without copies.
  const bool shadow_sampled = transfer == nullptr && !session.held() && !request->verify() && shadow_.Sample();
  // Both read the request's tensors from its message.
  if (request->verify() || shadow_sampled) wire->MoveIntoMessages();
  absl::StatusOr<typename Rpc::Call> decoded =
      Rpc::Decode(*request, *Rpc::Part(**set), config_.max_tokens, response, transfer.get(),
                  shadow_sampled ? nullptr : call->outputs(), wire.get(), session.held() ? &session : nullptr);
  if (!decoded.ok()) return decoded.status();
  response->set_request_id(RequestId(request->request_id()));
  // The decode stage ends here: the queue wait starts inside SubmitBatchable.
  const double decode_seconds = call->elapsed();
  return executor_.SubmitBatchable(std::make_unique<ComputeTask<Rpc>>(
      *this, call, held, request, response, std::move(*set), std::move(*decoded), std::move(transfer), std::move(wire),
      std::move(session), shadow_sampled, decode_seconds));
}

}  // namespace fusedlayer::server
