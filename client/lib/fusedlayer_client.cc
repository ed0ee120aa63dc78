#include "client/lib/fusedlayer_client.h"

#include <openssl/evp.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <limits>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "client/lib/transport_credentials.h"
#include "client/lib/wire_request.h"
#include "grpcpp/impl/client_unary_call.h"
#include "grpcpp/client_context.h"
#include "grpcpp/create_channel.h"
#include "grpc/grpc.h"
#include "grpcpp/support/channel_arguments.h"

namespace fusedlayer::client {

absl::Status ValidateClientOptions(const ClientOptions& options) {
  constexpr int64_t kMin = 4096;
  constexpr int64_t kMax = std::numeric_limits<int32_t>::max();  // protobuf's 2 GiB - 1 ceiling
  if (options.max_message_bytes < kMin || options.max_message_bytes > kMax) {
    return absl::InvalidArgumentError(absl::StrCat("max_message_bytes = ", options.max_message_bytes,
                                                   " is outside [", kMin, ", ", kMax, "]"));
  }
  if (options.deadline <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat("deadline = ", absl::FormatDuration(options.deadline),
                                                   " must be positive"));
  }
  for (const char ch : options.bearer_token) {
    // An HTTP/2 header value: visible ASCII only (never echo the token itself in the message).
    if (ch <= ' ' || ch > '~') {
      return absl::InvalidArgumentError("bearer_token has a character outside visible ASCII (space, newline?)");
    }
  }
  if (!options.load_balancing.empty() && options.load_balancing != "pick_first" &&
      options.load_balancing != "round_robin") {
    return absl::InvalidArgumentError(absl::StrCat("load_balancing = \"", options.load_balancing,
                                                   "\": want pick_first or round_robin (empty: gRPC's default)"));
  }
  if (options.load_deadline <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "load_deadline = ", absl::FormatDuration(options.load_deadline), " must be positive"));
  }
  if (options.connections < 0 || options.connections > kMaxConnections) {
    return absl::InvalidArgumentError(absl::StrCat("connections = ", options.connections, " is outside 0..",
                                                   kMaxConnections, " (0: chosen from expected_concurrency)"));
  }
  if (options.expected_concurrency < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("expected_concurrency = ", options.expected_concurrency, " must be at least 1"));
  }
  return absl::OkStatus();
}

bool IsUnixSocketTarget(absl::string_view target) {
  return absl::StartsWith(target, "unix:") || absl::StartsWith(target, "unix-abstract:");
}

int DefaultConnections(absl::string_view target, int expected_concurrency) {
  if (IsUnixSocketTarget(target)) return 1;
  constexpr int kCallsPerConnection = 4;
  constexpr int kMaxDefaultConnections = 8;
  const int concurrency = std::max(expected_concurrency, 1);
  return std::min(kMaxDefaultConnections, (concurrency + kCallsPerConnection - 1) / kCallsPerConnection);
}

int ConnectionsFor(absl::string_view target, const ClientOptions& options) {
  return options.connections > 0 ? options.connections : DefaultConnections(target, options.expected_concurrency);
}

absl::Status ToAbslStatus(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  // grpc::StatusCode and absl::StatusCode both follow google.rpc.Code (0..16).
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
}

