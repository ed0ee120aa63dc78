// LoadWeights (client streaming): the header first, then the payload in chunks, accumulated in the
// reactor; each chunk parsed here (a raw method), so a chunk that is not a valid WeightChunk is
// INVALID_ARGUMENT naming its place in the stream, never taken for the stream's end; only an exactly complete stream reaches the executor, where the weight manager builds,
// warms up and publishes the set (all or nothing). Bounded (docs/operations.md): streams open at
// once (--max_concurrent_uploads), the payload announced (--max_weight_payload_bytes) and the bytes
// all uploads buffer together (--max_upload_buffer_bytes, counted as chunks arrive). Refused while
// draining; a client that cancels before the set is published gets nothing published. A stream
// that sends nothing for --upload_idle_timeout_seconds is ended with DEADLINE_EXCEEDED by the
// service's IdleWatch and its buffered bytes are released (rpc/idle_watch.h).
#include <atomic>
#include <mutex>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "fusedlayer/wire/tsan_annotations.h"
#include "rpc/proto_convert.h"
#include "rpc/service.h"
#include "rpc/unary_call.h"
#include "rpc/wire_messages.h"
#include "weights/sha256.h"

namespace fusedlayer::server {

// Client-streaming LoadWeights: header first, then data; the payload is accumulated here and only
// an exactly complete stream reaches the executor (build + warm-up + publish, all or nothing).
class FusedLayerService::LoadWeightsReactor final : public grpc::ServerReadReactor<grpc::ByteBuffer> {
 public:
  LoadWeightsReactor(FusedLayerService& service, grpc::CallbackServerContext* ctx, grpc::ByteBuffer* response)
      : service_(service),
        ctx_(ctx),
        response_(response),
        start_(Clock::now()),
        idle_([this] { IdleTimeout(); }) {
    service_.metrics_.InflightAdd(1);
    const int open = service_.open_uploads_.fetch_add(1, std::memory_order_acq_rel) + 1;
    if (absl::Status s = service_.AdmitDuringDrain(); !s.ok()) {
      Complete(s);
      return;
    }
    if (open > service_.config_.max_concurrent_uploads) {
      Complete(absl::ResourceExhaustedError(
          absl::StrCat("server busy: ", service_.config_.max_concurrent_uploads,
                       " LoadWeights streams are already open (--max_concurrent_uploads); retry later")));
      return;
    }
    service_.upload_idle_.Add(&idle_);
    watched_ = true;
    ReadNext();
  }

  // Each callback first acquires what the thread that handed the stream to gRPC (StartRead,
  // Finish) released (fusedlayer/wire/tsan_annotations.h).
  void OnCancel() override {
    wire::TsanAcquireFrom(this);
    cancelled_.store(true, std::memory_order_release);
    wire::TsanReleaseTo(this);  // for OnDone, maybe on another thread (tsan_annotations.h: OnCancel)
  }

  void OnReadDone(bool ok) override {
    wire::TsanAcquireFrom(this);
    idle_.Touch();
    // Finished by the idle watch while this read was pending: nothing more to do with the stream.
    if (Finished()) return;
    if (!ok) return EndOfStream();
    ++chunks_;
    request_bytes_.fetch_add(wire_chunk_.Length(), std::memory_order_relaxed);
    if (absl::Status parsed = ParseWireRequest(&wire_chunk_, &chunk_); !parsed.ok()) {
      return Complete(absl::InvalidArgumentError(absl::StrCat(
          have_header_ ? absl::StrCat("weight set '", ClientString(header_.name()), "': ") : std::string(),
          "chunk ", chunks_, " of the stream is not a valid ", v1::WeightChunk::descriptor()->full_name(),
          " message; nothing is loaded")));
    }
    if (!have_header_) {
      if (!chunk_.has_header()) {
        return Complete(absl::InvalidArgumentError("the first WeightChunk must carry the header"));
      }
      header_ = std::move(*chunk_.mutable_header());
      have_header_ = true;
      if (header_.payload_bytes() > service_.config_.max_weight_payload_bytes) {
        return Complete(absl::ResourceExhaustedError(absl::StrCat(
            "weight set '", ClientString(header_.name()), "': payload_bytes = ", header_.payload_bytes(),
            " exceeds this server's limit of ", service_.config_.max_weight_payload_bytes,
            " bytes (--max_weight_payload_bytes)")));
      }
      // An upload over the network is checked end to end; a manifest (local files) may omit it.
      if (header_.sha256().empty()) {
        return Complete(absl::InvalidArgumentError(
            absl::StrCat("weight set '", ClientString(header_.name()), "': sha256 is required for LoadWeights (the payload's ",
                         "SHA-256 as 64 hex digits)")));
      }
      // Fail before the upload rather than after it.
      if (!header_.replace() && service_.weights_.Contains(header_.name())) {
        return Complete(absl::AlreadyExistsError(
            absl::StrCat("weight set '", ClientString(header_.name()), "' is already loaded (set replace to swap it)")));
      }
      // Nothing is reserved up front: a header alone must not make the server allocate.
    } else if (chunk_.has_header()) {
      return Complete(absl::InvalidArgumentError("only the first WeightChunk may carry a header"));
    }
    if (payload_.size() + chunk_.data().size() > header_.payload_bytes()) {
      return Complete(absl::InvalidArgumentError(
          absl::StrCat("weight set '", ClientString(header_.name()), "': the stream carries more than payload_bytes = ",
                       header_.payload_bytes(), " bytes")));
    }
    if (!service_.upload_bytes_.TryExtend(buffered_, chunk_.data().size())) {
      return Complete(absl::ResourceExhaustedError(absl::StrCat(
          "server busy: weight set '", ClientString(header_.name()), "': the uploads in progress already buffer ",
          service_.upload_bytes_.in_use(), " of ", service_.upload_bytes_.limit(),
          " bytes (--max_upload_buffer_bytes); retry later")));
    }
    payload_.append(chunk_.data());
    received_bytes_.store(payload_.size(), std::memory_order_relaxed);
    hasher_.Update(chunk_.data());  // hashed as it arrives, not on the device executor
    chunk_.Clear();
    ReadNext();
  }

