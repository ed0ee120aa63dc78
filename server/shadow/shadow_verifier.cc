#include "shadow/shadow_verifier.h"

#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/reflection.h"
#include "common/log.h"
#include "codec/request_codec.h"

namespace fusedlayer::server::shadow {

namespace {

// NaN-fills an output before the unfused run so an element it fails to write cannot pass as equal
// (bf16 / fp32 all-ones and e4m3fn 0xff are NaN; e4m3fnuz's NaN is 0x80).
void Poison(v1::Tensor* t) {
  if (t->data().empty()) return;
  const char fill = t->dtype() == v1::DATA_TYPE_FP8_E4M3FNUZ ? static_cast<char>(0x80) : static_cast<char>(0xff);
  std::fill(t->mutable_data()->begin(), t->mutable_data()->end(), fill);
}

// Poison() on every output the decoder sized (only those are set).
void PoisonOutputs(google::protobuf::Message* m) {
  const google::protobuf::Descriptor* d = m->GetDescriptor();
  const google::protobuf::Reflection* r = m->GetReflection();
  for (int i = 0; i < d->field_count(); ++i) {
    const google::protobuf::FieldDescriptor* f = d->field(i);
    if (f->is_repeated() || f->message_type() != v1::Tensor::descriptor() || !r->HasField(*m, f)) continue;
    Poison(static_cast<v1::Tensor*>(r->MutableMessage(m, f)));
  }
}

// Every set Tensor field of `m`, as (prefix + field name, tensor).
void TensorFields(const google::protobuf::Message& m, const std::string& prefix,
                  std::vector<std::pair<std::string, const v1::Tensor*>>* out) {
  const google::protobuf::Descriptor* d = m.GetDescriptor();
  const google::protobuf::Reflection* r = m.GetReflection();
  for (int i = 0; i < d->field_count(); ++i) {
    const google::protobuf::FieldDescriptor* f = d->field(i);
    if (f->is_repeated() || f->message_type() != v1::Tensor::descriptor() || !r->HasField(m, f)) continue;
    out->emplace_back(prefix + f->name(), static_cast<const v1::Tensor*>(&r->GetMessage(m, f)));
  }
}

uint64_t OutputBytes(const google::protobuf::Message& m) {
  std::vector<std::pair<std::string, const v1::Tensor*>> t;
  TensorFields(m, "", &t);
  uint64_t n = 0;
  for (const auto& [_, tensor] : t) n += tensor->data().size();
  return n;
}

v1::Verification ToVerification(const Comparison& c) {
  v1::Verification v;
  v.set_compared(true);
  v.set_mismatch(c.mismatch());
  for (const OutputComparison& o : c.outputs) *v.add_outputs() = ToProto(o);
  return v;
}

v1::Verification NotCompared(std::string reason) {
  v1::Verification v;
  v.set_compared(false);
  v.set_reason(std::move(reason));
  return v;
}

}  // namespace

namespace {

std::vector<std::string> LabelsOf(const std::vector<ShadowDevice>& devices) {
  std::vector<std::string> labels;
  for (const ShadowDevice& d : devices) labels.push_back(d.label);
  return labels;
}

}  // namespace

absl::StatusOr<std::unique_ptr<ShadowVerifier>> ShadowVerifier::Create(ShadowOptions options,
                                                                      std::vector<ShadowDevice> devices,
                                                                      prometheus::Registry& registry) {
  std::unique_ptr<ShadowDumpWriter> dumps, verify_dumps;
  if (!options.dump_dir.empty()) {
    absl::StatusOr<std::unique_ptr<ShadowDumpWriter>> w =
        ShadowDumpWriter::Open(options.dump_dir, options.dump_max_files, options.dump_max_bytes);
    if (!w.ok()) return w.status();
    dumps = std::move(*w);
    // A subdirectory: the sampled writer counts only the files directly in dump_dir, so the two
    // bounds stay apart across restarts too.
    absl::StatusOr<std::unique_ptr<ShadowDumpWriter>> vw = ShadowDumpWriter::Open(
        absl::StrCat(options.dump_dir, "/verify"), options.verify_dump_max_files, options.verify_dump_max_bytes);
    if (!vw.ok()) return vw.status();
    verify_dumps = std::move(*vw);
  }
  std::unique_ptr<ShadowVerifier> v(new ShadowVerifier(std::move(options), std::move(devices), registry));
  v->dumps_ = std::move(dumps);
  v->verify_dumps_ = std::move(verify_dumps);
  if (v->options_.sample_rate > 0) {
    LogInfo("shadow verification: sampling ", v->options_.sample_rate, " of fused requests, queue ",
            v->options_.queue_size, " jobs / ", v->options_.queue_max_bytes, " bytes",
            v->options_.dump_dir.empty() ? std::string(", no dumps")
                                         : absl::StrCat(", mismatch dumps in ", v->options_.dump_dir, " (at most ",
                                                        v->options_.dump_max_files, " files, ",
                                                        v->options_.dump_max_bytes, " bytes)"));
  }
  return v;
}

ShadowVerifier::ShadowVerifier(ShadowOptions options, std::vector<ShadowDevice> devices, prometheus::Registry& registry)
    : options_(std::move(options)),
      devices_(std::move(devices)),
      metrics_(registry, LabelsOf(devices_)),
      rng_(std::random_device{}()) {}

ShadowVerifier::~ShadowVerifier() = default;

bool ShadowVerifier::Sample() {
  const double rate = options_.sample_rate;
  if (rate <= 0) return false;
  if (rate >= 1) return true;
  std::lock_guard<std::mutex> lock(mu_);
  return std::uniform_real_distribution<double>(0, 1)(rng_) < rate;
}

size_t ShadowVerifier::queued_jobs() const {
  std::lock_guard<std::mutex> lock(mu_);
  return jobs_;
}

bool ShadowVerifier::Reserve(Op op, uint64_t bytes) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (jobs_ < static_cast<size_t>(options_.queue_size) && bytes_ + bytes <= options_.queue_max_bytes) {
      ++jobs_;
      bytes_ += bytes;
      metrics_.SetQueued(jobs_, bytes_);
      return true;
    }
  }
  metrics_.RecordDropped(op);
  return false;
}