absl::StatusOr<std::unique_ptr<FusedLayerClient>> FusedLayerClient::Connect(const std::string& target,
                                                                             ClientOptions options) {
  if (target.empty()) return absl::InvalidArgumentError("target is empty (expected host:port)");
  if (absl::Status s = ValidateClientOptions(options); !s.ok()) return s;
  // A bearer token in clear text can be read (and replayed) by anyone on the path.
  if (!options.bearer_token.empty() && !options.credentials && !IsLoopbackTarget(target)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "refusing to send the bearer token over plaintext to ", target,
        ": use TLS (credentials, fusedctl --tls_ca) or a loopback or unix: target"));
  }
  grpc::ChannelArguments args;
  // The defaults are 4 MiB to receive and unlimited to send; both set explicitly so the client never
  // sends what it could not receive back, and the limits read the same as the server's flags.
  args.SetMaxReceiveMessageSize(static_cast<int>(options.max_message_bytes));
  args.SetMaxSendMessageSize(static_cast<int>(options.max_message_bytes));
  if (!options.tls_server_name.empty()) args.SetSslTargetNameOverride(options.tls_server_name);
  if (!options.load_balancing.empty()) args.SetLoadBalancingPolicyName(options.load_balancing);
  auto credentials = options.credentials ? options.credentials : grpc::InsecureChannelCredentials();
  const int connections = ConnectionsFor(target, options);
  if (connections > 1) {
    // Channels with equal arguments share one connection through gRPC's global subchannel pool; a
    // pool of its own per channel gives each channel, and so each member, its own connection.
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  }
  std::vector<std::shared_ptr<grpc::Channel>> channels;
  channels.reserve(static_cast<size_t>(connections));
  for (int i = 0; i < connections; ++i) {
    std::shared_ptr<grpc::Channel> channel = grpc::CreateCustomChannel(target, credentials, args);
    if (!channel) return absl::InternalError(absl::StrCat("cannot create a channel to ", target));
    channels.push_back(std::move(channel));
  }
  return std::make_unique<FusedLayerClient>(std::move(channels), std::move(options));
}

FusedLayerClient::Connection::Connection(const std::shared_ptr<grpc::Channel>& channel)
    : channel(channel),
      stub(v1::FusedLayer::NewStub(channel)),
      health_stub(grpc::health::v1::Health::NewStub(channel)),
      mhc_method("/fusedlayer.v1.FusedLayer/MhcSeam", grpc::internal::RpcMethod::NORMAL_RPC, channel),
      swa_method("/fusedlayer.v1.FusedLayer/SwaNormQuant", grpc::internal::RpcMethod::NORMAL_RPC, channel) {}

FusedLayerClient::FusedLayerClient(std::shared_ptr<grpc::Channel> channel, ClientOptions options)
    : FusedLayerClient(std::vector<std::shared_ptr<grpc::Channel>>{std::move(channel)}, std::move(options)) {}

FusedLayerClient::FusedLayerClient(std::vector<std::shared_ptr<grpc::Channel>> channels, ClientOptions options)
    : channels_(std::move(channels)), options_(std::move(options)) {
  // An empty pool or a null channel is a programming error of the embedder, not a runtime condition.
  if (channels_.empty()) std::abort();
  connections_.reserve(channels_.size());
  for (const std::shared_ptr<grpc::Channel>& channel : channels_) {
    if (channel == nullptr) std::abort();
    connections_.emplace_back(channel);
  }
}

const FusedLayerClient::Connection& FusedLayerClient::Next() const {
  // One connection: no shared counter for every call of every thread to bounce between cores.
  if (connections_.size() == 1) return connections_.front();
  return connections_[next_connection_.fetch_add(1, std::memory_order_relaxed) % connections_.size()];
}

void FusedLayerClient::Prepare(grpc::ClientContext& ctx, const CallOptions& call,
                               absl::Duration fallback) const {
  const absl::Duration d = call.deadline.value_or(fallback);
  // gRPC 1.51's set_deadline takes a system_clock time point (a steady_clock one does not compile
  // into the right overload). absl::ToChronoTime converts an absl::Time to system_clock.
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + d));
  ctx.set_wait_for_ready(options_.wait_for_ready);
  if (!options_.bearer_token.empty()) ctx.AddMetadata("authorization", "Bearer " + options_.bearer_token);
}

absl::StatusOr<v1::MhcSeamResponse> FusedLayerClient::MhcSeam(const v1::MhcSeamRequest& request,
                                                              const CallOptions& call) const {
  return Unary(*Next().stub, &v1::FusedLayer::Stub::MhcSeam, request, call);
}

