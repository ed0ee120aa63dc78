// A plaintext unix-socket listener the server runs itself, so that it knows who connected.
//
// gRPC's own unix listener gives a call no way to learn the connecting process's credentials
// (auth/unix_peers.h says why they matter). This one binds and listens on the socket (the path
// checks of PrepareUnixSocketPath in server.cc still run first), accepts on its own thread, reads
// each connection's SO_PEERCRED into the table, and hands the connected socket to gRPC with
// grpc::AddInsecureChannelFromFd, where it is served like any other connection: the same service,
// channel arguments (message sizes, memory quota, streams per connection, connection age) and drain.
// gRPC accepts only insecure credentials that way, so the server uses this listener for plaintext
// unix addresses without tokens; with TLS or tokens gRPC's own listener stays, and the identity is
// the token's or the certificate's.
#pragma once

#include <sys/socket.h>
#include <sys/un.h>

#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "auth/unix_peers.h"
#include "config.h"
#include "grpcpp/server.h"

namespace fusedlayer::server {

// The socket address of a unix: or unix-abstract: --address (its length bounded by Validate()),
// in `*sa`; returns the address length to pass to bind or connect. An abstract name is a leading
// NUL and the name, with no terminator: the length says where it ends (as gRPC does).
socklen_t UnixSocketAddress(std::string_view address, sockaddr_un* sa);

class UnixPeerListener {
 public:
  // Binds `address` (unix:PATH or unix-abstract:NAME) and listens; UNAVAILABLE naming --address
  // when it cannot.
  static absl::StatusOr<std::unique_ptr<UnixPeerListener>> Listen(const std::string& address);
  ~UnixPeerListener();

  // Starts accepting; every connection goes to `server` (built and started, outliving Stop).
  void Start(grpc::Server* server);
  // Stops accepting and closes the socket (a path is unlinked); connections already handed to gRPC
  // stay its own. Idempotent.
  void Stop();

  const auth::UnixPeerTable& peers() const { return peers_; }

 private:
  UnixPeerListener(int fd, int stop_fd, std::string path) : fd_(fd), stop_fd_(stop_fd), path_(std::move(path)) {}
  void AcceptLoop(grpc::Server* server);

  int fd_ = -1;       // the listening socket
  int stop_fd_ = -1;  // an eventfd that wakes the accept loop to stop
  const std::string path_;  // the socket file to unlink at Stop; empty for an abstract name
  auth::UnixPeerTable peers_;
  std::thread thread_;
};

}  // namespace fusedlayer::server