  void OnDone() override {
    wire::TsanAcquireCallReferences(this);  // gRPC's own threads' last uses of the reactor (tsan_annotations.h)
    wire::TsanAcquireFrom(this);
    // After Remove the idle watch no longer runs (and will never run) IdleTimeout on this reactor.
    if (watched_) service_.upload_idle_.Remove(&idle_);
    buffered_.Release();
    ReleaseUploadSlot();
    service_.metrics_.InflightAdd(-1);
    Unref();
  }

 private:
  bool Finished() {
    std::lock_guard<std::mutex> lock(finish_mu_);
    return finished_;
  }

  // The next read, unless the call was finished meanwhile (by the idle watch, on its thread).
  void ReadNext() {
    std::lock_guard<std::mutex> lock(finish_mu_);
    if (finished_) return;
    wire::TsanReleaseTo(this);  // OnReadDone acquires it
    StartRead(&wire_chunk_);
  }

  // On the idle watch's thread: reads only atomics (the reactor's thread may be in OnReadDone).
  void IdleTimeout() {
    const int seconds = service_.config_.upload_idle_timeout_seconds;
    Complete(absl::DeadlineExceededError(absl::StrCat(
                 "LoadWeights stream sent nothing for ", seconds, " s (--upload_idle_timeout_seconds=", seconds,
                 ") after ", received_bytes_.load(std::memory_order_relaxed),
                 " payload bytes: the upload was dropped and its buffered bytes released; send the chunks without "
                 "pausing")),
             /*from_idle_watch=*/true);
  }

  void EndOfStream() {
    idle_.Disarm();  // the stream is complete: building may take long and is not idleness
    {
      // Either the idle watch finished the call just before (nothing may be built now), or from
      // here on it never will (Complete skips it once the stream ended).
      std::lock_guard<std::mutex> lock(finish_mu_);
      if (finished_) return;
      stream_ended_ = true;
    }
    if (ctx_->IsCancelled()) return Complete(absl::CancelledError("LoadWeights cancelled by the client"));
    if (absl::Status s = service_.AdmitDuringDrain(); !s.ok()) return Complete(s);
    if (!have_header_) return Complete(absl::InvalidArgumentError("empty LoadWeights stream: no header"));
    if (payload_.size() < header_.payload_bytes()) {
      return Complete(absl::DataLossError(absl::StrCat("weight set '", ClientString(header_.name()), "': the stream ended after ",
                                                       payload_.size(), " of ", header_.payload_bytes(),
                                                       " payload bytes")));
    }
    absl::StatusOr<std::string> digest = hasher_.FinishHex();
    if (!digest.ok()) return Complete(digest.status());
    payload_sha256_ = *std::move(digest);
    LogInfo("LoadWeights '", ClientString(header_.name()), "': ", payload_.size(), " payload bytes received, queued for build");
    absl::Status submitted = service_.executor_.SubmitControl([this](double queue_seconds) {
      service_.metrics_.ObserveQueue(0, queue_seconds);
      // Asked after the build and warm-up, just before publishing: a client that gave up (or a
      // drain that started) while the set was being built gets nothing published.
      auto may_publish = [this]() -> absl::Status {
        if (cancelled_.load(std::memory_order_acquire) || ctx_->IsCancelled()) {
          return absl::CancelledError("LoadWeights cancelled by the client before the set was published");
        }
        return service_.AdmitDuringDrain();
      };
      absl::StatusOr<v1::WeightSetInfo> info =
          service_.weights_.InstallOnWorker(header_, payload_, "rpc", may_publish, std::move(payload_sha256_));
      std::string().swap(payload_);  // release the staging copy before the response goes out
      buffered_.Release();
      if (!info.ok()) return Complete(info.status());
      const std::string serialized = info->SerializeAsString();
      grpc::Slice slice(serialized);
      *response_ = grpc::ByteBuffer(&slice, 1);
      Complete(absl::OkStatus());
    });
    if (!submitted.ok()) Complete(std::move(submitted));
  }