absl::StatusOr<v1::SwaNormQuantResponse> FusedLayerClient::SwaNormQuant(const v1::SwaNormQuantRequest& request,
                                                                        const CallOptions& call) const {
  return Unary(*Next().stub, &v1::FusedLayer::Stub::SwaNormQuant, request, call);
}

template <typename Response>
absl::StatusOr<Response> FusedLayerClient::SharedRequestCall(grpc::Channel& channel,
                                                             const grpc::internal::RpcMethod& method,
                                                             std::shared_ptr<const google::protobuf::Message> request,
                                                             const CallOptions& call) const {
  grpc::ClientContext ctx;
  Prepare(ctx, call, options_.deadline);
  const grpc::ByteBuffer wire = EncodeRequestByReference(std::move(request));
  Response response;
  const grpc::Status s =
      grpc::internal::BlockingUnaryCall<grpc::ByteBuffer, Response>(&channel, method, &ctx, wire, &response);
  if (!s.ok()) return ToAbslStatus(s);
  return response;
}

absl::StatusOr<v1::MhcSeamResponse> FusedLayerClient::MhcSeam(std::shared_ptr<const v1::MhcSeamRequest> request,
                                                              const CallOptions& call) const {
  const Connection& c = Next();
  return SharedRequestCall<v1::MhcSeamResponse>(*c.channel, c.mhc_method, std::move(request), call);
}

absl::StatusOr<v1::SwaNormQuantResponse> FusedLayerClient::SwaNormQuant(
    std::shared_ptr<const v1::SwaNormQuantRequest> request, const CallOptions& call) const {
  const Connection& c = Next();
  return SharedRequestCall<v1::SwaNormQuantResponse>(*c.channel, c.swa_method, std::move(request), call);
}

absl::StatusOr<v1::ListWeightSetsResponse> FusedLayerClient::ListWeightSets(const CallOptions& call) const {
  return Unary(*Next().stub, &v1::FusedLayer::Stub::ListWeightSets, v1::ListWeightSetsRequest(), call);
}

absl::StatusOr<v1::UnloadWeightSetResponse> FusedLayerClient::UnloadWeightSet(const std::string& name,
                                                                              const CallOptions& call) const {
  v1::UnloadWeightSetRequest request;
  request.set_name(name);
  return Unary(*Next().stub, &v1::FusedLayer::Stub::UnloadWeightSet, request, call);
}

absl::StatusOr<v1::CommitWeightSetsResponse> FusedLayerClient::CommitWeightSets(const std::string& stage,
                                                                                bool discard,
                                                                                const CallOptions& call) const {
  v1::CommitWeightSetsRequest request;
  request.set_stage(stage);
  request.set_discard(discard);
  return Unary(*Next().stub, &v1::FusedLayer::Stub::CommitWeightSets, request, call);
}

absl::Status FusedLayerClient::RegisterSystemSharedMemory(const std::string& name, const std::string& key,
                                                          uint64_t offset, uint64_t byte_size,
                                                          const CallOptions& call) const {
  v1::RegisterSystemSharedMemoryRequest request;
  request.set_name(name);
  request.set_key(key);
  request.set_offset(offset);
  request.set_byte_size(byte_size);
  return Unary(*Next().stub, &v1::FusedLayer::Stub::RegisterSystemSharedMemory, request, call).status();
}

absl::StatusOr<v1::SystemSharedMemoryStatusResponse> FusedLayerClient::SystemSharedMemoryStatus(
    const std::string& name, const CallOptions& call) const {
  v1::SystemSharedMemoryStatusRequest request;
  request.set_name(name);
  return Unary(*Next().stub, &v1::FusedLayer::Stub::SystemSharedMemoryStatus, request, call);
}

