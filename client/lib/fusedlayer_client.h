// fusedlayer C++ client: a thin wrapper over the generated FusedLayer stub.
//
// What it adds over the raw stub, and why:
//  - Message size limits raised on the channel. gRPC C++ refuses to *receive* more than 4 MiB by
//    default, and a 64-token mHC seam at C = 7168 already returns ~4.6 MB, so the default would turn
//    ordinary responses into RESOURCE_EXHAUSTED on the client side.
//  - A deadline on every call (gRPC's default is none: a stuck server would hang the caller forever).
//  - grpc::Status mapped to absl::Status with the same code and message, so callers use one error
//    type (absl::StatusOr<Response>) and the gRPC code name survives (absl::StatusCodeToString).
//  - LoadWeights streaming: the header goes in the first message, the payload follows in chunks
//    (one message per chunk keeps each far below any message limit), with the payload length and
//    SHA-256 filled in when the caller left them empty.
//  - grpc.health.v1 Check, used by `fusedctl health` (Docker HEALTHCHECK, Kubernetes probes).
//  - A pool of connections (ClientOptions::connections): calls spread round robin over several
//    channels, each on a TCP connection of its own, so concurrent calls are not all framed through
//    one HTTP/2 connection.
//
// Thread safety: a FusedLayerClient may be shared by any number of threads (the channels and the stubs
// are thread-safe; every call has its own ClientContext).
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>
#include "absl/strings/string_view.h"

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "fusedlayer/v1/fusedlayer.grpc.pb.h"
#include "fusedlayer/v1/fusedlayer.pb.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/channel.h"
#include "grpcpp/impl/rpc_method.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/status.h"

namespace fusedlayer::client {

namespace v1 = ::fusedlayer::v1;

inline constexpr int64_t kDefaultMaxMessageBytes = int64_t{1} << 30;  // 1 GiB, as the server
inline constexpr size_t kDefaultChunkBytes = size_t{4} << 20;        // 4 MiB per LoadWeights message
// Upper bound of ClientOptions::connections: far more than one client process can keep busy, and a
// typo such as 1000 would otherwise open a thousand sockets on the server.
inline constexpr int kMaxConnections = 64;

struct ClientOptions {
  // Largest message the client sends or receives. Must lie in [4 KiB, 2 GiB - 1]: protobuf cannot
  // serialise a message of 2 GiB or more, and below a few KiB not even an error reply fits.
  int64_t max_message_bytes = kDefaultMaxMessageBytes;
  // Deadline of compute and admin calls (MhcSeam, SwaNormQuant, List, Unload, Info, health).
  absl::Duration deadline = absl::Seconds(60);
  // Deadline of a whole LoadWeights stream: weight sets reach gigabytes, which take far longer than
  // a compute call over a network.
  absl::Duration load_deadline = absl::Minutes(10);
  // Channel credentials; null means plaintext (grpc::InsecureChannelCredentials). For TLS / mTLS
  // see TlsChannelCredentials (client/lib/transport_credentials.h) and docs/security.md.
  std::shared_ptr<grpc::ChannelCredentials> credentials;
  // TLS only: the name checked against the server certificate instead of the target's host (a
  // certificate for "fusedlayer.internal" reached through an IP address; tests). Empty: the host.
  std::string tls_server_name;
  // Sent as `authorization: Bearer <token>` metadata on every call (health included, where the
  // server ignores it). Empty: no token. Per-call metadata rather than CallCredentials because gRPC
  // drops CallCredentials on channels it does not consider secure, and a token server without TLS
  // (loopback, local credentials) still needs the header.
  std::string bearer_token;
  // When true, calls wait for the channel to become ready (up to the deadline) instead of failing at
  // once with UNAVAILABLE while the server is still starting. Off by default: a CLI should say
  // "connection refused" immediately.
  bool wait_for_ready = false;
  // How many TCP connections the client spreads its calls over, in [0, kMaxConnections]. gRPC C++
  // puts every channel to one target with equal arguments on a single shared connection (its global
  // subchannel pool), and one HTTP/2 connection carries its messages one frame at a time through one
  // socket (about 1 GiB/s), so concurrent calls with megabytes of tensors queue behind each other on
  // it however many threads send them. With N > 1 the client makes N channels, each with its own
  // subchannel pool and so its own connection, and every call takes the next one (round robin);
  // the stubs, shared-request methods, credentials, limits, deadlines and token apply on each.
  // 0: DefaultConnections(target, expected_concurrency). 1: one channel, created as before pools
  // existed (it may share its connection with other clients of the same target and options).
  int connections = 0;
  // How many calls the caller expects to have in flight at once (>= 1): what connections = 0 sizes
  // the pool from. The default, 1, keeps a single connection.
  int expected_concurrency = 1;
  // gRPC's load-balancing policy over the addresses the target resolves to: "" (gRPC's default,
  // pick_first: every call to the first address that answers), "pick_first" or "round_robin" (each
  // call to the next address: one server per GPU behind "ipv4:h:p1,h:p2" or a headless Service's
  // "dns:///svc:port"). Each member of a connection pool balances on its own.
  std::string load_balancing;
};

// Checks ranges; InvalidArgument names the offending field.
absl::Status ValidateClientOptions(const ClientOptions& options);

// True for unix: and unix-abstract: targets (one local socket: no TCP connection to spread over).
bool IsUnixSocketTarget(absl::string_view target);

// The pool size that ClientOptions::connections = 0 picks: 1 for a unix-socket target; otherwise
// one connection per 4 expected concurrent calls, rounded up, at most 8. Why 4: a caller spends
// part of each call away from the socket (building its request, waiting for the server's compute,
// reading the response), so a few callers per connection keep each one busy without a socket, an
// HTTP/2 session and flow-control windows on the server per caller; why at most 8: a very
// concurrent caller should not open dozens of sockets on a shared server by default. Both are
// starting points: `fusedctl bench --connections=N` measures other sizes beside the echo floor.
int DefaultConnections(absl::string_view target, int expected_concurrency);
// The number of connections Connect(target, options) makes: options.connections, or the default.
int ConnectionsFor(absl::string_view target, const ClientOptions& options);

// grpc::Status -> absl::Status, same code and message (the two enums share their numbering).
absl::Status ToAbslStatus(const grpc::Status& status);

// Per-call overrides.
struct CallOptions {
  std::optional<absl::Duration> deadline;  // default: ClientOptions::deadline (load_deadline for loads)
};

class FusedLayerClient {
 public:
  // Creates the channels, ConnectionsFor(target, options) of them (lazily connecting: no network
  // traffic happens before the first call, so a wrong target surfaces as UNAVAILABLE on that call).
  // InvalidArgument for an empty target or bad options.
  static absl::StatusOr<std::unique_ptr<FusedLayerClient>> Connect(const std::string& target,
                                                                    ClientOptions options = {});
  // For tests and embedders that already have a channel (e.g. an in-process one): every call on it.
  // options.connections is not consulted.
  FusedLayerClient(std::shared_ptr<grpc::Channel> channel, ClientOptions options);
  // A pool of existing channels (at least one, none null): calls take them round robin.
  FusedLayerClient(std::vector<std::shared_ptr<grpc::Channel>> channels, ClientOptions options);