  // Exactly once: from the reactor's thread, the executor, or the idle watch (from_idle_watch:
  // then header_ may be being written by the reactor's thread and is not read).
  void Complete(const absl::Status& status, bool from_idle_watch = false) {
    {
      std::lock_guard<std::mutex> lock(finish_mu_);
      if (finished_ || (from_idle_watch && stream_ended_)) return;
      finished_ = true;
    }
    idle_.Disarm();
    const uint64_t response_bytes = status.ok() ? response_->Length() : 0;
    service_.metrics_.RecordRequest(Method::kLoadWeights, static_cast<grpc::StatusCode>(status.code()),
                                    SecondsSince(start_), request_bytes_.load(std::memory_order_relaxed),
                                    response_bytes);
    if (!status.ok() && status.code() != absl::StatusCode::kCancelled) {
      LogWarning("LoadWeights",
                 !from_idle_watch && have_header_ ? absl::StrCat(" '", ClientString(header_.name()), "'")
                                                  : std::string(),
                 " failed: ", status.ToString());
    }
    // The slot is free before the client can see the status: a client that retries (or uploads
    // the next set) as soon as this one's error arrives must not find it still counted, which
    // OnDone alone (run after the status went out) could not promise.
    ReleaseUploadSlot();
    // The reactor stays alive until Finish() has returned too: gRPC's inline Finish() still reads
    // it after handing the status over, and OnDone may run on a gRPC thread before that.
    refs_.fetch_add(1, std::memory_order_relaxed);
    wire::TsanReleaseTo(this);  // OnDone acquires it
    Finish(ToGrpcStatus(status));
    Unref();  // `this` may be gone from here on
  }

  // acq_rel: whichever of OnDone and Complete lets go last sees everything the other did.
  void Unref() {
    if (refs_.fetch_sub(1, std::memory_order_acq_rel) == 1) delete this;
  }

  // Exactly once, from Complete or OnDone, whichever comes first.
  void ReleaseUploadSlot() {
    if (!slot_released_.exchange(true, std::memory_order_acq_rel)) {
      service_.open_uploads_.fetch_sub(1, std::memory_order_acq_rel);
    }
  }

  FusedLayerService& service_;
  grpc::CallbackServerContext* const ctx_;
  grpc::ByteBuffer* const response_;  // a serialized WeightSetInfo
  const Clock::time_point start_;
  grpc::ByteBuffer wire_chunk_;  // the chunk as it arrived, parsed into chunk_
  v1::WeightChunk chunk_;
  uint64_t chunks_ = 0;  // chunks read so far (for the messages)
  v1::WeightSetHeader header_;
  bool have_header_ = false;
  std::string payload_;
  ByteBudget::Lease buffered_;  // payload_'s bytes in the service's upload budget
  Sha256 hasher_;                // over payload_, chunk by chunk
  std::string payload_sha256_;
  std::atomic<bool> cancelled_{false};
  std::atomic<int> refs_{1};  // gRPC's (dropped in OnDone), and Complete's while it is in Finish()
  std::atomic<bool> slot_released_{false};  // this stream's --max_concurrent_uploads slot given back
  std::atomic<uint64_t> request_bytes_{0};
  std::atomic<uint64_t> received_bytes_{0};  // payload_.size(), for the idle watch's message
  std::mutex finish_mu_;  // guards finished_ and stream_ended_: Finish once, no StartRead after it
  bool finished_ = false;
  bool stream_ended_ = false;  // EndOfStream took over: the idle watch may no longer finish the call
  IdleWatch::Entry idle_;
  bool watched_ = false;  // added to the service's IdleWatch (the early refusals are not)
};

grpc::ServerReadReactor<grpc::ByteBuffer>* FusedLayerService::LoadWeights(grpc::CallbackServerContext* ctx,
                                                                          grpc::ByteBuffer* response) {
  return new LoadWeightsReactor(*this, ctx, response);
}

}  // namespace fusedlayer::server
