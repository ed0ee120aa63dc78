#include "client/fusedctl/echo_floor.h"

#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <random>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "grpcpp/generic/async_generic_service.h"
#include "grpcpp/impl/client_unary_call.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server_builder.h"
#include "grpcpp/support/server_callback.h"
#include "proto/fusedlayer/wire/tsan_annotations.h"

namespace fusedlayer::client {

// Answers each call on gRPC's callback threads: read the one request message, answer with the
// shared response buffer (a reference to the same slice, so no per-call copy), finish. Nothing
// blocks, like the product's reactors.
class EchoFloorServer::Service : public grpc::CallbackGenericService {
 public:
  Service(EchoFloorServer& owner, uint64_t response_bytes)
      : owner_(owner), response_(MakeBuffer(response_bytes)) {}

  grpc::ServerGenericBidiReactor* CreateReactor(grpc::GenericCallbackServerContext* /*ctx*/) override {
    return new Reactor(*this);
  }

  static grpc::ByteBuffer MakeBuffer(uint64_t bytes) {
    // A fixed pattern rather than zeros, in case a transport ever compressed runs.
    std::string data(bytes, '\0');
    for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<char>(i * 131 + 7);
    grpc::Slice slice(std::move(data));
    return grpc::ByteBuffer(&slice, 1);
  }

 private:
  class Reactor : public grpc::ServerGenericBidiReactor {
   public:
    explicit Reactor(Service& service) : service_(service) { StartRead(&request_); }
    void OnReadDone(bool ok) override {
      if (!ok) {
        wire::TsanReleaseTo(this);
        Finish(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "echo floor: the call sent no request message"));
        return;
      }
      service_.owner_.Record(request_.Length());
      response_ = service_.response_;
      // gRPC runs OnDone on another of its threads, after this write (libgrpc is not instrumented:
      // the edge is announced for TSan, proto/fusedlayer/wire/tsan_annotations.h).
      wire::TsanReleaseTo(this);
      StartWriteAndFinish(&response_, grpc::WriteOptions(), grpc::Status::OK);
    }
    void OnDone() override {
      wire::TsanAcquireFrom(this);
      delete this;
    }

   private:
    Service& service_;
    grpc::ByteBuffer request_;
    grpc::ByteBuffer response_;
  };

  EchoFloorServer& owner_;
  const grpc::ByteBuffer response_;
};

absl::StatusOr<std::unique_ptr<EchoFloorServer>> EchoFloorServer::Start(const std::string& address,
                                                                        uint64_t response_bytes,
                                                                        int64_t max_message_bytes) {
  std::unique_ptr<EchoFloorServer> s(new EchoFloorServer());
  s->service_ = std::make_unique<Service>(*s, response_bytes);
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(address, grpc::InsecureServerCredentials(), &port);
  builder.SetMaxReceiveMessageSize(static_cast<int>(max_message_bytes));
  builder.SetMaxSendMessageSize(static_cast<int>(max_message_bytes));
  builder.RegisterCallbackGenericService(s->service_.get());
  s->server_ = builder.BuildAndStart();
  const bool unix_socket = absl::StartsWith(address, "unix:") || absl::StartsWith(address, "unix-abstract:");
  // A unix socket has no port (gRPC reports 1); for TCP, 0 means the bind failed.
  if (s->server_ == nullptr || (!unix_socket && port == 0)) {
    return absl::UnavailableError(absl::StrCat("echo floor: cannot listen on ", address));
  }
  s->target_ = unix_socket ? address : absl::StrCat("127.0.0.1:", port);
  return s;
}

EchoFloorServer::~EchoFloorServer() {
  if (server_) {
    server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
    server_->Wait();
  }
}

void EchoFloorServer::Record(uint64_t request_bytes) {
  uint64_t lo = min_request_bytes_.load(std::memory_order_relaxed);
  while (request_bytes < lo && !min_request_bytes_.compare_exchange_weak(lo, request_bytes)) {
  }
  uint64_t hi = max_request_bytes_.load(std::memory_order_relaxed);
  while (request_bytes > hi && !max_request_bytes_.compare_exchange_weak(hi, request_bytes)) {
  }
  calls_.fetch_add(1, std::memory_order_relaxed);
}

EchoFloorClient::EchoFloorClient(std::shared_ptr<grpc::Channel> channel, uint64_t request_bytes,
                                 const ClientOptions& options)
    : EchoFloorClient(std::vector<std::shared_ptr<grpc::Channel>>{std::move(channel)}, request_bytes, options) {}

EchoFloorClient::EchoFloorClient(const std::vector<std::shared_ptr<grpc::Channel>>& channels, uint64_t request_bytes,
                                 const ClientOptions& options)
    : request_(EchoFloorServer::Service::MakeBuffer(request_bytes)), request_bytes_(request_bytes), options_(options) {
  if (channels.empty()) std::abort();  // a programming error: FusedLayerClient always has a channel
  members_.reserve(channels.size());
  for (const std::shared_ptr<grpc::Channel>& channel : channels) {
    // Registered on each channel like a generated stub's method.
    members_.push_back({channel, grpc::internal::RpcMethod(kEchoFloorMethod, grpc::internal::RpcMethod::NORMAL_RPC,
                                                           channel)});
  }
}

absl::StatusOr<uint64_t> EchoFloorClient::Call() const {
  // The same per-call set-up as FusedLayerClient::Prepare: deadline, wait-for-ready, token header.
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + options_.deadline));
  ctx.set_wait_for_ready(options_.wait_for_ready);
  if (!options_.bearer_token.empty()) ctx.AddMetadata("authorization", "Bearer " + options_.bearer_token);
  // The member choice as in FusedLayerClient::Next.
  const Member& m = members_.size() == 1
                        ? members_.front()
                        : members_[next_member_.fetch_add(1, std::memory_order_relaxed) % members_.size()];
  grpc::ByteBuffer response;
  const grpc::Status status = grpc::internal::BlockingUnaryCall<grpc::ByteBuffer, grpc::ByteBuffer>(
      m.channel.get(), m.method, &ctx, request_, &response);
  if (!status.ok()) return ToAbslStatus(status);
  return uint64_t(response.Length());
}

std::string EchoListenAddressFor(const std::string& target, const std::string& scratch_dir) {
  if (absl::StartsWith(target, "unix-abstract:")) {
    std::random_device rd;
    return absl::StrCat("unix-abstract:fusedctl-echo-floor-", ::getpid(), "-", rd());
  }
  if (absl::StartsWith(target, "unix:")) return absl::StrCat("unix:", scratch_dir, "/echo-floor.sock");
  return "127.0.0.1:0";
}

}  // namespace fusedlayer::client
