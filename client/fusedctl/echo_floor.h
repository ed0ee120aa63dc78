// The transport floor of `fusedctl bench --echo_floor`: a bare gRPC echo of the same message sizes.
//
// The benchmark starts an EchoFloorServer in its own process, on loopback (or on a unix socket when
// the benchmarked target is one), answering every call with a fixed-size response after reading the
// whole request, and drives it through an EchoFloorClient whose channels are built exactly like the
// real ones (FusedLayerClient::Connect with the same ClientOptions: message size limits, deadline,
// bearer-token header, and as many connections). What the echo costs is what gRPC and the socket cost for those byte counts
// with no protobuf parsing, no validation and no compute: the floor under the real round trip.
//
// Not part of the product API: the method name is fusedctl's own and no server answers it.
#pragma once

#include <atomic>
#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "client/lib/fusedlayer_client.h"
#include "grpcpp/channel.h"
#include "grpcpp/impl/rpc_method.h"
#include "grpcpp/server.h"
#include "grpcpp/support/byte_buffer.h"

namespace fusedlayer::client {

inline constexpr char kEchoFloorMethod[] = "/fusedctl.bench.EchoFloor/Echo";

class EchoFloorServer {
 public:
  // Listens on `address` (gRPC syntax: "127.0.0.1:0", "unix:/path", "unix-abstract:name"),
  // plaintext, with `max_message_bytes` as its receive and send limits. Every call of any method
  // gets `response_bytes` bytes back. Unavailable when it cannot listen.
  static absl::StatusOr<std::unique_ptr<EchoFloorServer>> Start(const std::string& address, uint64_t response_bytes,
                                                                int64_t max_message_bytes);
  ~EchoFloorServer();

  // What a client dials: "127.0.0.1:PORT" for a TCP address, the address itself for unix sockets.
  const std::string& target() const { return target_; }
  // Request sizes the server received (bytes of the message, as the real server would parse) and
  // the number of calls answered; min > max while there were none.
  uint64_t min_request_bytes() const { return min_request_bytes_.load(); }
  uint64_t max_request_bytes() const { return max_request_bytes_.load(); }
  int64_t calls() const { return calls_.load(); }

  class Service;  // the generic callback service (echo_floor.cc)

 private:
  EchoFloorServer() = default;
  void Record(uint64_t request_bytes);

  std::unique_ptr<Service> service_;
  std::unique_ptr<grpc::Server> server_;
  std::string target_;
  std::atomic<uint64_t> min_request_bytes_{std::numeric_limits<uint64_t>::max()};
  std::atomic<uint64_t> max_request_bytes_{0};
  std::atomic<int64_t> calls_{0};
};

class EchoFloorClient {
 public:
  // Calls kEchoFloorMethod on `channel` with a request of `request_bytes` bytes, the deadline and
  // the bearer-token header of `options` (as FusedLayerClient does for its calls).
  EchoFloorClient(std::shared_ptr<grpc::Channel> channel, uint64_t request_bytes, const ClientOptions& options);
  // The same over a pool (FusedLayerClient::channels(): at least one): each call takes the next
  // channel, round robin, as FusedLayerClient's calls do, so the floor has the real call's connections.
  EchoFloorClient(const std::vector<std::shared_ptr<grpc::Channel>>& channels, uint64_t request_bytes,
                  const ClientOptions& options);

  // One blocking unary call, through the same code path as a generated stub's (BlockingUnaryCall).
  // The response size in bytes, or the call's error.
  absl::StatusOr<uint64_t> Call() const;
  uint64_t request_bytes() const { return request_bytes_; }
  int connections() const { return static_cast<int>(members_.size()); }

 private:
  // A channel and the echo method registered with it.
  struct Member {
    std::shared_ptr<grpc::Channel> channel;
    grpc::internal::RpcMethod method;
  };
  std::vector<Member> members_;
  mutable std::atomic<uint64_t> next_member_{0};
  grpc::ByteBuffer request_;
  uint64_t request_bytes_;
  ClientOptions options_;
};

// Where the echo of a benchmark against `target` listens: a fresh unix socket in `scratch_dir` for a
// unix: target, a fresh abstract name for unix-abstract:, 127.0.0.1:0 otherwise (a remote server's
// network is not reproduced: run the benchmark on the server's host for a like-for-like floor).
std::string EchoListenAddressFor(const std::string& target, const std::string& scratch_dir);

}  // namespace fusedlayer::client