void ShadowVerifier::Release(uint64_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  --jobs_;
  bytes_ -= bytes;
  metrics_.SetQueued(jobs_, bytes_);
}

// The reservation comes first: a full queue costs nothing (no reference is taken, the messages
// are freed with the call as usual). The bytes are what the job keeps alive: the request and the
// fused outputs (the cached sizes are set here, on the worker, before gRPC serializes).
std::unique_ptr<ShadowVerifier::Job> ShadowVerifier::CaptureMhc(std::shared_ptr<const WeightSet> set,
                                                                MhcMessages* held, size_t device) {
  if (held == nullptr) {
    metrics_.RecordDropped(Op::kMhc);
    return nullptr;
  }
  const uint64_t bytes = held->request()->ByteSizeLong() + OutputBytes(*held->response());
  if (!Reserve(Op::kMhc, bytes)) return nullptr;
  return std::make_unique<Job>(*this, Op::kMhc, bytes, std::move(set), held->AddRef(), SwaMessagesRef(), device);
}

std::unique_ptr<ShadowVerifier::Job> ShadowVerifier::CaptureSwa(std::shared_ptr<const WeightSet> set,
                                                                SwaMessages* held, size_t device) {
  if (held == nullptr) {
    metrics_.RecordDropped(Op::kSwa);
    return nullptr;
  }
  const uint64_t bytes = held->request()->ByteSizeLong() + OutputBytes(*held->response());
  if (!Reserve(Op::kSwa, bytes)) return nullptr;
  return std::make_unique<Job>(*this, Op::kSwa, bytes, std::move(set), MhcMessagesRef(), held->AddRef(), device);
}

void ShadowVerifier::Submit(std::unique_ptr<Job> job) {
  if (job == nullptr) return;
  // A shared_ptr so the task stays copyable-free and the job (its reservation and its reference to
  // the RPC's messages) dies with the task whether it ran, was dropped at shutdown, or was refused
  // here because the executor is stopping.
  std::shared_ptr<Job> shared(std::move(job));
  absl::Status s = devices_[shared->device()].executor->SubmitBackground([this, shared](double) { Run(*shared); });
  if (!s.ok()) metrics_.RecordDropped(shared->op());  // shutting down
}