absl::StatusOr<v1::UnregisterSystemSharedMemoryResponse> FusedLayerClient::UnregisterSystemSharedMemory(
    const std::string& name, const CallOptions& call) const {
  v1::UnregisterSystemSharedMemoryRequest request;
  request.set_name(name);
  return Unary(*Next().stub, &v1::FusedLayer::Stub::UnregisterSystemSharedMemory, request, call);
}

absl::Status FusedLayerClient::RegisterCudaSharedMemory(const std::string& name, const std::string& raw_handle,
                                                        int device_id, uint64_t offset, uint64_t byte_size,
                                                        const CallOptions& call) const {
  v1::RegisterCudaSharedMemoryRequest request;
  request.set_name(name);
  request.set_raw_handle(raw_handle);
  request.set_device_id(device_id);
  request.set_offset(offset);
  request.set_byte_size(byte_size);
  return Unary(*Next().stub, &v1::FusedLayer::Stub::RegisterCudaSharedMemory, request, call).status();
}

absl::StatusOr<v1::CudaSharedMemoryStatusResponse> FusedLayerClient::CudaSharedMemoryStatus(
    const std::string& name, const CallOptions& call) const {
  v1::CudaSharedMemoryStatusRequest request;
  request.set_name(name);
  return Unary(*Next().stub, &v1::FusedLayer::Stub::CudaSharedMemoryStatus, request, call);
}

absl::StatusOr<v1::UnregisterCudaSharedMemoryResponse> FusedLayerClient::UnregisterCudaSharedMemory(
    const std::string& name, const CallOptions& call) const {
  v1::UnregisterCudaSharedMemoryRequest request;
  request.set_name(name);
  return Unary(*Next().stub, &v1::FusedLayer::Stub::UnregisterCudaSharedMemory, request, call);
}

absl::StatusOr<uint64_t> FusedLayerClient::OpenResidualSession(const std::string& name, int64_t tokens, int hc_mult,
                                                               int64_t hidden, const CallOptions& call) const {
  v1::OpenResidualSessionRequest request;
  request.set_name(name);
  request.set_tokens(tokens);
  request.set_hc_mult(hc_mult);
  request.set_hidden(hidden);
  absl::StatusOr<v1::OpenResidualSessionResponse> r =
      Unary(*Next().stub, &v1::FusedLayer::Stub::OpenResidualSession, request, call);
  if (!r.ok()) return r.status();
  return r->bytes();
}

absl::StatusOr<v1::OpenCallRingResponse> FusedLayerClient::OpenCallRing(const v1::OpenCallRingRequest& request,
                                                                        const CallOptions& call) const {
  return Unary(*Next().stub, &v1::FusedLayer::Stub::OpenCallRing, request, call);
}

absl::StatusOr<v1::ListResidualSessionsResponse> FusedLayerClient::ListResidualSessions(const CallOptions& call) const {
  return Unary(*Next().stub, &v1::FusedLayer::Stub::ListResidualSessions, v1::ListResidualSessionsRequest(), call);
}

absl::StatusOr<v1::CloseResidualSessionResponse> FusedLayerClient::CloseResidualSession(const std::string& name,
                                                                                        const CallOptions& call) const {
  v1::CloseResidualSessionRequest request;
  request.set_name(name);
  return Unary(*Next().stub, &v1::FusedLayer::Stub::CloseResidualSession, request, call);
}

absl::StatusOr<v1::GetServerInfoResponse> FusedLayerClient::GetServerInfo(const CallOptions& call) const {
  return Unary(*Next().stub, &v1::FusedLayer::Stub::GetServerInfo, v1::GetServerInfoRequest(), call);
}

