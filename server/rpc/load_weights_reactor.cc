// LoadWeights (client streaming): the header first, then the payload in chunks, accumulated in the
// reactor; only an exactly complete stream reaches the executor, where the weight manager builds,
// warms up and publishes the set (all or nothing).
#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "rpc/proto_convert.h"
#include "rpc/service.h"
#include "rpc/unary_call.h"

namespace fusedlayer::server {

// Client-streaming LoadWeights: header first, then data; the payload is accumulated here and only
// an exactly complete stream reaches the executor (build + warm-up + publish, all or nothing).
class FusedLayerService::LoadWeightsReactor final : public grpc::ServerReadReactor<v1::WeightChunk> {
 public:
  LoadWeightsReactor(FusedLayerService& service, grpc::CallbackServerContext* ctx, v1::WeightSetInfo* response)
      : service_(service), ctx_(ctx), response_(response), start_(Clock::now()) {
    service_.metrics_.InflightAdd(1);
    StartRead(&chunk_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) return EndOfStream();
    request_bytes_ += chunk_.ByteSizeLong();
    if (!have_header_) {
      if (!chunk_.has_header()) {
        return Complete(absl::InvalidArgumentError("the first WeightChunk must carry the header"));
      }
      header_ = std::move(*chunk_.mutable_header());
      have_header_ = true;
      if (header_.payload_bytes() > service_.config_.max_weight_payload_bytes) {
        return Complete(absl::ResourceExhaustedError(
            absl::StrCat("weight set '", header_.name(), "': payload_bytes = ", header_.payload_bytes(),
                         " exceeds this server's limit of ", service_.config_.max_weight_payload_bytes, " bytes")));
      }
      // Fail before the upload rather than after it.
      if (!header_.replace() && service_.weights_.Contains(header_.name())) {
        return Complete(absl::AlreadyExistsError(
            absl::StrCat("weight set '", header_.name(), "' is already loaded (set replace to swap it)")));
      }
      // Reserve up front, bounded so a hostile header cannot make us allocate before data arrives.
      payload_.reserve(std::min<uint64_t>(header_.payload_bytes(), uint64_t{256} << 20));
    } else if (chunk_.has_header()) {
      return Complete(absl::InvalidArgumentError("only the first WeightChunk may carry a header"));
    }
    if (payload_.size() + chunk_.data().size() > header_.payload_bytes()) {
      return Complete(absl::InvalidArgumentError(
          absl::StrCat("weight set '", header_.name(), "': the stream carries more than payload_bytes = ",
                       header_.payload_bytes(), " bytes")));
    }
    payload_.append(chunk_.data());
    chunk_.Clear();
    StartRead(&chunk_);
  }

  void OnDone() override {
    service_.metrics_.InflightAdd(-1);
    delete this;
  }

 private:
  void EndOfStream() {
    if (ctx_->IsCancelled()) return Complete(absl::CancelledError("LoadWeights cancelled by the client"));
    if (!have_header_) return Complete(absl::InvalidArgumentError("empty LoadWeights stream: no header"));
    if (payload_.size() < header_.payload_bytes()) {
      return Complete(absl::DataLossError(absl::StrCat("weight set '", header_.name(), "': the stream ended after ",
                                                       payload_.size(), " of ", header_.payload_bytes(),
                                                       " payload bytes")));
    }
    absl::Status submitted = service_.executor_.SubmitControl([this](double queue_seconds) {
      service_.metrics_.ObserveQueue(queue_seconds);
      absl::StatusOr<v1::WeightSetInfo> info = service_.weights_.InstallOnWorker(header_, payload_, "rpc");
      std::string().swap(payload_);  // release the staging copy before the response goes out
      if (!info.ok()) return Complete(info.status());
      *response_ = std::move(*info);
      Complete(absl::OkStatus());
    });
    if (!submitted.ok()) Complete(std::move(submitted));
  }

  void Complete(const absl::Status& status) {
    const uint64_t response_bytes = status.ok() ? response_->ByteSizeLong() : 0;
    service_.metrics_.RecordRequest(Method::kLoadWeights, static_cast<grpc::StatusCode>(status.code()),
                                    SecondsSince(start_), request_bytes_, response_bytes);
    if (!status.ok() && status.code() != absl::StatusCode::kCancelled) {
      LogWarning("LoadWeights", have_header_ ? absl::StrCat(" '", header_.name(), "'") : std::string(),
                 " failed: ", status.ToString());
    }
    Finish(ToGrpcStatus(status));
  }

  FusedLayerService& service_;
  grpc::CallbackServerContext* const ctx_;
  v1::WeightSetInfo* const response_;
  const Clock::time_point start_;
  v1::WeightChunk chunk_;
  v1::WeightSetHeader header_;
  bool have_header_ = false;
  std::string payload_;
  uint64_t request_bytes_ = 0;
};

grpc::ServerReadReactor<v1::WeightChunk>* FusedLayerService::LoadWeights(grpc::CallbackServerContext* ctx,
                                                                        v1::WeightSetInfo* response) {
  return new LoadWeightsReactor(*this, ctx, response);
}

}  // namespace fusedlayer::server