  absl::StatusOr<v1::MhcSeamResponse> MhcSeam(const v1::MhcSeamRequest& request,
                                              const CallOptions& call = {}) const;
  absl::StatusOr<v1::SwaNormQuantResponse> SwaNormQuant(const v1::SwaNormQuantRequest& request,
                                                        const CallOptions& call = {}) const;
  // The same calls with the request shared: its tensors' data goes to gRPC from the request's own
  // memory instead of being copied into a serialized message (client/lib/wire_request.h: ~0.5 ms a
  // call for the 4.4 MiB of an mHC seam C = 7168 T = 64 on one core). The request must not change
  // until gRPC lets go of it, which may be just after the call returns (the slices hold references).
  absl::StatusOr<v1::MhcSeamResponse> MhcSeam(std::shared_ptr<const v1::MhcSeamRequest> request,
                                              const CallOptions& call = {}) const;
  absl::StatusOr<v1::SwaNormQuantResponse> SwaNormQuant(std::shared_ptr<const v1::SwaNormQuantRequest> request,
                                                        const CallOptions& call = {}) const;
  absl::StatusOr<v1::ListWeightSetsResponse> ListWeightSets(const CallOptions& call = {}) const;
  absl::StatusOr<v1::UnloadWeightSetResponse> UnloadWeightSet(const std::string& name,
                                                              const CallOptions& call = {}) const;
  absl::StatusOr<v1::GetServerInfoResponse> GetServerInfo(const CallOptions& call = {}) const;
  // Publishes (discard: drops) every set uploaded with header.stage = `stage`, all in one step.
  absl::StatusOr<v1::CommitWeightSetsResponse> CommitWeightSets(const std::string& stage, bool discard = false,
                                                                const CallOptions& call = {}) const;

  // System shared memory (client/lib/shared_memory.h wraps these for a whole request).
  absl::Status RegisterSystemSharedMemory(const std::string& name, const std::string& key, uint64_t offset,
                                          uint64_t byte_size, const CallOptions& call = {}) const;
  absl::StatusOr<v1::SystemSharedMemoryStatusResponse> SystemSharedMemoryStatus(const std::string& name = "",
                                                                              const CallOptions& call = {}) const;
  // Empty name: every region of the caller's identity.
  absl::StatusOr<v1::UnregisterSystemSharedMemoryResponse> UnregisterSystemSharedMemory(
      const std::string& name, const CallOptions& call = {}) const;

  // CUDA shared memory (same host, same GPU): `raw_handle` is the cudaIpcMemHandle_t (64 bytes) of
  // a device allocation of this process (cudaIpcGetMemHandle; Backend::AllocateIpcExportable makes
  // one). Tensors then reference [offset, + byte_size) of it by name (Tensor.cuda_shared_memory,
  // OutputPlacement.cuda_shared_memory); the kernels use them where they lie.
  absl::Status RegisterCudaSharedMemory(const std::string& name, const std::string& raw_handle, int device_id,
                                        uint64_t offset, uint64_t byte_size, const CallOptions& call = {}) const;
  absl::StatusOr<v1::CudaSharedMemoryStatusResponse> CudaSharedMemoryStatus(const std::string& name = "",
                                                                          const CallOptions& call = {}) const;
  // Empty name: every region of the caller's identity.
  absl::StatusOr<v1::UnregisterCudaSharedMemoryResponse> UnregisterCudaSharedMemory(
      const std::string& name, const CallOptions& call = {}) const;