absl::StatusOr<v1::WeightSetInfo> FusedLayerClient::FindWeightSet(const std::string& name,
                                                                  const CallOptions& call) const {
  absl::StatusOr<v1::ListWeightSetsResponse> list = ListWeightSets(call);
  if (!list.ok()) return list.status();
  for (const v1::WeightSetInfo& info : list->weight_sets()) {
    if (info.name() == name) return info;
  }
  std::string names;
  for (const v1::WeightSetInfo& info : list->weight_sets()) absl::StrAppend(&names, names.empty() ? "" : ", ", info.name());
  return absl::NotFoundError(absl::StrCat("weight set \"", name, "\" is not loaded on the server (loaded: ",
                                          names.empty() ? "none" : names, ")"));
}

std::string Sha256Hex(absl::string_view data) {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  // EVP_Digest is OpenSSL's one-shot API (SHA256() is deprecated in 3.0 for new code).
  if (EVP_Digest(data.data(), data.size(), digest, &len, EVP_sha256(), nullptr) != 1) return {};
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out(2 * len, '0');
  for (unsigned i = 0; i < len; ++i) {
    out[2 * i] = kHex[digest[i] >> 4];
    out[2 * i + 1] = kHex[digest[i] & 15];
  }
  return out;
}

absl::StatusOr<v1::WeightSetInfo> FusedLayerClient::LoadWeights(v1::WeightSetHeader header, absl::string_view payload,
                                                                 size_t chunk_bytes, const CallOptions& call) const {
  if (chunk_bytes == 0) return absl::InvalidArgumentError("chunk_bytes must be positive");
  // Leave room for the header and framing inside one message.
  const size_t max_chunk = static_cast<size_t>(options_.max_message_bytes) / 2;
  if (chunk_bytes > max_chunk) {
    return absl::InvalidArgumentError(absl::StrCat("chunk_bytes = ", chunk_bytes, " exceeds half the message limit (",
                                                   max_chunk, ")"));
  }
  if (header.payload_bytes() == 0) {
    header.set_payload_bytes(payload.size());
  } else if (header.payload_bytes() != payload.size()) {
    return absl::InvalidArgumentError(absl::StrCat("header.payload_bytes = ", header.payload_bytes(),
                                                   " but the payload has ", payload.size(), " bytes"));
  }
  const std::string digest = Sha256Hex(payload);
  if (digest.empty()) return absl::InternalError("OpenSSL SHA-256 failed");
  if (header.sha256().empty()) {
    header.set_sha256(digest);
  } else if (header.sha256() != digest) {
    return absl::InvalidArgumentError(absl::StrCat("header.sha256 = ", header.sha256(),
                                                   " does not match the payload's SHA-256 ", digest));
  }

  grpc::ClientContext ctx;
  Prepare(ctx, call, options_.load_deadline);
  v1::WeightSetInfo info;
  std::unique_ptr<grpc::ClientWriter<v1::WeightChunk>> writer = Next().stub->LoadWeights(&ctx, &info);
  size_t offset = 0;
  bool first = true;
  // A stream whose Write fails is broken (server error, deadline): stop writing and let Finish()
  // report the server's status, which says why.
  while (first || offset < payload.size()) {
    v1::WeightChunk chunk;
    if (first) *chunk.mutable_header() = header;
    const size_t n = std::min(chunk_bytes, payload.size() - offset);
    chunk.set_data(payload.data() + offset, n);
    offset += n;
    first = false;
    if (!writer->Write(chunk)) break;
  }
  writer->WritesDone();
  grpc::Status s = writer->Finish();
  if (!s.ok()) return ToAbslStatus(s);
  return info;
}

absl::StatusOr<grpc::health::v1::HealthCheckResponse::ServingStatus> FusedLayerClient::CheckHealth(
    const std::string& service, const CallOptions& call) const {
  grpc::health::v1::HealthCheckRequest request;
  request.set_service(service);
  absl::StatusOr<grpc::health::v1::HealthCheckResponse> response =
      Unary(*Next().health_stub, &grpc::health::v1::Health::Stub::Check, request, call);
  if (!response.ok()) return response.status();
  return response->status();
}

}  // namespace fusedlayer::client