// Reads the RPC's messages (const only: gRPC may still be reading the response).
void ShadowVerifier::Run(Job& job) {
  if (job.op() == Op::kMhc) {
    const v1::MhcSeamRequest& r = job.mhc_request();
    const v1::MhcSeamResponse& fused = job.mhc_fused();
    v1::MhcSeamResponse unfused;
    absl::StatusOr<Comparison> c = CompareMhcOnWorker(job.device(), job.set(), r, fused, &unfused);
    if (!c.ok()) return;
    Record(job.device(), Op::kMhc, job.set(), fused.request_id(), *c, r, fused, unfused,
           {{"stage", v1::MhcStage_Name(r.stage())},
            {"mode", v1::MhcMode_Name(r.mode())},
            {"capture_aux", r.capture_aux() ? "true" : "false"},
            {"source", "sampled"}});
  } else {
    const v1::SwaNormQuantResponse& fused = job.swa_fused();
    v1::SwaNormQuantResponse unfused;
    absl::StatusOr<Comparison> c = CompareSwaOnWorker(job.device(), job.set(), job.swa_request(), fused, &unfused);
    if (!c.ok()) return;
    Record(job.device(), Op::kSwa, job.set(), fused.request_id(), *c, job.swa_request(), fused, unfused,
           {{"source", "sampled"}});
  }
}

absl::StatusOr<Comparison> ShadowVerifier::CompareMhcOnWorker(size_t device, const WeightSet& set,
                                                              const v1::MhcSeamRequest& request,
                                                              const v1::MhcSeamResponse& fused,
                                                              v1::MhcSeamResponse* unfused) {
  absl::StatusOr<RunStats> ran = absl::InternalError("no mHC part");
  absl::StatusOr<MhcCall> call = absl::InternalError("no mHC part");
  const PreparedMhcWeights* part = set.on(device).mhc.get();
  if (part != nullptr) {
    // The request was validated when it was served; the token limit was checked then.
    call = DecodeMhcRequest(request, *part, std::numeric_limits<int64_t>::max(), unfused);
    if (call.ok()) {
      PoisonOutputs(unfused);
      ran = RunMhcCall(*devices_[device].backend, *part, call->args, Path::kUnfused);
    } else {
      ran = call.status();
    }
  }
  if (!ran.ok()) {
    metrics_.RecordError(device, Op::kMhc);
    LogError("shadow verification: the unfused mhc run failed for request ", fused.request_id(), " (weight set '",
             set.name, "'): ", ran.status().ToString());
    return ran.status();
  }
  return CompareMhc(part->params(), set.mhc_norm_weight, call->args.stage, call->args.mode, call->args.capture_aux,
                    fused, *unfused);
}

absl::StatusOr<Comparison> ShadowVerifier::CompareSwaOnWorker(size_t device, const WeightSet& set,
                                                              const v1::SwaNormQuantRequest& request,
                                                              const v1::SwaNormQuantResponse& fused,
                                                              v1::SwaNormQuantResponse* unfused) {
  absl::StatusOr<RunStats> ran = absl::InternalError("no SWA part");
  absl::StatusOr<SwaCall> call = absl::InternalError("no SWA part");
  const PreparedSwaWeights* part = set.on(device).swa.get();
  if (part != nullptr) {
    call = DecodeSwaRequest(request, *part, std::numeric_limits<int64_t>::max(), unfused);
    if (call.ok()) {
      PoisonOutputs(unfused);
      ran = RunSwaCall(*devices_[device].backend, *part, call->args, Path::kUnfused);
    } else {
      ran = call.status();
    }
  }
  if (!ran.ok()) {
    metrics_.RecordError(device, Op::kSwa);
    LogError("shadow verification: the unfused swa run failed for request ", fused.request_id(), " (weight set '",
             set.name, "'): ", ran.status().ToString());
    return ran.status();
  }
  return CompareSwa(part->params(), call->args.tokens, set.swa_wq_b_row_abs_max, fused, *unfused);
}