  // Residual sessions (MhcSeamRequest.session): the mHC state kept on the server between seams.
  // OpenResidualSession returns the bytes the session holds; an empty name closes every session.
  absl::StatusOr<uint64_t> OpenResidualSession(const std::string& name, int64_t tokens, int hc_mult, int64_t hidden,
                                               const CallOptions& call = {}) const;
  absl::StatusOr<v1::ListResidualSessionsResponse> ListResidualSessions(const CallOptions& call = {}) const;
  absl::StatusOr<v1::CloseResidualSessionResponse> CloseResidualSession(const std::string& name,
                                                                        const CallOptions& call = {}) const;

  // A call ring (client/lib/call_ring.h opens one with this and takes it over).
  absl::StatusOr<v1::OpenCallRingResponse> OpenCallRing(const v1::OpenCallRingRequest& request,
                                                        const CallOptions& call = {}) const;

  // Finds one weight set by name in ListWeightSets (NotFound if absent).
  absl::StatusOr<v1::WeightSetInfo> FindWeightSet(const std::string& name, const CallOptions& call = {}) const;

  // Streams one weight set: `header` in the first message, `payload` in chunks of `chunk_bytes`.
  // header.payload_bytes and header.sha256 are filled in when zero/empty; when set they must match
  // the payload (InvalidArgument before anything is sent: the server would answer DATA_LOSS after
  // receiving gigabytes).
  absl::StatusOr<v1::WeightSetInfo> LoadWeights(v1::WeightSetHeader header, absl::string_view payload,
                                                size_t chunk_bytes = kDefaultChunkBytes,
                                                const CallOptions& call = {}) const;

  // grpc.health.v1.Health/Check for `service` ("" = the whole server).
  absl::StatusOr<grpc::health::v1::HealthCheckResponse::ServingStatus> CheckHealth(
      const std::string& service, const CallOptions& call = {}) const;

  const ClientOptions& options() const { return options_; }
  // The first connection's channel: for calls this class does not make (reflection, a generic stub).
  // With several connections the client's own calls use all of them; channels() lists them.
  const std::shared_ptr<grpc::Channel>& channel() const { return channels_.front(); }
  const std::vector<std::shared_ptr<grpc::Channel>>& channels() const { return channels_; }
  // How many connections the calls are spread over (channels().size()).
  int connections() const { return static_cast<int>(channels_.size()); }

 private:
  // One member of the pool: its channel, the stubs on it and the shared-request methods registered
  // with it (a registered method belongs to the channel it was registered with).
  struct Connection {
    explicit Connection(const std::shared_ptr<grpc::Channel>& channel);
    std::shared_ptr<grpc::Channel> channel;
    std::unique_ptr<v1::FusedLayer::Stub> stub;
    std::unique_ptr<grpc::health::v1::Health::Stub> health_stub;
    grpc::internal::RpcMethod mhc_method;
    grpc::internal::RpcMethod swa_method;
  };
  // The connection of the next call, round robin.
  const Connection& Next() const;

  void Prepare(grpc::ClientContext& ctx, const CallOptions& call, absl::Duration fallback) const;
  // One unary call of `stub` (a connection's stub or health_stub) with the per-call options: every
  // unary RPC goes through here, so deadlines, wait-for-ready and the token are set in one place.
  template <typename Stub, typename Request, typename Response>
  absl::StatusOr<Response> Unary(Stub& stub,
                                 grpc::Status (Stub::*method)(grpc::ClientContext*, const Request&, Response*),
                                 const Request& request, const CallOptions& call) const {
    grpc::ClientContext ctx;
    Prepare(ctx, call, options_.deadline);
    Response response;
    if (grpc::Status s = (stub.*method)(&ctx, request, &response); !s.ok()) return ToAbslStatus(s);
    return response;
  }
  // One compute call of `method` (Connection::mhc_method or swa_method) with a shared request (the
  // overloads above), on `channel`, the channel the method was registered with.
  template <typename Response>
  absl::StatusOr<Response> SharedRequestCall(grpc::Channel& channel, const grpc::internal::RpcMethod& method,
                                             std::shared_ptr<const google::protobuf::Message> request,
                                             const CallOptions& call) const;

  std::vector<std::shared_ptr<grpc::Channel>> channels_;
  ClientOptions options_;
  std::vector<Connection> connections_;  // connections_[i] is on channels_[i]
  mutable std::atomic<uint64_t> next_connection_{0};
};

// Lower-case hex SHA-256 of `data` (the digest LoadWeights sends in the header).
std::string Sha256Hex(absl::string_view data);

}  // namespace fusedlayer::client