void ShadowVerifier::Record(size_t device, Op op, const WeightSet& set, const std::string& request_id, const Comparison& comparison,
                            const google::protobuf::Message& request, const google::protobuf::Message& fused,
                            const google::protobuf::Message& unfused, std::map<std::string, std::string> metadata) {
  std::vector<ComparedOutput> counted;
  counted.reserve(comparison.outputs.size());
  for (const OutputComparison& c : comparison.outputs) {
    counted.push_back(ComparedOutput{c.output, c.mismatch, c.max_abs_diff, c.max_ulp_distance});
  }
  metrics_.RecordComparison(device, op, counted);
  if (!comparison.mismatch()) return;
  std::string dumped;
  auto source = metadata.find("source");
  ShadowDumpWriter* writer =
      source != metadata.end() && source->second == "verify" ? verify_dumps_.get() : dumps_.get();
  if (writer != nullptr) {
    DumpCase c;
    c.op = OpName(op);
    c.request_id = request_id;
    TensorFields(request, "request.", &c.tensors);
    TensorFields(fused, "fused.", &c.tensors);
    TensorFields(unfused, "unfused.", &c.tensors);
    std::vector<std::string> outputs;
    for (const OutputComparison& o : comparison.outputs) {
      if (o.mismatch) outputs.push_back(o.output);
    }
    c.metadata = std::move(metadata);
    c.metadata["op"] = OpName(op);
    c.metadata["weight_set"] = set.name;
    c.metadata["weight_set_sha256"] = set.sha256;
    c.metadata["request_id"] = request_id;
    c.metadata["backend"] = options_.backend;
    c.metadata["device"] = devices_[device].backend->device_name();
    c.metadata["device_label"] = devices_[device].label;
    c.metadata["mismatched_outputs"] = absl::StrJoin(outputs, ",");
    c.metadata["summary"] = comparison.MismatchSummary();
    absl::StatusOr<std::string> path = writer->Write(c);
    if (path.ok()) {
      metrics_.RecordDump(op, DumpResult::kWritten);
      dumped = absl::StrCat("; dump ", *path);
    } else if (absl::IsResourceExhausted(path.status())) {
      metrics_.RecordDump(op, DumpResult::kLimitReached);
      dumped = "; not dumped: dump limit reached";
    } else {
      metrics_.RecordDump(op, DumpResult::kError);
      dumped = absl::StrCat("; dump failed: ", path.status().ToString());
    }
  }
  LogWarning("shadow mismatch: request ", request_id, " op ", OpName(op), " weight set '", set.name, "' (",
             options_.backend, " ", devices_[device].label, " ", devices_[device].backend->device_name(),
             "): ", comparison.MismatchSummary(), dumped);
}

v1::Verification ShadowVerifier::VerifyMhc(const WeightSet& set, const v1::MhcSeamRequest& request,
                                           const v1::MhcSeamResponse& fused, size_t device) {
  v1::MhcSeamResponse unfused;
  absl::StatusOr<Comparison> c = CompareMhcOnWorker(device, set, request, fused, &unfused);
  if (!c.ok()) return NotCompared(absl::StrCat("the unfused run failed: ", c.status().ToString()));
  Record(device, Op::kMhc, set, fused.request_id(), *c, request, fused, unfused,
         {{"stage", v1::MhcStage_Name(request.stage())},
          {"mode", v1::MhcMode_Name(request.mode())},
          {"capture_aux", request.capture_aux() ? "true" : "false"},
          {"source", "verify"}});
  return ToVerification(*c);
}

v1::Verification ShadowVerifier::VerifySwa(const WeightSet& set, const v1::SwaNormQuantRequest& request,
                                           const v1::SwaNormQuantResponse& fused, size_t device) {
  v1::SwaNormQuantResponse unfused;
  absl::StatusOr<Comparison> c = CompareSwaOnWorker(device, set, request, fused, &unfused);
  if (!c.ok()) return NotCompared(absl::StrCat("the unfused run failed: ", c.status().ToString()));
  Record(device, Op::kSwa, set, fused.request_id(), *c, request, fused, unfused, {{"source", "verify"}});
  return ToVerification(*c);
}

}  // namespace fusedlayer::server::shadow
